"""Tuning parameters of the skinny linear kernels, and the tuned table (data, keyed by shape).

The kernels take a frozen `SkinnyParams` as a static argument. When none is given,
`skinny_params_for` looks the shape up in `tuned_params.json` (written from measurements on the
GPU machine by bench/kernels/linear.py) and falls back to a heuristic for other shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np

_TUNED_PATH = pathlib.Path(__file__).with_name("tuned_params.json")
_NUM_SMS = 132  # H200
FP8_BLOCK = 128  # the scale block of FP8 weights (both dimensions)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def m_bucket(m: int) -> int:
    """Rows the kernel computes for M real rows: the next power of two, at least 16 (the dot's minimum)."""
    return max(16, 1 << max(0, (m - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class SkinnyParams:
    """Static tuning of `skinny_matmul` / `skinny_matmul_fp8`.

    block_n: output columns (weight rows) per program, a power of two >= 16. FP8 needs it to
      divide 128, so that a program's rows share one row of scale blocks.
    block_k: reduction columns per pipelined loop step, a power of two >= 16 (FP8: a multiple of
      128; each 128-column sub-block gets its own scale).
    split_k: programs along K per output tile; > 1 writes float32 partial sums [split_k, M, N]
      that XLA adds (one more small fusion).
    num_warps / num_stages: Triton launch parameters (stages = software-pipeline depth, i.e. how
      many weight tiles are in flight per program).
    fp8_scale_on_x: FP8 only. True: each step gathers its per-column block scales f32[block_k]
      and folds them into the x tile (x * s rounded to bf16; one dot per step, and the scale load
      feeds the dot, so Triton pipelines it with the tiles). False: one dot per 128-column
      sub-block, its f32 partial times a scalar scale - the variant measured on 2026-11-29, whose
      scalar scale loads were not pipelined: every sub-block waited one L2 round trip, and FP8
      ran at 1.1-2.3 TB/s, slower than bf16 (bench/results/linear.md). Measured 2026-11-29
      (session 2): a layer in 134.7 us against 149.5 us for bf16 (1.11x).
    fp8_f16_dot: FP8 with fp8_scale_on_x only. The weights convert fp8 -> f16 (one packed
      instruction per two values on sm_89+; to bf16 the conversion goes through f16 and f32) and
      the dot runs in f16; x * s is divided per row by a power of two >= its max first (exact),
      which keeps it in f16's range, and the f32 partial is multiplied back. Measured 2026-11-30:
      no faster than the bf16 dot (bench/results/linear_fp8_2026-11-30.md).
    gemv: at M = 1 only, multiply-and-reduce on the CUDA cores instead of a dot (which pads x to
      16 rows: for FP8 weights the padded x tiles were as many bytes per step as the weight tiles).
    """

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fp8_scale_on_x: bool = True
    fp8_f16_dot: bool = False
    gemv: bool = False

    def __post_init__(self):
        if not _is_pow2(self.block_n) or self.block_n < 16:
            raise ValueError(f"{self.block_n=} must be a power of two >= 16")
        if not _is_pow2(self.block_k) or self.block_k < 16:
            raise ValueError(f"{self.block_k=} must be a power of two >= 16")
        if self.split_k < 1:
            raise ValueError(f"{self.split_k=} must be >= 1")
        if not _is_pow2(self.num_warps):
            raise ValueError(f"{self.num_warps=} must be a power of two")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")

    def check_fp8(self):
        if FP8_BLOCK % self.block_n:
            raise ValueError(f"FP8 weights need block_n dividing {FP8_BLOCK}; got {self.block_n}")
        if self.block_k % FP8_BLOCK:
            raise ValueError(f"FP8 weights need block_k a multiple of {FP8_BLOCK}; got {self.block_k}")
        if self.fp8_f16_dot and not self.fp8_scale_on_x:
            raise ValueError("fp8_f16_dot needs fp8_scale_on_x")


def tuned_key(m: int, n: int, k: int, w_dtype) -> str:
    return f"{np.dtype(w_dtype).name}_n{n}_k{k}_m{m}"


@functools.cache
def _tuned_table() -> dict:
    if not _TUNED_PATH.exists():
        return {}
    return json.loads(_TUNED_PATH.read_text())


def default_params(m: int, n: int, k: int, fp8: bool) -> SkinnyParams:
    """Heuristic for shapes the table lacks, read off the H200 sweeps (bench/results/linear*.md):
    block_n 64 when N >= 6144 (enough programs at 64 rows), else 32 (N = 4096 wants 128 programs);
    128 rows and 8 warps for M > 32 on very wide N; 4 stages at M <= 16, 3 above (SMEM)."""
    mp = m_bucket(m)
    bn = 64 if n >= 6144 else 32
    warps = 4
    if mp >= 64 and n >= 16384:
        bn, warps = 128, 8
    stages = 4 if mp <= 16 else 3
    if fp8 and m == 1:  # the 2026-11-30 sweep: the CUDA-core gemv on narrow tiles and long K steps
        return SkinnyParams(block_n=16, block_k=1024, num_warps=4, num_stages=4, gemv=True)
    if fp8:
        return SkinnyParams(block_n=32, block_k=256, num_warps=4, num_stages=4)
    return SkinnyParams(block_n=bn, block_k=256 if bn <= 64 else 128, num_warps=warps, num_stages=stages)


def skinny_params_for(m: int, n: int, k: int, w_dtype) -> SkinnyParams:
    """Tuned params for x [m, k] @ w [n, k]^T with weights of `w_dtype`, or the heuristic.

    The table holds measured M values (1, 8, 32, 64); an M in between takes the entry of the
    next measured M above it. An M whose row bucket lies past the largest measured one takes the
    heuristic: measured tiles are sized for their rows (the FP8 8-row entry of N=28672 asked for
    463 KB of shared memory at 64 rows on the H200, where 227 KB exist).
    """
    table = _tuned_table()
    prefix = tuned_key(0, n, k, w_dtype)[:-1]  # "<dtype>_n<N>_k<K>_m"
    ms = sorted(int(key[len(prefix):]) for key in table if key.startswith(prefix))
    if ms and m_bucket(m) <= m_bucket(ms[-1]):
        pick = next(t for t in ms if t >= m) if m <= ms[-1] else ms[-1]
        params = SkinnyParams(**table[prefix + str(pick)])
        if not (params.gemv and m > 1):  # a gemv pick (M = 1) says nothing about the dot's tiles
            return params
    return default_params(m, n, k, np.dtype(w_dtype).itemsize == 1)
