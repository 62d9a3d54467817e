"""Dense MLPs."""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] (+ b [N]) with float32 accumulation, result in x's dtype."""
    y = jnp.einsum("...k,kn->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """x [T, H], w_gate_up [H, 2I] (gate then up), w_down [I, H] -> [T, H]."""
    gu = linear(x, w_gate_up)
    g, u = jnp.split(gu, 2, axis=-1)
    return linear(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u, w_down)
