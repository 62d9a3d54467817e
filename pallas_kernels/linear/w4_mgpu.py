"""Mosaic GPU (Hopper: TMA + wgmma) GEMM for 4-bit weights (int4, NVFP4) at decode and prefill sizes: y = x @ W^T.

The Triton 4-bit kernel (`w4.py`) streams weights at M = 1 on the CUDA cores; its dot path for
M = 8..64 measured 1.5-2.9x slower than bf16 (session 15), so a batch-64 step with 4-bit weights
was slower than bf16. This kernel puts the weights on the tensor cores, "swap AB" (as
TensorRT-LLM's and vLLM's skinny GEMMs do): the product is computed transposed,
y^T [N, M] = W [N, K] @ x^T, so the weight tile is wgmma's A operand, 64 rows a CTA, dequantized
in registers, and x (M rows padded to a multiple of 8: by TMA's zero fill up to 8 rows, by XLA
beyond, where TMA wants whole tiles) is the small B operand; no tensor-core work is spent on
padding x to 64 rows.

* W arrives as `layers.linear.W4Linear` packs it (u8[N, K/2], byte j of row n: code 2j low nibble,
  2j+1 high), viewed as XLA's uint4[N, K] (XLA packs 4-bit arrays two to a byte, the first element
  in the low nibble on the GPU: the same bytes). TMA streams [64, block_k] code tiles
  `max_concurrent_steps` deep; each is upcast in registers to f32, turned into
  code * scale + (-zero * scale) (one FMA; the affine form of (code - zero) * scale), rounded to
  x's dtype (bf16 or f16, as a 16-bit checkpoint's weights are), and multiplied by wgmma with A
  from registers (`a_smem=True` stores it to shared memory first, which Mosaic GPU's interpret
  mode needs: the CPU tests run that variant).
* Scales come as `w4_mgpu_scales`: f32[2, G, N] (scale and -zero * scale, transposed so a CTA's 64
  rows of one group are contiguous), made once at load (`W4Linear.kernel_scales`: 1/8 of the
  packed weights' bytes more). Each step, or each of its column slices (`chunks`, for groups of
  64), has one scale per row.
* grid (N / 64, split_k, M tiles) (N / 128 with `compute_wgs=2`); up to `block_m` rows x is one
  tile, beyond that (prefill) tiles of `block_m` rows, each CTA dequantizing its weight tile again;
  each CTA writes its f32[64, tile] accumulator(s) to y^T by TMA (rows past N clipped); split_k > 1
  writes f32 partials that XLA adds. The caller gets f32[M, N] (XLA transposes the result;
  `matmul_f32` wants f32).

NVFP4 (`kind="fp4"`: e2m1 codes, an FP8 e4m3 scale per 16 codes, a global scale per row): the
scales come as `w4_mgpu_scales(scales)`, e4m3[1, G, N] (1/8 of the packed bytes more, as for int4). A code's
value is made exactly with integer operations, as a float16 bit pattern: sign to bit 15, its two
exponent and one mantissa bits to bits 10..11 and 9, which reads as e2m1 / 2^14 (a float16
subnormal for the codes 0 and 0.5, converted exactly to f32). The step's tile is then scaled in
16-column pieces, each by its group's scale row (times 2^14), and the pieces joined back for one
wgmma (the products e2m1 x e4m3 are exact in bf16 and f16). The global scale multiplies the f32
output. Hopper has no FP4 conversion (`cvt.*.e2m1x2` is Blackwell's) and no FP4 tensor cores.

K must be a multiple of block_k and N of 8 (TMA); int4's group size a multiple of block_k, the
whole K (per-channel scales), or 64 with two slices a step; NVFP4's 16.

H200 (session 27, `bench/kernels/w4_mgpu.py`, `bench/results/w4_mgpu_h200_2026-12-04_s27_*`),
Llama-3-8B projections at 64 rows against XLA's bf16 dot in the same run: q/k/v 20.1 / 21.4 us,
o 14.3 / 15.3, gate|up 61.2 / 68.0, down 29.7 / 44.4 (the Triton kernel's dot: 48-229 us); at 16
rows 1.25-1.44x bf16. A second machine measured 10-20% slower for this kernel (bf16 the same).
That is 0.6-1.4 TB/s of packed weights: the bound is the chain each CTA's single warpgroup runs
per step (dequantize 64 x 128 codes, wgmma, wait), not HBM; 8 steps in flight (more shared
memory per CTA, fewer CTAs per SM) was slower than 4, which points at occupancy. 2-3 steps in
flight, `chunks` (one slice's wgmma beside the next slice's dequantization), `overlap` (one
step's wgmma beside the next step's) and `compute_wgs=2` (two compute warpgroups and a TMA
warpgroup per CTA) won no consistent margin (session 28, `..._s28_call1.md`). `signed_upcast`
measured slower (gate|up 79.5 against 70.1 us). Prefill (session 28, `..._s28_call3.md`): 128-row
tiles of x, 2 steps in flight: 2.2-3x XLA's dequantize-then-dot at 256 rows, 1.16-1.35x at 1,024,
0.68-0.75x at 4,096 (where the engine keeps XLA's path).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear.pdl import prefetch_count, prefetch_then_wait, release_dependents

_ROWS = 64  # wgmma M: weight rows per CTA


@dataclasses.dataclass(frozen=True)
class W4MgpuParams:
    """Static tuning of `skinny_matmul_w4_mgpu`.

    block_k: K columns per pipeline step (a multiple of 64);
    max_concurrent_steps: TMA loads in flight per CTA; split_k: CTAs along K per 64 rows (> 1: f32
    partials added by XLA); a_smem: the dequantized tile goes to shared memory before the wgmma
    (interpret mode needs it; on the GPU the register operand saves the round trip);
    signed_upcast: codes read as int4 with the top bit flipped (code - 8), converted to bf16 by
    Mosaic GPU's int4 upcast (CUTLASS's bit trick) and on to f32, instead of integer extension
    and an int -> float conversion per code (the default: the upcast measured slower, above);
    chunks: the step's tile is dequantized and multiplied in this many column slices, each
    slice's wgmma issued before the next slice is converted (the tensor cores on one slice while
    the ALUs work on the next; one wait per step); groups narrower than block_k need at least
    block_k / group slices (one scale per row and slice); overlap: the step's wgmma is left
    running and waited for after the next step's tile is converted (the x tile released a step
    later; the register operand's hazard is ptxas' to serialize); compute_wgs 2: 128 weight rows
    a CTA, two compute warpgroups beside a TMA warpgroup (`_body_ws`; one slice a step, no
    overlap, groups a multiple of block_k); block_m: x rows per CTA (wgmma's N, a multiple of 8
    up to 256) where M is larger (prefill: a grid axis over M; each CTA dequantizes its weight
    tile again); pdl: programmatic dependent launch (`pdl.py`): the CTA's first weight and scale
    tiles (the pipeline's first fill) prefetched to L2 before it waits for the kernel that writes
    x, its dependents released after its main loop (one compute warpgroup; off in interpret
    mode); promote (int4, bf16 x): the codes (top bit flipped: code - 8) upcast to bf16 exactly by
    Mosaic GPU's int4 conversion and multiplied by x as they are, into a fresh accumulator per
    slice, and only the f32 products scaled (`_body_promote`): no per-code float conversion or
    multiply-add. Measured slower than the default on the H100 (session 44): 1.35-1.5x the Triton
    kernel at one row (its best variants), +10% on a batch-64 int4 step.
    """

    block_k: int = 128
    max_concurrent_steps: int = 4
    split_k: int = 1
    a_smem: bool = False
    signed_upcast: bool = False
    chunks: int = 1
    overlap: bool = False
    compute_wgs: int = 1
    block_m: int = 64
    pdl: bool = False
    promote: bool = False

    def __post_init__(self):
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"{self.block_k=} must be a multiple of 64")
        if self.max_concurrent_steps < 1 or self.split_k < 1:
            raise ValueError(f"{self.max_concurrent_steps=} and {self.split_k=} must be >= 1")
        # (32-column slices of the int4 tile failed Mosaic GPU's lowering: no bank-conflict-free
        # transfer plan for 16-byte rows)
        if self.chunks < 1 or self.block_k % self.chunks or (self.block_k // self.chunks) % 64:
            raise ValueError(f"{self.chunks=} must split block_k={self.block_k} into multiples of 64 columns")
        if self.block_m % 8 or not 8 <= self.block_m <= 256:
            raise ValueError(f"{self.block_m=} must be a multiple of 8 in 8..256")
        if self.compute_wgs not in (1, 2) or (self.compute_wgs == 2 and (self.chunks > 1 or self.overlap or self.pdl)):
            raise ValueError(f"{self.compute_wgs=} must be 1, or 2 without chunks, overlap or pdl")
        if self.promote and (self.compute_wgs == 2 or self.overlap or self.signed_upcast):
            raise ValueError("promote takes neither compute_wgs=2, overlap nor signed_upcast")


_SMS = 132  # H200 streaming multiprocessors
FP4_GROUP = 16


def w4_mgpu_params_for(m: int, n: int, k: int, group_size: int = 128, *, interpret: bool = False) -> W4MgpuParams:
    """Tiles from the H200 sweep of the Llama-3-8B projections (session 27,
    `bench/results/w4_mgpu_h200_2026-12-04_s27_call2.md`): K split 4 ways up to 16 rows (every shape
    gained: q/k/v 12.9 against 21.1 us unsplit, gate|up 42.9 against 48.3), beyond that the fewest
    splits that give ~one CTA per SM (gate|up's 448 CTAs unsplit 61.1 us against 72.4 split 4;
    q/k/v and o 2-way, down 4-way); 4 steps in flight (8 lost at 64 rows: gate|up 91 us); at least
    4 K steps per split. Groups of 64 (some GPTQ checkpoints): one slice per group (`chunks`; passed
    the H200 test with float16 x in session 28). Prefill (more than 64 rows): tiles of 128 rows of
    x, 2 steps in flight (session 28, `w4_mgpu_h200_2026-12-04_s28_call3.md`: against 128 rows 4
    deep, 64 rows 4 deep and 256 rows 2 deep, best or within 10% at 256-4096 rows but o and down at
    256 rows, where `overlap` was 22-26% faster, and down at 4096, 11%)."""
    block_m = 64 if m <= 64 else 128
    ctas = -(-n // _ROWS) * -(-m // block_m)
    steps = k // 128
    split = 1
    if m <= 16:
        while split < 4 and steps // (split * 2) >= 4:
            split *= 2
    else:
        while ctas * split < 0.9 * _SMS and steps // (split * 2) >= 4:
            split *= 2
    g = k if group_size in (-1, k) else group_size
    chunks = 2 if g == 64 else 1
    depth = 4 if m <= 64 else 2  # (a 128-row x tile is 32 KB a step: 2 in flight, more CTAs per SM)
    return W4MgpuParams(split_k=split, a_smem=interpret, chunks=chunks, block_m=block_m, max_concurrent_steps=depth)


@jax.jit
def w4_mgpu_scales(scales, zeros=None):
    """int4: scales [..., N, G] (any float), zeros u8[..., N, G] -> f32[..., 2, G, N]: scale and
    -zero * scale, the kernel's per-group affine map of a code, transposed. NVFP4 (zeros None):
    scales e4m3[..., N, G] -> e4m3[..., 1, G, N], transposed."""
    if zeros is None:
        return jnp.swapaxes(scales, -1, -2)[..., None, :, :]
    s = scales.astype(jnp.float32)
    b = -zeros.astype(jnp.float32) * s
    return jnp.swapaxes(jnp.stack([s, b], axis=-3), -1, -2)


def w4_mgpu_supports(m: int, n: int, k: int, group_size: int, params: W4MgpuParams | None = None,
                     kind: str = "int4") -> str | None:
    """None if the kernel takes these shapes, else why not."""
    bk = (params or W4MgpuParams()).block_k
    g = k if group_size in (-1, k) else group_size
    if m < 1:
        return f"{m=} must be >= 1"
    if k % bk or n % 8:
        return f"K={k} must be a multiple of block_k={bk} and N={n} of 8"
    p = params or W4MgpuParams()
    if kind == "fp4":
        if p.promote:
            return "NVFP4 does not take promote"
        if g != FP4_GROUP:
            return f"NVFP4 group size {group_size} must be {FP4_GROUP}"
        if p.compute_wgs == 2 or p.signed_upcast:
            return "NVFP4 takes neither compute_wgs=2 nor signed_upcast"
        return None
    chunk = bk // p.chunks
    if p.compute_wgs == 2 and g % bk:
        return f"group size {group_size} must be a multiple of block_k={bk} with two compute warpgroups"
    if g % bk and (bk % g or g % chunk):
        return f"group size {group_size} must be a multiple of block_k={bk} or of its slices ({chunk} columns)"
    return None


def _fp4_values(codes):
    """i32 e2m1 codes (sign in bit 3) -> f32 value / 2^14, exactly: the float16 whose sign is the
    code's bit 3 and whose exponent's two low bits and mantissa's top bit are its bits 2..0."""
    h = ((codes & 8) << 12) | ((codes & 7) << 9)
    return lax.bitcast_convert_type(h.astype(jnp.int16), jnp.float16).astype(jnp.float32)


def _store(acc, o_gmem, *, split: bool):
    """This CTA's f32[64, tile_m] tile of y^T into o_gmem f32[N, Mpad] (or its split's slice of
    f32[S, N, Mpad]) by TMA (rows past N clipped)."""
    rows, tile_m = acc.shape
    ni, si, mi = lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("m")

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((rows, tile_m), jnp.float32))
    def _(o_smem):
        o_smem[...] = acc
        plgpu.commit_smem()
        dst = o_gmem.at[si] if split else o_gmem
        plgpu.copy_smem_to_gmem(o_smem, dst.at[pl.ds(ni * rows, rows), pl.ds(mi * tile_m, tile_m)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _prefetch_then_wait(w_gmem, ks_gmem, ni, k_step0, steps_per_split, group, params: W4MgpuParams):
    """`W4MgpuParams.pdl`: this CTA's weight and scale tiles of the pipeline's first fill
    (`max_concurrent_steps`) to L2, then the grid-dependency wait."""
    bk = params.block_k
    ahead = prefetch_count(steps_per_split, _ROWS * bk // 2, params.max_concurrent_steps)
    rows = pl.ds(ni * _ROWS, _ROWS)
    prefetch_then_wait([w_gmem.at[rows, pl.ds((k_step0 + j) * bk, bk)] for j in range(ahead)]
                       + [ks_gmem.at[:, pl.ds((k_step0 * bk) // group, max(1, (ahead * bk) // group)), rows]])


def _body(w_gmem, x_gmem, ks_gmem, o_gmem, *scratch, tile_m, params: W4MgpuParams, steps_per_split, group, dtype,
          fp4, pdl):
    """w_gmem uint4[N, K], x_gmem [M | Mpad, K], ks_gmem f32[2, G, N] | e4m3[1, G, N] (fp4),
    o_gmem f32[N, Mpad] | f32[S, N, Mpad]; this CTA: 64 weight rows (n), a K range (s), `tile_m`
    rows of x (m). pdl: `params.pdl` on the GPU."""
    bk = params.block_k
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    mi = lax.axis_index("m")
    k_step0 = si * steps_per_split
    per_step = max(1, bk // group)  # scale rows a step reads
    if pdl:
        _prefetch_then_wait(w_gmem, ks_gmem, ni, k_step0, steps_per_split, group, params)

    def acc_scope(acc_ref):
        def step(idx, w_smem, x_smem, ks_smem):
            row = plgpu.Layout.WGMMA.reduce(1)
            wc = bk // params.chunks
            if params.a_smem:
                (a_smem,) = scratch
            if params.a_smem and not params.overlap:
                plgpu.wgmma_wait(0)  # the previous step's wgmma has read a_smem
            for c in range(params.chunks):
                cols = pl.ds(c * wc, wc)
                w_c, x_c = (w_smem, x_smem) if params.chunks == 1 else (w_smem.at[:, cols], x_smem.at[:, cols])
                gi = (c * wc) // group if bk > group else 0  # the slice's group in this step's scale rows
                if fp4:  # 16-column pieces, each times its group's scales (x 2^14), joined for one wgmma
                    v = _fp4_values(w_c[...].astype(jnp.int32))  # f32[64, WC]
                    pieces = []
                    for j in range(wc // group):
                        sj = plgpu.load(ks_smem.at[0, gi + j], (), layout=row).astype(jnp.float16)
                        sj = lax.broadcast_in_dim(sj.astype(jnp.float32) * 16384.0, (_ROWS, group), [0])
                        pieces.append((v[:, j * group:(j + 1) * group] * sj).astype(dtype))
                    a = jnp.concatenate(pieces, axis=1)
                else:
                    s = lax.broadcast_in_dim(plgpu.load(ks_smem.at[0, gi], (), layout=row), (_ROWS, wc), [0])
                    b = lax.broadcast_in_dim(plgpu.load(ks_smem.at[1, gi], (), layout=row), (_ROWS, wc), [0])
                    if params.signed_upcast:  # code - 8: the top bit flipped, read as int4 (Mosaic's fast upcast)
                        codes = (w_c[...] ^ jnp.int4(-8)).astype(jnp.bfloat16).astype(jnp.float32) + 8.0
                    else:
                        codes = w_c[...].astype(jnp.int32).astype(jnp.float32)  # f32[64, WC]
                    a = (codes * s + b).astype(dtype)
                if params.overlap and c == 0:  # the previous step's wgmma ran beside this conversion
                    plgpu.wgmma_wait(0)
                if params.a_smem:
                    (a_smem if params.chunks == 1 else a_smem.at[:, cols])[...] = a
                else:
                    plgpu.wgmma(acc_ref, a, x_c.transpose((1, 0)))  # x^T [WC, tile_m]
            if params.a_smem:
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, a_smem, x_smem.transpose((1, 0)))
            elif not params.overlap:
                plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step,
            grid=(steps_per_split,),
            in_specs=[
                # (an asynchronous wgmma reads its x tile, and a_smem's W tile, during the next step)
                plgpu.BlockSpec((_ROWS, bk), lambda kk: (ni, k_step0 + kk), delay_release=int(params.a_smem)),
                plgpu.BlockSpec((tile_m, bk), lambda kk: (mi, k_step0 + kk),
                                delay_release=int(params.a_smem or params.overlap)),
                plgpu.BlockSpec((1 if fp4 else 2, per_step, _ROWS),
                                lambda kk: (0, (k_step0 + kk) // max(1, group // bk), ni)),
            ],
            max_concurrent_steps=params.max_concurrent_steps,
        )(w_gmem, x_gmem, ks_gmem)
        plgpu.wgmma_wait(0)  # (the last step's wgmma, when it was left running)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_ROWS, tile_m)))  # f32[64, tile_m]
    if pdl:
        release_dependents()
    _store(acc, o_gmem, split=params.split_k > 1)


def _body_promote(w_gmem, x_gmem, ks_gmem, xs_gmem, o_gmem, *scratch, tile_m, params: W4MgpuParams, steps_per_split,
                  group, pdl):
    """`promote`: y = sum over slices of s * ((C - 8) x) + (b + 8 s) * sum(x), per row and slice,
    where C are a slice's codes, s and b = -zero * s its group's scale planes, and the tensor cores
    compute (C - 8) x exactly in f32 from bf16 operands (C - 8 is a small integer): the codes are
    read as int4 with the top bit flipped (code - 8) and upcast by Mosaic GPU's int4 -> bf16
    conversion (CUTLASS's: a few bit operations per two codes); each slice's product goes to a
    fresh accumulator and is scaled once, in f32, per row (DeepGEMM's promotion, as the W8A8
    kernel's). xs_gmem f32[K / WC, M tiles * W]: x's sums over each slice of WC columns, each tile of
    `tile_m` rows padded to W (a multiple of 32: TMA writes shared memory at 128-byte boundaries; 8
    or 24 floats a tile gave misaligned-address faults on the H100, session 43). The weights are
    never rounded to bf16, so the result is closer to the float64 oracle than `_body`'s."""
    bk = params.block_k
    wc = bk // params.chunks
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    mi = lax.axis_index("m")
    k_step0 = si * steps_per_split
    per_step = max(1, bk // group)
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    if pdl:
        _prefetch_then_wait(w_gmem, ks_gmem, ni, k_step0, steps_per_split, group, params)

    def bcast(v, dim):
        return lax.broadcast_in_dim(v, (_ROWS, tile_m), [dim])

    def step(idx, w_smem, x_smem, ks_smem, xs_smem, acc):
        def part(*accs):
            for c, acc_ref in enumerate(accs):
                cols = pl.ds(c * wc, wc)
                w_c, x_c = (w_smem, x_smem) if params.chunks == 1 else (w_smem.at[:, cols], x_smem.at[:, cols])
                a = (w_c[...] ^ jnp.int4(-8)).astype(jnp.bfloat16)  # code - 8, exact
                if params.a_smem:  # (interpret mode: no register operand)
                    (a_smem,) = scratch
                    a_ref = a_smem if params.chunks == 1 else a_smem.at[:, cols]
                    a_ref[...] = a
                    plgpu.commit_smem()
                    a = a_ref
                plgpu.wgmma(acc_ref, a, x_c.transpose((1, 0)))
            out = acc
            for c, acc_ref in enumerate(accs):
                gi = (c * wc) // group if bk > group else 0  # the slice's group in this step's scale rows
                sc = plgpu.load(ks_smem.at[0, gi], (), layout=row)
                b8 = plgpu.load(ks_smem.at[1, gi], (), layout=row) + 8.0 * sc
                xs = plgpu.load(xs_smem.at[c, pl.ds(0, tile_m)], (), layout=col)
                prod = plgpu.wgmma_accumulator_load(acc_ref, wait_n=params.chunks - 1 - c)  # (this slice's wgmma)
                out = out + prod * bcast(sc, 0) + bcast(b8, 0) * bcast(xs, 1)
            return out

        return pl.run_scoped(part, *[plgpu.ACC((_ROWS, tile_m))] * params.chunks)

    acc0 = plgpu.layout_cast(jnp.zeros((_ROWS, tile_m), jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.emit_pipeline(
        step,
        grid=(steps_per_split,),
        in_specs=[
            plgpu.BlockSpec((_ROWS, bk), lambda kk: (ni, k_step0 + kk)),
            plgpu.BlockSpec((tile_m, bk), lambda kk: (mi, k_step0 + kk)),
            plgpu.BlockSpec((2, per_step, _ROWS), lambda kk: (0, (k_step0 + kk) // max(1, group // bk), ni)),
            plgpu.BlockSpec((params.chunks, _xs_width(tile_m)), lambda kk: (k_step0 + kk, mi)),
        ],
        max_concurrent_steps=params.max_concurrent_steps,
        init_carry=acc0,
    )(w_gmem, x_gmem, ks_gmem, xs_gmem)
    if pdl:
        release_dependents()
    _store(acc, o_gmem, split=params.split_k > 1)


def _xs_width(tile_m: int) -> int:
    """`_body_promote`'s floats per tile of x's rows in xs (128-byte TMA boxes)."""
    return -(-tile_m // 32) * 32


def _body_ws(w_gmem, x_gmem, ks_gmem, o_gmem, o_smem, *scratch, tile_m, params: W4MgpuParams, steps_per_split,
             group, dtype):
    """`compute_wgs=2`: the CTA covers 128 weight rows, two compute warpgroups 64 each (one's
    conversion beside the other's wgmma), a third warpgroup issues the TMA loads (JAX's
    `hopper_mixed_type_matmul_mgpu` pattern); x's tile is loaded once for both. One slice a step,
    o_smem f32[2, 64, tile_m]; `a_smem` scratch bf16[2, 64, BK]."""
    bk = params.block_k
    ni = lax.axis_index("n")
    si = lax.axis_index("s")
    mi = lax.axis_index("m")
    wg = lax.axis_index("wg")
    k_step0 = si * steps_per_split
    rows = 2 * _ROWS

    def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((_ROWS, tile_m), jnp.float32))
        def _(acc_ref):
            eval_pipeline(acc_ref)
            o_smem.at[wg][...] = acc_ref[...]
            plgpu.commit_smem()
            dst = o_gmem.at[si] if params.split_k > 1 else o_gmem
            rows_out = pl.ds(ni * rows + wg * _ROWS, _ROWS)
            plgpu.copy_smem_to_gmem(o_smem.at[wg], dst.at[rows_out, pl.ds(mi * tile_m, tile_m)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def mma_body(idx, w_smem, x_smem, ks_smem, acc_ref):
        row = plgpu.Layout.WGMMA.reduce(1)
        mine = pl.ds(wg * _ROWS, _ROWS)
        s = lax.broadcast_in_dim(plgpu.load(ks_smem.at[0, 0, mine], (), layout=row), (_ROWS, bk), [0])
        b = lax.broadcast_in_dim(plgpu.load(ks_smem.at[1, 0, mine], (), layout=row), (_ROWS, bk), [0])
        codes = w_smem.at[mine][...].astype(jnp.int32).astype(jnp.float32)
        a = (codes * s + b).astype(dtype)
        if params.a_smem:
            (a_smem,) = scratch
            a_smem.at[wg][...] = a
            plgpu.commit_smem()
            a = a_smem.at[wg]
        plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref

    plgpu.emit_pipeline_warp_specialized(
        mma_body,
        grid=(steps_per_split,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((rows, bk), lambda kk: (ni, k_step0 + kk)),
            plgpu.BlockSpec((tile_m, bk), lambda kk: (mi, k_step0 + kk)),
            plgpu.BlockSpec((2, 1, rows), lambda kk: (0, (k_step0 + kk) // (group // bk), ni)),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=params.max_concurrent_steps,
        compute_context=compute_context,
    )(w_gmem, x_gmem, ks_gmem)


@functools.partial(jax.jit, static_argnames=("group_size", "kind", "params", "interpret"))
def skinny_matmul_w4_mgpu(x, packed, kscales, row_scale=None, *, group_size: int, kind: str = "int4",
                          params: W4MgpuParams | None = None, interpret: bool = False):
    """x bf16|f16[M, K] @ W^T -> f32[M, N] for 4-bit W: packed u8[N, K/2] (`W4Linear`'s layout),
    kscales (`w4_mgpu_scales`) f32[2, G, N] (kind "int4") or e4m3[1, G, N] ("fp4", with the global
    scale row_scale f32[N]). Shapes: `w4_mgpu_supports`."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape != (n, k // 2) or packed.dtype != jnp.uint8:
        raise ValueError(f"skinny_matmul_w4_mgpu: packed must be u8[N, K/2] = [{n}, {k // 2}]; got "
                         f"{packed.dtype}{list(packed.shape)}")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"skinny_matmul_w4_mgpu: x must be bfloat16 or float16; got {x.dtype}")
    if kind not in ("int4", "fp4"):
        raise ValueError(f"skinny_matmul_w4_mgpu: kind must be 'int4' or 'fp4'; got {kind!r}")
    fp4 = kind == "fp4"
    params = params or w4_mgpu_params_for(m, n, k, group_size, interpret=interpret)
    why = w4_mgpu_supports(m, n, k, group_size, params, kind)
    if why:
        raise ValueError(f"skinny_matmul_w4_mgpu: {why}")
    g = k if group_size in (-1, k) else group_size
    want = (1 if fp4 else 2, k // g, n)
    if kscales.shape != want or (fp4 and kscales.dtype != jnp.float8_e4m3fn):
        raise ValueError(f"skinny_matmul_w4_mgpu: kscales {kscales.dtype}{list(kscales.shape)} must be "
                         f"{'float8_e4m3fn' if fp4 else 'float'}{list(want)}")
    if fp4 != (row_scale is not None) or (fp4 and row_scale.shape != (n,)):
        raise ValueError(f"skinny_matmul_w4_mgpu: row_scale [N={n}] goes with kind 'fp4' only")
    if params.promote and x.dtype != jnp.bfloat16:
        raise ValueError(f"skinny_matmul_w4_mgpu: promote takes bfloat16 x (Mosaic GPU's fast int4 upcast); "
                         f"got {x.dtype}")
    bk = params.block_k
    mpad = -(-m // 8) * 8  # x's rows as the kernel sees them: a tile of tm rows per CTA
    tm = mpad if mpad <= params.block_m else params.block_m
    mpad = -(-mpad // tm) * tm
    num_steps = k // bk
    split_k = min(params.split_k, num_steps)
    steps_per_split = -(-num_steps // split_k)
    split_k = -(-num_steps // steps_per_split)
    params = dataclasses.replace(params, split_k=split_k)
    out_shape = (split_k, n, mpad) if split_k > 1 else (n, mpad)
    # the same bytes as 4-bit codes (module docstring; int4 for the signed upcast)
    signed = params.signed_upcast or params.promote
    codes = lax.bitcast_convert_type(packed, jnp.int4 if signed else jnp.uint4).reshape(n, k)
    ws = params.compute_wgs == 2
    a_scratch = [plgpu.SMEM((2, _ROWS, bk) if ws else (_ROWS, bk), x.dtype)] if params.a_smem else []
    pdl = params.pdl and not interpret
    if ws:
        body = functools.partial(_body_ws, dtype=x.dtype)
    elif params.promote:
        body = functools.partial(_body_promote, pdl=pdl)
    else:
        body = functools.partial(_body, dtype=x.dtype, fp4=fp4, pdl=pdl)
    f = plgpu.kernel(
        functools.partial(body, tile_m=tm, params=params, steps_per_split=steps_per_split, group=g),
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(-(-n // (_ROWS * params.compute_wgs)), split_k, mpad // tm),
        grid_names=("n", "s", "m"),
        scratch_types=([plgpu.SMEM((2, _ROWS, tm), jnp.float32)] if ws else []) + a_scratch,
        **(dict(num_threads=3, thread_name="wg") if ws else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="skinny_matmul_w4_mgpu",
    )
    if m > 8 and m != mpad:  # TMA: a dimension beyond its tile (8+ rows) must be a multiple of it
        x = jnp.pad(x, ((0, mpad - m), (0, 0)))
    if params.promote:  # x's sums over each slice of the kernel's steps, f32[K / WC, M tiles * W]
        wc = bk // params.chunks
        xs = jnp.sum(x.astype(jnp.float32).reshape(x.shape[0], k // wc, wc), axis=-1).T  # [K / WC, M]
        xs = jnp.pad(xs, ((0, 0), (0, mpad - x.shape[0]))).reshape(k // wc, mpad // tm, tm)
        xs = jnp.pad(xs, ((0, 0), (0, 0), (0, _xs_width(tm) - tm))).reshape(k // wc, -1)
        out = f(codes, x, kscales.astype(jnp.float32), xs)
    else:
        out = f(codes, x, kscales if fp4 else kscales.astype(jnp.float32))
    if split_k > 1:
        out = jnp.sum(out, axis=0)
    if fp4:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return out[:, :m].T  # f32[M, N]
