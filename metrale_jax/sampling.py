"""Sampling parameters (vLLM names and semantics) and on-device sampling.

`SamplingParams` is what a user passes. `SamplingMetadata` is its per-row device form, built by
`metadata_builder` once per step, and `sample` turns a step's logits into token ids (plus the
logprobs that were asked for) on the device, so only small arrays come back to the host.

Order of operations per row (vLLM v1):
  raw logits -> raw logprobs (float32 log-softmax; what `logprobs` reports)
  raw logits -> min_tokens suppression -> repetition/presence/frequency penalties
             -> greedy argmax (temperature 0) | temperature -> min_p -> top_k -> top_p -> Gumbel-max

Seeds: the random key of a row is derived from (request seed, sequence index, output index), never
from the row's position in the batch, so a seeded request samples the same tokens whatever else
is in the batch.

No sort over the vocabulary, and no conditional whose predicate goes to the host (XLA runs a
plain conditional from the host, which waits for the predicate, i.e. for the whole forward pass,
so the next step could not be queued behind this one). Penalties, the filters, the random draw
and the logprobs are computed per row and selected per row; what no row of the step needs (the
filters and the draw, the top logprobs, the bitmask) is skipped under `lax.cond` on the CPU
(`branches`) and on the GPU (`skip`: conditionals inside the step's CUDA graph, evaluated on the
device). `filter_logits` applies
min_p / top_k / top_p with thresholds found by a fixed number of passes over [R, V] (a k-ary
search over float32 bit patterns: 8 passes of 15 thresholds on a GPU); the top logprobs come
from `lax.top_k` (`top_k_plan`: up to 32 rows over chunks of 2,048 logits, which XLA sorts; more
rows through XLA's TopK kernel in rounds of 8, masking the ids taken). On the CPU
(`sample(branches=True)`, where a conditional costs nothing) the filters, the draw and the top
logprobs are skipped under `lax.cond` when no row needs them, and the thresholds are read off 256
`lax.top_k` candidates when every row's nucleus fits in them: the same tokens either way.
Prompt logprobs are branch-free too: a prefill or mixed step computes them for a bounded number of
its prompt tokens (`EngineConfig.max_prompt_logprobs_tokens`, gathered rows; a request asking for
them prefills at most that many tokens per step), in the same LM-head matmul as the sampled rows,
so the weights are read once; on the CPU they stay under `lax.cond`.

Penalties need to know which tokens a sequence has seen. That lives on the device in
`PenaltyState` (a row per penalised sequence, part of the donated engine state): each step counts
its own input tokens into it (prompt tokens set a presence bit, generated tokens add to a count),
so the host never ships token histories.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.errors import InvalidSamplingParamsError
from metrale_jax.structured_output import StructuredOutputsParams

Array = jax.Array
log = logging.getLogger(__name__)

_MAX_SEED = 2**64


class RequestOutputKind(enum.IntEnum):
    """What `LLMEngine.step()` returns for a request, as vLLM: CUMULATIVE, every step, the whole
    output so far (the default); DELTA, every step, only what is new since the request's last
    output (token ids, text, logprobs; what the server streams: nothing grows with the output);
    FINAL_ONLY, one output when the request finishes (what `LLM.generate` uses)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling parameters, with vLLM's names, defaults and semantics.

    top_k: -1 or 0 = off. top_p: in (0, 1]. min_p: in [0, 1]. temperature 0 = greedy.
    max_tokens: None = up to max_model_len. seed: None (or -1, vLLM's "none") = a seed drawn from
    the engine's RNG.
    logprobs / prompt_logprobs: None = off, k >= 0 = the chosen/prompt token plus the top k.
    structured_outputs: None = free text; else a `StructuredOutputsParams` constraint (JSON schema,
    regex, choice, grammar) every sampled token obeys (`metrale_jax.structured_output`).
    guided_decoding: vLLM 0.10's name for it (a `GuidedDecodingParams`, the same class), moved
    into structured_outputs.
    allowed_token_ids: None = any token; else only these are sampled (vLLM's).
    logit_bias: {token id: bias in [-100, 100]}, OpenAI's and vLLM's: added to the token's logit
    before penalties and sampling (the returned logprobs stay the model's, as vLLM's). The two
    ends are exact, as OpenAI describes them: -100 bans the token and 100 allows only the tokens
    given 100 (a token mask, `token_mask`); 0 does nothing. The other values share the engine's
    `max_suppress_ids` table with min_tokens' stop ids (`additive_bias`).
    bad_words: words never generated, vLLM's: each word is tokenized as it is and after a space,
    and the last token of each tokenization is banned wherever the output so far ends with the
    tokens before it (a one-token word: everywhere). Needs a tokenizer.
    truncate_prompt_tokens: k >= 1 keeps the prompt's last k tokens (vLLM's left truncation); -1
    keeps as many as fit beside one generated token (max_model_len - 1).
    detokenize: False = token ids only (empty text; stop strings then refused, as vLLM).
    spaces_between_special_tokens: accepted for vLLM's scripts; no effect (it concerns slow Python
    tokenizers; the `tokenizers` library decodes without it, as vLLM's fast path does).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidSamplingParamsError("give structured_outputs or guided_decoding (its vLLM 0.10 name), "
                                                 "not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.seed, int | np.integer) and self.seed == -1:  # (vLLM's -1: no seed)
            self.seed = None
        if isinstance(self.logit_bias, dict) and any(isinstance(k, str) for k in self.logit_bias):
            # token ids as JSON object keys (OpenAI's form), as vLLM's from_optional reads them
            self.logit_bias = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.validate()

    def validate(self) -> None:
        """Raise InvalidSamplingParamsError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise InvalidSamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int | np.integer) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not np.isfinite(v):
                bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(name, "must be an integer")
        if self.n < 1:
            bad("n", "must be >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be None or an integer >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            bad("stop", "needs detokenize=True (stop strings are matched in the text)")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < _MAX_SEED):
            bad("seed", "must be None or a 64-bit integer")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                bad(name, "must be None or an integer >= 0")
        if self.output_kind not in tuple(RequestOutputKind):
            bad("output_kind", f"must be one of {[k.name for k in RequestOutputKind]}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be None or a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.bad_words is not None and (not isinstance(self.bad_words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad("bad_words", "must be None or a list of non-empty strings")
        t = self.truncate_prompt_tokens
        if t is not None and (not is_int(t) or not (t == -1 or t >= 1)):
            bad("truncate_prompt_tokens", "must be None, -1 or an integer >= 1")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids
                or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be None or a non-empty list of token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(k) and k >= 0 and is_num(v) for k, v in self.logit_bias.items()):
                bad("logit_bias", "must be None or a dict of token id -> number")
            odd = [(k, v) for k, v in self.logit_bias.items() if not (np.isfinite(v) and -100 <= v <= 100)]
            if odd:
                raise InvalidSamplingParamsError(f"logit_bias {odd[0][0]}: {odd[0][1]!r} must be in [-100, 100]")

    def token_mask(self, vocab_size: int) -> np.ndarray | None:
        """allowed_token_ids and logit_bias as a packed mask i32[ceil(vocab_size / 32)] (bit i of
        word w: token 32w + i may be sampled), or None when neither restricts anything.
        InvalidSamplingParamsError for an id >= vocab_size (any of logit_bias's) or a mask that
        allows nothing."""
        bias = self.logit_bias or {}
        ids = [*(self.allowed_token_ids or ()), *bias]  # (every logit_bias id, the added ones too)
        if any(int(t) >= vocab_size for t in ids):
            raise InvalidSamplingParamsError(f"allowed_token_ids / logit_bias: token id {max(ids)} is outside the "
                                             f"vocabulary [0, {vocab_size})")
        only = [k for k, v in bias.items() if v == 100]
        ban = [k for k, v in bias.items() if v == -100]
        if self.allowed_token_ids is None and not only and not ban:
            return None
        width = -(-int(vocab_size) // 32)
        allow = np.zeros(width * 32, bool)
        if self.allowed_token_ids is None and not only:
            allow[:vocab_size] = True
        else:
            keep = set(map(int, self.allowed_token_ids)) if self.allowed_token_ids is not None else set(map(int, only))
            if self.allowed_token_ids is not None and only:
                keep &= set(map(int, only))
            allow[list(keep)] = True
        allow[list(map(int, ban))] = False
        if not allow.any():
            raise InvalidSamplingParamsError("allowed_token_ids and logit_bias leave no token to sample")
        return np.packbits(allow, bitorder="little").view(np.int32)

    @property
    def additive_bias(self) -> tuple[tuple[int, float], ...]:
        """The logit_bias entries added to the logits, (token id, bias) by id: all but the
        mask's ends (-100, 100) and 0."""
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items() if v not in (-100, 0, 100)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_or_off(self) -> int:
        """top_k with both "off" spellings (-1, 0) mapped to 0."""
        return max(int(self.top_k), 0)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def bad_words_token_ids(words: list[str], tokenizer) -> list[tuple[int, ...]]:
    """`SamplingParams.bad_words` as token sequences, vLLM's rule: each word (leading spaces
    stripped) tokenized as it is, and after one space where that starts with another token and
    has as many tokens (the word inside a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def bad_word_bans(words: list[tuple[int, ...]], output: list[int]) -> list[int]:
    """The last tokens of the bad-word sequences of `words` whose other tokens end `output`."""
    return [w[-1] for w in words if len(w) - 1 <= len(output) and tuple(output[len(output) - len(w) + 1:]) == w[:-1]]


def ban_tokens(mask: np.ndarray | None, ids: list[int], vocab_size: int) -> np.ndarray:
    """A token mask i32[ceil(vocab_size / 32)] (None: every id allowed) with `ids` banned (a copy)."""
    bits = (np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool) if mask is not None
            else np.arange(-(-vocab_size // 32) * 32) < vocab_size)
    bits[list(ids)] = False
    return np.packbits(bits, bitorder="little").view(np.int32)


def and_token_masks(out: np.ndarray, rows: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """`out` i32[R, W] (-1 = all allowed) with each (row, mask i32[W]) of `rows` ANDed in, in place."""
    for r, m in rows:
        out[r] &= m
    return out


# ---- device side ---------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    """Token occurrences per penalised sequence. R = rows (0 = penalties disabled), V = vocab."""

    prompt_seen: Array  # bool[R, V]  token occurs in the prompt
    out_counts: Array  # i32[R, V]   times the token was generated so far


def init_penalty_state(rows: int, vocab: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((rows, vocab), jnp.bool_), jnp.zeros((rows, vocab), jnp.int32))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs of one step. S = sampled rows, T = the step's input tokens,
    B = prefill streams, P = prompt-logprob rows (min(T, max_prompt_logprobs_tokens)), M = suppressed
    ids per row.

    Pad rows: logits_indices 0, temperature 0, pen_rows -1, suppress_ids -1.
    """

    logits_indices: Array  # i32[S]  row of the step's hidden states to sample
    temperature: Array  # f32[S]  0 = greedy
    top_k: Array  # i32[S]  0 = off
    top_p: Array  # f32[S]  1 = off
    min_p: Array  # f32[S]  0 = off
    repetition_penalty: Array  # f32[S]  1 = off
    presence_penalty: Array  # f32[S]
    frequency_penalty: Array  # f32[S]
    pen_rows: Array  # i32[S]  PenaltyState row of the sequence; -1 = no penalties
    seeds: Array  # u32[S, 3]  (seed low 32 bits, seed high 32 bits, sequence index)
    out_index: Array  # i32[S]  index of the token being sampled among the sequence's outputs
    suppress_ids: Array  # i32[S, M]  ids whose logits `suppress_bias` changes; -1 = none
    suppress_bias: Array  # f32[S, M]  added to those logits: -inf (min_tokens' stop ids: never
    #                       sampled) or a logit_bias value
    flags: Array  # bool[4]  any (penalties, top-k/top-p, random rows, logprobs) among the rows;
    #               read only by `sample(branches=True)` (the CPU), never on the GPU
    tok_pen_rows: Array  # i32[T]  PenaltyState row of each input token; -1 = not counted
    tok_is_output: Array  # bool[T]  input token is a generated token (count) vs prompt (presence)
    reset_rows: Array  # i32[B]  PenaltyState rows cleared before this step's tokens are counted
    prompt_lp_rows: Array  # i32[P]  prefill token (0..T-1 among the step's prefill tokens) of each row
    prompt_lp_targets: Array  # i32[P]  the next prompt token, whose logprob that row gives; -1 = none
    token_src: Array  # i32[T]  row of the previous step's sampled tokens that IS this input token
    #                   (overlapped stepping: the host does not know it yet); -1 = use `tokens`
    mask_logprobs: Array  # bool[S]  the row's logprobs see its bitmask (a structured-output grammar's, as
    #                       vLLM's); else they are the raw logits' (allowed_token_ids, logit_bias' ends, bad_words)
    mtp_next: Array | None = None  # i32[T]  with an MTP drafter: the token after each input token,
    #                   >= 0 a known token, < 0 the sample of row -1 - value (engine/spec_decode.py)


F_PENALTY, F_FILTER, F_RANDOM, F_LOGPROBS = range(4)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleOutput:
    """What a step returns. K = max_logprobs (static). Only the requested parts are fetched."""

    token_ids: Array  # i32[S]  sampled token per row
    logprobs: Array  # f32[S]  raw log-softmax of the sampled token
    ranks: Array  # i32[S]  1-based rank of the sampled token (valid when flags[F_LOGPROBS])
    top_ids: Array  # i32[S, K]
    top_logprobs: Array  # f32[S, K]
    prompt_logprobs: Array  # f32[P]  raw logprob of each prompt_lp_target (0 where none)
    prompt_ranks: Array  # i32[P]
    prompt_top_ids: Array  # i32[P, K]
    prompt_top_logprobs: Array  # f32[P, K]
    spec_accepted: Array | None = None  # i32[N]  verify steps: drafts each row accepted (engine/spec_decode.py)
    drafts: Array | None = None  # i32[N + B, k]  MTP drafter: each decode row's next drafts, a sampled stream's
    #                 first (then -1); verify steps i32[N, k]


# ---- the penalty table ---------------------------------------------------------------------------
def _oob(idx: Array, size: int) -> Array:
    """Map negative ("none") indices out of range, so `mode="drop"` really drops them."""
    return jnp.where(idx < 0, size, idx)


def update_penalty_state(ps: PenaltyState, tokens: Array, smd: SamplingMetadata) -> PenaltyState:
    """Clear `reset_rows`, then count this step's input tokens `tokens` i32[T] into their rows."""
    rows = ps.prompt_seen.shape[0]
    if rows == 0:
        return ps
    reset = _oob(smd.reset_rows, rows)
    seen = ps.prompt_seen.at[reset].set(False, mode="drop")
    counts = ps.out_counts.at[reset].set(0, mode="drop")
    r = smd.tok_pen_rows
    seen = seen.at[_oob(jnp.where(smd.tok_is_output, -1, r), rows), tokens].set(True, mode="drop")
    counts = counts.at[_oob(jnp.where(smd.tok_is_output, r, -1), rows), tokens].add(1, mode="drop")
    return PenaltyState(seen, counts)


def _apply_penalties(logits: Array, ps: PenaltyState, smd: SamplingMetadata) -> Array:
    """vLLM penalties on f32[S, V] logits; rows with pen_rows -1 are unchanged."""
    rows = ps.prompt_seen.shape[0]
    if rows == 0:
        return logits
    has = smd.pen_rows >= 0
    r = jnp.clip(smd.pen_rows, 0, rows - 1)
    seen = ps.prompt_seen[r] & has[:, None]  # bool[S, V]
    counts = jnp.where(has[:, None], ps.out_counts[r], 0)  # i32[S, V]
    rep = smd.repetition_penalty[:, None]
    occurred = seen | (counts > 0)
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(occurred, penalised, logits)
    logits = logits - smd.frequency_penalty[:, None] * counts.astype(jnp.float32)
    logits = logits - smd.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)
    return logits


# ---- sampling ------------------------------------------------------------------------------------
def _fmix32(h: Array) -> Array:
    """MurmurHash3's 32-bit finaliser: a bijective avalanche mix of u32 values."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(smd: SamplingMetadata) -> Array:
    """u32[S, 2] per-row stream keys from (seed, sequence index, output index) only."""
    s = smd.seeds.astype(jnp.uint32)
    idx = smd.out_index.astype(jnp.uint32)
    h = _fmix32(s[:, 0] ^ jnp.uint32(0x5EED5EED))
    h = _fmix32(h ^ s[:, 1] * jnp.uint32(0x9E3779B9))
    h = _fmix32(h ^ s[:, 2] * jnp.uint32(0x85EBCA77))
    k0 = _fmix32(h ^ idx * jnp.uint32(0xC2B2AE3D))
    k1 = _fmix32(k0 ^ jnp.uint32(0x27D4EB2F))
    return jnp.stack([k0, k1], axis=-1)


def row_gumbel(smd: SamplingMetadata, vocab: int) -> Array:
    """f32[S, V] standard Gumbel noise; row r depends only on row r's (seed, seq, output index).

    A counter-based hash (two MurmurHash3 finaliser rounds over (row key, token index)) instead
    of threefry: statistically ample for sampling, cheap to run and quick to compile.
    """
    keys = row_keys(smd)
    v = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    h = _fmix32(keys[:, :1] ^ (v * jnp.uint32(0x9E3779B9)))
    h = _fmix32(h + keys[:, 1:])
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), but
    # (2**24 - 1) + 0.5 rounds to 2**24 in float32: u would be 1 and the noise +inf (a uniform
    # draw, masked tokens included, in 2**-24 of the tokens: ~0.8% of draws at V = 128k)
    u = jnp.minimum(u, jnp.float32(1.0 - 2.0**-24))
    return -jnp.log(-jnp.log(u))


# ---- filtering: temperature, min_p, top_k, top_p without a sort -----------------------------------
@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FilterParams:
    """Per-row parameters of `filter_logits`, R rows (vLLM's names and "off" values)."""

    temperature: Array  # f32[R]  0 = greedy: the row's logits are not scaled
    top_k: Array  # i32[R]  0 (or >= V) = off
    top_p: Array  # f32[R]  1 = off
    min_p: Array  # f32[R]  0 = off

    @staticmethod
    def of(smd: SamplingMetadata) -> FilterParams:
        return FilterParams(smd.temperature, smd.top_k, smd.top_p, smd.min_p)


# Threshold searches look at `ways - 1` thresholds per pass over [R, V], so each pass divides the
# interval of candidate thresholds by `ways`; the interval starts as the 2**32 float32 bit patterns,
# so a search takes `search_passes(ways)` = ceil(32 / log2(ways)) passes. On a GPU a pass is one
# fused reduction whatever `ways` is (16 ways: 8 passes, ~launch-bound); the CPU backend writes the
# [R, ways - 1, V] comparison out before reducing it, and compiles 32 unrolled passes 5x slower
# than 16, so there 4 ways (16 passes) is the compromise.
SEARCH_WAYS = 16
CPU_SEARCH_WAYS = 4
# `sample(branches=True)` (the CPU) reads the thresholds off this many largest logits first
CPU_CANDIDATES = 256


def default_search_ways() -> int:
    """`CPU_SEARCH_WAYS` when JAX's default backend is the CPU, else `SEARCH_WAYS`."""
    return CPU_SEARCH_WAYS if jax.default_backend() == "cpu" else SEARCH_WAYS


def search_passes(ways: int) -> int:
    """Passes over [R, V] that one threshold search of `ways` ways takes (ways**passes >= 2**32)."""
    if ways < 2:
        raise ValueError(f"{ways=} must be >= 2")
    passes = 1
    while ways**passes < 2**32:
        passes += 1
    return passes


def _key(x: Array) -> Array:
    """f32 -> u32 with the same order (-inf < ... < -0 < +0 < ... < +inf; NaNs beyond)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _unkey(k: Array) -> Array:
    """Inverse of `_key`."""
    b = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


_KEY_NEG_INF = 0x007FFFFF  # _key(-inf)


# How a threshold search counts: `sum(x[:, None, :] >= th[:, :, None], -1)` reads every row once per
# threshold; one variadic reduction (J accumulators per row) reads it once. The CPU wrote the
# [R, J, V] comparisons out: the variadic form is 16x faster there (R 8, V 49,152, J 15) and halves
# the engine's top-p fallback. On the H200 (the sampler alone, V 128,256, 2026-12-02) it is slower
# for few rows (one thread block per row: 1 row 0.61 -> 0.86 ms, 64 rows 1.78 -> 1.92 ms) and
# faster for a verify step's many (320 rows: 5.40 -> 4.98 ms), so the GPU takes it from
# VARIADIC_MIN_ROWS rows.
VARIADIC_MIN_ROWS = 256


@dataclass(frozen=True)
class CountKernel:
    """The threshold searches count through the Pallas kernel `pallas_kernels.sampling.sums_ge`
    (a grid over rows and vocabulary chunks) instead of XLA's row reductions (one thread block per
    row); `AttentionConfig.sampler_kernel`. interpret: the kernel's interpret mode (CPU tests)."""

    interpret: bool = False


def _sums_ge(x: Array, th: Array, weight: Array | None = None, *, variadic: bool = True,
             kernel: CountKernel | None = None) -> Array:
    """For each row r and threshold j: the sum over V of `weight` f32[R, V] (None: the count, i32)
    where x f32[R, V] >= th f32[R, J][r, j], in one of the two forms above (static `variadic`) or
    through the Pallas kernel (`kernel`)."""
    if kernel is not None:
        from pallas_kernels.sampling import sums_ge

        return sums_ge(x, th, weight, interpret=kernel.interpret)
    zero = jnp.int32(0) if weight is None else jnp.float32(0)
    if not variadic:
        ge = x[:, None, :] >= th[:, :, None]  # [R, J, V]
        return jnp.sum(ge, axis=-1, dtype=jnp.int32) if weight is None else jnp.sum(
            jnp.where(ge, weight[:, None, :], zero), axis=-1)
    ops = tuple((x >= th[:, j:j + 1]).astype(jnp.int32) if weight is None
                else jnp.where(x >= th[:, j:j + 1], weight, zero) for j in range(th.shape[1]))
    sums = jax.lax.reduce(ops, (zero,) * len(ops), lambda a, b: tuple(p + q for p, q in zip(a, b)), (1,))
    return jnp.stack(sums, axis=-1)


def _largest_threshold(holds, lo: Array, hi: Array, ways: int) -> Array:
    """Largest f32[R] threshold t (by bit pattern, within [_unkey(lo), _unkey(hi)]) for which
    `holds(t f32[R, W]) -> bool[R, W]` is true, for a `holds` that is true up to some t and false
    above it; `holds(lo)` is taken as true. A fixed number of passes, each evaluating `ways - 1`
    thresholds of every row in one reduction over [R, V]: no loop, no conditional."""
    j = jnp.arange(1, ways, dtype=jnp.uint32)[None, :]  # u32[1, W-1]
    for _ in range(search_passes(ways)):
        step = (hi - lo) // jnp.uint32(ways) + jnp.uint32(1)  # u32[R] >= 1
        t = jnp.minimum(lo[:, None] + j * step[:, None], hi[:, None])  # u32[R, W-1] (no overflow)
        ok = holds(_unkey(t))  # bool[R, W-1]
        lo = jnp.max(jnp.where(ok, t, lo[:, None]), axis=-1)
        hi = jnp.maximum(jnp.min(jnp.where(ok, hi[:, None], t - jnp.uint32(1)), axis=-1), lo)
    return _unkey(lo)


def filter_logits(logits: Array, params: FilterParams, *, ways: int | None = None, candidates: int = 0,
                  count_kernel: CountKernel | None = None) -> Array:
    """vLLM v1's sampling filters on f32[R, V] logits, per row, without a sort and without a branch:
    temperature -> min_p -> top_k -> top_p. Returns the temperature-scaled logits f32[R, V] with
    every dropped token set to -inf; softmax of a row is the distribution that row samples from.

    - temperature: logits / temperature (rows with temperature 0 are left unscaled).
    - min_p: drop p < min_p * max(p) (p = softmax of the scaled logits).
    - top_k: keep x >= the k-th largest scaled logit: ties with it are all kept (vLLM keeps them too).
    - top_p (renormalised inside top-k, as vLLM): keep x >= t, t the largest value such that the
      probability mass of {x >= t} is >= top_p * (mass kept by top-k); i.e. a token is kept iff
      the mass of the tokens strictly above it is < top_p. vLLM's sort splits a group of tokens
      tied at the boundary by their place in the sort; here the whole tied group is kept. The
      largest token is always kept.
    top_k and top_p thresholds come from a search over float32 bit patterns (`_largest_threshold`,
    `search_passes(ways)` passes each), so the kept set is exact up to the float rounding of the
    mass sums. Rows whose parameters are off come out as logits / temperature (bit for bit at
    temperature 0 or 1), and the cost does not depend on the parameters. Any number of rows; no
    row depends on another.
    ways (static): thresholds per pass + 1; None = `default_search_ways()`.
    candidates (static, > 0: the CPU's choice, see `sample(branches=True)`): first read both
    thresholds off the `candidates` largest logits (`lax.top_k`, a partial sort on the CPU) and
    run the searches only, under `lax.cond`, when some row's top_k or nucleus reaches past them.
    The same kept sets (up to the float rounding of the mass sums).
    count_kernel (static): the searches count through that Pallas kernel (`CountKernel`).
    """
    ways = default_search_ways() if ways is None else ways
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    t = jnp.where(params.temperature > 0, params.temperature, 1.0).astype(jnp.float32)
    x = x / t[:, None]
    m = jnp.max(x, axis=-1)  # f32[R]
    # min_p (p / max p = exp(x - max)); min_p 0 drops nothing
    x = jnp.where(jnp.exp(x - m[:, None]) < params.min_p[:, None], neg_inf, x)
    # top_k: the largest t with count(x >= t) >= k
    k_on = (params.top_k > 0) & (params.top_k < v)
    k = jnp.where(k_on, params.top_k, 1)[:, None, None]  # i32[R, 1, 1]

    variadic = x.shape[0] >= VARIADIC_MIN_ROWS or jax.default_backend() == "cpu"

    def enough_tokens(th: Array) -> Array:  # th f32[R, W-1]
        return _sums_ge(x, th, variadic=variadic, kernel=count_kernel) >= k[:, :, 0]

    p_on = params.top_p < 1
    top_p = jnp.where(p_on, params.top_p, 1.0)

    def search_k(x):  # -> t_k f32[R]
        lo = jnp.full(m.shape, _KEY_NEG_INF, jnp.uint32)
        return jnp.where(k_on, _largest_threshold(enough_tokens, lo, _key(m), ways), neg_inf)

    def search_p(x, t_k):  # -> (t_k, t_p) f32[R]
        xk = jnp.where(x >= t_k[:, None], x, neg_inf)
        # top_p: the largest t with mass(x >= t) >= top_p * mass(top-k set)
        e = jnp.exp(xk - m[:, None])  # f32[R, V]  unnormalised probabilities, 0 where dropped
        need = (top_p * jnp.sum(e, axis=-1))[:, None]  # f32[R, 1]

        def enough_mass(th: Array) -> Array:  # th f32[R, W-1]
            return _sums_ge(xk, th, e, variadic=variadic, kernel=count_kernel) >= need

        return t_k, jnp.where(p_on, _largest_threshold(enough_mass, _key(t_k), _key(m), ways), neg_inf)

    if candidates:
        c = jax.lax.top_k(x, min(candidates, v))[0]  # f32[R, C] descending
        n_c = c.shape[-1]
        kk = jnp.minimum(k[:, 0, 0], n_c)
        t_k = jnp.where(k_on, jnp.take_along_axis(c, kk[:, None] - 1, axis=-1)[:, 0], neg_inf)
        total = jnp.sum(jnp.where(x >= t_k[:, None], jnp.exp(x - m[:, None]), 0.0), axis=-1)  # f32[R]
        e_c = jnp.where(c >= t_k[:, None], jnp.exp(c - m[:, None]), 0.0)  # f32[R, C]
        mass_ge = jnp.sum(jnp.where(c[:, None, :] >= c[:, :, None], e_c[:, None, :], 0.0), axis=-1)  # f32[R, C]
        need = top_p * total
        # the thresholds are values of the candidates unless top_k or the nucleus reaches past them
        ok = (~k_on | (k[:, 0, 0] <= n_c)) & (~p_on | (mass_ge[:, -1] >= need))
        t_p = jnp.where(p_on, jnp.max(jnp.where(mass_ge >= need[:, None], c, neg_inf), axis=-1), neg_inf)
        # (the CPU: a conditional is free) the top-k search only when some row's top_k passes them
        k_exact = t_k

        def fallback(x):
            return search_p(x, jax.lax.cond(jnp.any(k_on & (k[:, 0, 0] > n_c)), search_k, lambda x: k_exact, x))

        t_k, t_p = jax.lax.cond(jnp.all(ok), lambda x: (t_k, t_p), fallback, x)
    else:
        t_k, t_p = search_p(x, search_k(x))
    return jnp.where((x >= t_k[:, None]) & (x >= t_p[:, None]), x, neg_inf)


# ---- top logprobs without a full sort ------------------------------------------------------------
# How `lax.top_k` runs on the GPU decides the cost: XLA's TopK kernel (k <= 16, rows of >= 1,024)
# gives each row one thread block and keeps the k best in registers; a larger k sorts the row.
# The top 20 of 128,256 logprobs on the H200 (bench/kernels/top_k.py, 2026-12-02, session 12):
#   rows   whole rows, rounds of 8   chunks of 2,048, rounds of 16   chunks of 2,048, one round
#   1      316 us                    80 us                            39 us
#   64     337 us                    963 us                           477 us
# So up to TOP_K_CHUNKED_ROWS rows, each row is cut into chunks of TOP_K_CHUNK, every chunk's top k
# sorted out, then the top k of those candidates taken; more rows go whole through the TopK kernel
# in rounds of TOP_K_ROUND, each round masking the ids the earlier rounds took. The CPU takes whole
# rows in one round (a partial sort). Every plan gives the same ids and values, ties in id order.
TOP_K_CHUNK = 2048
TOP_K_CHUNKED_ROWS = 32
TOP_K_ROUND = 8


def top_k_plan(rows: int, k: int, cpu: bool = False) -> tuple[int, int]:
    """(chunk, round) for the top k of f32[rows, V] (see above; chunk 0 = whole rows)."""
    if cpu:
        return 0, k
    return (TOP_K_CHUNK, k) if rows <= TOP_K_CHUNKED_ROWS else (0, TOP_K_ROUND)


def _top_k(x: Array, n: int, chunk: int = TOP_K_CHUNK) -> tuple[Array, Array]:
    """`lax.top_k(x, n)` of f32[R, V] (values f32[R, n], ids i32[R, n], ties in id order) through
    chunks of `chunk` elements when V > 2 * chunk (0: whole rows, the CPU's choice: its partial
    sort took 1.6x longer through chunks): every element of the row's top n is in its
    chunk's top n; the candidates are laid out chunk by chunk, each chunk's in descending order
    with ties in id order, so equal values keep their id order through the second top_k."""
    r, v = x.shape
    if not chunk or v <= 2 * chunk or n > chunk:
        val, idx = jax.lax.top_k(x, n)
        return val, idx.astype(jnp.int32)
    c = -(-v // chunk)
    xp = jnp.pad(x, ((0, 0), (0, c * chunk - v)), constant_values=-jnp.inf)  # pads: ids >= V, lose ties
    cval, cidx = jax.lax.top_k(xp.reshape(r, c, chunk), n)  # f32[R, C, n]
    cidx = cidx.astype(jnp.int32) + (jnp.arange(c, dtype=jnp.int32) * chunk)[None, :, None]
    val, pos = jax.lax.top_k(cval.reshape(r, c * n), n)
    return val, jnp.take_along_axis(cidx.reshape(r, c * n), pos, axis=-1)


def _top_logprobs(lp: Array, k: int, chunk: int, round_: int) -> tuple[Array, Array]:
    """(ids i32[R, k], values f32[R, k]) of the k largest of f32[R, V], best first, ties in id
    order (as `lax.top_k`), in rounds of at most `round_` (`top_k_plan`). A round masks the ids
    taken before it with -inf, so the row's own -inf values (tokens a grammar banned) stand in as
    the lowest finite float meanwhile: below every real logprob, above the masked ids."""
    rows = jnp.arange(lp.shape[0])[:, None]
    lowest = jnp.finfo(jnp.float32).min
    lp = jnp.where(lp == -jnp.inf, lowest, lp)
    ids, vals = [], []
    for start in range(0, k, round_):
        n = min(round_, k - start)
        val, idx = _top_k(lp, n, chunk)
        ids.append(idx)
        vals.append(val)
        if start + n < k:
            lp = lp.at[rows, idx].set(-jnp.inf)
    vals = jnp.concatenate(vals, axis=-1)
    return jnp.concatenate(ids, axis=-1), jnp.where(vals == lowest, -jnp.inf, vals)


def _rank_and_top(lp: Array, target: Array, k: int, cpu: bool) -> tuple[Array, Array, Array]:
    """Rank (1-based, vLLM: count of logprobs >= the target's) and top-k of f32[R, V] logprobs."""
    tl = jnp.take_along_axis(lp, jnp.maximum(target, 0)[:, None], axis=-1)  # f32[R, 1]
    rank = jnp.sum(lp >= tl, axis=-1).astype(jnp.int32)
    top_ids, top_lp = _top_logprobs(lp, k, *top_k_plan(lp.shape[0], k, cpu))
    return rank, top_ids, top_lp


# ---- structured output: the token bitmask ---------------------------------------------------------
def apply_token_bitmask(logits: Array, bitmask: Array) -> Array:
    """Ban tokens on f32[R, V] logits: token j of row r stays iff bit j % 32 of
    `bitmask[r, j // 32]` (i32[R, ceil(V / 32)], llguidance's / xgrammar's packed layout) is set;
    the others become -inf. A row of -1 (all bits set) is unchanged, bit for bit."""
    r, v = logits.shape
    w = bitmask.shape[-1]
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[R, W, 32]
    allowed = bits.reshape(r, w * 32)[:, :v] != 0  # bool[R, V]
    return jnp.where(allowed, logits, -jnp.inf)


# ---- sampling ------------------------------------------------------------------------------------
def sample(
    logits: Array, smd: SamplingMetadata, ps: PenaltyState, *, max_logprobs: int, branches: bool = False,
    skip: bool = False, bitmask: Array | None = None, count_kernel: CountKernel | None = None,
) -> tuple[Array, Array, Array, Array, Array]:
    """Sample f32[S, V] logits. Returns (token_ids i32[S], logprobs f32[S], ranks i32[S],
    top_ids i32[S, K], top_logprobs f32[S, K]) with K = max(max_logprobs, 1).

    One graph for every batch: penalties, the filters, the random draw, ranks and top logprobs are
    computed for every row and selected per row (no `lax.cond`, so nothing waits on the host).
    Greedy rows (temperature 0) take the argmax of the penalised logits. Ranks and top logprobs
    are of the raw log-softmax and are computed whatever the rows asked for (the host reads them
    only for rows that asked).

    branches (static): skip the filters and the random draw when no row samples at random, and
    the ranks and top logprobs when no row asked for them (zeros then), under `lax.cond` on the
    host-computed flags, and take the CPU's algorithms (the searches from `lax.top_k`
    candidates, top logprobs of whole rows). The same tokens and values either way. Cheap on the
    CPU (the CPU default, where the searches cost more than the step of a small model).
    skip (static): the same `lax.cond` skips with the GPU's algorithms
    (`AttentionConfig.sampler_skip`). XLA runs a plain conditional from the host, which copies the
    predicate back and waits for it (stalling the step queue), so the step executables that skip
    are compiled with conditionals inside their command buffers (CUDA graph conditional nodes:
    the predicate stays on the device; `engine.compile.COMMAND_BUFFER_WITH_CONDITIONALS`).

    bitmask: i32[S, ceil(V / 32)] token masks (`apply_token_bitmask`; -1 rows = unconstrained):
    structured-output grammars, allowed_token_ids, logit_bias' -100 / 100, bad_words. Applied first:
    penalties, the greedy argmax and every filter see the banned tokens at -inf; the logprobs too in
    the rows of `smd.mask_logprobs` (grammars: vLLM applies its grammar bitmask before its sampler),
    the other rows' logprobs are the raw logits' (vLLM applies the rest inside its sampler, after
    its raw logprobs). With `branches` or `skip`, skipped under `lax.cond` when every word is -1.

    count_kernel: `filter_logits`'s (the searches' counting kernel).
    """
    cond = branches or skip
    logits = raw = logits.astype(jnp.float32)
    if bitmask is not None:
        if cond:
            logits = jax.lax.cond(jnp.all(bitmask == -1), lambda x, m: x, apply_token_bitmask, logits, bitmask)
        else:
            logits = apply_token_bitmask(logits, bitmask)
    s, v = logits.shape
    k = max(max_logprobs, 1)
    raw_lp = jax.nn.log_softmax(logits if bitmask is None else jnp.where(smd.mask_logprobs[:, None], logits, raw),
                                axis=-1)
    # logit_bias and min_tokens' suppression, then the penalties (vLLM's order; -inf stays -inf)
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], smd.suppress_ids.shape)
    x = logits.at[rows, _oob(smd.suppress_ids, v)].add(smd.suppress_bias, mode="drop")
    x = _apply_penalties(x, ps, smd)  # rows with pen_rows -1: x, bit for bit
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)

    def draw(x):
        kept = filter_logits(x, FilterParams.of(smd), candidates=CPU_CANDIDATES if branches else 0,
                             count_kernel=count_kernel)
        noise = row_gumbel(smd, v)
        if branches:  # the CPU: XLA fused the noise into the argmax reduction, 6x slower than this
            kept, noise = jax.lax.optimization_barrier((kept, noise))
        return jnp.argmax(kept + noise, axis=-1).astype(jnp.int32)

    def no_draw(x):
        return greedy

    sampled = jax.lax.cond(smd.flags[F_RANDOM], draw, no_draw, x) if cond else draw(x)
    tok = jnp.where(smd.temperature > 0, sampled, greedy)
    chosen = jnp.take_along_axis(raw_lp, tok[:, None], axis=-1)[:, 0]

    def tops(lp, t):
        return _rank_and_top(lp, t, k, branches)

    def no_tops(lp, t):
        return jnp.zeros((s,), jnp.int32), jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32)

    if cond:
        ranks, top_ids, top_lp = jax.lax.cond(smd.flags[F_LOGPROBS], tops, no_tops, raw_lp, tok)
    else:
        ranks, top_ids, top_lp = tops(raw_lp, tok)
    return tok, chosen, ranks, top_ids, top_lp


