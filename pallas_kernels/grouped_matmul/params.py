"""Tuning parameters of the grouped GEMM, and the tuned table (data, keyed by shape).

The kernel takes a frozen `GroupedMatmulParams` as a static argument. When none is given,
`grouped_matmul_params_for` looks the shape up in `tuned_params.json` (written from measurements
on the GPU machine by bench/kernels/grouped_matmul.py) and falls back to a heuristic.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np

_TUNED_PATH = pathlib.Path(__file__).with_name("tuned_params.json")
SMEM_LIMIT = 232448  # bytes of shared memory a CTA may use on the H200 (227 KiB)
GRID_MINOR = ("n", "m")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulParams:
    """Static tuning of `grouped_matmul` (Mosaic GPU: TMA + wgmma, one warpgroup per CTA).

    block_m: rows per tile (the wgmma M side): 64, 128 or 192.
    block_n: output columns per tile: 64, 128, 192 or 256 (w tiles are swizzled in 64-column
      tiles, 128 bytes of bf16).
    block_k: reduction columns per pipeline step: a multiple of 64 (128-byte bf16 rows, the
      widest swizzle).
    num_stages: pipeline depth (TMA loads of x and w tiles in flight per CTA); at least 2.
    grid_minor: which tile index moves fastest along the launch order: "n" (the CTAs of one row
      tile run together and share its x tile in L2) or "m" (those of one weight column slab do).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    grid_minor: str = "n"

    def __post_init__(self):
        if self.block_m not in (64, 128, 192):
            raise ValueError(f"{self.block_m=} must be 64, 128 or 192")
        if self.block_n not in (64, 128, 192, 256):
            raise ValueError(f"{self.block_n=} must be 64, 128, 192 or 256")
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"{self.block_k=} must be a positive multiple of 64")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be >= 2 (one wgmma stays in flight)")
        if self.grid_minor not in GRID_MINOR:
            raise ValueError(f"{self.grid_minor=} must be one of {GRID_MINOR}")

    def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
        """Shared memory a CTA needs: the pipeline buffers, then (reusing them) the output tile."""
        stage = (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize
        return max(self.num_stages * stage, self.block_m * self.block_n * out_itemsize) + 1024


def rows_bucket(m: int) -> int:
    """The table's row key: the next power of two (serving buckets are powers of two anyway)."""
    return 1 << max(0, (m - 1).bit_length())


def tuned_key(m: int, k: int, n: int, num_groups: int, dtype, out_dtype) -> str:
    return f"{np.dtype(dtype).name}_{np.dtype(out_dtype).name}_m{rows_bucket(m)}_k{k}_n{n}_e{num_groups}"


@functools.cache
def _tuned_table() -> dict:
    if not _TUNED_PATH.exists():
        return {}
    return json.loads(_TUNED_PATH.read_text())


def default_params(m: int, k: int, n: int, num_groups: int) -> GroupedMatmulParams:
    """Heuristic. Few rows per group (decode): the weights dominate the bytes, so 64-row tiles
    (the wgmma minimum) waste the least work and a deeper pipeline keeps more weight bytes in
    flight. Many rows per group (prefill): 128x128 tiles, as tokamax and jax's ragged_dot_mgpu use."""
    if m <= 64 * num_groups:
        return GroupedMatmulParams(block_m=64, block_n=128, block_k=64, num_stages=6)
    return GroupedMatmulParams(block_m=128, block_n=128, block_k=64, num_stages=4)


def grouped_matmul_params_for(m: int, k: int, n: int, num_groups: int, dtype, out_dtype) -> GroupedMatmulParams:
    """Tuned params for x [m, k] @ w [num_groups, k, n], or the heuristic."""
    hit = _tuned_table().get(tuned_key(m, k, n, num_groups, dtype, out_dtype))
    if hit is not None:
        return GroupedMatmulParams(**hit)
    return default_params(m, k, n, num_groups)
