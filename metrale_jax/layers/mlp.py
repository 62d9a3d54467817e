"""Dense MLPs."""

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import linear

__all__ = ["linear", "silu_mul", "silu_mul_linear", "swiglu_mlp", "add_shared_expert"]


def silu_mul(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2I] (gate then up) -> silu(gate) * up [..., I], silu in float32."""
    g, u = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(g.astype(jnp.float32)).astype(gate_up.dtype) * u


def silu_mul_linear(gate_up: jax.Array, w_down, residual: jax.Array | None = None) -> jax.Array:
    """(residual +) linear(silu_mul(gate_up), w_down) (one row of 4-bit weights: the activation and
    the residual add in the kernel's launch, `linear_w4.w4_linear`)."""
    from metrale_jax.layers.linear_w4 import w4_fuses, w4_linear

    if w4_fuses(gate_up, w_down):
        return w4_linear(gate_up, w_down, residual=residual, silu_mul=True)
    return linear(silu_mul(gate_up), w_down, residual=residual)


def swiglu_mlp(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """x [T, H], w_gate_up [H, 2I] (gate then up), w_down [I, H] (or `Fp8Linear`s) -> [T, H]."""
    return silu_mul_linear(linear(x, w_gate_up), w_down)


def add_shared_expert(y: jax.Array, x: jax.Array, lp: dict) -> jax.Array:
    """y [T, H] (the routed experts' output for x [T, H]) plus the shared expert's SwiGLU output
    gated per token by sigmoid(x . shared_gate) (Qwen2-MoE's and Qwen3-Next's MoE), in float32;
    lp holds shared_gate_up [H, 2 Is], shared_down [Is, H], shared_gate [H, 1]."""
    shared = swiglu_mlp(x, lp["shared_gate_up"], lp["shared_down"])
    gate = jax.nn.sigmoid(linear(x, lp["shared_gate"]).astype(jnp.float32))
    return (y.astype(jnp.float32) + gate * shared.astype(jnp.float32)).astype(x.dtype)
