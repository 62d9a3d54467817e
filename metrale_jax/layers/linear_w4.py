"""x @ W for a packed 4-bit `W4Linear` (GPTQ, AWQ, compressed-tensors W4A16, NVFP4).

bf16 or f16 inputs of weights marked `use_kernel` (the engine's GPU default,
`linear.use_fp8_kernel`) go through a Pallas kernel that reads the packed bytes and dequantizes
in registers: 2..`W4_MGPU_MAX_M` rows on Hopper the tensor-core GEMM
(`pallas_kernels/linear/w4_mgpu.py`; int4: 1.1-1.5x bf16's dot at 64 rows on the H200, against
0.3-0.4x for the streaming kernel's dot; prefill steps up to 1,024 rows in tiles of x's rows;
NVFP4 too since session 37), one row and the rest of the decode sizes (1..`W4_KERNEL_MAX_M` rows)
the weight-streaming kernel (`pallas_kernels/linear/w4.py`); everything else (larger prefill
steps, the CPU) dequantizes the whole weight in XLA and runs one GEMM.
GPTQ act-order weights keep their groups contiguous in the packed order (`perm`): the kernel path
gathers x's columns into that order, the XLA path puts the dequantized weight's columns back.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

W4_KERNEL_MAX_M = 64  # the streaming kernel's row limit (and the decode sizes)
# The tensor-core kernel's rows: prefill too, in tiles of x's rows, up to where XLA's
# dequantize-then-dot measured faster (H200, session 28: 1.16-1.35x the kernel's time at 1024 rows,
# 0.68-0.75x at 4096; the kernel dequantizes each weight tile once per 128 rows of x)
W4_MGPU_MAX_M = 1024


def w4_kernel_scales(w):
    """The tensor-core kernel's scales for `w` (int4: f32[..., 2, G, N]; NVFP4: e4m3[..., 1, G, N]),
    or None where that kernel does not take it (shapes it cannot tile: `w4_mgpu_supports`)."""
    from metrale_jax.layers.stack import Unstacked
    from pallas_kernels.linear.w4_mgpu import w4_mgpu_params_for, w4_mgpu_scales, w4_mgpu_supports

    per_layer = isinstance(w.packed, Unstacked)  # (the engine's unrolled layers, `split_layers`)
    n = (w.packed.parts[0] if per_layer else w.packed).shape[-2]
    params = w4_mgpu_params_for(2, n, w.k, w.group_size)
    if w4_mgpu_supports(2, n, w.k, w.group_size, params, w.kind):
        return None
    if per_layer:
        zeros = w.zeros.parts if w.kind == "int4" else [None] * len(w.scales.parts)
        return Unstacked([w4_mgpu_scales(s, z) for s, z in zip(w.scales.parts, zeros)])
    return w4_mgpu_scales(w.scales, w.zeros)


def dequantize_w4(w, dtype) -> jax.Array:
    """W4Linear -> [..., N, K] in `dtype` (weight columns in the packed order: x[..., perm] pairs with it)."""
    from pallas_kernels.linear.reference import dequantize_w4_reference

    return dequantize_w4_reference(w.packed, w.scales, w.aux, k=w.k, group_size=w.group_size,
                                   kind=w.kind).astype(dtype)


def w4_fuses(x: jax.Array, w) -> bool:
    """Whether x @ w is one row on the streaming kernel, marked to take the decode layer's pieces
    around the product into its launch (`w4_linear`; `AttentionConfig.w4_fused_decode`)."""
    from metrale_jax.layers.linear import W4Linear

    return (isinstance(w, W4Linear) and w.use_kernel and w.fused_decode and w.packed.ndim == 2 and w.perm is None
            and math.prod(x.shape[:-1]) == 1 and x.dtype in (jnp.bfloat16, jnp.float16) and not _promotes(x, w))


def _promotes(x: jax.Array, w) -> bool:
    """Whether x @ w runs the tensor-core kernel's `promote` form (`W4Linear.promote`: int4, bf16 x)."""
    return w.promote and w.kind == "int4" and w.kernel_scales is not None and x.dtype == jnp.bfloat16


