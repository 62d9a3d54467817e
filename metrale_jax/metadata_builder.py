"""The one host builder of step inputs: `AttnMetadata`, `BatchedAttnMetadata`, the step's tokens
and `SamplingMetadata`, filled in numpy, padded to the step's bucket, and sent to the device in
one `jax.device_put` per step.

A step has N decode rows (one token each) followed by T prefill tokens from at most B streams
(chunks). Its tokens are `i32[N + T]`: decode rows first, then the chunks in order, then padding.
Sampled rows S = N + B: one per decode row, then one per stream (used when the chunk reaches the
end of its prompt, so the next token is sampled); the rest are padding.

Padding never writes: pad decode rows have slot -1 and seq_len 0, pad prefill tokens slot -1,
pad streams zero tokens and kv_len 0, pad SSM slots -1, pad penalty rows -1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata
from metrale_jax.sampling import (
    F_FILTER,
    F_LOGPROBS,
    F_PENALTY,
    F_RANDOM,
    SamplingMetadata,
    SamplingParams,
    seed_words,
)


@dataclass(frozen=True)
class StepBucket:
    """A compiled step's static shape. kind: "decode" (pmd None), "prefill" (dmd None), "mixed",
    or "verify" (speculative decoding: N rows of 1 + num_spec tokens, engine/spec_decode.py)."""

    kind: str
    num_seqs: int = 0  # N decode rows
    num_tokens: int = 0  # T prefill tokens
    num_streams: int = 0  # B prefill streams
    num_spec: int = 0  # k: drafts per verify row

    def __post_init__(self) -> None:
        if self.kind not in ("decode", "prefill", "mixed", "verify"):
            raise ValueError(f"unknown step kind {self.kind!r}")
        if self.kind == "verify":
            if self.num_seqs < 1 or self.num_spec < 1 or self.num_tokens or self.num_streams:
                raise ValueError(f"verify bucket needs num_seqs, num_spec >= 1 only: {self}")
            return
        if self.num_spec:
            raise ValueError(f"only verify buckets have num_spec: {self}")
        if self.kind != "prefill" and self.num_seqs < 1:
            raise ValueError(f"{self.kind} bucket needs num_seqs >= 1, got {self.num_seqs}")
        if self.kind != "decode" and (self.num_tokens < 1 or self.num_streams < 1):
            raise ValueError(f"{self.kind} bucket needs num_tokens, num_streams >= 1: {self}")
        if self.kind == "decode" and (self.num_tokens or self.num_streams):
            raise ValueError(f"decode bucket has no prefill part: {self}")
        if self.kind == "prefill" and self.num_seqs:
            raise ValueError(f"prefill bucket has no decode rows: {self}")

    @property
    def total_tokens(self) -> int:
        return self.num_seqs * (1 + self.num_spec) + self.num_tokens

    @property
    def num_sample_rows(self) -> int:
        return self.num_seqs * (1 + self.num_spec) + self.num_streams

    def __str__(self) -> str:
        if self.kind == "verify":
            return f"verify(N={self.num_seqs}, k={self.num_spec})"
        return f"{self.kind}(N={self.num_seqs}, T={self.num_tokens}, B={self.num_streams})"


@dataclass(frozen=True)
class BuilderConfig:
    """Static sizes shared by every bucket."""

    block_size: int
    max_blocks_per_seq: int
    vocab_size: int
    max_suppress_ids: int = 16  # M: ids whose logits a row changes (logit_bias, eos + stop ids under min_tokens)
    max_prompt_lp_tokens: int = 128  # prompt-logprob rows of a prefill / mixed step: min(T, this)
    mtp: bool = False  # an MTP drafter runs in the steps: fill `SamplingMetadata.mtp_next`


@dataclass
class RowSampling:
    """How one row is sampled (host form of a `SamplingMetadata` row)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    pen_row: int = -1  # PenaltyState row; -1 = none
    seed: tuple[int, int, int] = (0, 0, 0)  # seed_words(seed, sequence index)
    out_index: int = 0  # index of the sampled token among the sequence's outputs
    suppress_ids: Sequence[int] = ()  # never sampled (min_tokens' stop ids)
    bias: Sequence[tuple[int, float]] = ()  # (token id, bias) added to the logits (logit_bias)
    logprobs: bool = False
    grammar: bool = False  # structured output: its logprobs see its mask (`SamplingMetadata.mask_logprobs`)

    @staticmethod
    def from_params(
        sp: SamplingParams, *, seed: int, seq_index: int, out_index: int, pen_row: int = -1,
        suppress_ids: Sequence[int] = (),
    ) -> RowSampling:
        return RowSampling(
            temperature=float(sp.temperature), top_k=sp.top_k_or_off, top_p=float(sp.top_p),
            min_p=float(sp.min_p), repetition_penalty=float(sp.repetition_penalty),
            presence_penalty=float(sp.presence_penalty), frequency_penalty=float(sp.frequency_penalty),
            pen_row=pen_row if sp.has_penalties else -1, seed=seed_words(seed, seq_index),
            out_index=out_index, suppress_ids=tuple(suppress_ids), bias=sp.additive_bias,
            logprobs=sp.logprobs is not None, grammar=sp.structured_outputs is not None,
        )

    def logit_changes(self, suppress_ids: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
        """The row's `suppress_ids` / `suppress_bias` entries: the bias, then the suppressed ids
        (`suppress_ids`, default the row's own)."""
        sup = list(self.suppress_ids if suppress_ids is None else suppress_ids)
        return [t for t, _ in self.bias] + sup, [b for _, b in self.bias] + [-np.inf] * len(sup)


@dataclass
class DecodeRow:
    """One sequence's next token: `token` at `position`, cached in `block_table`."""

    token: int
    position: int
    block_table: Sequence[int]
    sampling: RowSampling
    ssm_slot: int = -1
    token_is_output: bool = True  # for the penalty table (a decode input is a generated token)
    src_row: int = -1  # >= 0: the token is the previous step's sample in this row (not yet on the host)
    lora_slot: int = -1  # LoRA adapter slot (AttnMetadata.seq_slot); -1 = base model
    moe_lora_slot: int = -1  # the slot when the adapter trains MoE experts (moe_row_adapter), else -1


@dataclass
class PrefillChunk:
    """`tokens` at positions start .. start+len-1 of one stream.

    `sampling` is set when the chunk ends the known tokens, so the next token is sampled.
    `prompt_lp_targets[i]` is the token whose prompt logprob position i predicts (-1 = none).
    `num_output_tokens` of the chunk's tokens, counted from its end, are generated tokens being
    recomputed after a preemption (they count as outputs for the frequency penalty).
    `reset_penalty_row`: clear `sampling.pen_row`'s counts first (the stream starts from 0).
    """

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    sampling: RowSampling | None = None
    pen_row: int = -1
    ssm_slot: int = -1
    prompt_lp_targets: Sequence[int] | None = None
    num_output_tokens: int = 0
    reset_penalty_row: bool = False
    lora_slot: int = -1  # as DecodeRow's, for every token of the chunk
    moe_lora_slot: int = -1
    next_token: int = -1  # the known token after the chunk (one that does not sample; MTP drafter)


@dataclass
class StepInputs:
    """A step's inputs (numpy until `to_device`). dmd is None for prefill, pmd None for decode."""

    bucket: StepBucket
    dmd: AttnMetadata | None
    pmd: BatchedAttnMetadata | None
    tokens: np.ndarray  # i32[N + T]
    smd: SamplingMetadata
    sample_rows: list[int] = field(default_factory=list)  # sampled rows in use, in input order

    def to_device(self) -> tuple:
        """One host->device transfer of (dmd, pmd, tokens, smd)."""
        return jax.device_put((self.dmd, self.pmd, self.tokens, self.smd))


def _slot(block_table: Sequence[int], pos: int, bs: int) -> int:
    return int(block_table[pos // bs]) * bs + pos % bs


def build_step(
    cfg: BuilderConfig, bucket: StepBucket, rows: Sequence[DecodeRow], chunks: Sequence[PrefillChunk]
) -> StepInputs:
    """Fill one step's inputs in numpy, padded to `bucket` (a verify bucket takes
    `engine.spec_decode.VerifyRow`s as `rows`)."""
    if bucket.kind == "verify":
        from metrale_jax.engine.spec_decode import build_verify_step

        if chunks:
            raise ValueError("a verify step has no prefill chunks")
        return build_verify_step(cfg, bucket, rows)
    n, t, b = bucket.num_seqs, bucket.num_tokens, bucket.num_streams
    bs, mb = cfg.block_size, cfg.max_blocks_per_seq
    if len(rows) > n:
        raise ValueError(f"{len(rows)} decode rows do not fit bucket {bucket}")
    if len(chunks) > b:
        raise ValueError(f"{len(chunks)} prefill streams do not fit bucket {bucket}")
    nt = sum(len(c.tokens) for c in chunks)
    if nt > t:
        raise ValueError(f"{nt} prefill tokens do not fit bucket {bucket}")
    s = n + b
    tokens = np.zeros(n + t, np.int32)
    tok_pen_rows = np.full(n + t, -1, np.int32)
    tok_is_output = np.zeros(n + t, np.bool_)
    token_src = np.full(n + t, -1, np.int32)
    # MTP drafter: the token after each input token (a decode row's is its sample, row i)
    mtp_next = -1 - np.arange(n + t, dtype=np.int32) if cfg.mtp else None

    dmd = None
    if bucket.kind != "prefill":
        pos = np.zeros(n, np.int32)
        slots = np.full(n, -1, np.int32)
        seq_lens = np.zeros(n, np.int32)
        bt = np.zeros((n, mb), np.int32)
        ssm = np.full(n, -1, np.int32)
        lslot = np.full(n, -1, np.int32)
        mslot = np.full(n, -1, np.int32)
        for i, r in enumerate(rows):
            if len(r.block_table) > mb:
                raise ValueError(f"block table of {len(r.block_table)} blocks exceeds {mb}")
            tokens[i] = r.token
            pos[i] = r.position
            slots[i] = _slot(r.block_table, r.position, bs)
            seq_lens[i] = r.position + 1
            bt[i, : len(r.block_table)] = r.block_table
            ssm[i] = r.ssm_slot
            tok_pen_rows[i] = r.sampling.pen_row
            tok_is_output[i] = r.token_is_output
            token_src[i] = r.src_row
            lslot[i], mslot[i] = r.lora_slot, r.moe_lora_slot
        dmd = AttnMetadata(
            positions=pos, positions_h=pos, positions_w=pos, slots=slots, seq_lens=seq_lens,
            block_tables=bt, ssm_slots=ssm, seq_slot=lslot, moe_row_adapter=mslot,
            num_seqs=n, max_blocks_per_seq=mb,
        )

    pmd = None
    nplp = min(t, cfg.max_prompt_lp_tokens)
    prompt_lp_rows = np.zeros(nplp, np.int32)
    prompt_lp_targets = np.full(nplp, -1, np.int32)
    j_plp = 0
    reset_rows = np.full(b, -1, np.int32)
    last_token_row = []
    if bucket.kind != "decode":
        pos = np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        bt = np.zeros((b, mb), np.int32)
        cu = np.zeros(b + 1, np.int32)
        kv_lens = np.zeros(b, np.int32)
        ssm = np.full(b, -1, np.int32)
        lslot = np.full(b, -1, np.int32)
        mslot = np.full(b, -1, np.int32)
        o = 0
        for j, c in enumerate(chunks):
            L = len(c.tokens)
            if L < 1:
                raise ValueError("a prefill chunk needs at least one token")
            if len(c.block_table) > mb:
                raise ValueError(f"block table of {len(c.block_table)} blocks exceeds {mb}")
            p = np.arange(c.start, c.start + L, dtype=np.int32)
            btab = np.asarray(c.block_table, np.int32)
            pos[o : o + L] = p
            slots[o : o + L] = btab[p // bs] * bs + p % bs
            tokens[n + o : n + o + L] = c.tokens
            tok_pen_rows[n + o : n + o + L] = c.pen_row
            if c.num_output_tokens:
                tok_is_output[n + o + L - c.num_output_tokens : n + o + L] = True
            if c.prompt_lp_targets is not None:  # compacted: one row per position with a target
                tg = np.asarray(c.prompt_lp_targets)
                at = np.flatnonzero(tg >= 0)
                if j_plp + len(at) > nplp:
                    raise ValueError(f"more than {nplp} prompt-logprob tokens in bucket {bucket} "
                                     f"(max_prompt_lp_tokens={cfg.max_prompt_lp_tokens})")
                prompt_lp_rows[j_plp : j_plp + len(at)] = o + at
                prompt_lp_targets[j_plp : j_plp + len(at)] = tg[at]
                j_plp += len(at)
            if c.reset_penalty_row:
                reset_rows[j] = c.pen_row
            bt[j, : len(btab)] = btab
            kv_lens[j] = c.start + L
            ssm[j] = c.ssm_slot
            lslot[j], mslot[j] = c.lora_slot, c.moe_lora_slot
            if mtp_next is not None:  # the chunk's next tokens, then the one after it or its sample
                mtp_next[n + o: n + o + L - 1] = c.tokens[1:]
                mtp_next[n + o + L - 1] = -1 - (n + j) if c.sampling else max(c.next_token, 0)
            o += L
            cu[j + 1] = o
            last_token_row.append(n + o - 1)
        cu[len(chunks) + 1 :] = o
        pmd = BatchedAttnMetadata(
            positions=pos, positions_h=pos, positions_w=pos, slots=slots, block_tables=bt,
            cu_seqlens=cu, kv_lens=kv_lens, ssm_slots=ssm, seq_slot=lslot, moe_row_adapter=mslot,
            num_tokens=t, num_streams=b, max_blocks_per_seq=mb,
        )

    # sampled rows: decode rows 0..len(rows)-1, then stream j at row n + j
    samp: list[tuple[int, int, RowSampling]] = [(i, i, r.sampling) for i, r in enumerate(rows)]
    samp += [(n + j, last_token_row[j], c.sampling) for j, c in enumerate(chunks) if c.sampling]
    smd = _sampling_metadata(cfg, s, samp, tok_pen_rows, tok_is_output, reset_rows, prompt_lp_rows,
                             prompt_lp_targets, token_src)
    if mtp_next is not None:
        mtp_next[n + nt:] = 0  # padding tokens
        smd = dataclasses.replace(smd, mtp_next=mtp_next)
    return StepInputs(bucket, dmd, pmd, tokens, smd, [r for r, _, _ in samp])


def _sampling_metadata(
    cfg: BuilderConfig, s: int, samp: list[tuple[int, int, RowSampling]], tok_pen_rows: np.ndarray,
    tok_is_output: np.ndarray, reset_rows: np.ndarray, prompt_lp_rows: np.ndarray, prompt_lp_targets: np.ndarray,
    token_src: np.ndarray | None = None,
) -> SamplingMetadata:
    m = cfg.max_suppress_ids
    li = np.zeros(s, np.int32)
    temp = np.zeros(s, np.float32)
    top_k = np.zeros(s, np.int32)
    top_p = np.ones(s, np.float32)
    min_p = np.zeros(s, np.float32)
    rep = np.ones(s, np.float32)
    pres = np.zeros(s, np.float32)
    freq = np.zeros(s, np.float32)
    pen = np.full(s, -1, np.int32)
    seeds = np.zeros((s, 3), np.uint32)
    out_index = np.zeros(s, np.int32)
    sup = np.full((s, m), -1, np.int32)
    supb = np.zeros((s, m), np.float32)
    flags = np.zeros(4, np.bool_)
    lpm = np.zeros(s, np.bool_)
    if samp:  # column by column (the host loop's hot path at large batches)
        idx = np.fromiter((r for r, _, _ in samp), np.int64, len(samp))
        rss = [rs for _, _, rs in samp]
        li[idx] = [h for _, h, _ in samp]
        for arr, name in ((temp, "temperature"), (top_k, "top_k"), (top_p, "top_p"), (min_p, "min_p"),
                          (rep, "repetition_penalty"), (pres, "presence_penalty"), (freq, "frequency_penalty"),
                          (pen, "pen_row"), (seeds, "seed"), (out_index, "out_index"), (lpm, "grammar")):
            arr[idx] = [getattr(rs, name) for rs in rss]
        top_k[(top_k < 0) | (top_k >= cfg.vocab_size)] = 0
        for row, rs in zip(idx, rss):
            if rs.suppress_ids or rs.bias:
                ids, vals = rs.logit_changes()
                if len(ids) > m:
                    raise ValueError(f"{len(ids)} suppressed / biased ids exceed max_suppress_ids={m}")
                sup[row, : len(ids)] = ids
                supb[row, : len(ids)] = vals
        flags[F_PENALTY] = bool(np.any(pen[idx] >= 0))
        flags[F_RANDOM] = bool(np.any(temp[idx] > 0))
        flags[F_FILTER] = bool(np.any((temp[idx] > 0) & ((top_k[idx] > 0) | (top_p[idx] < 1.0))))
        flags[F_LOGPROBS] = any(rs.logprobs for rs in rss)
    return SamplingMetadata(
        logits_indices=li, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, pen_rows=pen,
        seeds=seeds, out_index=out_index, suppress_ids=sup, suppress_bias=supb, flags=flags, tok_pen_rows=tok_pen_rows,
        tok_is_output=tok_is_output, reset_rows=reset_rows, prompt_lp_rows=prompt_lp_rows,
        prompt_lp_targets=prompt_lp_targets,
        token_src=np.full(tok_pen_rows.shape, -1, np.int32) if token_src is None else token_src,
        mask_logprobs=lpm,
    )


def sampling_only(
    cfg: BuilderConfig, rows: Sequence[RowSampling], num_rows: int | None = None
) -> SamplingMetadata:
    """SamplingMetadata for rows 0..len(rows)-1 of a bare logits matrix (no step around it):
    for tests, examples and custom sampling loops."""
    s = num_rows if num_rows is not None else len(rows)
    samp = [(i, i, r) for i, r in enumerate(rows)]
    z = np.full(0, -1, np.int32)
    return _sampling_metadata(cfg, s, samp, z, z.astype(np.bool_), z, z, z)


def abstract_step_inputs(cfg: BuilderConfig, bucket: StepBucket) -> tuple:
    """ShapeDtypeStructs of (dmd, pmd, tokens, smd) for `bucket`, for ahead-of-time lowering."""
    inp = build_step(cfg, bucket, [], [])
    tree = (inp.dmd, inp.pmd, inp.tokens, inp.smd)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


# ---- packing: one transfer per step -------------------------------------------------------------
@dataclass(frozen=True)
class PackedLayout:
    """Where each leaf of (dmd, pmd, tokens, smd) sits in the step's two flat buffers.

    entries: one (buffer "i" | "f", offset, shape, dtype name) per leaf, in flatten order; ints,
    bools and u32 travel in the i32 buffer (bit-cast), floats in the f32 buffer. Hashable: it is
    a static argument of the packed step.
    """

    treedef: object
    entries: tuple[tuple[str, int, tuple[int, ...], str], ...]
    num_i32: int
    num_f32: int


# Every leaf starts on a 256-byte boundary of its buffer. Inside the step a leaf is a slice of
# the packed parameter, and XLA may hand such a slice to a custom call as a sub-buffer without a
# copy: the Mosaic GPU prefill kernel rejects operands that are not 256-byte aligned ("Input buffer
# 2 is not 256-byte aligned": the block tables of a mixed step, H200, 2026-12-01).
ALIGN = 64  # elements of 4 bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(tree) -> PackedLayout:
    leaves, treedef = jax.tree.flatten(tree)
    entries, oi, of = [], 0, 0
    for leaf in leaves:
        a = np.asarray(leaf)
        n = int(a.size)
        if a.dtype == np.float32:
            entries.append(("f", of, tuple(a.shape), "float32"))
            of = _aligned(of + n)
        else:
            entries.append(("i", oi, tuple(a.shape), a.dtype.name))
            oi = _aligned(oi + n)
    return PackedLayout(treedef, tuple(entries), max(oi, ALIGN), max(of, ALIGN))


_LAYOUTS: dict = {}


def packed_layout(cfg: BuilderConfig, bucket: StepBucket) -> PackedLayout:
    key = (cfg, bucket)
    if key not in _LAYOUTS:
        inp = build_step(cfg, bucket, [], [])
        _LAYOUTS[key] = _layout((inp.dmd, inp.pmd, inp.tokens, inp.smd))
    return _LAYOUTS[key]


def pack(cfg: BuilderConfig, inputs: StepInputs) -> tuple[PackedLayout, np.ndarray, np.ndarray]:
    """Flatten a step's inputs into (layout, i32[num_i32], f32[num_f32])."""
    layout = packed_layout(cfg, inputs.bucket)
    leaves = jax.tree.leaves((inputs.dmd, inputs.pmd, inputs.tokens, inputs.smd))
    ibuf = np.zeros(layout.num_i32, np.int32)
    fbuf = np.zeros(layout.num_f32, np.float32)
    for leaf, (buf, off, _, dt) in zip(leaves, layout.entries):
        a = np.asarray(leaf).reshape(-1)
        if buf == "f":
            fbuf[off : off + a.size] = a
        elif dt == "uint32":
            ibuf[off : off + a.size] = a.view(np.int32)
        else:
            ibuf[off : off + a.size] = a
    return layout, ibuf, fbuf


def unpack(layout: PackedLayout, ibuf, fbuf):
    """Inverse of `pack`, on the device (inside the jitted step): -> (dmd, pmd, tokens, smd)."""
    import jax.numpy as jnp

    leaves = []
    for buf, off, shape, dt in layout.entries:
        n = int(np.prod(shape, dtype=np.int64))
        src = fbuf if buf == "f" else ibuf
        a = src[off : off + n].reshape(shape)
        if dt == "bool":
            a = a != 0
        elif dt == "uint32":
            a = jax.lax.bitcast_convert_type(a, jnp.uint32)
        leaves.append(a)
    return jax.tree.unflatten(layout.treedef, leaves)
