"""Tuning parameters of the paged-attention kernels, and the tuned table (data, keyed by shape).

The kernels take a frozen `DecodeParams` / `PrefillParams` as a static argument. When none is
given, `decode_params_for` / `prefill_params_for` look the shape up in `tuned_params.json`
(written from measurements on the GPU machine; see bench/kernels/paged_attention.py) and fall
back to a heuristic for shapes the table does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np

_TUNED_PATH = pathlib.Path(__file__).with_name("tuned_params.json")
_NUM_SMS = 132  # H200


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """Static tuning of `paged_decode_attention`.

    block_k: KV tokens per inner-loop step (a power of two >= 16; independent of the page size,
      since keys are gathered token by token through the block table).
    num_splits: split-K partitions of each row's context (flash-decoding); > 1 adds a combine step.
    num_warps / num_stages: Triton launch parameters (stages = software-pipeline depth).
    heads_inner: launch order; True puts the KV heads of one row next to each other (grid
      (Hkv, N, S)), so neighbouring CTAs read neighbouring bytes of the same pages.
    prefetch: issue the next step's K/V loads before this step's math (register double
      buffering), for when Triton's own pipeliner does not overlap them (fp8 pools).
    """

    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    heads_inner: bool = False
    prefetch: bool = False

    def __post_init__(self):
        if not _is_pow2(self.block_k) or self.block_k < 16:
            raise ValueError(f"{self.block_k=} must be a power of two >= 16")
        if self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")


@dataclasses.dataclass(frozen=True)
class PrefillParams:
    """Static tuning of `paged_prefill_attention`.

    block_rows: query rows per tile, counted as (token, head-in-group) pairs: a tile holds
      block_rows // group_pad tokens of one stream, all heads of one KV head (a power of two).
    block_k: KV tokens per inner-loop step (a power of two >= 16).
    num_warps / num_stages: Triton launch parameters.
    """

    block_rows: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not _is_pow2(self.block_rows) or self.block_rows < 16:
            raise ValueError(f"{self.block_rows=} must be a power of two >= 16")
        if not _is_pow2(self.block_k) or self.block_k < 16:
            raise ValueError(f"{self.block_k=} must be a power of two >= 16")


def decode_key(n, hq, hkv, d, block_size, kv_dtype, max_ctx) -> str:
    return f"n{n}_hq{hq}_hkv{hkv}_d{d}_bs{block_size}_{np.dtype(kv_dtype).name}_ctx{max_ctx}"


def prefill_key(t, hq, hkv, d, block_size, kv_dtype) -> str:
    return f"t{t}_hq{hq}_hkv{hkv}_d{d}_bs{block_size}_{np.dtype(kv_dtype).name}"


@functools.cache
def _tuned_table() -> dict:
    if not _TUNED_PATH.exists():
        return {"decode": {}, "prefill": {}}
    return json.loads(_TUNED_PATH.read_text())


def decode_params_for(n, hq, hkv, d, block_size, kv_dtype, max_ctx) -> DecodeParams:
    """Tuned params for this decode shape, or a heuristic: enough CTAs to fill the SMs twice."""
    hit = _tuned_table()["decode"].get(decode_key(n, hq, hkv, d, block_size, kv_dtype, max_ctx))
    if hit is not None:
        return DecodeParams(**hit)
    # Measured on the H200 (bench/results/paged_attention.md): block_k 64 with 4 warps wins for
    # bf16 D=128; split until there are >= 2 CTAs per SM (a power of two, as the sweep preferred).
    block_k = 64 if d <= 128 else 32
    ctas = n * hkv
    max_splits = max(1, max_ctx // (4 * block_k))  # each split keeps a few inner steps
    want = -(-2 * _NUM_SMS // ctas)
    num_splits = int(min(max_splits, 1 << (want - 1).bit_length()))
    return DecodeParams(block_k=block_k, num_splits=num_splits, num_warps=4, num_stages=3)


def prefill_params_for(t, hq, hkv, d, block_size, kv_dtype) -> PrefillParams:
    hit = _tuned_table()["prefill"].get(prefill_key(t, hq, hkv, d, block_size, kv_dtype))
    if hit is not None:
        return PrefillParams(**hit)
    if d <= 64:
        return PrefillParams(block_rows=128, block_k=64, num_warps=4, num_stages=3)
    if d <= 128:  # best at D=128 for both 4x2048 shapes on the H200
        return PrefillParams(block_rows=128, block_k=32, num_warps=8, num_stages=2)
    return PrefillParams(block_rows=64, block_k=32, num_warps=4, num_stages=2)
