"""Linear layers: plain weights [K, N], or FP8 e4m3 weights with 128x128 block scales.

`linear(x, w, b)` takes either. An `Fp8Linear` keeps the checkpoint's layout ([N, K], the
DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv` format). A fused projection (q|k|v, gate|up) stacks
its parts along N, each padded to a multiple of 128 rows so every part keeps its own scale
blocks; `segments` names the valid output columns. The XLA path here dequantizes in the dot's
operand; `pallas_kernels/linear` holds the weight-streaming GPU kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

FP8_BLOCK = 128


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Fp8Linear:
    w8: jax.Array  # f8e4m3[..., N_pad, K]  (a leading layer axis when stacked)
    scale_inv: jax.Array  # f32[..., N_pad // 128, ceil(K / 128)]
    segments: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True), default=())
    # (first row in N_pad, rows) of each part; the output concatenates these columns

    @property
    def n_out(self) -> int:
        return sum(n for _, n in self.segments)


def dequantize(w: Fp8Linear, dtype) -> jax.Array:
    """-> [N_pad, K] in `dtype`: each element times its block's scale."""
    n_pad, k = w.w8.shape[-2:]
    s = jnp.repeat(jnp.repeat(w.scale_inv, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n_pad, :k]
    return (w.w8.astype(jnp.float32) * s).astype(dtype)


def linear(x: jax.Array, w, b: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w (+ b [N]) with float32 accumulation, result in x's dtype.

    w: [K, N], or an `Fp8Linear` whose valid output columns are N.
    """
    if isinstance(w, Fp8Linear):
        y = jnp.einsum("...k,nk->...n", x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)
        if len(w.segments) > 1 or w.segments[0] != (0, y.shape[-1]):
            y = jnp.concatenate([y[..., s:s + n] for s, n in w.segments], axis=-1)
    else:
        y = jnp.einsum("...k,kn->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)
