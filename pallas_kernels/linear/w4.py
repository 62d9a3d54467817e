"""Weight-streaming skinny GEMM for 4-bit weights (decode, M = 1..64): y = x @ W^T.

W arrives packed as `layers.linear.W4Linear` holds it (the layout the loader repacks every
4-bit format into, `metrale_jax/quant/w4.py`):
    packed u8[N, ceil(K/2)]   byte j of row n: code of column 2j in the low nibble, 2j+1 in the high
    scales [N, ceil(K/G)]     f16 | bf16 | f32 (int4) or float8_e4m3fn (fp4), group G along K
    zeros  u8[N, ceil(K/G)]   int4 only: W = (code - zero) * scale
    row_scale f32[N]          fp4 only: W = e2m1(code) * scale * row_scale
Rows are output columns and K bytes are contiguous, as in the FP8 kernel (`skinny.py`): each
program streams block_n rows of block_k / 2 contiguous bytes per step, a quarter of bf16's bytes.

Per step the kernel loads a [block_n, block_k/2] byte tile, splits it into the even-column codes
(low nibbles) and odd-column codes (high nibbles), gathers each code's group scale (and zero) from
the small scale tile (L1/L2 hits: G / 2 neighbouring bytes share one), dequantizes both halves in
registers to x's dtype (bf16, or f16: GPTQ / AWQ checkpoints are float16) and runs two dots,
against x's even and odd columns (x is loaded with a stride of 2, so no nibble interleaving is
needed in registers). FP4 codes become values arithmetically (e2m1: 0, .5, 1, 1.5, 2, 3, 4, 6 and
a sign bit); e2m1 * e4m3 has at most 6 significant bits, so the FP4 weights are exact in bf16, and
the per-row global scale multiplies the f32 result. Int4 weights (code - zero) * scale are
rounded to x's dtype (as a bf16 checkpoint's weights are). Accumulation float32, output in x's
dtype. Shapes are arbitrary: partial N and K tiles are masked; the group size must be even (so a
byte's two codes share a group). Lowered through Triton, as
`skinny.py` (see its docstring for why); runs in interpret mode on the CPU.

Variants, static in `W4Params`, for the H200 sweep to choose between (the defaults are a guess;
`tuned_w4.json` holds session 15's sweep of the q/k/v shape, K 4,096 x N 6,144, where `gemv` with
`scale_tile` took 14.0 µs at M = 1 against the defaults' 33.8, and `scale_tile` won at M 8-64):
`scale_tile` loads each step's scales as a [block_n, block_k / G] tile
broadcast in registers instead of a per-byte gather; `group_partial` (int4) dots x with the raw
codes per group and applies zero and scale to the f32 partial; `gemv` (M = 1) multiplies and
reduces on the CUDA cores instead of a dot padded to 16 rows. `gemv` with `group_partial` (int4
and NVFP4, session 23): per group, the sum of code * x in f32, then zero * sum(x) subtracted and
the group's scale applied to the partial, so per weight only the nibble extraction, a float built
from the code's bits (no int -> float conversion instruction, a quarter of the FMA rate) and one
FMA; the other variants dequantize each weight (subtract, convert, scale, round) first. On the
H200 it is the best M = 1 variant for int4 (q/k/v 12.5 us against 17.5 us for the next, gate|up
42.4 against 45.0 us: 1.0-1.4 TB/s of codes, so the ALU work was not the main bound; NVFP4 not
swept yet). `unroll` writes the K loop out, so that all of a program's weight loads can be in
flight together. `half2` (M = 1, int4 and NVFP4, session 25) is what the table picks at M = 1: the
bytes read as u32 words, each word's 8 products summed by one inline-PTX call (`_DOT8_PTX`: int4
codes masked into f16 subnormals; `_DOT8_FP4_PTX`: e2m1 codes shifted into f16; half2 FMAs against
x scaled into f16 by a power of two per word), ~4 instructions per byte against ~10 for `gemv` +
`group_partial`, whose bound was instruction issue. H200, Llama-3-8B projections at M = 1, int4:
q/k/v 9.0 us, o 8.4-9.4, gate|up 21.7 (2.7 TB/s of codes), down 14.4-15.8, against 12.5 / - / 42.4
/ - before; NVFP4 11.5 / 9.0 / 26.0 / 23.8 (bench/results/w4_h200_2026-12-04_s25_call*). The narrow
projections are latency-bound (1.0-1.4 TB/s: 256-384 programs, one step's tile in flight each):
`prefetch` (the next step's tile carried through the loop) did not change that; `split_k` (programs
along K, f32 partials that XLA adds) helped down (14.4 against 17.9 us) and not o. The same
dequantization for the dot path (M > 1: words to f16 weights by inline PTX, 8 dots a step) measured
2-6x slower than bf16 at M = 16 / 64 (`..._call4_half2_dot.json`) and was not kept. `word_scales`
(half2, session 29) scales each word by its own group's scale instead of summing the words of a group
first: the table's pick for NVFP4's q/k/v, o and down (10.1 / 8.1 / 19.5 us, groups of 16 = 2 words). `w4_params_for`
reads the sweep's table (`tuned_w4.json`, written by bench/kernels/w4.py) when a wrapper call gives no params;
its int4 and NVFP4 M = 1 picks for q|k|v, o and gate|up come from the H100 sweeps timed by Nsight Compute
in sessions 47-48 (bench/kernels/w4_chain.py --sweep: each launch's own duration, ~1% apart between
repeats), the rest from the H200's CUDA-event sweeps.
At 2-64 rows int4 runs the tensor-core kernel (`w4_mgpu.py`) on Hopper; NVFP4, whose groups of 16 that
kernel cannot take, runs this kernel's dot path, 2.5x slower than bf16 at batch 64 on an H100
(session 36): `swap_ab` (the dequantized tile as the dot's first operand, which wgmma may keep in
registers) is the candidate for the next sweep (`bench/kernels/w4.py --kinds fp4 --ms 16,64 --only scale_tile`;
`bench/gpu_session.sh fp4dot`). `packed_x` (half2, session 36, not yet measured: `--ms 1 --only packed_x`)
packs x's f16 pairs once per word column rather than in the PTX per (row, word). `W4Fused` (session 41):
the one-row half2 path can also take a decode layer's RMSNorm, SwiGLU, bias and residual add into its
launch (off in the engine by default: no device-step gain on the H100, `AttentionConfig.w4_fused_decode`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.linear.params import m_bucket

MAX_M = 64


@dataclasses.dataclass(frozen=True)
class W4Params:
    """Static tuning of `skinny_matmul_w4` (`w4_params_for`: the sweeps' table, `tuned_w4.json`).

    block_n: weight rows per program (power of two >= 16); block_k: K columns per loop step
    (power of two >= 32, i.e. block_k / 2 bytes per row); num_warps / num_stages: Triton launch.
    """

    block_n: int = 32
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4
    # False: dequantize each weight in registers ((code - zero) * scale, rounded to x's dtype), one
    # dot pair per step. True: per group, dot x with the raw codes (exact in bf16), subtract
    # zero * sum(x) and multiply the f32 partial by the group's per-column scale (needs block_k and
    # the group size to divide one another, and groups of >= 32: int4 only in practice, NVFP4's 16
    # would give dots of 8 columns, below Triton's 16; more accurate, fewer per-element ops, more dots).
    # With gemv (M = 1): the same per group on the CUDA cores, int4 and NVFP4 (G a multiple of
    # block_k, or a power of two dividing it).
    group_partial: bool = False
    # M = 1 only: multiply-and-reduce on the CUDA cores (f32) instead of a dot that pads x to 16
    # rows (the FP8 kernel's fastest M = 1 variant on the H200); other M use the dot.
    gemv: bool = False
    # The dequantizing paths: load each step's scales (and zeros) as a small [block_n, block_k / G]
    # tile and broadcast it in registers (needs G a power of two dividing block_k), instead of
    # gathering one scale per weight pair (any G; many more load instructions).
    scale_tile: bool = False
    # Unroll the K loop (all of a program's weight loads visible at once, so they can be in flight
    # together; a loop whose loads feed no dot may not be software-pipelined by Triton, which
    # would leave one tile in flight per program: session 23's guess, to be swept).
    unroll: bool = False
    # M = 1 (with gemv and group_partial; int4 and NVFP4, session 25): the packed bytes read as u32 words
    # (8 codes), each word's 8 products summed by one inline-PTX call with packed half2 FMAs (codes
    # masked or shifted straight into f16: no conversion instruction), x scaled into f16 by a power of
    # two per word. ~4 instructions per byte against ~10 (module docstring). Needs K % 8 == 0 and a
    # group size divisible by 8; interpret mode runs a jnp twin of the PTX.
    half2: bool = False
    # half2: carry the next steps' weight words and x in the loop (loaded before this step's math), so
    # a program has loads in flight while it computes (Triton does not software-pipeline loads that
    # feed no dot). An int: how many steps ahead (True = 1). Session 46's Nsight Compute run found the
    # one-row programs loading a step, then computing it; one step ahead cannot cover a load's
    # latency when a step's math is shorter. Session 47 (H100, Nsight Compute durations): two steps
    # ahead, unrolled, block_n 16 is the fastest one-program-per-tile variant for q|k|v (8.5 against
    # the old pick's 10.4 us) and o (7.3 against 9.4): the table's picks there. Rolled rings lost then,
    # likely because each prefetch converted x as it loaded it (so the warp waited there; not measured);
    # since session 47 the ring carries x as loaded and the step converts it (see also `ring_scales`).
    # Session 48: NVFP4's q|k|v and o are fastest at 8 warps on that ring (49 registers against 72-133).
    prefetch: int = 0
    # half2: programs per output tile along K (each sums its share of the steps into an f32 partial;
    # XLA adds the partials, fused into the consumer when that is an XLA fusion, e.g. a residual add):
    # more programs for narrow layers, whose few programs each had one step's loads in flight.
    split_k: int = 1
    # half2: each word's sum times its own group's scale (zero and x-sum per word for int4), gathered
    # per word, then one sum over the step's words; instead of per-group sums of the words (a
    # reshape of the [BN, words] tile) and one scale per group. For NVFP4's groups of 16 (2 words).
    word_scales: bool = False
    # The dot path (M > 1): the product computed transposed, y^T [BN, Mp] = W_tile @ x^T, so the
    # dequantized weight tile is the dot's first operand (on Hopper, wgmma's A, which may stay in
    # registers; x^T, the small operand, is B), as the tensor-core GEMM `w4_mgpu.py` and Marlin-style
    # kernels do; the default orientation makes the weights B, which wgmma reads from shared memory
    # (a round trip for every dequantized tile). For NVFP4, whose groups of 16 `w4_mgpu` cannot take.
    swap_ab: bool = False
    # half2: x's f16 pairs packed into the four u32 registers the PTX multiplies by once per word
    # column (on the [W] vectors, before the broadcast over the tile's rows), instead of inside the
    # PTX per (row, word): 4 fewer instructions per word of ~20 (session 36 guess, for the sweep).
    packed_x: bool = False
    # half2: a step's scales (and int4's zeros) loaded with its words, carried by the prefetch ring as
    # loaded, instead of loaded by the step that uses them (so the step waits on their latency). Costs
    # registers: ptxas gives NVFP4's split-4 down 78 against 56 (2 waves of programs against 1) and
    # gate|up 122-128 against 95-96 (session 47, compiled for sm_90a on the CPU); for the sweep.
    ring_scales: bool = False

    def __post_init__(self):
        for f in ("block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{f}={v} must be a power of two >= 16")
        if self.block_k < 32:
            raise ValueError(f"{self.block_k=} must be >= 32 (16 bytes a row)")
        if self.split_k < 1:
            raise ValueError(f"{self.split_k=} must be >= 1")
        if self.prefetch < 0:
            raise ValueError(f"{self.prefetch=} must be >= 0 (steps ahead)")


@dataclasses.dataclass(frozen=True)
class W4Fused:
    """What a launch computes around the product besides x @ W^T (static; the wrapper's arguments
    `norm_weight`, `silu_mul`, `bias`, `residual` set it). The one-row half2 path computes it in the
    kernel, which removes the XLA launches around each projection of a decode layer at batch 1
    (normalize, scale and round, add the residual, SwiGLU); other paths compute it in XLA around
    the kernel, with the same roundings as the unfused layers (`metrale_jax.layers`)."""

    norm: bool = False  # x is the residual stream: the input is x * norm_weight rounded, the product times 1/rms(x)
    eps: float = 1e-6  # (norm)
    silu_mul: bool = False  # x is gate | up [M, 2K]: the input is silu(gate) rounded times up, rounded
    bias: bool = False  # bias [N] added to the f32 product
    residual: bool = False  # the result is residual [M, N] + the product rounded to x's dtype, rounded

    @property
    def any(self) -> bool:
        return self.norm or self.silu_mul or self.bias or self.residual


_TUNED_PATH = pathlib.Path(__file__).with_name("tuned_w4.json")  # written by bench/kernels/w4.py (absent: defaults)


@functools.cache
def _tuned_table() -> dict:
    return json.loads(_TUNED_PATH.read_text()) if _TUNED_PATH.exists() else {}


def w4_tuned_key(kind: str, m: int, n: int, k: int) -> str:
    return f"{kind}_n{n}_k{k}_m{m}"


def w4_params_for(kind: str, m: int, n: int, k: int, group_size: int | None = None) -> W4Params:
    """The tuned params of the smallest measured M >= m for this (kind, N, K); for a shape the sweep
    did not measure, those of the nearest measured shape of the kind (log-distance in N and K: one
    projection's best beats the untuned defaults, 14.0 vs 33.8 us on q/k/v at M = 1 on the H200);
    the defaults when nothing fits (no entry, or params this K / group size cannot take)."""
    table = _tuned_table()
    shapes = {(int(nn), int(kk)) for key in table for kd, nn, kk, _ in [_parse_key(key)] if kd == kind}
    if not shapes:
        return W4Params()
    n0, k0 = (n, k) if (n, k) in shapes else min(
        shapes, key=lambda s: (abs(math.log2(s[0] / n)) + abs(math.log2(s[1] / k)), s))
    prefix = w4_tuned_key(kind, 0, n0, k0)[:-1]
    ms = sorted(int(key[len(prefix):]) for key in table if key.startswith(prefix))
    pick = next((t for t in ms if t >= m), None)
    if pick is None:
        return W4Params()
    p = W4Params(**table[prefix + str(pick)])
    p = dataclasses.replace(p, gemv=False, half2=False, split_k=1, word_scales=False, packed_x=False,
                            ring_scales=False) \
        if p.gemv and m > 1 else p
    return p if group_size is None or _params_fit(p, m, k, group_size) is None else W4Params()


def _parse_key(key: str) -> tuple[str, int, int, int]:
    kind, n, k, m = key.split("_")
    return kind, int(n[1:]), int(k[1:]), int(m[1:])


def _block_k(params: W4Params, k: int) -> int:
    return min(params.block_k, max(32, 1 << max(0, (k - 1).bit_length())))


def _params_fit(params: W4Params, m: int, k: int, group_size: int) -> str | None:
    """Why `params` cannot run this call (None: they can)."""
    block_k = _block_k(params, k)
    gemv = params.gemv and m == 1
    pow2_divides = not block_k % group_size and not group_size & (group_size - 1)
    if params.group_partial and gemv and group_size % block_k and not pow2_divides:
        return (f"group_partial with gemv needs {group_size=} to be a multiple of block_k ({block_k}), or a power of "
                "two dividing it")
    if params.group_partial and not gemv and (block_k % group_size and group_size % block_k or group_size < 32):
        return (f"group_partial needs block_k ({block_k}) and {group_size=} to divide one another, and groups of "
                ">= 32 (one dot pair each)")
    if params.half2 and gemv and not (params.group_partial and k % 8 == 0 and group_size % 8 == 0):
        return f"half2 needs group_partial, K % 8 == 0 and a group size divisible by 8 ({k=}, {group_size=})"
    if params.word_scales and not (params.half2 and gemv):
        return "word_scales needs half2 with gemv (M = 1)"
    if params.packed_x and not (params.half2 and gemv):
        return "packed_x needs half2 with gemv (M = 1)"
    if params.ring_scales and not (params.half2 and gemv):
        return "ring_scales needs half2 with gemv (M = 1)"
    if params.split_k > 1 and not (params.half2 and params.gemv):
        return f"split_k={params.split_k} needs half2 with gemv"
    if params.scale_tile and (block_k % group_size or group_size & (group_size - 1)):
        return f"scale_tile needs {group_size=} a power of two dividing block_k ({block_k})"
    return None


def _load_scale(ref, mask):
    """f32 scales of a masked gather from `ref` (f16 | bf16 | f32 | float8_e4m3fn), 0 where masked.
    No `other=` fill: Triton cannot cast an integer splat to float8 (the fill is applied after)."""
    return _loaded_scale(plgpu_triton.load(ref, mask=mask), mask, ref.dtype)


def _loaded_scale(raw, mask, dtype):
    """Scales gathered with `mask` (float8 ones possibly carried as their bytes, u8) -> f32, 0 where masked."""
    if raw.dtype != dtype:
        raw = jax.lax.bitcast_convert_type(raw, dtype)
    return jnp.where(mask, raw.astype(jnp.float32), 0.0)


def _e2m1(c):
    """i32 codes 0..15 -> f32 e2m1 values (0, .5, 1, 1.5, 2, 3, 4, 6 and a sign bit), built as f32
    bits with integer ops (an int -> float conversion runs at a quarter of the FMA rate on the
    H100 / H200): e > 0 is 2^(e-1) * (1 + m/2), e = 0 is m * 0.5."""
    e, m = (c >> 1) & 3, c & 1
    bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)) | ((c & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _codes_f32(c):
    """i32 codes 0..15 -> the same values in f32, without a conversion instruction: the bits of
    2^23 + c, minus 2^23 (exact)."""
    return jax.lax.bitcast_convert_type(c | 0x4B000000, jnp.float32) - 8388608.0


def _loop(num_steps: int, body, acc, unroll: bool):
    """fori_loop(0, num_steps, body, acc), or the steps written out one after another (Pallas'
    Triton lowering takes no `unroll` argument)."""
    if not unroll:
        return jax.lax.fori_loop(0, num_steps, body, acc)
    for i in range(num_steps):
        acc = body(jnp.int32(i), acc)
    return acc


# One u32 word of codes (byte i: column 2i in the low nibble, 2i + 1 in the high one) and the word's 8
# x values as f16 ($2..$9, odd columns pre-divided by 16) -> f32 $0 = sum_c code_c * x_c * 2^-24. The
# codes are masked into the halves of four f16x2 registers as they lie, so each half is the code as an
# f16 subnormal (code * 2^-24; a high nibble 16 * code * 2^-24, hence its x / 16): no conversion, no
# offset to subtract. Each register pairs two columns (0 with 5, 1 with 4, 2 with 7, 3 with 6), the x
# pairs are packed to match, then one multiply and three FMAs in half2 (products and 4-term sums
# rounded to f16, relative 2^-11; subnormals kept: no .ftz) and the two halves added.
_DOT8_PTX = """{
.reg .b32 v<4>, p<4>, w8, a;
.reg .f16 l, h;
mov.b32 p0, {$2, $7};
mov.b32 p1, {$3, $6};
mov.b32 p2, {$4, $9};
mov.b32 p3, {$5, $8};
and.b32 v0, $1, 0x00F0000F;
and.b32 v1, $1, 0x000F00F0;
shr.u32 w8, $1, 8;
and.b32 v2, w8, 0x00F0000F;
and.b32 v3, w8, 0x000F00F0;
mul.rn.f16x2 a, v0, p0;
fma.rn.f16x2 a, v1, p1, a;
fma.rn.f16x2 a, v2, p2, a;
fma.rn.f16x2 a, v3, p3, a;
mov.b32 {l, h}, a;
add.rn.f16 l, l, h;
cvt.f32.f16 $0, l;
}"""


# NVFP4: the same sum over e2m1 codes (sign, 2 exponent bits, 1 mantissa bit), x not divided. Per
# register pair k (columns k and k + 4): the code's 3 magnitude bits shifted to f16 bits 9-11 and its
# sign to bit 15 make the f16 e2m1 * 2^-14 (2^(e-1) (1 + m/2) * 2^-14; e = 0 lands on the subnormal
# m * 2^-15), so $0 = sum_c e2m1_c * x_c * 2^-14.
_DOT8_FP4_PTX = """{
.reg .b32 a, b, v, p, acc;
.reg .f16 l, h;
""" + "".join(f"""{f'shl.b32 a, $1, {9 - 4 * c};' if c < 3 else 'shr.u32 a, $1, 3;'}
{f'shl.b32 b, $1, {12 - 4 * c};' if c < 3 else 'mov.b32 b, $1;'}
lop3.b32 v, a, b, 0x0E000E00, 0xE4;
and.b32 v, v, 0x8E008E00;
mov.b32 p, {{${2 + c}, ${6 + c}}};
{'mul.rn.f16x2 acc, v, p;' if c == 0 else 'fma.rn.f16x2 acc, v, p, acc;'}
""" for c in range(4)) + """mov.b32 {l, h}, acc;
add.rn.f16 l, l, h;
cvt.f32.f16 $0, l;
}"""


# The same two sums with x's pairs already packed: $2..$5 the u32 registers p0..p3 above (int4: columns
# (0, 5), (1, 4), (2, 7), (3, 6); NVFP4: (c, c + 4)), low half the first column.
_DOT8_PACKED_PTX = """{
.reg .b32 v<4>, w8, a;
.reg .f16 l, h;
and.b32 v0, $1, 0x00F0000F;
and.b32 v1, $1, 0x000F00F0;
shr.u32 w8, $1, 8;
and.b32 v2, w8, 0x00F0000F;
and.b32 v3, w8, 0x000F00F0;
mul.rn.f16x2 a, v0, $2;
fma.rn.f16x2 a, v1, $3, a;
fma.rn.f16x2 a, v2, $4, a;
fma.rn.f16x2 a, v3, $5, a;
mov.b32 {l, h}, a;
add.rn.f16 l, l, h;
cvt.f32.f16 $0, l;
}"""
_DOT8_FP4_PACKED_PTX = """{
.reg .b32 a, b, v, acc;
.reg .f16 l, h;
""" + "".join(f"""{f'shl.b32 a, $1, {9 - 4 * c};' if c < 3 else 'shr.u32 a, $1, 3;'}
{f'shl.b32 b, $1, {12 - 4 * c};' if c < 3 else 'mov.b32 b, $1;'}
lop3.b32 v, a, b, 0x0E000E00, 0xE4;
and.b32 v, v, 0x8E008E00;
{f'mul.rn.f16x2 acc, v, ${2 + c};' if c == 0 else f'fma.rn.f16x2 acc, v, ${2 + c}, acc;'}
""" for c in range(4)) + """mov.b32 {l, h}, acc;
add.rn.f16 l, l, h;
cvt.f32.f16 $0, l;
}"""
_PAIRS = {False: ((0, 5), (1, 4), (2, 7), (3, 6)), True: ((0, 4), (1, 5), (2, 6), (3, 7))}  # fp4: True


def _pack_pairs(h8, fp4: bool):
    """f16[W, 8] -> four u32[W]: each the bits of two of a word's x values (`_PAIRS`), low half first."""
    bits = jax.lax.bitcast_convert_type(h8, jnp.uint16).astype(jnp.uint32)  # u32[W, 8]
    cols = jnp.split(bits, 8, axis=1)
    return [(cols[a] | (cols[b] << 16)).reshape(-1) for a, b in _PAIRS[fp4]]


def _unpack_pairs(ps, fp4: bool):
    """`_pack_pairs`' inverse (interpret mode): four u32 arrays -> the 8 f16 arrays, column order."""
    hs = [None] * 8
    for (a, b), p in zip(_PAIRS[fp4], ps):
        hs[a] = jax.lax.bitcast_convert_type((p & 0xFFFF).astype(jnp.uint16), jnp.float16)
        hs[b] = jax.lax.bitcast_convert_type((p >> 16).astype(jnp.uint16), jnp.float16)
    return hs


def _dot8(w, hs, interpret: bool, fp4: bool):
    """u32 words w[BN, W] and 8 f16 x arrays hs[c][BN, W] -> f32[BN, W]: int4, sum_c code_c * hs[c] *
    2^-24 (* 16 for odd c); fp4, sum_c e2m1(code_c) * hs[c] * 2^-14. By `_DOT8_PTX` / `_DOT8_FP4_PTX` on
    the GPU; in interpret mode the same sum in f32."""
    if interpret:
        if fp4:
            return sum(_e2m1(((w >> (4 * c)) & 15).astype(jnp.int32)) * h.astype(jnp.float32) * 2.0 ** -14
                       for c, h in enumerate(hs))
        return sum(((w >> (4 * c)) & 15).astype(jnp.float32) * h.astype(jnp.float32) * (2.0 ** (-20 if c % 2 else -24))
                   for c, h in enumerate(hs))
    return plgpu_triton.elementwise_inline_asm(
        _DOT8_FP4_PTX if fp4 else _DOT8_PTX, args=[w, *hs], constraints="=f,r" + ",h" * 8, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])[0]


def _dot8_packed(w, ps, interpret: bool, fp4: bool):
    """`_dot8` with x's pairs packed (`_pack_pairs`, broadcast to w's shape): four u32 arrays."""
    if interpret:
        return _dot8(w, _unpack_pairs(ps, fp4), True, fp4)
    return plgpu_triton.elementwise_inline_asm(
        _DOT8_FP4_PACKED_PTX if fp4 else _DOT8_PACKED_PTX, args=[w, *ps], constraints="=f,r" + ",r" * 4, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])[0]


