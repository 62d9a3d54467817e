"""Speculative decoding: the config, the n-gram (prompt lookup) drafter, the verify step's inputs
and the verify step itself.

A verify step replaces the decode step when `EngineConfig.speculative_config` is set. Each of its
N rows carries 1 + k_r tokens, k_r <= k (k = num_speculative_tokens): the row's last sampled token
t0 at position p, then the drafts d1..d_k_r at p+1..p+k_r. The rows are the streams of a ragged
prefill layout (`BatchedAttnMetadata` with `verify_width` W = 1 + k, T = N * W tokens), so the
paged attention is the prefill path's and the K/V of every window position is written; recurrent
layers keep the state after every position in the step's scratch (`layers/spec_states.py`).

Sampling: the target distribution of every window position is sampled with the ordinary sampler
(`sampling.sample`: penalties, min_tokens suppression, temperature, min_p, top-k / top-p through
`filter_logits`, the row's seed and output index), sampled row r * W + j. Row r accepts drafts
while the sample of position j equals d_{j+1}; it emits the samples of positions 0..a_r (the
accepted drafts, then the bonus / correction token). For greedy rows that is the usual rule
(accept while draft == argmax, plus one bonus token). For random rows it IS the standard
speculative-sampling rule with a one-hot draft distribution q (the n-gram and argmax-MTP drafters
are deterministic): accepting d with probability min(1, p(d) / q(d)) = p(d) and, on rejection,
drawing from the normalized residual max(p - q, 0) = p without d, gives the same law as drawing
x ~ p and accepting iff x == d (then P(accept) = p(d) and x | x != d ~ p without d, normalized).
So the output distribution is exactly the target's. A discarded position's noise (same seed and
output index as the next step's first position) was never observed, so reusing it is harmless.

Penalties: a row's window position j sees the penalty counts of the table plus its drafts
d1..dj (an expanded per-position penalty table); after acceptance the table counts t0 and the
accepted drafts only.

Write-on-accept: the accepted count a_r is computed inside the step, which copies the state of
position a_r of every recurrent layer into the sequence's slot. K/V of rejected positions lies
past the sequence's new length (p + 1 + a_r) and is overwritten by the next step.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata
from metrale_jax.sampling import and_token_masks, bad_word_bans, ban_tokens

SPEC_METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 2, "prompt_lookup_max": 4}`, or `{"method": "mtp", ...}` (the model's
    multi-token-prediction head drafts; the prompt_lookup keys are then unused)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # shortest suffix n-gram the n-gram drafter looks up
    prompt_lookup_max: int = 4  # longest (tried first)
    # no drafts while at least this many sequences run (vLLM's key): a verify step of B rows costs
    # more than a decode step (Llama-3-8B, H200: 1.09x at B = 1, 1.54x at B = 64), so at large
    # batches it only pays when most rows' drafts are right; None = always draft
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method.endswith("_mtp"):  # vLLM's older per-model names (qwen3_next_mtp, deepseek_mtp...)
            object.__setattr__(self, "method", "mtp")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} must be one of {SPEC_METHODS}")
        if not 1 <= int(self.num_speculative_tokens) <= 32:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min={self.prompt_lookup_min} <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and int(self.disable_by_batch_size) < 1:
            raise ValueError(f"disable_by_batch_size={self.disable_by_batch_size} must be >= 1 (or None)")

    @staticmethod
    def of(value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict (vLLM's keys) or its JSON text -> SpeculativeConfig | None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        bad = sorted(set(value) - known)
        if bad:
            raise ValueError(f"unknown speculative_config keys {bad}; known: {sorted(known)}")
        return SpeculativeConfig(**value)


# ---- the n-gram drafter (host) --------------------------------------------------------------------
def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, nmin: int, nmax: int) -> list[int]:
    """Prompt lookup: the longest suffix n-gram (n from nmax down to nmin) that occurs earlier in
    `tokens`; returns up to k tokens that followed its latest earlier occurrence ([] if none)."""
    if k <= 0:
        return []
    a = np.asarray(tokens, np.int64)
    n_tok = a.shape[0]
    for n in range(min(nmax, n_tok - 1), nmin - 1, -1):
        pat = a[n_tok - n:]
        # windows starting at 0..n_tok-n-1 (an occurrence before the suffix itself)
        win = np.lib.stride_tricks.sliding_window_view(a[: n_tok - 1], n)
        hits = np.flatnonzero((win == pat).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start: start + k].tolist()
    return []


class NgramIndex:
    """Incremental prompt lookup over one sequence's growing tokens, with `ngram_propose`'s answers:
    for each n in [nmin, nmax], the latest start of every n-gram followed by at least one token.
    Each step adds the new windows (O(new tokens x n's)) instead of rescanning the sequence."""

    def __init__(self, nmin: int, nmax: int):
        self.nmin, self.nmax = nmin, nmax
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in range(nmin, nmax + 1)}
        self.next_start = dict.fromkeys(self.latest, 0)

    def propose(self, tokens: Sequence[int], k: int, extend: bool = False) -> list[int]:
        """Up to k tokens after `tokens`; `extend`: always k when a match is found, repeating
        the tokens that followed it (the sequence taken as periodic from there on)."""
        n_tok = len(tokens)
        for n, table in self.latest.items():  # windows starting at next_start .. n_tok-1-n
            for s in range(self.next_start[n], n_tok - n):
                table[tuple(tokens[s: s + n])] = s
            self.next_start[n] = max(self.next_start[n], n_tok - n)
        if k <= 0:
            return []
        for n in range(min(self.nmax, n_tok - 1), self.nmin - 1, -1):
            s = self.latest[n].get(tuple(tokens[n_tok - n:]))
            if s is not None:
                out = list(tokens[s + n: s + n + k])
                period = n_tok - s - n  # = len(out) when it ran to the end of `tokens`
                while extend and len(out) < k:
                    out.append(out[-period])
                return out
        return []


_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> NgramIndex


def allowed_prefix(mask: np.ndarray, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` whose tokens the packed mask i32[W] allows."""
    for i, t in enumerate(drafts):
        if not (int(mask[t >> 5]) >> (t & 31)) & 1:
            return list(drafts[:i])
    return list(drafts)


def draft_tokens(seq, k: int, spec: SpeculativeConfig) -> list[int]:
    """Up to k drafts for `seq` (a scheduler Sequence) after its last token: the MTP head's, which
    the last step returned for this very length of the sequence (none otherwise: then the row
    takes a plain decode step that drafts), or the n-gram drafter's, with an index kept per
    sequence (tests and benches swap this function for other drafters)."""
    if spec.method == "mtp":
        length, drafts = seq.mtp_drafts
        if length != len(seq.token_ids):
            return []
        # up to the first -1 (a prefill's stream drafts one token)
        return [int(d) for d in itertools.takewhile(lambda d: d >= 0, drafts[:k])]
    return _index(seq, spec).propose(seq.token_ids, k)


def _index(seq, spec: SpeculativeConfig) -> NgramIndex:
    """`seq`'s n-gram index (made on first use)."""
    idx = _INDEXES.get(seq)
    if idx is None:
        idx = _INDEXES[seq] = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return idx


def drafts_after(cont: Sequence[int], inflight_drafts: Sequence[int], k: int) -> list[int]:
    """Given `cont`, the tokens predicted after a row's last known token, and the drafts of its
    step in flight (window [that token, `inflight_drafts`]): that step accepts the drafts `cont`
    agrees with and emits `cont`'s next token; -> up to k drafts after that."""
    a = 0
    while a < len(inflight_drafts) and a < len(cont) and cont[a] == inflight_drafts[a]:
        a += 1
    return list(cont[a + 1: a + 1 + k])


def draft_past_inflight(seq, inflight_drafts: Sequence[int], k: int, spec: SpeculativeConfig) -> list[int]:
    """Up to k n-gram drafts for a row whose last step is still on the device (overlapped verify
    steps): that step's window is [the last known token, `inflight_drafts`] and its outcome is
    unknown, so the n-gram continuation of the known tokens stands in for it: the in-flight step
    is predicted to accept the drafts that agree with the continuation and to emit the
    continuation's next token, and the drafts are the continuation after that. Any drafts are
    correct (verification keeps the target distribution); these are right when the sequence goes
    on repeating itself."""
    cont = _index(seq, spec).propose(seq.token_ids, len(inflight_drafts) + 1 + k, extend=True)
    return drafts_after(cont, inflight_drafts, k)


# ---- the verify step's inputs (host) --------------------------------------------------------------
@dataclass
class VerifyRow:
    """One sequence's window: `tokens` = [t0, d1..d_k_r] at positions `position`.. in `block_table`.
    `sampling` is the row's RowSampling for position 0 (out_index of t0's successor);
    `suppress_until` = min_tokens: positions whose output index is below it suppress `stop_ids`."""

    tokens: Sequence[int]
    position: int
    block_table: Sequence[int]
    sampling: object  # metadata_builder.RowSampling
    ssm_slot: int = -1
    suppress_until: int = 0
    stop_ids: Sequence[int] = ()
    lora_slot: int = -1  # as DecodeRow's (set by the LoRA manager's assign_slots)
    moe_lora_slot: int = -1
    # the sampled row, in the step in flight, of this row's last token (overlapped verify steps):
    # t0 and the window's shift come from the device (`advance_windows`); -1 = t0 is tokens[0]
    src_row: int = -1


_PER_SAMPLED_ROW = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "pen_rows", "seeds", "out_index", "mask_logprobs")


def build_verify_step(cfg, bucket, rows: Sequence[VerifyRow]):
    """A verify step's inputs (numpy), padded to `bucket` (kind "verify", N rows, k drafts):
    pmd with N streams and T = N * (1 + k) tokens; sampled row r * (1 + k) + j = row r's position j.
    Built column by column (a synchronous step: the device waits for this)."""
    from metrale_jax.metadata_builder import StepInputs, _sampling_metadata

    n, w = bucket.num_seqs, bucket.num_spec + 1
    t = n * w
    bs, mb = cfg.block_size, cfg.max_blocks_per_seq
    nr = len(rows)
    if nr > n:
        raise ValueError(f"{nr} verify rows do not fit bucket {bucket}")
    lens = np.fromiter((len(r.tokens) for r in rows), np.int32, nr)
    start = np.fromiter((r.position for r in rows), np.int32, nr)
    nblk = np.fromiter((len(r.block_table) for r in rows), np.int32, nr)
    if nr and not (1 <= lens.min() and lens.max() <= w):
        raise ValueError(f"a verify row carries 1..{w} tokens, got {lens.min() if lens.min() < 1 else lens.max()}")
    if nr and nblk.max() > mb:
        raise ValueError(f"block table of {nblk.max()} blocks exceeds {mb}")
    if np.any(nblk * bs < start + lens):
        raise ValueError("a verify row's block table does not cover its window")
    bt = np.zeros((n, mb), np.int32)
    for r, row in enumerate(rows):
        bt[r, : nblk[r]] = row.block_table
    cu = np.zeros(n + 1, np.int32)
    cu[1: nr + 1] = np.cumsum(lens)
    o = int(cu[nr])
    cu[nr + 1:] = o
    tok_row = np.repeat(np.arange(nr), lens)  # i32[o] the row of each real token
    j = np.arange(o, dtype=np.int32) - cu[tok_row]  # its place in the row's window
    tokens = np.zeros(t, np.int32)
    pos = np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    tokens[:o] = [x for row in rows for x in row.tokens]
    pos[:o] = start[tok_row] + j
    slots[:o] = bt[tok_row, pos[:o] // bs] * bs + pos[:o] % bs

    def col(name, fill):
        a = np.full(n, fill, np.int32)
        a[:nr] = np.fromiter((getattr(r, name) for r in rows), np.int32, nr)
        return a

    kv_lens = np.zeros(n, np.int32)
    kv_lens[:nr] = start + lens
    # sampling: every real token's position is sampled (row r * W + j), with its row's parameters
    # (built once per row, then spread over the positions) and output index + j
    first = cu[:nr]
    tok_pen_rows = np.full(t, -1, np.int32)
    tok_pen_rows[first] = [r.sampling.pen_row for r in rows]  # t0 counts now; accepted drafts in the step
    tok_is_output = np.zeros(t, np.bool_)
    tok_is_output[first] = True
    z = np.zeros(0, np.int32)
    per_row = _sampling_metadata(cfg, nr, [(r, 0, row.sampling) for r, row in enumerate(rows)], z, z.astype(bool),
                                 z, z, z)
    smd = _sampling_metadata(cfg, n * w, [], tok_pen_rows, tok_is_output, np.full(n, -1, np.int32), z, z)
    sidx = tok_row * w + j
    for name in _PER_SAMPLED_ROW:
        getattr(smd, name)[sidx] = getattr(per_row, name)[tok_row]
    smd.logits_indices[sidx] = np.arange(o)
    smd.token_src[first] = [row.src_row for row in rows]
    smd.out_index[sidx] += j
    smd.flags[:] = per_row.flags
    # every position: the row's logit_bias; min_tokens: the stop ids too while the position's output
    # index is below it
    smd.suppress_ids[sidx] = -1
    smd.suppress_bias[sidx] = 0.0
    for r, row in enumerate(rows):
        ids, vals = row.sampling.logit_changes(row.stop_ids)
        if len(ids) > smd.suppress_ids.shape[1]:
            raise ValueError(f"{len(ids)} suppressed / biased ids exceed max_suppress_ids={cfg.max_suppress_ids}")
        nb = len(row.sampling.bias)
        js = np.arange(lens[r])
        if nb:
            smd.suppress_ids[r * w + js, :nb] = ids[:nb]
            smd.suppress_bias[r * w + js, :nb] = vals[:nb]
        if row.stop_ids:
            live = r * w + js[row.sampling.out_index + js < row.suppress_until]
            smd.suppress_ids[live, nb : len(ids)] = ids[nb:]
            smd.suppress_bias[live, nb : len(ids)] = vals[nb:]
    pmd = BatchedAttnMetadata(
        positions=pos, positions_h=pos, positions_w=pos, slots=slots, block_tables=bt, cu_seqlens=cu,
        kv_lens=kv_lens, ssm_slots=col("ssm_slot", -1), seq_slot=col("lora_slot", -1),
        moe_row_adapter=col("moe_lora_slot", -1), num_tokens=t, num_streams=n, max_blocks_per_seq=mb,
        verify_width=w)
    return StepInputs(bucket, None, pmd, tokens, smd, sidx.tolist())


# ---- the verify step (device) ---------------------------------------------------------------------
def _window_penalties(ps, smd, tok_grid, mask, w: int):
    """Per-position penalty table: sampled row r*W+j sees table row pen_rows[r*W+j] plus the drafts
    of positions 1..j of its window. -> (PenaltyState [S, V], smd with pen_rows = own row or -1)."""
    from metrale_jax.sampling import PenaltyState

    rows = ps.prompt_seen.shape[0]
    if rows == 0:
        return ps, smd
    n = tok_grid.shape[0]
    has = smd.pen_rows >= 0
    r = jnp.clip(smd.pen_rows, 0, rows - 1)
    counts = jnp.where(has[:, None], ps.out_counts[r], 0)  # i32[N * W, V]
    # + the drafts d_i (1 <= i <= j) of position j's window: N * W (W - 1) / 2 scatter-adds
    pj, pi = np.asarray([(j, i) for j in range(w) for i in range(1, j + 1)], np.int32).T
    at = jnp.arange(n, dtype=jnp.int32)[:, None] * w + pj[None, :]  # i32[N, P] the sampled row
    ok = mask[:, pi] & has[at]
    counts = counts.at[jnp.where(ok, at, n * w).reshape(-1), tok_grid[:, pi].reshape(-1)].add(1, mode="drop")
    seen = ps.prompt_seen[r] & has[:, None]
    own = jnp.where(has, jnp.arange(n * w, dtype=jnp.int32), -1)
    return PenaltyState(seen, counts), dataclasses.replace(smd, pen_rows=own)


def accepted_drafts(samples, tokens, md: BatchedAttnMetadata):
    """samples i32[N * W] (row r*W+j: the target's sample at row r's position j), tokens i32[T]
    -> i32[N]: how many leading drafts each row accepts (sample of j == draft at j + 1)."""
    from metrale_jax.layers.spec_states import verify_grid

    w = md.verify_width
    idx, mask = verify_grid(md)
    n = idx.shape[0]
    s = samples.reshape(n, w)
    drafts = tokens[idx]  # [N, W]; column j+1 is the draft checked by the sample of column j
    ok = (s[:, :-1] == drafts[:, 1:]) & mask[:, 1:]
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def advance_windows(pmd: BatchedAttnMetadata, tokens, smd, prev, block_size: int):
    """Overlapped verify steps: a row whose last step is still in flight (`smd.token_src` >= 0 at
    its window's first token: that step's sampled row) takes its first token from `prev`
    (i32[2R], `step._next_tokens`) and moves its whole window by that row's shift (the drafts a
    verify step accepted, which the host has not read): positions, KV slots, KV lengths and the
    output index of each position (seeded sampling). -> (pmd, tokens, smd)."""
    from metrale_jax.layers.spec_states import _scatter_tokens, verify_grid
    from metrale_jax.step import take_prev_tokens

    r = prev.shape[0] // 2
    n, w = pmd.num_streams, pmd.verify_width
    t = tokens.shape[0]
    src = smd.token_src
    tokens = take_prev_tokens(tokens, src, prev)
    cu = pmd.cu_seqlens
    row_src = jnp.where(cu[1:] > cu[:-1], src[jnp.clip(cu[:-1], 0, t - 1)], -1)  # i32[N]
    shift = jnp.where(row_src >= 0, prev[r + jnp.clip(row_src, 0, r - 1)], 0).astype(jnp.int32)  # i32[N]
    idx, mask = verify_grid(pmd)
    rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, w))
    tok_row = _scatter_tokens(rows, idx, mask, t)  # i32[T] (pads: row 0, unused)
    pos = pmd.positions + shift[tok_row]
    mb = pmd.block_tables.shape[1]
    blk = pmd.block_tables[tok_row, jnp.clip(pos // block_size, 0, mb - 1)]
    slots = jnp.where(pmd.slots >= 0, blk * block_size + pos % block_size, -1)
    pmd = dataclasses.replace(pmd, positions=pos, positions_h=pos, positions_w=pos, slots=slots,
                              kv_lens=jnp.where(cu[1:] > cu[:-1], pmd.kv_lens + shift, pmd.kv_lens))
    return pmd, tokens, dataclasses.replace(smd, out_index=smd.out_index + jnp.repeat(shift, w))


def verify_step(params, state, pmd: BatchedAttnMetadata, tokens, smd, *, model, attn, max_logprobs: int,
                num_drafts: int = 0, bitmask=None, prev_tokens=None):
    """One verify step (see the module doc) -> (state, SampleOutput with `spec_accepted` i32[N],
    and with an MTP drafter (num_drafts = k) each row's next drafts i32[N, k], drafted from its
    last accepted position). bitmask i32[N * W, ceil(V / 32)]: structured output's mask of each
    window position (the grammar's state after the drafts before it; -1 = unconstrained), so a
    draft the grammar forbids is never the sample there: rejected. prev_tokens i32[2R]: the
    previous step's `next_tokens`, for rows whose last step is still in flight (`advance_windows`)."""
    from metrale_jax.layers.spec_states import add_scratch, commit, verify_grid
    from metrale_jax.sampling import PenaltyState, SampleOutput, sample, update_penalty_state
    from metrale_jax.step import StepState, count_kernel

    n, w = pmd.num_streams, pmd.verify_width
    if prev_tokens is not None and state.model.block_size:
        pmd, tokens, smd = advance_windows(pmd, tokens, smd, prev_tokens, state.model.block_size)
    pen = update_penalty_state(state.penalties, tokens, smd)  # t0 of each penalized row
    ms = state.model
    if ms.ssm:
        ms = dataclasses.replace(ms, ssm=add_scratch(ms.ssm, n * w))
    ms, hidden = model.forward_paged(params, ms, tokens, None, pmd, attn)
    logits = model.compute_logits(params, hidden[smd.logits_indices])  # f32[N * W, V]
    idx, mask = verify_grid(pmd)
    tok_grid = tokens[idx]
    wps, wsmd = _window_penalties(pen, smd, tok_grid, mask, w)
    tok, lp, rank, top_ids, top_lp = sample(logits, wsmd, wps, max_logprobs=max_logprobs, bitmask=bitmask,
                                            branches=attn.sampler_branches, skip=attn.sampler_skip,
                                            count_kernel=count_kernel(attn))
    acc = accepted_drafts(tok, tokens, pmd)
    if ms.ssm:
        ms = dataclasses.replace(ms, ssm=commit(ms.ssm, pmd.ssm_slots, acc, w))
    drafts = None
    if num_drafts:  # the token after window position j is its sample (rejected positions: rewritten later)
        t = tokens.shape[0]
        li = smd.logits_indices
        nxt = jnp.zeros((t,), jnp.int32).at[jnp.where(mask.reshape(-1), li, t)].set(tok, mode="drop")
        last = li[jnp.arange(n) * w + acc]
        rows = (last, pmd.positions[last], pmd.block_tables, mask[:, 0])
        ms, drafts = mtp_draft(params, ms, hidden, nxt, None, pmd, rows, model=model, attn=attn, k=num_drafts)
    rows = pen.prompt_seen.shape[0]
    if rows:  # count the accepted drafts (positions 1..a_r) of penalized rows
        j = jnp.arange(w)[None, :]
        row_pen = smd.pen_rows.reshape(n, w)[:, 0]
        keep = mask & (j >= 1) & (j <= acc[:, None]) & (row_pen[:, None] >= 0)
        r = jnp.where(keep, row_pen[:, None], rows).reshape(-1)
        pen = PenaltyState(pen.prompt_seen, pen.out_counts.at[r, tok_grid.reshape(-1)].add(1, mode="drop"))
    k = max(max_logprobs, 1)
    out = SampleOutput(tok, lp, rank, top_ids, top_lp, jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32),
                       jnp.zeros((0, k), jnp.int32), jnp.zeros((0, k), jnp.float32), spec_accepted=acc,
                       drafts=drafts)
    return StepState(ms, pen), out


# ---- the MTP drafter (device) ----------------------------------------------------------------------
def mtp_draft(params, ms, hidden, tokens_next, dmd, pmd, rows, *, model, attn, k: int, first_only=None):
    """The MTP head (params["mtp"], `models/mtp.py`) inside a step: -> (model state, drafts i32[D + B, k]).

    First over every token of the step (tokens_next i32[N + T]: the token after each one, hidden
    [N + T, H] the target's): that writes the head's K/V of the step's positions to its KV-pool
    layer (the one after the model's own), the context of later drafts, as every step kind does.
    Then, for the D drafting rows `rows` = (last i32[D]: the token whose head output gives the
    first draft, its position i32[D], block tables i32[D, max_blocks], valid bool[D]), the first
    draft is the argmax of the LM head there, and draft j + 1 runs the head once more at position
    + j on draft j and the head's own previous output (vLLM's chaining), as a decode row whose K/V
    goes to that position's slot (the scheduler allocates these k - 1 lookahead positions;
    the next step overwrites them). rows None: no such rows (D = 0).
    first_only = (last i32[B], valid bool[B]): B more rows that draft their first token only, -1
    after it (and everywhere when not valid): a prefill's sampled streams, which have no lookahead
    positions to chain at."""
    fam, cfg = model.family, model.cfg
    layer = model.num_attention_layers
    kv, y = fam.mtp_forward_paged(cfg, params, ms.kv, layer, tokens_next, hidden, dmd, pmd, attn, 0)

    def argmax(x):
        return jnp.argmax(model.compute_logits(params, x), axis=-1).astype(jnp.int32)

    out = []
    if rows is not None:
        last, pos, bt, valid = rows
        d_rows = last.shape[0]
        h = y[last]
        drafts = [argmax(h)]
        bs, mb = kv.block_size, bt.shape[1]
        none = jnp.full((d_rows,), -1, jnp.int32)
        for j in range(1, k):
            q = pos + j
            ok = valid & (q < mb * bs)
            slots = jnp.where(ok, bt[jnp.arange(d_rows), jnp.clip(q // bs, 0, mb - 1)] * bs + q % bs, -1)
            md = AttnMetadata(positions=q, positions_h=q, positions_w=q, slots=slots, seq_lens=jnp.where(ok, q + 1, 0),
                              block_tables=bt, ssm_slots=none, seq_slot=none, moe_row_adapter=none, num_seqs=d_rows,
                              max_blocks_per_seq=mb)
            kv, h = fam.mtp_forward_paged(cfg, params, kv, layer, drafts[-1], h, md, None, attn, j)
            drafts.append(argmax(h))
        out.append(jnp.stack(drafts, axis=1))
    if first_only is not None:
        last, valid = first_only
        out.append(jnp.full((last.shape[0], k), -1, jnp.int32).at[:, 0].set(jnp.where(valid, argmax(y[last]), -1)))
    drafts = jnp.concatenate(out, axis=0) if out else jnp.zeros((0, k), jnp.int32)
    return dataclasses.replace(ms, kv=kv), drafts


def mtp_step_draft(params, ms, hidden, samples, dmd, pmd, smd, *, model, attn, k: int):
    """`mtp_draft` in a decode / mixed / prefill step: the token after each input token is
    `smd.mtp_next` (or a sample); the decode rows draft k tokens, a stream whose chunk samples its
    first one (from its last prompt token and that sample). -> (model state, drafts i32[N + B, k],
    row r the step's sampled row r: decode rows, then the streams)."""
    m = smd.mtp_next
    nxt = jnp.where(m >= 0, m, samples[jnp.clip(-1 - m, 0, samples.shape[0] - 1)])
    n = 0 if dmd is None else dmd.num_seqs
    rows = None if dmd is None else (jnp.arange(n, dtype=jnp.int32), dmd.positions, dmd.block_tables,
                                     dmd.seq_lens > 0)
    first_only = None
    if pmd is not None:
        cu = pmd.cu_seqlens
        j = jnp.arange(pmd.num_streams, dtype=jnp.int32)
        last = n + jnp.maximum(cu[1:] - 1, 0)  # the stream's last token among the step's N + T
        first_only = (last, (cu[1:] > cu[:-1]) & (m[last] == -1 - (n + j)))  # its chunk samples
    return mtp_draft(params, ms, hidden, nxt, dmd, pmd, rows, model=model, attn=attn, k=k, first_only=first_only)


# ---- the engine's side (host) ---------------------------------------------------------------------
def overlaps(engine) -> bool:
    """Whether this engine's verify steps overlap (n-gram drafts, no recurrent state, one
    process): each is dispatched with its rows' first tokens counted as computed, and the next
    step may be scheduled and dispatched before the host reads it, its rows' windows moved on the
    device by what it accepted (`advance_windows`) and their drafts taken past it
    (`draft_past_inflight`). MTP drafts and recurrent states stay synchronous (a prefix-cache
    snapshot of a verified state is taken after its step; MTP lookahead positions)."""
    spec = engine.config.speculative_config
    return (spec is not None and spec.method == "ngram" and not engine.uses_ssm and not engine.num_drafts
            and engine.lockstep is None)


def _needs_host(s) -> bool:
    """Whether a row's next inputs need its last samples on the host: a grammar's masks, bad words
    of several tokens (their bans follow the output) and min_tokens' suppression (by output index)."""
    return s.grammar is not None or bool(s.request.bad_words) or s.num_outputs < s.request.params.min_tokens


def can_overlap(engine) -> bool:
    """Whether the next step may be scheduled while the step in flight runs: only decode rows
    to schedule (nothing waiting, swapped or mid-prefill, so the next step is a decode or verify
    step, whose windows `advance_windows` moves), and no row whose inputs need that step's
    samples on the host (a grammar's masks, min_tokens' suppression)."""
    sch = engine.scheduler
    if sch.waiting or sch.swapped:
        return False
    return not any(_needs_host(s) or s.pending > 1 or s.num_computed < s.prompt_len for s in sch.running)


def bad_word_window_masks(rows, sampled, w: int, vocab_size: int) -> list[tuple[int, np.ndarray]]:
    """(sample row, mask) of each window position where a row's bad words of several tokens ban
    their last token: position j follows the output and the row's first j drafts (the output is
    all on the host: `_needs_host`), so a draft that completes a bad word is rejected there."""
    out = []
    for r, s, _ in sampled:
        if not s.request.bad_words:
            continue
        hist = s.token_ids[s.prompt_len:]
        drafts = rows[r].tokens[1:]
        for j in range(len(drafts) + 1):
            ban = bad_word_bans(s.request.bad_words, [*hist, *drafts[:j]])
            if ban:
                out.append((r * w + j, ban_tokens(None, ban, vocab_size)))
    return out


def dispatch_verify(engine, sched):
    """Build and run a verify step for `sched.decode` (no prefill chunks); -> the engine's _InFlight,
    or None for a plain decode step: when no row has drafts (1 token per row instead of 1 + k) and
    none has a verify step in flight, or, without overlap (`overlaps`), when a row's last token is
    still in flight (`sync_for_drafts` let the previous step overlap).
    A row that follows a grammar (structured output) drafts the tokens its grammar forces, if any
    (jump-forward), else only what its grammar accepts, and each of its window positions is masked
    by the grammar's state after the drafts before it.

    Without overlap, `Scheduler.complete` (which counts the computed tokens and, with prefix
    caching, registers the filled blocks and picks the SSM snapshots to take) runs in
    `finish_verify`, once the accepted counts are known: a snapshot is then only ever taken of a
    verified state at a block boundary. With overlap it runs here for each row's first token (as
    for a decode step); the accepted drafts are counted when read."""
    overlap = engine._spec_overlap  # (`overlaps`)
    if any(s.inflight for s in sched.decode) and (not overlap or any(map(_needs_host, sched.decode))):
        return None  # (a row whose last token is still on the device cannot draft after it)
    from metrale_jax.engine.compile import _ceil_bucket
    from metrale_jax.engine.engine import _InFlight
    from metrale_jax.metadata_builder import StepBucket, pack
    from metrale_jax.parallel import local

    spec = engine.config.speculative_config
    prev = engine._inflight
    prev_drafts = (prev.row_drafts or {}) if prev is not None else {}
    rows, sampled = [], []
    for s in sched.decode:
        if s.inflight:  # its last token (and with a verify step, its length) is still on the device
            drafts = draft_past_inflight(s, prev_drafts.get(s.seq_id, ()), s.spec_len, spec) if s.spec_len else []
            t0, src = 0, s.inflight_row
        else:
            drafts = draft_tokens(s, s.spec_len, spec) if s.spec_len else []
            t0, src = s.token_ids[-1], -1
        if s.grammar is not None:  # what the grammar forces first (jump-forward), then what it accepts
            drafts = engine._grammars.forced_drafts(s.grammar, drafts, s.spec_len)
        if s.request.token_mask is not None:  # (allowed_token_ids / logit_bias: drafts it allows)
            drafts = allowed_prefix(s.request.token_mask, drafts)
        p = s.request.params
        rows.append(VerifyRow(tokens=[t0, *drafts], position=s.num_computed, block_table=s.blocks,
                              sampling=engine._row_sampling(s), ssm_slot=s.ssm_slot, suppress_until=p.min_tokens,
                              stop_ids=tuple(sorted(engine._stop_ids(p))) if p.min_tokens else (), src_row=src))
        sampled.append((len(sampled), s, len(drafts)))
    if not any(n for _, _, n in sampled) and not any(s.spec_inflight for s in sched.decode):
        return None
    k = spec.num_speculative_tokens
    if engine.lora is not None:
        engine.lora.assign_slots(engine, sched, rows, [])
    bucket = StepBucket("verify", num_seqs=_ceil_bucket(engine.config.decode_buckets, len(rows)), num_spec=k)
    inputs = build_verify_step(engine.builder, bucket, rows)
    _, ibuf, fbuf = pack(engine.builder, inputs)
    w = 1 + k
    masked = [(s.grammar, r * w, rows[r].tokens[1:]) for r, s, _ in sampled if s.grammar is not None]
    bitmask = engine._grammars.fill(masked, bucket.num_sample_rows) if masked else None
    fixed = [(r * w + j, s.request.token_mask) for r, s, _ in sampled if s.request.token_mask is not None
             for j in range(w)]  # every window position of a row with allowed_token_ids / logit_bias
    fixed += bad_word_window_masks(rows, sampled, w, engine.vocab_size)
    if fixed:
        if bitmask is None:
            bitmask = np.full((bucket.num_sample_rows, fixed[0][1].size), -1, np.int32)
        bitmask = and_token_masks(bitmask, fixed)
    engine._announce("step", bucket, ibuf, fbuf, bitmask)  # processes under jax.distributed run it too
    dev = engine.compiler.put(ibuf, fbuf)
    if bitmask is not None:
        bitmask = engine.compiler.put(bitmask)
    engine.state, out, engine._next_tokens = engine.compiler.run(bucket, engine.params, engine.state, dev,
                                                                 engine._next_tokens, bitmask)
    if overlap:
        engine.scheduler.complete(sched)  # each row's t0 (its accepted drafts: `finish_verify`)
    for r, s, n in sampled:
        s.inflight += 1
        s.inflight_row = r
        if overlap:
            s.spec_inflight += n
    from metrale_jax.sampling import F_LOGPROBS

    want_lp = bool(inputs.smd.flags[F_LOGPROBS])
    names = ["token_ids", "logprobs", "spec_accepted"] + (["ranks", "top_ids", "top_logprobs"] if want_lp else [])
    names += ["drafts"] if out.drafts is not None else []
    arrays = [local(getattr(out, n)) for n in names]
    for a in arrays:
        a.copy_to_host_async()
    return _InFlight(sched, inputs, sampled, names, arrays, want_lp, False, overlapped=overlap,
                     row_drafts={s.seq_id: rows[r].tokens[1:] for r, s, _ in sampled} if overlap else None)


def sync_for_drafts(engine, f) -> bool:
    """Whether the engine reads dispatched step `f` before scheduling the next one. With overlap
    (`overlaps`) a verify step when the next step could not overlap it (`can_overlap`), and a
    plain step stays in flight as without speculation (the next one drafts past it) unless a row
    needs its samples on the host (`_needs_host`): then, and without overlap: after a
    verify step always (the next rows' lengths depend on what it accepted), with an MTP drafter
    always (its drafts come with the samples); after a plain step only when some row's n-gram
    lookup over its known tokens already finds a match (the sequence repeats itself, so the lookup
    after the token in flight likely finds one too), or when a row's grammar forced 2+ tokens
    after its last fed one (`Sequence.grammar_forced`: the next step drafts the rest, jump-forward).
    Otherwise the step stays in flight and the next one is dispatched first, as without
    speculation: stepping synchronously with no drafts to verify cost 25% of tokens/s at batch 1
    and 39% at batch 64 (Llama-3-8B shape, H200, session 13)."""
    if engine._spec_overlap:  # (`overlaps`)
        if f.overlapped:
            return not can_overlap(engine)
        if not any(_needs_host(s) for _, s in f.sampled):
            return False  # (the next verify step drafts past it)
    if f.inputs.bucket.kind == "verify" or engine.num_drafts:
        return True
    if engine.scheduler.spec_paused():  # (no drafts next step: `disable_by_batch_size`)
        return False
    from metrale_jax.engine.scheduler import SeqStatus

    spec = engine.config.speculative_config
    return any(s.status == SeqStatus.RUNNING and (s.grammar_forced or draft_tokens(s, 1, spec)) for _, s in f.sampled)


def finish_verify(engine, f):
    """Apply a verify step's samples: each row emits its accepted drafts and one more token."""
    import time

    from metrale_jax.engine.scheduler import ScheduledStep, SeqStatus

    out = f.read()
    w = f.inputs.bucket.num_spec + 1
    now = time.time()
    touched = {}
    st = engine.spec_stats
    live = []  # (sequence, accepted drafts) of the rows still running after their tokens
    for r, seq, n_drafts in f.sampled:
        seq.inflight -= 1
        if f.overlapped:
            seq.spec_inflight -= n_drafts
        req = seq.request
        a = min(int(out["spec_accepted"][r]), n_drafts)
        if n_drafts:
            st["spec_num_drafts"] += 1
            st["spec_draft_tokens"] += n_drafts
            st["spec_accepted_tokens"] += a
        if req.aborted or seq.status == SeqStatus.FINISHED:
            continue
        for j in range(a + 1):
            t = int(out["token_ids"][r * w + j])
            if seq.grammar is not None and t not in engine.eos_token_ids and not seq.grammar.consume_token(t):
                seq.grammar_error = seq.grammar.get_error() or "token rejected"  # (`_append_token` finishes it)
            engine._append_token(seq, r * w + j, out, f.want_lp)
            if seq.status == SeqStatus.FINISHED:
                break
        seq.grammar_forced = False  # (the next verify step drafts what the grammar forces itself)
        if seq.status == SeqStatus.RUNNING:
            live.append((seq, a))
            if "drafts" in out:  # the MTP head's drafts after the emitted tokens
                seq.mtp_drafts = (len(seq.token_ids), out["drafts"][r])
        if req.first_token_time is None:
            req.first_token_time = now
        touched[req.request_id] = req
    # t0 and the accepted drafts are in the cache now (K/V, and the recurrent state of the last
    # one): count them, then let prefix caching register the blocks and snapshot verified states
    for seq, a in live:
        seq.num_computed += a
    if f.overlapped:  # (its t0s were counted at dispatch)
        return engine._outputs(touched.values(), now)
    done = ScheduledStep([seq for seq, _ in live], [], [])
    engine.scheduler.complete(done)  # + 1 per row (t0)
    if getattr(done, "ssm_snapshots", None):
        engine._announce("ssm_copy", done.ssm_snapshots)
        engine.state = engine.compiler.copy_ssm_slots(engine.state, done.ssm_snapshots)
    return engine._outputs(touched.values(), now)
