"""Routed experts with block-FP8 weights (`Fp8Linear` [E, N_pad, K] per layer) kept FP8 on the device.

Two static paths, by the number of (token, expert) pairs P = T * k against the expert count E
(`moe.routed_experts` picks with `use_pairs`; `moe_w4.py` is the 4-bit twin, whose kernel bound is 8E):
* P < E, or P < 4E with the kernel (decode): each pair's matvec reads only its expert's FP8
  weights: with `use_kernel` (the engine's GPU default, `linear.use_fp8_kernel`) and bf16
  activations through the Pallas kernel `pallas_kernels/linear/expert_fp8.py`, otherwise by
  gathering the pairs' FP8 weights and dequantizing them in XLA (`pair_matvec`, under
  `moe.pair_experts`);
* otherwise (prefill): the grouped GEMM of `moe.routed_experts` with `fp8_grouped_matmul`: on the
  GPU tokamax's Hopper kernel for quantized weights (FP8 read, upcast in registers; the H200,
  session 30: 1.9-3.9x faster than dequantizing, 0.74-1.02x the time of bf16 experts), else every
  expert dequantized to the activation dtype (a transient copy of the layer's experts).
The weights stay FP8 in memory (half of bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import FP8_BLOCK, Fp8Linear, dequantize


def _select_rows(w: jax.Array, segments) -> jax.Array:
    """[..., N_pad, K] -> [..., N, K]: the valid rows of each part, concatenated."""
    if len(segments) == 1 and segments[0][0] == 0 and segments[0][1] == w.shape[-2]:
        return w
    return jnp.concatenate([w[..., s:s + n, :] for s, n in segments], axis=-2)


def _valid_columns(y: jax.Array, w: Fp8Linear) -> jax.Array:
    """[..., N_pad] -> [..., N]: the columns of `w.segments`."""
    return _select_rows(y[..., None], w.segments)[..., 0]


def dense_experts(w: Fp8Linear, dtype) -> jax.Array:
    """Fp8Linear [E, N_pad, K] -> [E, K, N] in `dtype` (the layout `moe.routed_experts` takes)."""
    return jnp.swapaxes(_select_rows(dequantize(w, dtype), w.segments), -1, -2)


def use_pairs(x, experts, w_down: Fp8Linear) -> bool:
    """Whether the P = T * k pairs of `experts` i32[T, k] take the per-pair path (`moe.pair_experts`)."""
    # the kernel reads 1 byte per pair and parameter; the grouped GEMM of the routed experts reads
    # each routed expert once, but in 64-row tiles. At P ~ E they tie: a batch-64 decode step of
    # Qwen3-Next (640 pairs for 512 experts) took 513 us per layer on the kernel (session 15) and
    # 325 + 188 us through tokamax's FP8 grouped GEMM (session 30); before it, the grouped path
    # dequantized the layer (~5 bytes per parameter), hence P < 4E. XLA's gather materializes the
    # pairs' dequantized weights, so without the kernel only P < E
    kernel = w_down.use_kernel and x.dtype == jnp.bfloat16
    return experts.size < (4 if kernel else 1) * w_down.w8.shape[0]


def pair_matvec(xp, w: Fp8Linear, flat) -> jax.Array:
    """xp [P, K], w `Fp8Linear` [E, N_pad, K], flat i32[P] -> f32[P, N]: row p through expert flat[p]
    alone (`moe.pair_experts`), on the kernel or by gathering the pairs' FP8 weights in XLA."""
    if w.use_kernel and xp.dtype == jnp.bfloat16:
        from pallas_kernels.linear.expert_fp8 import expert_matvec_fp8

        y = expert_matvec_fp8(xp, w.w8, w.scale_inv, flat, interpret=w.interpret).astype(jnp.float32)
        if w.col_scale is not None:  # per-channel FP8 (the kernel takes block scales)
            y = y * w.col_scale[flat]
        return _valid_columns(y, w)  # f32[P, N_pad] -> [P, N]
    sub = jax.tree.map(lambda a: a[flat], w)  # the pairs' experts: FP8 bytes [P, N_pad, K] and their scales
    wd = _select_rows(dequantize(sub, xp.dtype), w.segments)  # [P, N, K]
    return jnp.einsum("pk,pnk->pn", xp, wd, preferred_element_type=jnp.float32)


