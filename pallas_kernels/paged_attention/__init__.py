"""Paged attention kernels over the engine's layer-stacked KV pools [L, NB, bs, Hkv, D].

* `paged_decode_attention`: one query token per row, split-K (flash-decoding) for long contexts;
  `paged_verify_attention` the same kernel over speculative verify windows (a few queries per row,
  causal among themselves) with the ragged prefill kernel's arguments.
* `paged_prefill_attention`: ragged causal chunked prefill over B streams (cu_seqlens, kv_lens);
  `prefill_mgpu.paged_prefill_attention_mgpu` its Mosaic GPU twin (TMA + wgmma, the GPU default
  where it applies: bf16, head_dim 64/128, power-of-two GQA groups <= 16).
* `paged_kv_write`: the step's K/V write by slot (slot -1 writes nothing), faster than XLA's scatter;
  `rope_and_write_kv` the same with RoPE of q and k applied from a fused q|k|v projection.
* f32 references of both attention kernels (`reference.py`), tuned params as data
  (`tuned_params.json`, keyed by shape; `params.py`).

Mixed batches: two launches (decode kernel + prefill kernel) measured 1.6x faster than one
ragged launch; see prefill.py. All kernels but the prefill twin lower through Triton
(`pl.pallas_call`); decode.py and prefill.py say why. Figures: bench/results/paged_attention.md,
session4_2026-11-30.md (the Mosaic GPU prefill).
"""

from pallas_kernels.paged_attention.decode import paged_decode_attention, paged_verify_attention, verify_supports
from pallas_kernels.paged_attention.kv_write import paged_kv_write, rope_and_write_kv
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
    "paged_verify_attention",
    "rope_and_write_kv",
    "verify_supports",
]
