"""Attention metadata pytrees, the JAX form of the seed's `AttnMetadataDev` / `BatchedAttnMetadata`.

Arrays are data fields; bucket sizes are static meta fields, so each bucket is one compiled
executable. All integers are int32 (JAX without x64 would silently truncate the seed's i64).

Padding rules:
* a padded decode row has `seq_lens == 0` and `slots == -1`;
* a padded prefill token has `slots == -1`; a padded stream has zero tokens in `cu_seqlens`
  and `kv_lens == 0`;
* a slot of -1 never writes: `cache.kv.write_kv` maps it out of range and scatters with
  `mode="drop"` (`.at[-1]` would write the last element);
* `ssm_slots == -1` (padding) reads zeros and writes nothing, the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttnMetadata:
    """Decode rows: one new token per sequence. N = num_seqs (static bucket)."""

    positions: Array  # i32[N]  position of the new token (MRoPE T stream)
    positions_h: Array  # i32[N]  MRoPE H stream (== positions without images)
    positions_w: Array  # i32[N]  MRoPE W stream (== positions without images)
    slots: Array  # i32[N]  flat KV slot (block * block_size + offset) of the new token; -1 = pad
    seq_lens: Array  # i32[N]  tokens in the cache after this step (incl. the new one); 0 = pad
    block_tables: Array  # i32[N, max_blocks_per_seq]  pool block ids; unused entries 0
    ssm_slots: Array  # i32[N]  SSM pool row per sequence; -1 = pad / no SSM state
    seq_slot: Array  # i32[N]  LoRA adapter slot; -1 = base model (metrale_jax.lora)
    moe_row_adapter: Array  # i32[N]  expert-LoRA slot per row (its adapter trains experts); -1 = none
    num_seqs: int = dataclasses.field(metadata=dict(static=True), default=0)
    max_blocks_per_seq: int = dataclasses.field(metadata=dict(static=True), default=0)
    # > 0: rows from this one on were added by the step (`pad_decode_rows`: a few rows run on 8,
    # `AttentionConfig.min_decode_rows`) and carry nothing, not even a LoRA delta; 0 = none added
    live_rows: int = dataclasses.field(metadata=dict(static=True), default=0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BatchedAttnMetadata:
    """Varlen prefill chunks over several streams. T = num_tokens, B = num_streams (static)."""

    positions: Array  # i32[T]  stacked in cu_seqlens order (MRoPE T stream)
    positions_h: Array  # i32[T]
    positions_w: Array  # i32[T]
    slots: Array  # i32[T]  flat KV slot of each new token; -1 = pad token
    block_tables: Array  # i32[B, max_blocks_per_seq]
    cu_seqlens: Array  # i32[B+1]  prefix sum of per-stream new-token counts (pads at the end)
    kv_lens: Array  # i32[B]  chunk start + new-token count: the stream's causal bound
    ssm_slots: Array  # i32[B]  SSM pool row per stream; -1 = pad
    seq_slot: Array  # i32[B]  LoRA adapter slot; -1 = base
    moe_row_adapter: Array  # i32[B]  -1 = none
    num_tokens: int = dataclasses.field(metadata=dict(static=True), default=0)
    num_streams: int = dataclasses.field(metadata=dict(static=True), default=0)
    max_blocks_per_seq: int = dataclasses.field(metadata=dict(static=True), default=0)
    # > 0: a speculative verify step, each stream one row's window of at most this many tokens
    # (1 + k); recurrent layers then keep the state after every position (layers/spec_states.py)
    verify_width: int = dataclasses.field(metadata=dict(static=True), default=0)


def pad_decode_rows(md: AttnMetadata, tokens: Array, rows: int) -> tuple[AttnMetadata, Array]:
    """`md` (N decode rows) and tokens i32[N] padded to `rows` >= N rows by the padding rules
    above (seq_lens 0, slots -1, ssm_slots / seq_slot / moe_row_adapter -1, positions and
    block tables 0): the same rows the builder pads a bucket with."""
    import jax.numpy as jnp

    extra = rows - md.num_seqs
    if extra <= 0:
        return md, tokens

    def pad(a, fill):
        return jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)

    md = AttnMetadata(positions=pad(md.positions, 0), positions_h=pad(md.positions_h, 0),
                      positions_w=pad(md.positions_w, 0), slots=pad(md.slots, -1), seq_lens=pad(md.seq_lens, 0),
                      block_tables=pad(md.block_tables, 0), ssm_slots=pad(md.ssm_slots, -1),
                      seq_slot=pad(md.seq_slot, -1), moe_row_adapter=pad(md.moe_row_adapter, -1), num_seqs=rows,
                      max_blocks_per_seq=md.max_blocks_per_seq, live_rows=md.live_rows or md.num_seqs)
    return md, pad(tokens, 0)
