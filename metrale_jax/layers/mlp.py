"""Dense MLPs."""

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import W4Linear, linear

__all__ = ["linear", "silu_mul", "silu_mul_linear", "swiglu_mlp"]


def silu_mul(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2I] (gate then up) -> silu(gate) * up [..., I], silu in float32."""
    g, u = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(g.astype(jnp.float32)).astype(gate_up.dtype) * u


def silu_mul_linear(gate_up: jax.Array, w) -> jax.Array:
    """`linear(silu_mul(gate_up), w)`: gate_up [..., 2I] -> [..., N]; a fused 4-bit `w` takes the
    product itself and applies the activation as it reads it (`linear_w4.w4_fused`)."""
    if isinstance(w, W4Linear) and w.fused:
        from metrale_jax.layers.linear_w4 import w4_fused

        y = w4_fused(gate_up, w, silu_mul=True)
        if y is not None:
            return y
    return linear(silu_mul(gate_up), w)


def swiglu_mlp(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """x [T, H], w_gate_up [H, 2I] (gate then up), w_down [I, H] (or `Fp8Linear`s) -> [T, H]."""
    return linear(silu_mul(linear(x, w_gate_up)), w_down)
