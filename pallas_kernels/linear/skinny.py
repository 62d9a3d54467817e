"""Weight-streaming skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T, M = 1..64.

At decode batch sizes a linear layer's time is the time to read its weights once; these kernels
stream W from HBM with a deep software pipeline and keep x (tiny) in L2. Two weight formats:
* `skinny_matmul`: bf16 W [N, K];
* `skinny_matmul_fp8`: float8_e4m3fn W [N, K] with 128x128 block scales `scale_inv`
  f32[ceil(N/128), ceil(K/128)] (the HF / DeepSeek-V3 `weight_scale_inv` format), dequantized in
  the kernel. A program's block_n (<= 128) rows share one row of scale blocks, so the scale only
  varies along K: by default each step gathers its per-column scales and folds them into the x
  tile (x * s in bf16, exact fp8->bf16 weights, one f32-accumulated dot per step), or with
  `SkinnyParams.fp8_f16_dot` runs the dot in f16 (cheaper conversion, rows normalized by a power
  of two); see `SkinnyParams.fp8_scale_on_x` for the measured per-sub-block alternative.
Activations are bf16, accumulation float32, output bf16.

Layout: W is [N, K], the checkpoint's (torch Linear) layout, so each program streams block_n
rows of block_k * itemsize contiguous bytes (512 B for bf16 at block_k=256), and narrow output
tiles (block_n = 16..64) give enough programs to cover the SMs without split-K. A [K, N] weight
needs wide N tiles for contiguous rows and then too few programs (bench/kernels/linear.py
measures both; see bench/results/linear.md).

Grid: (cdiv(N, block_n), split_k). Program (j, s) loops over its share of the K steps with
`fori_loop`; Triton pipelines the loads `num_stages` deep. x rows beyond M, columns beyond K and
weight rows beyond N are masked (partial last blocks are fine). With split_k > 1, programs write
f32 partials [split_k, M, N] and XLA adds them.

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU. Why: the Mosaic GPU twin
(`skinny_mgpu.py`: TMA + wgmma via `emit_pipeline`) was measured beside it on the H200
(2026-11-29, bench/results/linear.md) and was slower at M <= 32 (2.0-2.4 vs 3.2-3.7 TB/s on the
Llama-3-8B projections; it only wins at M=64 on the down projection), and it needs K % 64 (bf16) /
K % 128 (FP8) and N % 8, while this kernel takes any shape (masked partial tiles) and runs
unchanged in Pallas' interpret mode on the CPU. The Pallas Triton backend is deprecated since
jax 0.11 but still the default in 0.11.2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.linear.params import FP8_BLOCK, SkinnyParams, m_bucket, skinny_params_for

MAX_M = 64


def _skinny_kernel(
    x_ref,  # bf16[M, K] (whole array)
    w_ref,  # bf16 | float8_e4m3fn [N, K] (whole array)
    *refs,  # (scale_inv f32[NB, KB] if fp8), then out: bf16[M, N] (split_k == 1) or f32[S, M, N]
    m: int,
    n: int,
    k: int,
    mp: int,
    block_n: int,
    block_k: int,
    steps_per_split: int,
    num_steps: int,
    split_k: int,
    fp8: bool,
    scale_on_x: bool,
    f16_dot: bool,
    gemv: bool,
):
    if fp8:
        s_ref, o_ref = refs
    else:
        (o_ref,) = refs
    pid_n = pl.program_id(0)
    pid_s = pl.program_id(1)
    rows = jnp.arange(mp, dtype=jnp.int32)  # i32[Mp]
    ncols = pid_n * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[BN] weight rows
    row_ok = rows < m if mp > m else None
    n_ok = ncols < n if n % block_n else None
    k_partial = k % block_k != 0
    sub = FP8_BLOCK if fp8 and not scale_on_x else block_k  # columns per dot
    nb = (pid_n * block_n) // FP8_BLOCK  # scale row of this tile (block_n divides 128 for fp8)
    kblocks = -(-k // FP8_BLOCK)

    def and_(a, b):
        if a is None:
            return b
        if b is None:
            return a
        return a & b

    def w_tile(kcols, k_ok):  # [BN, len(kcols)] weights, streamed once (evict first)
        w_mask = and_(None if n_ok is None else n_ok[:, None], None if k_ok is None else k_ok[None, :])
        return plgpu_triton.load(
            w_ref.at[ncols[:, None], kcols[None, :]], mask=w_mask,
            other=None if w_mask is None else jnp.zeros((), w_ref.dtype), eviction_policy="evict_first",
        )

    def col_scales(kcols):
        # f32[len(kcols)]: per-column scales of this tile's scale row (a few distinct values, L1
        # hits); past-K columns are clamped to the last block (x is 0 there).
        kb_cols = jnp.minimum(kcols // FP8_BLOCK, kblocks - 1)
        return plgpu_triton.load(s_ref.at[jnp.full(kcols.shape, nb, jnp.int32), kb_cols])

    def gemv_body(i, acc):  # M = 1 on the CUDA cores: x is one row, no padding to a dot's 16 rows
        kcols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[BK]
        k_ok = kcols < k if k_partial else None
        x = plgpu_triton.load(x_ref.at[jnp.zeros_like(kcols), kcols], mask=k_ok,
                              other=None if k_ok is None else 0.0).astype(jnp.float32)  # f32[BK]
        if fp8:
            x = x * col_scales(kcols)
        return acc + jnp.sum(w_tile(kcols, k_ok).astype(jnp.float32) * x[None, :], axis=1)  # f32[BN]

    def body(i, acc):
        for j in range(block_k // sub):
            k0 = i * block_k + j * sub
            kcols = k0 + jnp.arange(sub, dtype=jnp.int32)  # i32[sub]
            k_ok = kcols < k if k_partial else None
            x_mask = and_(None if row_ok is None else row_ok[:, None], None if k_ok is None else k_ok[None, :])
            x = plgpu_triton.load(
                x_ref.at[rows[:, None], kcols[None, :]], mask=x_mask, other=None if x_mask is None else 0.0
            )  # bf16[Mp, sub]
            w = w_tile(kcols, k_ok)  # [BN, sub]
            if fp8 and scale_on_x:
                xs = x.astype(jnp.float32) * col_scales(kcols)[None, :]  # f32[Mp, sub]
                if f16_dot:
                    # fp8 -> f16 is one packed cvt per 2 weights (-> bf16 goes through f16 and f32).
                    # f16's range is narrow, so each x row is divided by a power of two >= its
                    # max |x * s| first (exact) and the f32 partial multiplied back.
                    bits = jax.lax.bitcast_convert_type(jnp.max(jnp.abs(xs), axis=1), jnp.int32)
                    p2 = jax.lax.bitcast_convert_type(bits & 0x7F800000, jnp.float32)  # f32[Mp] 2^floor(log2)
                    r = jnp.where(p2 > 0, 2.0 * p2, 1.0)  # f32[Mp]
                    xh = (xs * (1.0 / r)[:, None]).astype(jnp.float16)  # |xh| < 1
                    part = plgpu_triton.dot(xh, w.astype(jnp.float16), trans_b=True).astype(jnp.float32)
                    acc = acc + part * r[:, None]
                else:
                    acc = acc + plgpu_triton.dot(xs.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                                 trans_b=True).astype(jnp.float32)
            elif fp8:
                part = plgpu_triton.dot(x, w.astype(jnp.bfloat16), trans_b=True).astype(jnp.float32)  # f32[Mp, BN]
                kb = k0 // FP8_BLOCK
                if k_partial:
                    kb = jnp.minimum(kb, kblocks - 1)  # a fully masked sub-block may lie past K
                acc = acc + part * s_ref[nb, kb]
            else:
                acc = acc + plgpu_triton.dot(x, w, trans_b=True).astype(jnp.float32)
        return acc

    step0 = pid_s * steps_per_split
    if split_k == 1:
        step1 = num_steps
    else:
        step1 = jnp.minimum(step0 + steps_per_split, num_steps)
    if gemv:
        acc = jax.lax.fori_loop(step0, step1, gemv_body, jnp.zeros((block_n,), jnp.float32))
        zero = jnp.zeros_like(ncols)
        if split_k == 1:
            plgpu_triton.store(o_ref.at[zero, ncols], acc.astype(o_ref.dtype), mask=n_ok)
        else:
            plgpu_triton.store(o_ref.at[pid_s + zero, zero, ncols], acc, mask=n_ok)
        return
    acc = jax.lax.fori_loop(step0, step1, body, jnp.zeros((mp, block_n), jnp.float32))
    out_mask = and_(None if row_ok is None else row_ok[:, None], None if n_ok is None else n_ok[None, :])
    if split_k == 1:
        plgpu_triton.store(o_ref.at[rows[:, None], ncols[None, :]], acc.astype(o_ref.dtype), mask=out_mask)
    else:
        plgpu_triton.store(
            o_ref.at[pid_s, rows[:, None], ncols[None, :]], acc, mask=out_mask
        )


def _drop_alias_input(kernel, n_in: int):
    """Kernel wrapper ignoring the aliased poison input (placed after the `n_in` real inputs)."""

    def wrapped(*refs):
        return kernel(*refs[:n_in], *refs[n_in + 1:])

    return wrapped


def _call(x, w, scale_inv, *, params: SkinnyParams, interpret: bool, poison: bool):
    m, k = x.shape
    n = w.shape[0]
    fp8 = scale_inv is not None
    gemv = params.gemv and m == 1
    mp = 1 if gemv else m_bucket(m)
    num_steps = -(-k // params.block_k)
    split_k = min(params.split_k, num_steps)
    steps_per_split = -(-num_steps // split_k)
    split_k = -(-num_steps // steps_per_split)  # no empty splits
    grid = (-(-n // params.block_n), split_k)
    kernel = functools.partial(
        _skinny_kernel, m=m, n=n, k=k, mp=mp, block_n=params.block_n, block_k=params.block_k,
        steps_per_split=steps_per_split, num_steps=num_steps, split_k=split_k, fp8=fp8,
        scale_on_x=params.fp8_scale_on_x, f16_dot=params.fp8_f16_dot, gemv=gemv,
    )
    args = [x, w] + ([scale_inv] if fp8 else [])
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
    aliases = {}
    if poison:  # test hook: the output starts as NaN (an aliased input), so unwritten elements show
        aliases[len(args)] = 0
        kernel = _drop_alias_input(kernel, len(args))
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="skinny_matmul_fp8" if fp8 else "skinny_matmul",
    )(*args)
    if split_k > 1:
        out = jnp.sum(out, axis=0).astype(x.dtype)
    return out


def _check(x, w, name: str, w_dtypes):
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{name}: x must be [M, K] and w [N, K]; got {x.shape} and {w.shape}")
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{name}: {m=} must be in 1..{MAX_M} (larger batches belong to XLA's dot)")
    if w.shape[1] != k:
        raise ValueError(f"{name}: x {x.shape} and w {w.shape} disagree on K (w is [N, K])")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"{name}: x must be bfloat16; got {x.dtype}")
    if jnp.dtype(w.dtype) not in w_dtypes:
        raise ValueError(f"{name}: w dtype {w.dtype} must be one of {w_dtypes}")


@functools.partial(jax.jit, static_argnames=("params", "interpret", "_poison"))
def skinny_matmul(x, w, *, params: SkinnyParams | None = None, interpret: bool = False, _poison: bool = False):
    """x bf16[M, K] @ w bf16[N, K]^T -> bf16[M, N], float32 accumulation, M in 1..64.

    params: static tuning (default: the tuned table for this shape, else a heuristic).
    interpret: run in Pallas interpret mode (CPU tests).
    """
    _check(x, w, "skinny_matmul", (jnp.dtype(jnp.bfloat16),))
    if params is None:
        params = skinny_params_for(x.shape[0], w.shape[0], x.shape[1], w.dtype)
    return _call(x, w, None, params=params, interpret=interpret, poison=_poison)


@functools.partial(jax.jit, static_argnames=("params", "interpret", "_poison"))
def skinny_matmul_fp8(
    x, w8, scale_inv, *, params: SkinnyParams | None = None, interpret: bool = False, _poison: bool = False
):
    """x bf16[M, K] @ (w8 float8_e4m3fn[N, K] * scale_inv per 128x128 block)^T -> bf16[M, N].

    scale_inv: f32 (or bf16, upcast) [ceil(N/128), ceil(K/128)], W ~= w8 * scale_inv blockwise.
    params: static tuning (block_n must divide 128, block_k be a multiple of 128).
    """
    _check(x, w8, "skinny_matmul_fp8", (jnp.dtype(jnp.float8_e4m3fn),))
    n, k = w8.shape
    want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if scale_inv.shape != want:
        raise ValueError(f"skinny_matmul_fp8: scale_inv shape {scale_inv.shape} must be {want} for w {w8.shape}")
    if params is None:
        params = skinny_params_for(x.shape[0], n, k, w8.dtype)
    params.check_fp8()
    return _call(x, w8, scale_inv.astype(jnp.float32), params=params, interpret=interpret, poison=_poison)