def prompt_logprobs(logits: Array, targets: Array, *, max_logprobs: int,
                    cpu: bool = False) -> tuple[Array, Array, Array, Array]:
    """Logprob, rank and top-k of each `targets` i32[P] token (-1 = none: zeros) from its row of
    f32[P, V] logits. Returns (logprobs f32[P], ranks i32[P], top_ids i32[P, K], top_logprobs
    f32[P, K]), K = max(max_logprobs, 1). P is bounded (`EngineConfig.max_prompt_logprobs_tokens`
    rows per step), so a step computes it branch-free (`step._step`). cpu: `top_k_plan`'s."""
    k = max(max_logprobs, 1)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tl = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    rank, ids, top = _rank_and_top(lp, targets, k, cpu)
    return jnp.where(targets >= 0, tl, 0.0), rank, ids, top


def seed_words(seed: int, seq_index: int) -> tuple[int, int, int]:
    """The u32 triple a row's key is derived from: (seed low, seed high, sequence index)."""
    s = int(seed) % _MAX_SEED
    return s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF, int(seq_index) & 0xFFFFFFFF


GuidedDecodingParams = StructuredOutputsParams  # vLLM 0.10's name

__all__ = [
    "SamplingParams", "RequestOutputKind", "GuidedDecodingParams", "SamplingMetadata", "SampleOutput", "PenaltyState",
    "init_penalty_state",
    "update_penalty_state", "sample", "prompt_logprobs", "FilterParams", "filter_logits", "search_passes",
    "SEARCH_WAYS", "CPU_SEARCH_WAYS", "CountKernel", "default_search_ways", "row_keys", "row_gumbel", "seed_words",
    "apply_token_bitmask", "top_k_plan",
]


# generation_config.json's fields that are request defaults (vLLM's list), as SamplingParams names
_GENERATION_DEFAULTS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                        "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: str, model_generation_config: dict | None) -> dict:
    """The SamplingParams defaults a model's generation config sets (`EngineConfig.generation_config`:
    "auto" = the model's, "vllm" = none, else a folder holding generation_config.json). A value
    SamplingParams refuses is left out, with a warning (the model still serves)."""
    if source == "vllm":
        return {}
    if source == "auto":
        cfg = dict(model_generation_config or {})
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config={source!r}: {path} does not exist (or give 'auto' / 'vllm')")
        cfg = json.loads(path.read_text(encoding="utf-8"))
    out = {}
    for theirs, ours in _GENERATION_DEFAULTS.items():
        if cfg.get(theirs) is None:
            continue
        try:
            SamplingParams(**{ours: cfg[theirs]})
        except (InvalidSamplingParamsError, TypeError) as e:
            log.warning("generation config: %s=%r left out (%s)", theirs, cfg[theirs], e)
            continue
        out[ours] = cfg[theirs]
    return out
