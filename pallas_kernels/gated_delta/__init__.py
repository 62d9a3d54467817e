"""Gated delta rule (Qwen3-Next's Gated DeltaNet): varlen chunked prefill and single-token decode.

Plain-array API in FLA's shape; state f32[.., HV, K, V] as transformers' `recurrent_states`.
"""

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule
from pallas_kernels.gated_delta.fused_recurrent import fused_recurrent_gated_delta_rule
from pallas_kernels.gated_delta.naive import l2norm, naive_gated_delta_rule
from pallas_kernels.gated_delta.params import (
    ChunkParams,
    RecurrentParams,
    chunk_params_for,
    recurrent_params_for,
)

__all__ = [
    "ChunkParams",
    "RecurrentParams",
    "chunk_gated_delta_rule",
    "chunk_params_for",
    "fused_recurrent_gated_delta_rule",
    "l2norm",
    "naive_gated_delta_rule",
    "recurrent_params_for",
]
