"""RMSNorm variants, computed in float32 and cast back to the input dtype."""

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import linear


def rms_norm(x: jax.Array, w: jax.Array, eps: float, zero_centered: bool = False) -> jax.Array:
    """x [..., H], w [H]. zero_centered uses (1 + w), as Qwen3-Next's layer norms do."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    y = y * (1.0 + wf if zero_centered else wf)
    return y.astype(x.dtype)


def rms_norm_linear(x: jax.Array, w: jax.Array, eps: float, proj, b: jax.Array | None = None) -> jax.Array:
    """`linear(rms_norm(x, w, eps), proj, b)`, with the row's 1/rms applied to the product.

    x [..., H], w [H], proj [H, N] (or an `Fp8Linear`) -> [..., N]. (x * w) @ proj * r equals
    (x * r * w) @ proj: the matmul's input needs no broadcast of the row reduction, so XLA fuses
    x * w into the GEMM's operand and r into its epilogue, and the reduction joins the residual
    add before it: one kernel per norm instead of three at decode sizes (measured on the H200,
    bench/results/). Rounding: x * w is rounded to x's dtype, as HF rounds x * r.
    """
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # f32[..., 1]
    return linear((xf * w.astype(jnp.float32)).astype(x.dtype), proj, b, row_scale=r)