def tokamax_takes(dtype, k: int, use_tokamax: bool) -> bool:
    """Whether `fp8_grouped_matmul` runs tokamax's FP8 kernel (no dense copy of the experts) for
    activations of `dtype` and K = k, where tokamax is installed."""
    return use_tokamax and jnp.dtype(dtype) == jnp.bfloat16 and k % FP8_BLOCK == 0


def fp8_grouped_matmul(x, w: Fp8Linear, sizes, use_tokamax: bool):
    """x [M, K] rows sorted by group, w `Fp8Linear` [G, N_pad, K], sizes i32[G] -> f32[M, N] (the
    valid columns of `w.segments`): tokamax's quantized grouped GEMM on the GPU (bf16 x, K a
    multiple of 128), else the experts dequantized to x's dtype and `moe.grouped_matmul`."""
    from metrale_jax.layers import moe

    if tokamax_takes(x.dtype, w.w8.shape[-1], use_tokamax) and moe.tokamax_available():
        y = _tokamax_fp8_grouped_matmul(x, w.w8, w.scale_inv, sizes)  # f32[M, N_pad]
        if w.col_scale is not None:  # per-channel FP8: each row times its group's channel scales
            groups = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=x.shape[0])
            y = y * w.col_scale[groups]
        return _valid_columns(y, w)
    return moe.grouped_matmul(x, dense_experts(w, x.dtype), sizes, use_tokamax)


def f16_operands(x, w8, scale_inv):
    """The FP8 grouped GEMM's operands in f16 (Mosaic GPU upcasts FP8 e4m3 to f16 only), scaled so
    that nothing overflows f16: x bf16[M, K], w8 f8e4m3[G, N_pad, K], scale_inv f32[G, N_pad/128,
    K/128] -> (x16 f16[M, K], scales f16[G, K/128, N_pad], undo f32[M, 1]) with
    y = (x16 @ (w8 * scales)) * undo. Each row of x is divided by a power of two 2^ex above its
    largest |x| (|x16| < 1, exact), the block scales by one power of two 2^ew so that
    448 * max(scale) * 2^-ew * K <= 2^15: every dot product of a row stays below 2^15."""
    k = w8.shape[-1]
    xf = x.astype(jnp.float32)
    ax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    ex = jnp.where(ax > 0, jnp.floor(jnp.log2(jnp.maximum(ax, 1e-30))) + 1, 0.0)  # f32[M, 1]
    ew = jnp.ceil(jnp.log2(448.0 * jnp.maximum(jnp.max(scale_inv), 1e-30) * k / 2.0**15))  # (all-zero scales: finite)
    s = jnp.repeat(scale_inv, FP8_BLOCK, axis=-2)[:, : w8.shape[-2], :]  # f32[G, N_pad, K/128]
    scales = jnp.swapaxes(s * jnp.exp2(-ew), -1, -2).astype(jnp.float16)
    return (xf * jnp.exp2(-ex)).astype(jnp.float16), scales, jnp.exp2(ex + ew)


@jax.jit
def _tokamax_fp8_grouped_matmul(x, w8, scale_inv, sizes):
    """tokamax's Hopper grouped GEMM for quantized weights: x bf16[M, K], w8 f8e4m3[G, N_pad, K],
    scale_inv f32[G, N_pad/128, K/128], sizes i32[G] -> f32[M, N_pad]. A jitted function of its own
    (lowered once per shape, as `moe._tokamax_grouped_matmul`).

    The weights go in as a qwix `QArray` [G, K, N_pad] (tokamax's default dimension numbers): its
    kernel transposes them back to the [G, N_pad, K] we store (the two transposes cancel), and its
    sm90 heuristics take the K block from the scales' tile along axis 1 (in the transposed layout
    N's, 1: "No possible swizzle" on the H200)."""
    import qwix

    from metrale_jax.layers import moe

    tk = moe._load_tokamax()
    x16, scales, undo = f16_operands(x, w8, scale_inv)
    m = x16.shape[0]
    x16, sizes = moe.pad_rows_for_tma(x16, sizes)
    q = qwix.QArray(jnp.swapaxes(w8, -1, -2), scales, qtype=jnp.float8_e4m3fn)
    op = moe.tokamax_op(tk, x16, q, sizes, preferred_element_type=None)
    y = tk.ragged_dot(x16, q, sizes, implementation=(op,))  # f16[M + pad, N_pad]: |y| < 2^15
    return y[:m].astype(jnp.float32) * undo
