"""Tuning parameters of the Mamba-2 kernels, and the tuned table (data, keyed by shape).

The kernels take a frozen `SSDParams` / `StateUpdateParams` as a static argument. When none is
given, `ssd_params_for` / `state_update_params_for` look the shape up in `tuned_params.json`
(written from measurements on the GPU machine by bench/kernels/mamba2.py) and fall back to a
heuristic for shapes the table does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np

_TUNED_PATH = pathlib.Path(__file__).with_name("tuned_params.json")

#: How the SSD scan's four matmuls per chunk are fed to the tensor cores.
#: "auto": the inputs' own 16-bit dtype when x is bf16/f16 (f32 accumulation; mamba_ssm and FLA do
#: the same), exact f32 ("ieee") when x is f32. "bf16": always bf16 operands. "tf32": f32 operands at
#: TF32 (~1e-3 relative). "ieee": exact f32 (slower on GPU: no tensor cores).
DOT_MODES = ("auto", "bf16", "tf32", "ieee")


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class SSDParams:
    """Static tuning of `ssd_chunk_scan`.

    chunk_size: tokens per chunk (a power of two >= 16); the math is the same for any value.
    block_p: headdim columns per program (a power of two >= 16 dividing headdim); the recurrence is
      independent across headdim, so smaller blocks give more programs (and recompute C.B^T).
    dot_mode: one of DOT_MODES.
    num_warps / num_stages: Triton launch parameters.
    """

    chunk_size: int = 64
    block_p: int = 64
    dot_mode: str = "auto"
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not _is_pow2(self.chunk_size) or self.chunk_size < 16:
            raise ValueError(f"{self.chunk_size=} must be a power of two >= 16")
        if not _is_pow2(self.block_p) or self.block_p < 16:
            raise ValueError(f"{self.block_p=} must be a power of two >= 16")
        if self.dot_mode not in DOT_MODES:
            raise ValueError(f"{self.dot_mode=} must be one of {DOT_MODES}")


@dataclasses.dataclass(frozen=True)
class StateUpdateParams:
    """Static tuning of `selective_state_update`.

    block_p: headdim rows of the [headdim, d_state] state tile per program (a power of two).
    num_warps / num_stages: Triton launch parameters.
    """

    block_p: int = 64
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if not _is_pow2(self.block_p):
            raise ValueError(f"{self.block_p=} must be a power of two")


def ssd_key(nheads, headdim, d_state, ngroups, dtype, num_streams) -> str:
    return f"h{nheads}_p{headdim}_n{d_state}_g{ngroups}_{np.dtype(dtype).name}_s{num_streams}"


def state_update_key(nheads, headdim, d_state, ngroups, dtype) -> str:
    return f"h{nheads}_p{headdim}_n{d_state}_g{ngroups}_{np.dtype(dtype).name}"


@functools.cache
def _tuned_table() -> dict:
    if not _TUNED_PATH.exists():
        return {"ssd": {}, "state_update": {}}
    return json.loads(_TUNED_PATH.read_text())


def ssd_params_for(nheads, headdim, d_state, ngroups, dtype, num_streams) -> SSDParams:
    """Tuned params for this shape, or a heuristic.

    The table is keyed by stream count too (it sets how many programs run: nheads * headdim/block_p
    * streams). A count the table lacks takes the entry of the largest tabled count below it (else
    the smallest one).
    """
    table = _tuned_table().get("ssd", {})
    prefix = ssd_key(nheads, headdim, d_state, ngroups, dtype, "")
    counts = sorted(int(k[len(prefix) :]) for k in table if k.startswith(prefix) and k[len(prefix) :].isdigit())
    if counts:
        below = [c for c in counts if c <= num_streams]
        return SSDParams(**table[f"{prefix}{below[-1] if below else counts[0]}"])
    block_p = min(64, headdim)
    # Measured on the H200 (bench/results/mamba2_2026-11-29): with about one program per SM a
    # deeper software pipeline wins (0.39 vs 0.52 ms at 128 programs); with several per SM the
    # shallower one does (0.34 vs 0.41 ms at 512 programs).
    programs = nheads * (headdim // block_p) * num_streams
    stages = 3 if programs <= 264 else 2
    if np.dtype(dtype).itemsize >= 4:
        # 4-byte x/B/C tiles: three stages of [64, 64] x and [64, d_state 128] B and C asked for
        # 247 KB of shared memory on the H200 (227 KB exist) in a float32 model (2026-12-01)
        stages = 2
    return SSDParams(chunk_size=64, block_p=block_p, num_warps=4, num_stages=stages)


def state_update_params_for(nheads, headdim, d_state, ngroups, dtype) -> StateUpdateParams:
    hit = _tuned_table().get("state_update", {}).get(state_update_key(nheads, headdim, d_state, ngroups, dtype))
    if hit is not None:
        return StateUpdateParams(**hit)
    return StateUpdateParams(block_p=min(64, headdim), num_warps=4, num_stages=1)


def check_mixer_inputs(x, dt_raw, A_log, B, C, D, dt_bias, rows_name: str) -> tuple[int, int, int, int, int]:
    """Validates the per-token SSD inputs shared by the scan and the state update.

    x [R, nheads, headdim], dt_raw [R, nheads], B/C [R, ngroups, d_state], A_log/D/dt_bias f32[nheads]
    -> (R, nheads, headdim, ngroups, d_state). `rows_name` names R in the messages ("T" or "R").
    """
    if x.ndim != 3:
        raise ValueError(f"{x.shape=} must be [{rows_name}, nheads, headdim]")
    rows, nheads, headdim = x.shape
    if B.ndim != 3 or B.shape[0] != rows or C.shape != B.shape:
        raise ValueError(f"{B.shape=} and {C.shape=} must both be [{rows_name}={rows}, ngroups, d_state]")
    _, ngroups, d_state = B.shape
    if nheads % ngroups:
        raise ValueError(f"{nheads=} must be a multiple of {ngroups=}")
    if dt_raw.shape != (rows, nheads):
        raise ValueError(f"{dt_raw.shape=} must be ({rows_name}, nheads) = {(rows, nheads)}")
    for name, v in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        if v.shape != (nheads,):
            raise ValueError(f"{name}.shape={v.shape} must be ({nheads},)")
    return rows, nheads, headdim, ngroups, d_state
