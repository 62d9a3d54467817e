"""Linear layers: plain weights [K, N], FP8 e4m3 weights with 128x128 block scales, or packed 4-bit weights.

`linear(x, w, b)` takes either. An `Fp8Linear` keeps the checkpoint's layout ([N, K], the
DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv` format). A fused projection (q|k|v, gate|up) stacks
its parts along N, each padded to a multiple of 128 rows so every part keeps its own scale
blocks; `segments` names the valid output columns. The XLA path here dequantizes in the dot's
operand; with `use_kernel` (set by `use_fp8_kernel`, the engine's GPU default), inputs of at most
64 rows in bf16 (decode steps) go through a Pallas kernel of `pallas_kernels/linear` instead,
which reads the FP8 bytes once: the weight-streaming W8A16 kernel for a few rows, the W8A8 kernel
on the FP8 tensor cores for more (`W8A16_MAX_M` below says where and why). Every path computes
the product of x as it is (the W8A8 kernel takes x as two FP8 terms, about bf16's precision), so a
request's tokens do not depend on how many rows share its step.

bf16 weights stay on XLA's dot at every size: on the H200 the Pallas bf16 kernel read a
Llama-3-8B layer at 3.51 TB/s against XLA's 3.46-3.71 (bench/results/linear.md), no gain.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

FP8_BLOCK = 128
# FP8 linears marked `use_kernel` (bf16 x of M rows): M <= W8A16_MAX_M through the weight-streaming
# W8A16 kernel; M <= 64 through the Mosaic W8A8 kernel (FP8 tensor cores; x as two FP8 terms, each
# quantized per row and 128 columns) where it takes the shape (K % 128 == 0), else the W8A16
# kernel up to KERNEL_MAX_M rows; larger M (prefill) through XLA. H200, Llama-3-8B projections, one layer
# (bench/results/linear_fp8_batch_2026-12-02_s11.md): at 16 rows W8A8 98 us against W8A16 138 us
# and bf16 XLA 121 us, at 64 rows 93 us against 214 (W8A16; 2.1x slower than bf16 per step on
# 2026-11-29, its tiles are sized for M <= 8) and 130 (bf16). 1-8 rows stay on W8A16 (FP8 batch 1
# ran 1.44x bf16's tokens/s with it; W8A8 at so few rows is unmeasured). Those figures are from
# the one-term W8A8 kernel, whose x rounding (~2**-4) changed greedy tokens between a request run
# alone and in a batch (session 31); with the second term's wgmma a layer takes 126 / 111 us at
# 16 / 64 rows (bf16: 117 / 123; bench/results/linear_fp8_batch_2026-12-04_s32_two_terms.md).
W8A16_MAX_M = 8
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
    w8a8: bool = dataclasses.field(metadata=dict(static=True), default=False)  # 9-64 rows: the W8A8 kernel
    pdl: bool = dataclasses.field(metadata=dict(static=True), default=False)  # the W8A8 kernel's (`use_fp8_kernel`)
    # f32[..., N_pad] | None: per-output-channel scales (per-channel FP8 checkpoints, whose block
    # scales are then 1), applied to the product's columns
    col_scale: jax.Array | None = None

    @property
    def n_out(self) -> int:
        return sum(n for _, n in self.segments)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class W4Linear:
    """4-bit weights (GPTQ, AWQ, compressed-tensors W4A16, NVFP4; `quant/w4.py`), one layout.

    Two codes per byte along K (byte j of a row: code 2j in the low nibble, 2j+1 in the high), rows
    = output columns, so a decode kernel streams contiguous K bytes of each row (the FP8 kernel's
    [N, K] layout, half the bytes). Fused parts (q|k|v, gate|up) are stacked along N, unpadded.
    W[n, perm[k]] = (code - zeros[n, k // G]) * scales[n, k // G]          (kind "int4")
                 = e2m1(code) * scales[n, k // G] * row_scale[n]          (kind "fp4")
    """

    packed: jax.Array  # u8[..., N, ceil(K / 2)]  (a leading layer axis when stacked)
    scales: jax.Array  # f16 | bf16 | f32 (int4), float8_e4m3fn (fp4) [..., N, ceil(K / G)]
    zeros: jax.Array | None  # u8[..., N, ceil(K / G)] (int4), None (fp4)
    row_scale: jax.Array | None  # f32[..., N] (fp4: the per-part global scale), None (int4)
    perm: jax.Array | None  # i32[..., K]: the input column of weight column k (GPTQ act-order), None = identity
    # the tensor-core kernel's scales (`pallas_kernels/linear/w4_mgpu.py`; Hopper, set by
    # `use_fp8_kernel`): int4 f32[..., 2, ceil(K / G), N] (scales and -zeros * scales transposed),
    # fp4 e4m3[..., 1, K / 16, N] (scales transposed); else None
    kernel_scales: jax.Array | None = None
    k: int = dataclasses.field(metadata=dict(static=True), default=0)  # input features
    group_size: int = dataclasses.field(metadata=dict(static=True), default=128)
    kind: str = dataclasses.field(metadata=dict(static=True), default="int4")  # "int4" | "fp4"
    use_kernel: bool = dataclasses.field(metadata=dict(static=True), default=False)
    interpret: bool = dataclasses.field(metadata=dict(static=True), default=False)
    # one row: the decode layer's pieces around the product in the kernel's launch (`linear_w4.w4_fuses`)
    fused_decode: bool = dataclasses.field(metadata=dict(static=True), default=False)
    # the tensor-core kernel with programmatic dependent launch (`use_fp8_kernel`)
    pdl: bool = dataclasses.field(metadata=dict(static=True), default=False)
    # int4 with bf16 x: the tensor-core kernel's `promote` form from one row up (`linear_w4.w4_matmul`)
    promote: bool = dataclasses.field(metadata=dict(static=True), default=False)
    # MoE experts: per-pair matvecs through the Pallas expert kernel (`layers/moe_w4.py`) instead of
    # XLA's gather; off everywhere by default: slower than the gather on the H100 (session 42)
    expert_kernel: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def n_out(self) -> int:
        return self.packed.shape[-2]

    @property
    def aux(self) -> jax.Array:
        """The kernels' and the reference's fourth operand: zeros (int4) or row_scale (fp4)."""
        return self.row_scale if self.kind == "fp4" else self.zeros


def dequantize(w: Fp8Linear, dtype) -> jax.Array:
    """-> [N_pad, K] in `dtype`: each element times its block's scale (and its row's `col_scale`)."""
    n_pad, k = w.w8.shape[-2:]
    s = jnp.repeat(jnp.repeat(w.scale_inv, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n_pad, :k]
    if w.col_scale is not None:
        s = s * w.col_scale[..., None]
    return (w.w8.astype(jnp.float32) * s).astype(dtype)


def linear(x: jax.Array, w, b: jax.Array | None = None, row_scale: jax.Array | None = None,
           residual: jax.Array | None = None) -> jax.Array:
    """(residual +) x [..., K] @ w (* row_scale) (+ b [N]) with float32 accumulation, result in x's dtype.

    w: [K, N], an `Fp8Linear` whose valid output columns are N, or a 4-bit `W4Linear` [N, K].
    row_scale: f32[..., 1], multiplies each row of the f32 product (see `norms.rms_norm_linear`).
    residual [..., N]: added to the rounded result in x's dtype (one row of 4-bit weights: in the
    kernel's launch, `linear_w4.w4_linear`).
    """
    if row_scale is None and isinstance(w, W4Linear):
        from metrale_jax.layers.linear_w4 import w4_fuses, w4_linear

        if w4_fuses(x, w):
            return w4_linear(x, w, b, residual)
    y = matmul_f32(x, w)
    if row_scale is not None:
        y = y * row_scale
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype) if residual is None else residual + y.astype(x.dtype)


def matmul_f32(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ w (as `linear` takes it) -> the float32 product f32[..., N]."""
    if isinstance(w, W4Linear):
        from metrale_jax.layers.linear_w4 import w4_matmul

        return w4_matmul(x, w)  # f32[..., N]
    if isinstance(w, Fp8Linear):
        m = math.prod(x.shape[:-1])
        kernel = _fp8_kernel(w, x.dtype, m)
        if kernel is not None:
            y = kernel(x.reshape(m, x.shape[-1]), w.w8, w.scale_inv, interpret=w.interpret)
            y = y.reshape(x.shape[:-1] + (-1,)).astype(jnp.float32)  # bf16[M, N_pad] -> f32[..., N_pad]
            if w.col_scale is not None:  # (the kernels take block scales only)
                y = y * w.col_scale
        else:
            y = jnp.einsum("...k,nk->...n", x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)
        if len(w.segments) > 1 or w.segments[0] != (0, y.shape[-1]):
            y = jnp.concatenate([y[..., s:s + n] for s, n in w.segments], axis=-1)
        return y
    return jnp.einsum("...k,kn->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _fp8_kernel(w: Fp8Linear, dtype, m: int):
    """The Pallas kernel for x bf16[m, K] @ `w` (module constants above), or None for XLA."""
    if not (w.use_kernel and w.w8.ndim == 2 and dtype == jnp.bfloat16 and m >= 1):
        return None
    from pallas_kernels.linear import skinny_matmul_fp8
    from pallas_kernels.linear.skinny_mgpu import skinny_matmul_w8a8_mgpu, w8a8_params_for, w8a8_supports

    if w.w8a8 and m > W8A16_MAX_M and w8a8_supports(m, *w.w8.shape):
        params = dataclasses.replace(w8a8_params_for(*w.w8.shape), pdl=w.pdl)
        return functools.partial(skinny_matmul_w8a8_mgpu, params=params)
    return skinny_matmul_fp8 if m <= KERNEL_MAX_M else None


def has_quantized_linears(params) -> bool:
    """Whether `params` holds any `Fp8Linear` or `W4Linear`."""
    kinds = (Fp8Linear, W4Linear)
    return any(isinstance(w, kinds) for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, kinds)))


def is_experts(path) -> bool:
    """Whether a parameter-tree path (`jax.tree_util` keys) leads into MoE experts (`experts_*`)."""
    return any(str(getattr(k, "key", "")).startswith("experts_") for k in path)


def use_fp8_kernel(params, interpret: bool = False, w8a8: bool = True, fp4_tensor_cores: bool = True,
                   w4_fused_decode: bool = False, pdl: bool = False, w4_promote: bool = False):
    """`params` with every `Fp8Linear` (and `W4Linear`) marked to run decode-sized inputs through
    the Pallas kernels (a new tree sharing the arrays); `w8a8` (Hopper's tensor-core kernels): the
    FP8 ones of 9-64 rows through the W8A8 kernel (`_fp8_kernel`), the int4 ones (and with
    `fp4_tensor_cores` the NVFP4 ones) of 2-1,024 rows through the 4-bit GEMM
    (`linear_w4.w4_matmul`; it gets its transposed scales here); `w4_fused_decode`: one-row 4-bit
    linears with the layer's norms, SwiGLU and residual adds in their launches (`linear_w4.w4_linear`);
    `pdl`: those Mosaic GPU kernels with programmatic dependent launch (`AttentionConfig.kernel_pdl`);
    `w4_promote`: int4 linears with bf16 inputs of 1-1,024 rows through the 4-bit GEMM's `promote`
    form (`AttentionConfig.w4_promote`; one row too, instead of the streaming kernel)."""
    def mark(path, w):
        if isinstance(w, Fp8Linear):
            return dataclasses.replace(w, use_kernel=True, interpret=interpret, w8a8=w8a8, pdl=pdl)
        if isinstance(w, W4Linear):
            from metrale_jax.layers.linear_w4 import w4_kernel_scales

            # (MoE experts run their own kernels: `layers/moe_w4.py`)
            ks = w4_kernel_scales(w) if w8a8 and not is_experts(path) and (w.kind == "int4" or fp4_tensor_cores) \
                else None
            return dataclasses.replace(w, use_kernel=True, interpret=interpret, kernel_scales=ks,
                                       fused_decode=w4_fused_decode, pdl=pdl, promote=w4_promote and w8a8)
        return w

    return jax.tree_util.tree_map_with_path(mark, params, is_leaf=lambda w: isinstance(w, (Fp8Linear, W4Linear)))
