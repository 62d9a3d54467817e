"""Dense MLPs."""

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import linear

__all__ = ["linear", "swiglu_mlp"]


def swiglu_mlp(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """x [T, H], w_gate_up [H, 2I] (gate then up), w_down [I, H] (or `Fp8Linear`s) -> [T, H]."""
    g, u = jnp.split(linear(x, w_gate_up), 2, axis=-1)
    return linear(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u, w_down)
