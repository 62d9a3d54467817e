"""Tuning parameters of the gated-delta kernels, and the tuned table (data, keyed by shape).

The kernels take a frozen params dataclass as a static argument. When none is given,
`chunk_params_for` / `recurrent_params_for` look the shape up in `tuned_params.json`
(written from measurements on the GPU machine by bench/kernels/gated_delta.py) and fall back to
a default for shapes the table does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

_TUNED_PATH = pathlib.Path(__file__).with_name("tuned_params.json")


@dataclasses.dataclass(frozen=True)
class ChunkParams:
    """Chunked prefill (chunk.py).

    block_v: value columns per program of the sequential state/output kernel (divides V).
    num_warps_prepare / num_warps_main: Triton warps of the per-chunk WY kernel / the scan kernel.
    num_stages: Triton software-pipelining stages of the scan kernel's loads.
    """

    block_v: int = 64
    num_warps_prepare: int = 4
    num_warps_main: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class RecurrentParams:
    """Single-token decode (fused_recurrent.py). block_v: value columns per program (divides V)."""

    block_v: int = 32
    num_warps: int = 4


def shape_key(h: int, hv: int, dk: int, dv: int, dtype) -> str:
    return f"H={h},HV={hv},K={dk},V={dv},{dtype}"


def chunk_key(h: int, hv: int, dk: int, dv: int, dtype, num_streams: int) -> str:
    return f"{shape_key(h, hv, dk, dv, dtype)},B={num_streams}"


@functools.cache
def _tuned_table() -> dict:
    if not _TUNED_PATH.exists():
        return {"chunk": {}, "recurrent": {}}
    return json.loads(_TUNED_PATH.read_text())


def chunk_params_for(h: int, hv: int, dk: int, dv: int, dtype, num_streams: int) -> ChunkParams:
    """Tuned entry for (shape, B), else the widest block_v <= 64 that still gives the scan kernel
    >= 128 programs (B * HV * V / block_v): a lone long stream needs narrower value blocks to fill
    the GPU (H200: block_v 32 for B=1, 64 for B=4 at HV=32, V=128)."""
    hit = _tuned_table().get("chunk", {}).get(chunk_key(h, hv, dk, dv, dtype, num_streams))
    if hit is not None:
        return ChunkParams(**hit)
    block_v = min(64, dv)
    while block_v > 16 and num_streams * hv * (dv // block_v) < 128:
        block_v //= 2
    return ChunkParams(block_v=block_v)


def recurrent_params_for(h: int, hv: int, dk: int, dv: int, dtype) -> RecurrentParams:
    hit = _tuned_table().get("recurrent", {}).get(shape_key(h, hv, dk, dv, dtype))
    if hit is not None:
        return RecurrentParams(**hit)
    return RecurrentParams(block_v=min(64, dv))
