"""Dense MLPs."""

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import linear

__all__ = ["linear", "silu_mul", "swiglu_mlp"]


def silu_mul(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2I] (gate then up) -> silu(gate) * up [..., I], silu in float32."""
    g, u = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(g.astype(jnp.float32)).astype(gate_up.dtype) * u


def swiglu_mlp(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """x [T, H], w_gate_up [H, 2I] (gate then up), w_down [I, H] (or `Fp8Linear`s) -> [T, H]."""
    return linear(silu_mul(linear(x, w_gate_up)), w_down)
