"""Paged attention kernels over the engine's layer-stacked KV pools [L, NB, bs, Hkv, D]."""

from pallas_kernels.paged_attention.decode import paged_decode_attention
from pallas_kernels.paged_attention.kv_write import paged_kv_write
from pallas_kernels.paged_attention.params import DecodeParams, PrefillParams
from pallas_kernels.paged_attention.prefill import paged_prefill_attention
from pallas_kernels.paged_attention.reference import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)

__all__ = [
    "DecodeParams",
    "PrefillParams",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_kv_write",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
]