def _w4_kernel(x_ref, p_ref, s_ref, *refs, m, n, k, mp, block_n, block_k, group, num_steps, fp4, group_partial,
               gemv, scale_tile, unroll, half2, prefetch, split_k, word_scales, swap_ab, packed_x, ring_scales,
               interpret,
               fused: W4Fused):
    # x_ref bf16|f16[M, K] (silu_mul: [1, 2K]); p_ref u8[N, ceil(K/2)]; s_ref [N, NG]; refs: z_ref
    # u8[N, NG] (int4) or r_ref f32[N] (fp4), then the fused inputs (`W4Fused`, half2 only: norm
    # weight [K], bias [N], residual [1, N]), then o_ref [M, N] (split_k: f32[S, 1, N], and with
    # the norm a second f32[S, 1, N] of each program's sum of squares). All whole arrays.
    aux_ref, *refs = refs
    nw_ref = refs.pop(0) if fused.norm else None
    b_ref = refs.pop(0) if fused.bias else None
    res_ref = refs.pop(0) if fused.residual else None
    o_ref, ss_ref = (refs[0], refs[1] if len(refs) > 1 else None)
    pid_n = pl.program_id(0)
    half = block_k // 2
    kb = (k + 1) // 2  # bytes per row
    ng = (k + group - 1) // group
    rows = jnp.arange(mp, dtype=jnp.int32)  # i32[Mp]
    ncols = pid_n * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[BN] weight rows
    n_ok = ncols < n  # bool[BN]
    row_ok = rows < m  # bool[Mp]

    def codes(i):  # step i -> (byte columns j i32[BK/2], even / odd column codes i32[BN, BK/2])
        j = i * half + jnp.arange(half, dtype=jnp.int32)
        b = plgpu_triton.load(p_ref.at[ncols[:, None], j[None, :]], mask=n_ok[:, None] & (j < kb)[None, :],
                              other=0, eviction_policy="evict_first").astype(jnp.int32)
        return j, b & 15, b >> 4

    def x_row(j):  # M = 1: x's even / odd columns of byte columns j, f32[BK/2] each
        zj = jnp.zeros_like(j)
        xe = plgpu_triton.load(x_ref.at[zj, 2 * j], mask=2 * j < k, other=0.0).astype(jnp.float32)
        return xe, plgpu_triton.load(x_ref.at[zj, 2 * j + 1], mask=2 * j + 1 < k, other=0.0).astype(jnp.float32)

    def weights(i):  # step i -> (byte columns j i32[BK/2], f32 dequantized even / odd weights [BN, BK/2])
        j, lo, hi = codes(i)
        t_mask = n_ok[:, None] & (j < kb)[None, :]
        if scale_tile:  # [BN, BK/G] tiles, each value repeated over its group's G/2 bytes in registers
            nsg = block_k // group
            gidx = i * nsg + jnp.arange(nsg, dtype=jnp.int32)  # i32[BK/G]
            g_mask = n_ok[:, None] & (gidx < ng)[None, :]

            def tile(ref, dtype):
                if dtype == jnp.float32:
                    t = _load_scale(ref.at[ncols[:, None], gidx[None, :]], g_mask)
                else:
                    t = plgpu_triton.load(ref.at[ncols[:, None], gidx[None, :]], mask=g_mask, other=0).astype(dtype)
                return jnp.broadcast_to(t[:, :, None], (block_n, nsg, group // 2)).reshape(block_n, half)

            s = tile(s_ref, jnp.float32)
            z = None if fp4 else tile(aux_ref, jnp.int32)
        else:  # one gathered scale (and zero) per byte column
            grp = jnp.minimum((2 * j) // group, ng - 1)
            s = _load_scale(s_ref.at[ncols[:, None], grp[None, :]], t_mask)
            z = None if fp4 else plgpu_triton.load(aux_ref.at[ncols[:, None], grp[None, :]], mask=t_mask,
                                                   other=0).astype(jnp.int32)
        if fp4:
            return j, _e2m1(lo) * s, _e2m1(hi) * s
        return j, (lo - z).astype(jnp.float32) * s, (hi - z).astype(jnp.float32) * s

    def mm(xv, wv):  # x [Mp, C] . W [BN, C] -> f32 [Mp, BN], or its transpose [BN, Mp] (swap_ab)
        wv = wv.astype(xv.dtype)
        return (plgpu_triton.dot(wv, xv, trans_b=True) if swap_ab else
                plgpu_triton.dot(xv, wv, trans_b=True)).astype(jnp.float32)

    def per_row(v):  # f32[Mp] -> broadcastable against the accumulator
        return v[None, :] if swap_ab else v[:, None]

    def per_col(v):  # f32[BN] -> broadcastable against the accumulator
        return v[:, None] if swap_ab else v[None, :]

    def body(i, acc):
        j, w_lo, w_hi = weights(i)
        ke, ko = 2 * j, 2 * j + 1
        xe = plgpu_triton.load(x_ref.at[rows[:, None], ke[None, :]], mask=row_ok[:, None] & (ke < k)[None, :],
                               other=0.0)  # bf16|f16[Mp, BK/2]
        xo = plgpu_triton.load(x_ref.at[rows[:, None], ko[None, :]], mask=row_ok[:, None] & (ko < k)[None, :],
                               other=0.0)
        return acc + mm(xe, w_lo) + mm(xo, w_hi)

    if gemv:  # m == 1: on the CUDA cores, acc f32[BN]
        nsg = max(1, block_k // group)  # group_partial: groups per step (1: the step lies inside one group)

        def group_sums(prod, xw, per):  # f32[BN, T], f32[T] (T = block_k / per) -> per-group [BN, nsg], [nsg]
            if nsg > 1:
                return (jnp.sum(prod.reshape(block_n, nsg, group // per), axis=2),
                        jnp.sum(xw.reshape(nsg, group // per), axis=1))
            return jnp.sum(prod, axis=1)[:, None], jnp.sum(xw)[None]

        def group_cols(i):  # step i's groups: i32[nsg]
            return (i * block_k) // group + jnp.arange(nsg, dtype=jnp.int32)

        def zero_and_scale(i, part, xs, loaded=(None, None)):  # sum_k x (q - z) * s over this step's groups
            # -> f32[BN]; loaded: the groups' scales and zeros as loaded before (half2's ring_scales), or
            # None: loaded here (after the products: ptxas gave int4 gate|up 124 registers against 96
            # with them loaded before the group sums, session 47)
            gidx = group_cols(i)
            g_mask = n_ok[:, None] & (gidx < ng)[None, :]
            sc, z = loaded
            sc = _load_scale(s_ref.at[ncols[:, None], gidx[None, :]], g_mask) if sc is None else \
                _loaded_scale(sc, g_mask, s_ref.dtype)  # f32[BN, nsg]
            if not fp4:  # sum_k x (q - z) = sum_k x q - z * sum_k x
                if z is None:
                    z = plgpu_triton.load(aux_ref.at[ncols[:, None], gidx[None, :]], mask=g_mask, other=0)
                part = part - z.astype(jnp.int32).astype(jnp.float32) * xs[None, :]
            return jnp.sum(part * sc, axis=1)

        if half2:  # p_ref u32[N, K/8]
            nw, kw = block_k // 8, k // 8
            # f32[1, 8]: int4's high nibbles take x / 16 (their f16 is 16 * code * 2^-24); NVFP4 none
            odd_16 = None if fp4 else jnp.where(jnp.arange(8, dtype=jnp.int32) % 2 == 1, 0.0625, 1.0)[None, :]

            def rounded(v):  # f32 -> x's dtype -> f32 (the unfused path's roundings)
                return v.astype(x_ref.dtype).astype(jnp.float32)

            def word_cols(i):  # step i's word columns: i32[W]
                return i * nw + jnp.arange(nw, dtype=jnp.int32)

            def scale_cols(i):  # step i's scale (and zero) columns: i32[1, T] (T: W words or nsg groups)
                return (8 * word_cols(i) // group if word_scales else group_cols(i))[None, :]

            def scale_ok(i):  # bool[BN, T]
                return n_ok[:, None] & ((word_cols(i) < kw)[None, :] if word_scales else scale_cols(i) < ng)

            def live(i, mask):  # mask, and off for a prefetch past this program's last step along K
                return mask & (i < last) if prefetch and split_k > 1 else mask

            def load_half2(i):
                # step i's loads, as loaded (no conversion: a prefetch ring carries them to the step that
                # uses them, and an instruction using a value waits for its load, so converting here would
                # stall the warp on every prefetch of a rolled loop): u32[BN, W] words, x [W, 8] (each
                # word's 8 columns; silu_mul: gate, then up [W, 8]; norm: then the norm's weight [W, 8]),
                # with ring_scales the scales [BN, T] (masked-off lanes undefined: `step_half2` zeroes
                # them) and int4's zeros u8[BN, T], else None (the step loads them). A prefetch past this
                # program's last step along K loads nothing (past K's last step the column mask covers it).
                jw = word_cols(i)
                w_ok = live(i, jw < kw)
                wt = plgpu_triton.load(p_ref.at[ncols[:, None], jw[None, :]], mask=n_ok[:, None] & w_ok[None, :],
                                       other=0, eviction_policy="evict_first")
                cols = 8 * jw[:, None] + jnp.arange(8, dtype=jnp.int32)[None, :]  # i32[W, 8]
                zc = jnp.zeros_like(cols)
                xs = [plgpu_triton.load(x_ref.at[zc, cols], mask=w_ok[:, None], other=0.0)]
                if fused.silu_mul:  # x = gate | up
                    xs.append(plgpu_triton.load(x_ref.at[zc, cols + k], mask=w_ok[:, None], other=0.0))
                if fused.norm:
                    xs.append(plgpu_triton.load(nw_ref.at[cols], mask=w_ok[:, None], other=0.0))
                if not ring_scales:
                    return wt, tuple(xs), None, None
                return (wt, tuple(xs)) + load_scales(i, live(i, scale_ok(i)))

            def load_scales(i, g_ok):  # step i's scales [BN, T] as loaded, and int4's zeros u8[BN, T]
                gw = ncols[:, None], scale_cols(i)
                sc = plgpu_triton.load(s_ref.at[gw], mask=g_ok)  # (no fill: `_load_scale`)
                if sc.dtype == jnp.float8_e4m3fn:  # carried as its bytes (no instruction; no float8 loop carry)
                    sc = jax.lax.bitcast_convert_type(sc, jnp.uint8)
                return sc, None if fp4 else plgpu_triton.load(aux_ref.at[gw], mask=g_ok, other=0)

            def inputs_half2(xs):  # the loaded x columns -> (f32[W, 8] x, f32[W, 8] squares (norm) or None)
                x8 = xs[0].astype(jnp.float32)
                if fused.silu_mul:  # silu(gate) rounded, times up, rounded
                    return rounded(rounded(x8 / (1.0 + jnp.exp(-x8))) * xs[1].astype(jnp.float32)), None
                if fused.norm:  # x * w rounded; the row's 1/rms multiplies the f32 product
                    return rounded(x8 * xs[1].astype(jnp.float32)), x8 * x8
                return x8, None

            def step_half2(i, acc, wt, x8, sc, z):
                # x * cs in f16, cs = 2^(141 - e) per word, e the biased exponent of the word's max |x|
                # (in-thread: no barrier in the loop): |x * cs| < 2^15, so products <= 15 * 2^-9 and
                # half2 sums stay far from f16's range (NVFP4: <= 6 * 2^-14 * 2^15 per product); inv undoes
                # cs and the code's 2^-24 (int4) or 2^-14 (NVFP4) on the f32 sum: 2^(e - 117) or 2^(e - 127).
                e = (jax.lax.bitcast_convert_type(jnp.max(jnp.abs(x8), axis=1), jnp.int32) >> 23) & 255
                e = jnp.clip(e, 14, 244)  # i32[W]
                cs = jax.lax.bitcast_convert_type((268 - e) << 23, jnp.float32)  # f32[W]
                inv = jax.lax.bitcast_convert_type((e if fp4 else e + 10) << 23, jnp.float32)
                xs = x8 * cs[:, None]
                h8 = (xs if fp4 else xs * odd_16).astype(jnp.float16)  # f16[W, 8]
                if packed_x:  # the pairs packed once per word column, then broadcast over the rows
                    ps = [jnp.broadcast_to(q[None, :], (block_n, nw)) for q in _pack_pairs(h8, fp4)]
                    d = _dot8_packed(wt, ps, interpret, fp4)
                else:
                    hs = [jnp.broadcast_to(h.reshape(nw)[None, :], (block_n, nw)) for h in jnp.split(h8, 8, axis=1)]
                    d = _dot8(wt, hs, interpret, fp4)
                d = d * inv[None, :]  # f32[BN, W]: each word's sum of code * x
                if word_scales:  # scale (and zero) of each word's group (loaded here unless ring_scales)
                    sc, z = (sc, z) if sc is not None else load_scales(i, scale_ok(i))
                    if not fp4:  # sum_k x (q - z) = sum_k x q - z * sum_k x
                        d = d - z.astype(jnp.int32).astype(jnp.float32) * jnp.sum(x8, axis=1)[None, :]
                    return acc + jnp.sum(d * _loaded_scale(sc, scale_ok(i), s_ref.dtype), axis=1)
                part, xg = group_sums(d, jnp.sum(x8, axis=1), 8)
                return acc + zero_and_scale(i, part, xg, (sc, z))

            # (acc f32[BN], the norm's squares summed per position f32[W, 8]: one reduction after the loop)
            carry0 = (jnp.zeros((block_n,), jnp.float32), jnp.zeros((nw, 8), jnp.float32) if fused.norm else None)
            sps = -(-num_steps // split_k)  # steps per program along K (those past the last: masked off)
            first = pl.program_id(1) * sps
            last = first + sps  # (this program's steps end there)

            def advance(i, carry, wt, xs, sc, z):
                acc, ss = carry
                x8, sq = inputs_half2(xs)
                return step_half2(i, acc, wt, x8, sc, z), None if sq is None else ss + sq

            if prefetch:  # a ring of the next `prefetch` steps' loads (past the program's last: masked off)
                ahead = int(prefetch)

                def body_prefetch(t, carry):
                    state, ring = carry
                    return advance(first + t, state, *ring[0]), ring[1:] + (load_half2(first + t + ahead),)

                # (step `first` itself, not `first + 0`: one step ahead traces to the kernel it was before the ring)
                ring0 = (load_half2(first),) + tuple(load_half2(first + d) for d in range(1, ahead))
                acc, ss = _loop(sps, body_prefetch, (carry0, ring0), unroll)[0]
            else:
                acc, ss = _loop(sps, lambda t, carry: advance(first + t, carry, *load_half2(first + t)), carry0,
                                unroll)
            if fp4:
                acc = acc * plgpu_triton.load(aux_ref.at[ncols], mask=n_ok, other=0.0)
            zero = jnp.zeros_like(ncols)
            ss = None if ss is None else jnp.sum(jnp.sum(ss, axis=1))  # this program's share of K's sum of squares
            if split_k > 1:  # o_ref f32[S, 1, N] (the wrapper applies the fused epilogue)
                plgpu_triton.store(o_ref.at[pl.program_id(1) + zero, zero, ncols], acc, mask=n_ok)
                if ss is not None:  # (the same value in each column: a vector store)
                    plgpu_triton.store(ss_ref.at[pl.program_id(1) + zero, zero, ncols], ss + 0.0 * acc, mask=n_ok)
                return
            if ss is not None:
                acc = acc * jax.lax.rsqrt(ss / k + fused.eps)
            if b_ref is not None:
                acc = acc + plgpu_triton.load(b_ref.at[ncols], mask=n_ok, other=0.0).astype(jnp.float32)
            y = acc.astype(o_ref.dtype)
            if res_ref is not None:  # residual + the product rounded, as `x + linear(...)` in x's dtype
                res = plgpu_triton.load(res_ref.at[zero, ncols], mask=n_ok, other=0.0).astype(jnp.float32)
                y = (res + y.astype(jnp.float32)).astype(o_ref.dtype)
            plgpu_triton.store(o_ref.at[zero, ncols], y, mask=n_ok)
            return

        def body_gemv_groups(i, acc):  # per group, sum code * x, then zero and scale
            j, lo, hi = codes(i)
            xe, xo = x_row(j)
            dec = _e2m1 if fp4 else _codes_f32
            prod = dec(lo) * xe[None, :] + dec(hi) * xo[None, :]  # f32[BN, BK/2]
            part, xg = group_sums(prod, xe + xo, 2)
            return acc + zero_and_scale(i, part, xg)

        def body_gemv(i, acc):  # multiply-and-reduce the dequantized weights
            j, w_lo, w_hi = weights(i)
            xe, xo = x_row(j)
            return acc + jnp.sum(w_lo * xe[None, :] + w_hi * xo[None, :], axis=1)

        acc = _loop(num_steps, body_gemv_groups if group_partial else body_gemv, jnp.zeros((block_n,), jnp.float32),
                    unroll)
        if fp4:
            acc = acc * plgpu_triton.load(aux_ref.at[ncols], mask=n_ok, other=0.0)
        plgpu_triton.store(o_ref.at[jnp.zeros_like(ncols), ncols], acc.astype(o_ref.dtype), mask=n_ok)
        return

    sub = min(group, block_k)  # group_partial: K columns per dot pair, within one group

    def body_group_partial(i, acc):
        for gi in range(block_k // sub):
            k0 = i * block_k + gi * sub
            j = k0 // 2 + jnp.arange(sub // 2, dtype=jnp.int32)  # i32[sub/2] byte columns
            t_mask = n_ok[:, None] & (j < kb)[None, :]
            b = plgpu_triton.load(p_ref.at[ncols[:, None], j[None, :]], mask=t_mask, other=0,
                                  eviction_policy="evict_first").astype(jnp.int32)  # i32[BN, sub/2]
            g = jnp.minimum(k0 // group, ng - 1)
            gcol = jnp.full((block_n,), g, jnp.int32)
            s = _load_scale(s_ref.at[ncols, gcol], n_ok)  # f32[BN]
            ke, ko = 2 * j, 2 * j + 1
            xe = plgpu_triton.load(x_ref.at[rows[:, None], ke[None, :]],
                                   mask=row_ok[:, None] & (ke < k)[None, :], other=0.0)  # [Mp, sub/2]
            xo = plgpu_triton.load(x_ref.at[rows[:, None], ko[None, :]],
                                   mask=row_ok[:, None] & (ko < k)[None, :], other=0.0)
            lo, hi = b & 15, b >> 4
            if fp4:
                lo, hi = _e2m1(lo), _e2m1(hi)  # exact in bf16 / f16
            part = mm(xe, lo) + mm(xo, hi)
            if not fp4:  # sum_k x (q - z) = x . q - z * sum_k x
                z = plgpu_triton.load(aux_ref.at[ncols, gcol], mask=n_ok, other=0).astype(jnp.float32)  # f32[BN]
                xsum = jnp.sum(xe.astype(jnp.float32), axis=1) + jnp.sum(xo.astype(jnp.float32), axis=1)  # f32[Mp]
                part = part - per_row(xsum) * per_col(z)
            acc = acc + part * per_col(s)
        return acc

    acc = _loop(num_steps, body_group_partial if group_partial else body,
                jnp.zeros((block_n, mp) if swap_ab else (mp, block_n), jnp.float32), unroll)  # f32[Mp, BN] | [BN, Mp]
    if fp4:
        acc = acc * per_col(plgpu_triton.load(aux_ref.at[ncols], mask=n_ok, other=0.0))
    if swap_ab:
        plgpu_triton.store(o_ref.at[rows[None, :], ncols[:, None]], acc.astype(o_ref.dtype),
                           mask=row_ok[None, :] & n_ok[:, None])
    else:
        plgpu_triton.store(o_ref.at[rows[:, None], ncols[None, :]], acc.astype(o_ref.dtype),
                           mask=row_ok[:, None] & n_ok[None, :])


def _check(x, packed, scales, aux, k: int, group: int, kind: str, fused: W4Fused):
    if kind not in ("int4", "fp4"):
        raise ValueError(f"{kind=} must be 'int4' or 'fp4'")
    if x.ndim != 2 or packed.ndim != 2:
        raise ValueError(f"skinny_matmul_w4: x must be [M, K] and packed [N, K/2]; got {x.shape}, {packed.shape}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny_matmul_w4: {m=} must be in 1..{MAX_M}")
    if x.shape[1] != (2 * k if fused.silu_mul else k) or packed.shape[1] != (k + 1) // 2:
        raise ValueError(f"skinny_matmul_w4: x {x.shape} and packed {packed.shape} disagree with {k=}"
                         f"{' (silu_mul: x is gate | up, 2K wide)' if fused.silu_mul else ''}")
    if fused.silu_mul and fused.norm:
        raise ValueError("skinny_matmul_w4: silu_mul and norm_weight exclude one another")
    if group < 2 or group % 2:
        raise ValueError(f"skinny_matmul_w4: {group=} must be even")
    n = packed.shape[0]
    if scales.shape != (n, -(-k // group)):
        raise ValueError(f"skinny_matmul_w4: scales {scales.shape} must be {(n, -(-k // group))}")
    want = (n,) if kind == "fp4" else scales.shape
    if aux.shape != want:
        raise ValueError(f"skinny_matmul_w4: {'row_scale' if kind == 'fp4' else 'zeros'} {aux.shape} must be {want}")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"skinny_matmul_w4: x must be bfloat16 or float16; got {x.dtype}")
    if jnp.dtype(packed.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"skinny_matmul_w4: packed must be uint8; got {packed.dtype}")


def _prologue(x, norm_weight, eps: float, silu_mul: bool):
    """The fused input in XLA (`W4Fused`): -> (the product's input [M, K], the row scale f32[M, 1] or None)."""
    if silu_mul:  # (as layers.mlp.silu_mul)
        g, u = jnp.split(x, 2, axis=-1)
        x = jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u
    if norm_weight is None:
        return x, None
    xf = x.astype(jnp.float32)  # (as layers.norms.rms_norm_linear)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * norm_weight.astype(jnp.float32)).astype(x.dtype), r


def _epilogue(y, r, bias, residual, dtype):
    """The fused output in XLA: f32 product y [M, N] -> ((y * r + bias) rounded (+ residual), rounded) in dtype."""
    if r is not None:
        y = y * r
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = y.astype(dtype)
    return y if residual is None else (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("k", "group_size", "kind", "params", "interpret", "eps", "silu_mul"))
def skinny_matmul_w4(x, packed, scales, aux, *, k: int, group_size: int, kind: str,
                     params: W4Params | None = None, interpret: bool = False, norm_weight=None, eps: float = 1e-6,
                     silu_mul: bool = False, bias=None, residual=None):
    """x bf16|f16[M, K] @ W^T -> [M, N] in x's dtype for a packed 4-bit W (module docstring), M in 1..64.

    aux: zeros u8[N, ceil(K/G)] (kind "int4") or row_scale f32[N] (kind "fp4").
    Fused around the product (`W4Fused`; in the launch on the one-row half2 path, else in XLA):
    norm_weight [K]: x is the residual stream, the input RMSNorm(x) * norm_weight (`eps`) as
    `layers.norms.rms_norm_linear` rounds it; silu_mul: x is gate | up [M, 2K], the input
    `layers.mlp.silu_mul(x)`; bias [N]; residual [M, N]: residual + the result, in x's dtype.
    """
    fused = W4Fused(norm=norm_weight is not None, eps=float(eps), silu_mul=silu_mul, bias=bias is not None,
                    residual=residual is not None)
    _check(x, packed, scales, aux, k, group_size, kind, fused)
    m = x.shape[0]
    n = packed.shape[0]
    params = params or w4_params_for(kind, m, n, k, group_size)
    why = _params_fit(params, m, k, group_size)
    if why:
        raise ValueError(f"skinny_matmul_w4: {why}")
    block_k = _block_k(params, k)
    gemv = params.gemv and m == 1
    if fused.any and not (params.half2 and gemv):  # in XLA around the kernel
        xin, r = _prologue(x, norm_weight, eps, silu_mul)
        y = skinny_matmul_w4(xin, packed, scales, aux, k=k, group_size=group_size, kind=kind, params=params,
                             interpret=interpret)
        return _epilogue(y.astype(jnp.float32), r, bias, residual, x.dtype)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"skinny_matmul_w4: bias {bias.shape} must be {(n,)}")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"skinny_matmul_w4: residual {residual.shape} must be {(m, n)}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"skinny_matmul_w4: norm_weight {norm_weight.shape} must be {(k,)}")
    split_k = min(params.split_k, -(-k // block_k)) if params.half2 and gemv else 1
    kernel = functools.partial(
        _w4_kernel, m=m, n=n, k=k, mp=m_bucket(m), block_n=params.block_n, block_k=block_k, group=group_size,
        num_steps=-(-k // block_k), fp4=kind == "fp4", group_partial=params.group_partial, gemv=gemv,
        scale_tile=params.scale_tile, unroll=params.unroll, half2=params.half2 and gemv, prefetch=params.prefetch,
        split_k=split_k, word_scales=params.word_scales, swap_ab=params.swap_ab and not gemv,
        packed_x=params.packed_x and gemv, ring_scales=params.ring_scales and gemv, interpret=interpret, fused=fused)
    if params.half2 and gemv:  # the same bytes as u32 words (4 bytes, 8 codes each)
        packed = jax.lax.bitcast_convert_type(packed.reshape(n, k // 8, 4), jnp.uint32)
    inputs = [x, packed, scales, aux] + [a for a in (norm_weight, bias, residual) if a is not None]
    partial = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
    out_shape = jax.ShapeDtypeStruct((m, n), x.dtype) if split_k == 1 else (partial, partial) if fused.norm else partial
    out = pl.pallas_call(
        kernel,
        grid=(-(-n // params.block_n), split_k),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=(pl.no_block_spec,) * 2 if split_k > 1 and fused.norm else pl.no_block_spec,
        out_shape=out_shape,
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        # (the fusions in the name, for profiles: e.g. skinny_matmul_w4_norm, skinny_matmul_w4_silu_res)
        name="skinny_matmul_w4" + "".join(f"_{f}" for f, on in (("norm", fused.norm), ("silu", fused.silu_mul),
                                                                 ("bias", fused.bias), ("res", fused.residual)) if on),
    )(*inputs)
    if split_k == 1:
        return out
    # the programs' f32 partials along K (and their shares of the norm's sum of squares), added in XLA
    acc, ss = out if fused.norm else (out, None)
    r = None if ss is None else jax.lax.rsqrt(ss.sum(axis=0) / k + eps)
    return _epilogue(acc.sum(axis=0), r, bias, residual, x.dtype)
