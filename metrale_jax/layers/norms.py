"""RMSNorm variants, computed in float32 and cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float, zero_centered: bool = False) -> jax.Array:
    """x [..., H], w [H]. zero_centered uses (1 + w), as Qwen3-Next's layer norms do."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    y = y * (1.0 + wf if zero_centered else wf)
    return y.astype(x.dtype)
