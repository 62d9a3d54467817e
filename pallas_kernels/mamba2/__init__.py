"""Mamba-2 SSD kernels: the varlen chunked scan (prefill) and the selective-state update (decode).

Plain-array API; the model does in_proj, the causal conv1d (pallas_kernels/conv1d), the gate by
silu(z), the grouped RMSNorm and out_proj around them.
"""

from pallas_kernels.mamba2.params import SSDParams, StateUpdateParams
from pallas_kernels.mamba2.reference import (
    selective_state_update_reference,
    softplus_dt,
    ssd_chunk_scan_reference,
    ssd_minimal,
)
from pallas_kernels.mamba2.ssd import ssd_chunk_scan
from pallas_kernels.mamba2.state_update import selective_state_update

__all__ = [
    "SSDParams",
    "StateUpdateParams",
    "selective_state_update",
    "selective_state_update_reference",
    "softplus_dt",
    "ssd_chunk_scan",
    "ssd_chunk_scan_reference",
    "ssd_minimal",
]
