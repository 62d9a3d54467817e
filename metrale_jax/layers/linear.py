"""Linear layers: plain weights [K, N], or FP8 e4m3 weights with 128x128 block scales.

`linear(x, w, b)` takes either. An `Fp8Linear` keeps the checkpoint's layout ([N, K], the
DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv` format). A fused projection (q|k|v, gate|up) stacks
its parts along N, each padded to a multiple of 128 rows so every part keeps its own scale
blocks; `segments` names the valid output columns. The XLA path here dequantizes in the dot's
operand; with `use_kernel` (set by `use_fp8_kernel`, the engine's GPU default), inputs of at most
`KERNEL_MAX_M` rows in bf16 (small decode steps) go through the weight-streaming Pallas kernel of
`pallas_kernels/linear` instead, which reads the FP8 bytes once.

bf16 weights stay on XLA's dot at every size: on the H200 the Pallas bf16 kernel read a
Llama-3-8B layer at 3.51 TB/s against XLA's 3.46-3.71 (bench/results/linear.md), no gain.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

FP8_BLOCK = 128
# rows up to which FP8 linears use the decode kernel: on the H200 (2026-11-29) its default tiles ran
# a Llama-3-8B decode step at 64 rows 2.1x slower than bf16 (they are sized for M <= 8)
KERNEL_MAX_M = 16


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Fp8Linear:
    w8: jax.Array  # f8e4m3[..., N_pad, K]  (a leading layer axis when stacked)
    scale_inv: jax.Array  # f32[..., N_pad // 128, ceil(K / 128)]
    segments: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True), default=())
    # (first row in N_pad, rows) of each part; the output concatenates these columns
    use_kernel: bool = dataclasses.field(metadata=dict(static=True), default=False)
    interpret: bool = dataclasses.field(metadata=dict(static=True), default=False)  # the kernel on CPU (tests)

    @property
    def n_out(self) -> int:
        return sum(n for _, n in self.segments)


def dequantize(w: Fp8Linear, dtype) -> jax.Array:
    """-> [N_pad, K] in `dtype`: each element times its block's scale."""
    n_pad, k = w.w8.shape[-2:]
    s = jnp.repeat(jnp.repeat(w.scale_inv, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n_pad, :k]
    return (w.w8.astype(jnp.float32) * s).astype(dtype)


def linear(x: jax.Array, w, b: jax.Array | None = None, row_scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w (* row_scale) (+ b [N]) with float32 accumulation, result in x's dtype.

    w: [K, N], or an `Fp8Linear` whose valid output columns are N.
    row_scale: f32[..., 1], multiplies each row of the f32 product (see `norms.rms_norm_linear`).
    """
    if isinstance(w, Fp8Linear):
        m = math.prod(x.shape[:-1])
        if w.use_kernel and w.w8.ndim == 2 and 1 <= m <= KERNEL_MAX_M and x.dtype == jnp.bfloat16:
            from pallas_kernels.linear import skinny_matmul_fp8

            y = skinny_matmul_fp8(x.reshape(m, x.shape[-1]), w.w8, w.scale_inv, interpret=w.interpret)
            y = y.reshape(x.shape[:-1] + (-1,)).astype(jnp.float32)  # bf16[M, N_pad] -> f32[..., N_pad]
        else:
            y = jnp.einsum("...k,nk->...n", x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)
        if len(w.segments) > 1 or w.segments[0] != (0, y.shape[-1]):
            y = jnp.concatenate([y[..., s:s + n] for s, n in w.segments], axis=-1)
    else:
        y = jnp.einsum("...k,kn->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if row_scale is not None:
        y = y * row_scale
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def use_fp8_kernel(params, interpret: bool = False):
    """`params` with every `Fp8Linear` marked to run decode-sized inputs through the Pallas
    kernel (a new tree sharing the arrays)."""
    return jax.tree.map(
        lambda w: dataclasses.replace(w, use_kernel=True, interpret=interpret) if isinstance(w, Fp8Linear) else w,
        params, is_leaf=lambda w: isinstance(w, Fp8Linear))
