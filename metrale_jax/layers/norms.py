"""RMSNorm variants, computed in float32 and cast back to the input dtype."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import linear, matmul_f32


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
    (x * r * w) @ proj: the matmul's input needs no broadcast of the row reduction, so XLA computes
    the reduction and x * w in one kernel and folds r into the GEMM's consumers (H200 decode
    profile, bench/results/session4_2026-11-30.md: two kernels per norm with the residual add,
    three before). Rounding: x * w is rounded to x's dtype, as HF rounds x * r.
    """
    from metrale_jax.layers.linear_w4 import w4_fuses, w4_linear

    if w4_fuses(x, proj):  # (one row of 4-bit weights: the norm in the kernel's launch)
        return w4_linear(x, proj, b, norm=(w, eps))
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # f32[..., 1]
    return linear((xf * w.astype(jnp.float32)).astype(x.dtype), proj, b, row_scale=r)


class RowNorm(NamedTuple):
    """An RMSNorm's row scale in pieces: r = rsqrt(sum_sq / size + eps)."""

    sum_sq: jax.Array  # f32[..., 1]  each row's sum of squares
    eps: float
    size: int  # the normalized width

    def scale(self) -> jax.Array:
        """r f32[..., 1] (as `rms_norm_linear` computes it)."""
        return jax.lax.rsqrt(self.sum_sq / self.size + self.eps)


def rms_norm_matmul(x: jax.Array, w: jax.Array, eps: float, proj) -> tuple[jax.Array, RowNorm]:
    """`rms_norm_linear` (no bias) before its row scale and rounding: -> (the product y
    f32[..., N], the row scale's pieces); (y * norm.scale()).astype(x.dtype) is `rms_norm_linear`'s
    result. For a consumer that is a kernel of ours (`lora.ops.add_delta`), which scales as it
    reads: given the rounded result, XLA writes it with a launch of its own, and given r, computes
    it with one more (the sum of squares is the norm's reduction output itself)."""
    xf = x.astype(jnp.float32)
    ss = jnp.sum(xf * xf, axis=-1, keepdims=True)
    return matmul_f32((xf * w.astype(jnp.float32)).astype(x.dtype), proj), RowNorm(ss, eps, x.shape[-1])
