"""Mosaic GPU (Hopper: TMA + wgmma) twin of the skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T.

Same contract as `skinny.py` (bf16 x, bf16 or FP8-block-scaled W [N, K], f32 accumulation, bf16
out, M = 1..64), written with `plgpu.kernel` + `plgpu.emit_pipeline`:
* grid (cdiv(N, block_n), split_k), one warpgroup per CTA; the pipeline streams x tiles
  [64, block_k] and W tiles [block_n, block_k] by TMA, `max_concurrent_steps` deep;
* x is the wgmma A operand: its tile has 64 rows, of which rows >= M lie past the array and
  are zero-filled by TMA (they cost SMEM writes, not HBM/L2 reads); W^T is the B operand
  (K-major, the transposed view of the [block_n, block_k] tile);
* bf16 W goes straight to wgmma. FP8 W is loaded from SMEM into registers (WGMMA layout, so
  block_n must be 64 or 128), multiplied by its block scale (read from GMEM; block_k = 128 so
  one scale per step) and rounded to bf16 - the dequantization HF does - then stored to an SMEM
  scratch that wgmma reads;
* the epilogue writes the first M rows of the [64, block_n] accumulator by TMA (columns past N
  are clipped by TMA). split_k > 1 writes f32 partials [split_k, M, N] that XLA adds.

TMA tiles need K to be a multiple of 64 (bf16) / 128 (FP8) and N a multiple of 8 (N and K need
not be multiples of the block sizes). Other shapes raise ValueError; `skinny.py` (Triton
lowering) takes any shape.

CI runs these kernels in Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`), which models
TMA, barriers and wgmma, and cross-lowers them for an H200 on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear.params import FP8_BLOCK
from pallas_kernels.linear.pdl import prefetch_count, prefetch_then_wait, release_dependents

MAX_M = 64
_ROWS = 64  # wgmma M: x tiles are 64 rows (zero-filled past M)
STACK_MAX_M = _ROWS // 2  # `stack_terms`: x's two FP8 terms as the two halves of one 64-row tile


@dataclasses.dataclass(frozen=True)
class MgpuParams:
    """Static tuning of the Mosaic GPU skinny GEMM.

    block_n: W rows per CTA (a multiple of 8 up to 256 for bf16; 64 or 128 for FP8, whose
      register dequantization uses the WGMMA layout).
    block_k: K columns per pipeline step (bf16: a multiple of 64, i.e. 128-byte rows for the
      swizzle; FP8: exactly 128, one scale per step; W8A8: 128, or 256, two 128-column groups a
      step, each into its own accumulator, the first group's scaling beside the second's wgmma;
      256 is off until measured on the H200).
    max_concurrent_steps: pipeline depth (TMA loads in flight per CTA).
    split_k: CTAs along K per output tile (> 1 adds an XLA reduction of f32 partials).
    stack_terms: W8A8 with at most `STACK_MAX_M` rows: x's two FP8 terms go in as the two halves
      of one 64-row tile (hi in rows 0..M-1, lo in rows 32..32+M-1), so each step runs one wgmma,
      as one FP8 term did, instead of two; the halves' f32 products are added once, at the end.
      Off until measured on the H200 (the one-term kernel's 16-32-row times are its expectation).
    pdl: W8A8: programmatic dependent launch (`pdl.py`): the CTA's first weight tiles (the
      pipeline's first fill) prefetched to L2 before it waits for the kernel that writes x, its
      dependents released after its main loop (off in interpret mode).
    """

    block_n: int = 64
    block_k: int = 128
    max_concurrent_steps: int = 4
    split_k: int = 1
    stack_terms: bool = False
    pdl: bool = False

    def __post_init__(self):
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"{self.block_n=} must be a multiple of 8 in 8..256")
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"{self.block_k=} must be a multiple of 64")
        if self.max_concurrent_steps < 1 or self.split_k < 1:
            raise ValueError(f"{self.max_concurrent_steps=} and {self.split_k=} must be >= 1")

    def check_fp8(self, w8a8: bool = False):
        if self.block_n not in (64, 128):
            raise ValueError(f"FP8 needs block_n 64 or 128; got {self.block_n}")
        if self.block_k not in ((FP8_BLOCK, 2 * FP8_BLOCK) if w8a8 else (FP8_BLOCK,)):
            raise ValueError(f"FP8 needs block_k == {FP8_BLOCK} (W8A8: or {2 * FP8_BLOCK}); got {self.block_k}")


def _body(x_gmem, w_gmem, *refs, m, k, params: MgpuParams, steps_per_split: int, fp8: bool):
    """x_gmem bf16[M, K], w_gmem [N, K], (s_gmem f32[NB, KB] if fp8), o_gmem [M, N] | f32[S, M, N]."""
    if fp8:
        s_gmem, o_gmem, wb_smem = refs  # wb_smem bf16[BN, BK]: the dequantized W tile
    else:
        (o_gmem,) = refs
    bn, bk = params.block_n, params.block_k
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    k_step0 = si * steps_per_split

    def acc_scope(acc_ref):
        if fp8:
            nb = (ni * bn) // FP8_BLOCK

            def step(idx, x_smem, w_smem):
                kb = jnp.minimum(k_step0 + idx[0], -(-k // FP8_BLOCK) - 1)  # past-K steps read zeros
                w = plgpu.layout_cast(w_smem[...], plgpu.Layout.WGMMA_8BIT)  # float8[BN, BK]
                wb = (w.astype(jnp.float32) * s_gmem[nb, kb]).astype(jnp.bfloat16)
                plgpu.wgmma_wait(0)  # the previous step's wgmma has finished reading wb_smem
                wb_smem[...] = wb
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, x_smem, wb_smem.transpose((1, 0)))
        else:

            def step(idx, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))

        plgpu.emit_pipeline(
            step,
            grid=(steps_per_split,),
            in_specs=[
                plgpu.BlockSpec((_ROWS, bk), lambda kk: (0, k_step0 + kk), delay_release=1),
                plgpu.BlockSpec((bn, bk), lambda kk: (ni, k_step0 + kk), delay_release=1),
            ],
            max_concurrent_steps=params.max_concurrent_steps,
        )(x_gmem, w_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_ROWS, bn)))  # f32[64, BN]
    _store(acc, o_gmem, m=m, bn=bn, split=params.split_k > 1)


def _store(acc, o_gmem, *, m: int, bn: int, split: bool, halves: bool = False):
    """The first m rows of this CTA's f32[64, BN] tile into o_gmem [M, N] (or its split's
    f32[S, M, N] slice) by TMA; columns past N are clipped. halves: the tile's row r and row 32 + r
    are two parts of output row r (`MgpuParams.stack_terms`), added in f32 first."""
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    dst = (o_gmem.at[si] if split else o_gmem).at[:, pl.ds(ni * bn, bn)]
    if halves:
        half = _ROWS // 2

        @functools.partial(pl.run_scoped, f_smem=plgpu.SMEM((_ROWS, bn), jnp.float32),
                           o_smem=plgpu.SMEM((half, bn), o_gmem.dtype))
        def _(f_smem, o_smem):
            f_smem[...] = acc
            plgpu.commit_smem()  # (a warpgroup barrier too: rows other threads wrote are read next)
            o_smem[...] = (f_smem[pl.ds(0, half)] + f_smem[pl.ds(half, half)]).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, m)], dst)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((_ROWS, bn), o_gmem.dtype))
    def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, m)], dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _body_w8a8(*refs, m, k, params: MgpuParams, steps_per_split: int, pdl: bool):
    """refs: x's terms, w_gmem float8[N, K], sx_gmem f32[KB, 64] (x's group scales, transposed, a
    row per x tile row, zero past x's rows), sw_gmem f32[NB, KB], o_gmem [M, N] | f32[S, M, N].
    x's terms: xh_gmem, xl_gmem float8[M, K] (`quantize_rows_fp8`; x = (hi + lo) times the scale
    of its row's 128-column group), or with `stack_terms` one float8[32 + M, K], hi then lo
    (`_stacked`).

    Each 128-column group of K runs the FP8 x FP8 wgmma of the terms into a fresh accumulator,
    added to the running f32 tile times (x's row scales of that group) x (W's block scale): the
    block scales change every 128 columns, so the products are scaled per group (DeepGEMM's
    promotion), in registers. A step of two groups (block_k 256) issues both groups' wgmmas into
    two accumulators, then scales the first while the second runs. pdl: `params.pdl` on the GPU."""
    *x_gmems, w_gmem, sx_gmem, sw_gmem, o_gmem = refs
    bn = params.block_n
    groups = params.block_k // FP8_BLOCK
    row = plgpu.Layout.WGMMA.reduce(1)
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    k_step0 = si * steps_per_split
    nb = (ni * bn) // FP8_BLOCK
    last_kb = -(-k // FP8_BLOCK) - 1
    bk = params.block_k
    if pdl:  # (boxes of 128 columns: TMA's 256-element limit)
        ahead = prefetch_count(steps_per_split * groups, bn * FP8_BLOCK, params.max_concurrent_steps * groups)
        prefetch_then_wait([w_gmem.at[pl.ds(ni * bn, bn), pl.ds(k_step0 * bk + j * FP8_BLOCK, FP8_BLOCK)]
                            for j in range(ahead)])

    def step(idx, *smem):
        *x_smems, w_smem, sx_smem, acc = smem

        def scale(g):  # f32[64, BN]: x's row scales of group g of this step times W's block scale
            kb = jnp.minimum((k_step0 + idx[0]) * groups + g, last_kb)  # past K: x and its scales read zeros
            return lax.broadcast_in_dim(plgpu.load(sx_smem.at[g], (), layout=row) * sw_gmem[nb, kb], (_ROWS, bn),
                                        [0])

        def part(*accs):
            for g, acc_ref in enumerate(accs):
                cols = pl.ds(g * FP8_BLOCK, FP8_BLOCK)
                for x_smem in x_smems:
                    x_g, w_g = (x_smem, w_smem) if groups == 1 else (x_smem.at[:, cols], w_smem.at[:, cols])
                    plgpu.wgmma(acc_ref, x_g, w_g.transpose((1, 0)))
            out = acc
            for g, acc_ref in enumerate(accs):
                s = scale(g)
                # wait for group g's wgmmas only (one committed group per wgmma; the later groups'
                # run on); the last load waits for all: the step's tiles can be released after it
                later = len(x_smems) * (groups - 1 - g)
                out = out + plgpu.wgmma_accumulator_load(acc_ref, wait_n=later) * s
            return out

        return pl.run_scoped(part, *[plgpu.ACC((_ROWS, bn))] * groups)  # f32[64, BN]

    acc0 = plgpu.layout_cast(jnp.zeros((_ROWS, bn), jnp.float32), plgpu.Layout.WGMMA)
    x_spec = plgpu.BlockSpec((_ROWS, bk), lambda kk: (0, k_step0 + kk))
    acc = plgpu.emit_pipeline(
        step,
        grid=(steps_per_split,),
        in_specs=[
            *[x_spec] * len(x_gmems),
            plgpu.BlockSpec((bn, bk), lambda kk: (ni, k_step0 + kk)),
            plgpu.BlockSpec((groups, _ROWS), lambda kk: (k_step0 + kk, 0)),
        ],
        max_concurrent_steps=params.max_concurrent_steps,
        init_carry=acc0,
    )(*x_gmems, w_gmem, sx_gmem)
    if pdl:
        release_dependents()
    _store(acc, o_gmem, m=m, bn=bn, split=params.split_k > 1, halves=len(x_gmems) == 1)


def _call(x, w, scale_inv, *, params: MgpuParams, interpret: bool, x_scales=None, out_dtype=None):
    """x_scales (W8A8): x is a tuple of x's float8 terms (`_body_w8a8`) and these are their f32[KB, 64]
    group scales (with `stack_terms`, one array of 32 + M rows)."""
    m, k = (x[0] if x_scales is not None else x).shape
    if params.stack_terms and x_scales is not None:
        m -= STACK_MAX_M
    n = w.shape[0]
    fp8 = scale_inv is not None
    w8a8 = x_scales is not None
    out_dtype = out_dtype or x.dtype
    num_steps = -(-k // params.block_k)
    split_k = min(params.split_k, num_steps)
    steps_per_split = -(-num_steps // split_k)
    split_k = -(-num_steps // steps_per_split)
    params = dataclasses.replace(params, split_k=split_k)
    out_shape = (split_k, m, n) if split_k > 1 else (m, n)
    if w8a8:
        body = functools.partial(_body_w8a8, m=m, k=k, params=params, steps_per_split=steps_per_split,
                                 pdl=params.pdl and not interpret)
        scratch, name, args = [], "skinny_matmul_w8a8_mgpu", (*x, w, x_scales, scale_inv)
    else:
        body = functools.partial(_body, m=m, k=k, params=params, steps_per_split=steps_per_split, fp8=fp8)
        scratch = [plgpu.SMEM((params.block_n, params.block_k), jnp.bfloat16)] if fp8 else []
        name = "skinny_matmul_fp8_mgpu" if fp8 else "skinny_matmul_mgpu"
        args = (x, w, scale_inv) if fp8 else (x, w)
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32 if split_k > 1 else out_dtype),
        grid=(-(-n // params.block_n), split_k),
        grid_names=("n", "s"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )
    out = f(*args)
    if split_k > 1:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out


def _check(x, w, name, w_dtype):
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: x must be [M, K] and w [N, K]; got {x.shape} and {w.shape}")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{name}: {m=} must be in 1..{MAX_M}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16) or jnp.dtype(w.dtype) != jnp.dtype(w_dtype):
        raise ValueError(f"{name}: x must be bfloat16 and w {jnp.dtype(w_dtype)}; got {x.dtype}, {w.dtype}")
    # The swizzled SMEM tiles need K to be a multiple of 128 bytes' worth of W elements (64 bf16,
    # 128 fp8; seen on the H200: "dimension 1 must have size smaller or a multiple of its tiling
    # 64, but got 784"), and TMA stores need 16-byte output rows (N % 8).
    k_mult = 128 // jnp.dtype(w.dtype).itemsize
    if k % k_mult or n % 8:
        raise ValueError(f"{name}: K={k} must be a multiple of {k_mult} and N={n} of 8 (TMA tiles)")


def _default(fp8: bool) -> MgpuParams:
    return MgpuParams(block_n=64, block_k=128, max_concurrent_steps=6 if fp8 else 4)


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def skinny_matmul_mgpu(x, w, *, params: MgpuParams | None = None, interpret: bool = False):
    """x bf16[M, K] @ w bf16[N, K]^T -> bf16[M, N] (Mosaic GPU; K % 64 == 0 == N % 8)."""
    _check(x, w, "skinny_matmul_mgpu", jnp.bfloat16)
    return _call(x, w, None, params=params or _default(False), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def skinny_matmul_fp8_mgpu(x, w8, scale_inv, *, params: MgpuParams | None = None, interpret: bool = False):
    """x bf16[M, K] @ (w8 float8_e4m3fn[N, K] * scale_inv f32[ceil(N/128), ceil(K/128)])^T -> bf16[M, N]."""
    params = _check_fp8(x, w8, scale_inv, params, "skinny_matmul_fp8_mgpu")
    return _call(x, w8, scale_inv.astype(jnp.float32), params=params, interpret=interpret)


def _check_fp8(x, w8, scale_inv, params: MgpuParams | None, name: str, w8a8: bool = False) -> MgpuParams:
    """`_check` for FP8 weights, their block scales f32[ceil(N/128), K/128], and the params (or the default)."""
    _check(x, w8, name, jnp.float8_e4m3fn)
    n, k = w8.shape
    want = (-(-n // FP8_BLOCK), k // FP8_BLOCK)  # (K is a multiple of 128: `_check`)
    if scale_inv.shape != want:
        raise ValueError(f"{name}: scale_inv shape {scale_inv.shape} must be {want}")
    params = params or _default(True)
    params.check_fp8(w8a8)
    return params


def quantize_rows_fp8(x):
    """x [M, K] (K % 128 == 0, M <= 64) -> ((hi, lo) float8_e4m3fn[M, K] each, f32[K / 128, 64]):
    each row's 128-column groups divided by their scale (absolute max / 448, e4m3's largest
    value), the activation scheme of block-FP8 checkpoints (DeepSeek-V3, Qwen3-FP8), and written
    as two FP8 terms: hi, their rounding, and lo, the rounding of what hi left (x / scale = hi +
    lo up to ~2**-8 of the group's largest value, about bf16's own precision). hi alone is the
    W8A8 of vLLM and DeepGEMM, whose rounding (~2**-4 per element) a step of one size took and
    a step of another size (the W8A16 kernel, XLA's dot) did not: session 31's FP8 Llama-3-8B
    acceptance run on the H200 found greedy requests that changed token when run alone. With lo
    every path computes the same product up to bf16 rounding. The scales are transposed and
    padded to 64 rows (zeros) as `skinny_matmul_w8a8_mgpu` reads them."""
    m, k = x.shape
    g = x.astype(jnp.float32).reshape(m, k // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1), 1e-12)  # f32[M, KB]
    # a multiply by 448 / amax, not a division (which XLA may turn into an approximate reciprocal,
    # moving values near e4m3's rounding midpoints to the other side)
    y = g * (448.0 / amax)[..., None]
    # hi's value in f32, rounded as e4m3 rounds (3 mantissa bits; e4m3's subnormals below 2**-6
    # aside, which lo then misses by at most 2**-10). Not f32(f8(y)): XLA folds that back into y
    # (its excess-precision rewrite), which left lo all zeros on the H200; an optimization
    # barrier kept it at the price of a second fusion per linear (session 32).
    hi_f32 = lax.reduce_precision(y, exponent_bits=5, mantissa_bits=3)
    hi = hi_f32.astype(jnp.float8_e4m3fn)
    lo = (y - hi_f32).astype(jnp.float8_e4m3fn)
    return (hi.reshape(m, k), lo.reshape(m, k)), jnp.pad((amax / 448.0).T, ((0, 0), (0, _ROWS - m)))


_SMS = 132  # H200 streaming multiprocessors


def w8a8_params_for(n: int, k: int) -> MgpuParams:
    """The W8A8 kernel's tiles for a [N, K] weight, from the H200 sweep of the Llama-3-8B
    projections at 16-64 rows (bench/results/linear_fp8_batch_2026-12-05_s35.md): two 128-column
    groups per pipeline step and, at <= 32 rows, both FP8 terms of x in one tile (`stack_terms`)
    everywhere; 128-row tiles without a K split when they still fill every SM (gate|up, N =
    28,672: 41 us at 64 rows against 46 with one group a step); else a 2-way K split, with 64-row
    tiles when twice their count still fits the SMs (o, down: 10.6 and 24.9 us against 16.1 and
    31.0 before) and 128-row tiles when it does not (q|k|v: 14.2 against 17.0). The four
    projections of a layer took 85-91 us at 16-64 rows against 116-123 for the best bf16 kernel."""
    bk = 2 * FP8_BLOCK
    if -(-n // 128) >= _SMS:
        return MgpuParams(block_n=128, block_k=bk, max_concurrent_steps=3, stack_terms=True)
    split = 2 if k >= 4 * bk else 1
    if 2 * -(-n // 64) <= _SMS:
        return MgpuParams(block_n=64, block_k=bk, max_concurrent_steps=4, split_k=split, stack_terms=True)
    return MgpuParams(block_n=128, block_k=bk, max_concurrent_steps=3, split_k=split, stack_terms=True)


def _stacked(x8, sx, m: int):
    """`quantize_rows_fp8`'s (hi, lo) f8[M, K] and f32[KB, 64] for `stack_terms` (M <= 32, a
    multiple of 8): x f8[32 + M, K] (hi in rows 0..M-1, zeros, lo from row 32) and the scales of
    those rows."""
    hi, lo = x8
    xs = jnp.concatenate([jnp.pad(hi, ((0, STACK_MAX_M - m), (0, 0))), lo])
    return (xs,), jnp.concatenate([sx[:, :STACK_MAX_M], sx[:, :STACK_MAX_M]], axis=1)


def w8a8_supports(m: int, n: int, k: int) -> bool:
    """Whether `skinny_matmul_w8a8_mgpu` takes x [m, k] and W [n, k] (see `_check`)."""
    return 1 <= m <= MAX_M and k % FP8_BLOCK == 0 and n % 8 == 0


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def skinny_matmul_w8a8_mgpu(x, w8, scale_inv, *, params: MgpuParams | None = None, interpret: bool = False):
    """x bf16[M, K] @ (w8 float8_e4m3fn[N, K] * scale_inv f32[ceil(N/128), K/128])^T -> bf16[M, N]
    on the FP8 tensor cores: x goes in as two FP8 terms scaled per row and 128-column group
    (`quantize_rows_fp8`), which keep it to about bf16's precision, so the result equals the
    W8A16 kernel's up to bf16 rounding; W never leaves FP8."""
    params = _check_fp8(x, w8, scale_inv, params or w8a8_params_for(*w8.shape), "skinny_matmul_w8a8_mgpu", True)
    m = x.shape[0]
    stack = params.stack_terms and m <= STACK_MAX_M
    params = dataclasses.replace(params, stack_terms=stack)
    # TMA: x's and y's rows past one 8-row tile must be whole tiles (M = 12 or 20 failed to lower)
    mp = -(-m // 8) * 8 if m > 8 or stack else m
    x8, sx = quantize_rows_fp8(jnp.pad(x, ((0, mp - m), (0, 0))))
    if stack:
        x8, sx = _stacked(x8, sx, mp)
    y = _call(x8, w8, scale_inv.astype(jnp.float32), params=params, interpret=interpret, x_scales=sx,
              out_dtype=x.dtype)
    return y[:m] if mp != m else y