def w4_linear(x: jax.Array, w, bias: jax.Array | None = None, residual: jax.Array | None = None,
              norm: tuple[jax.Array, float] | None = None, silu_mul: bool = False) -> jax.Array:
    """One row (`w4_fuses`) through the streaming kernel with what is around the product in the same
    launch (`pallas_kernels.linear.w4.W4Fused`): x [..., K] -> [..., N] in x's dtype.

    norm (weight [K], eps): x is the residual stream and the input its RMSNorm, as
    `norms.rms_norm_linear` computes it; silu_mul: x is gate | up [..., 2K] and the input
    `mlp.silu_mul(x)`; bias [N]; residual [..., N]: residual + the rounded result, as `x + linear(...)`.
    At batch 1 a Llama-3-8B int4 step runs 399 launches instead of 495 (the RMSNorm reduces, the
    q|k|v scale, SiLU x up and a residual add ran as XLA kernels of 1-2 us each); on the H100 the
    step did not get faster (`AttentionConfig.w4_fused_decode`, off by default).
    """
    from pallas_kernels.linear import skinny_matmul_w4

    nw, eps = norm if norm is not None else (None, 1e-6)
    y = skinny_matmul_w4(x.reshape(1, x.shape[-1]), w.packed, w.scales, w.aux,
                         k=w.k, group_size=w.group_size, kind=w.kind, interpret=w.interpret, norm_weight=nw,
                         eps=float(eps), silu_mul=silu_mul, bias=bias,
                         residual=None if residual is None else residual.reshape(1, -1))
    return y.reshape(x.shape[:-1] + (-1,))


def w4_matmul(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ W^T -> f32[..., N] (float32 accumulation)."""
    m = math.prod(x.shape[:-1])
    promote = _promotes(x, w)
    tc = w.kernel_scales is not None and (1 if promote else 2) <= m <= W4_MGPU_MAX_M
    if w.use_kernel and w.packed.ndim == 2 and (1 <= m <= W4_KERNEL_MAX_M or tc) and \
            x.dtype in (jnp.bfloat16, jnp.float16):
        from pallas_kernels.linear import skinny_matmul_w4
        from pallas_kernels.linear.w4_mgpu import skinny_matmul_w4_mgpu, w4_mgpu_params_for

        if w.perm is not None:  # x's columns in the packed order (a pass over x, not over the weight)
            x = jnp.take(x, w.perm, axis=-1)
        if tc:  # the tensor cores (one row: the streaming kernel, unless `promote`)
            params = w4_mgpu_params_for(m, w.packed.shape[0], w.k, w.group_size, interpret=w.interpret)
            params = dataclasses.replace(params, pdl=w.pdl, promote=promote)
            y = skinny_matmul_w4_mgpu(x.reshape(m, x.shape[-1]), w.packed, w.kernel_scales, w.row_scale,
                                      group_size=w.group_size, kind=w.kind, params=params, interpret=w.interpret)
            return y.reshape(x.shape[:-1] + (-1,))
        y = skinny_matmul_w4(x.reshape(m, x.shape[-1]), w.packed, w.scales, w.aux, k=w.k, group_size=w.group_size,
                             kind=w.kind, interpret=w.interpret)
        return y.reshape(x.shape[:-1] + (-1,)).astype(jnp.float32)
    wd = dequantize_w4(w, x.dtype)  # [N, K] in the packed column order
    if w.perm is not None:
        # back to the input's column order (one pass over the dequantized weight; gathering x
        # instead made XLA's CPU backend emit a bf16 x bf16 -> f32 dot it cannot run)
        wd = jnp.take(wd, jnp.argsort(w.perm), axis=-1)
    return jnp.einsum("...k,nk->...n", x, wd, preferred_element_type=jnp.float32)
