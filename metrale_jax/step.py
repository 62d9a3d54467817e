"""Pure step functions: the model's paged forward, the LM head on the sampled rows, and sampling,
all in one executable. The state (KV pools, SSM pool, penalty table) is donated.

    decode_step(params, state, md, tokens, smd, *, model, attn, max_logprobs)
    mixed_step(params, state, dmd, pmd, tokens, smd, *, model, attn, max_logprobs)
    prefill_step(params, state, pmd, tokens, smd, *, model, attn, max_logprobs)

tokens i32[N + T] are the decode rows' tokens followed by the prefill tokens; `smd` says which
rows of the hidden states are sampled (`logits_indices`) and how. They return
`(state, SampleOutput)`. The engine compiles each (kind, bucket) once ahead of time with
`jit_step(kind)`; research code can call them directly under `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.linear import has_quantized_linears
from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata, pad_decode_rows
from metrale_jax.sampling import (
    CountKernel,
    PenaltyState,
    SampleOutput,
    SamplingMetadata,
    init_penalty_state,
    prompt_logprobs,
    sample,
    update_penalty_state,
)

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepState:
    """Everything a step donates and returns: the model's state (`metrale_jax.cache.EngineState`:
    KV pools, SSM pool) and the sampler's penalty table."""

    model: Any
    penalties: PenaltyState


def init_step_state(model, num_blocks: int, block_size: int, kv_dtype=None, max_ssm_slots: int = 0,
                    penalty_rows: int = 0, extra_kv_layers: int = 0) -> StepState:
    """Zeroed state: `num_blocks` KV blocks of `block_size` tokens, `penalty_rows` penalty rows
    (`extra_kv_layers`: KV layers for an MTP drafter)."""
    ms = model.init_state(num_blocks, block_size, kv_dtype, max_ssm_slots=max_ssm_slots,
                          extra_kv_layers=extra_kv_layers)
    return StepState(ms, init_penalty_state(penalty_rows, model.cfg.vocab_size))


def count_kernel(attn: AttentionConfig) -> CountKernel | None:
    """The sampler's counting kernel when `attn.sampler_kernel` (interpreted with `attn.interpret`)."""
    return CountKernel(attn.interpret) if attn.sampler_kernel else None


def _pads_pay(model, params, attn: AttentionConfig) -> bool:
    """Whether a decode step may run on padding rows (`AttentionConfig.min_decode_rows`): every
    linear a plain XLA dot (FP8 and 4-bit kernels have 1-row variants) and no layer routing to
    experts (padding rows would be routed). LoRA deltas run on the live rows alone
    (`AttnMetadata.live_rows`): XLA's deltas over all 8 rows cost more than the padding saved (a
    batch-1 Llama-3-8B LoRA step on the H200 went 5.55 -> 6.18 ms padded to 8, session 18)."""
    return not (getattr(model, "has_experts", False) or has_quantized_linears(params))


def take_prev_tokens(tokens: Array, src: Array, prev_tokens: Array) -> Array:
    """tokens i32[T] with each one whose `src` i32[T] is >= 0 replaced by that row's token of the
    previous step (`prev_tokens` i32[2R], `_next_tokens`)."""
    return jnp.where(src >= 0, prev_tokens[jnp.clip(src, 0, prev_tokens.shape[0] // 2 - 1)], tokens)


def _forward(params, state: StepState, dmd: AttnMetadata | None, pmd: BatchedAttnMetadata | None,
             tokens: Array, smd: SamplingMetadata, *, model, attn: AttentionConfig, max_logprobs: int,
             prev_tokens: Array | None = None) -> tuple[StepState, Array, tuple, Array]:
    """A step up to its sampler: (state with the new KV / SSM state and penalty counts, logits
    f32[S, V] of the sampled rows, prompt logprobs (values f32[P], ranks i32[P], top ids i32[P, K],
    top values f32[P, K]), the final hidden states [N + T, H])."""
    n = dmd.num_seqs if dmd is not None else 0
    if prev_tokens is not None:  # overlapped stepping: some inputs are the last step's samples
        tokens = take_prev_tokens(tokens, smd.token_src, prev_tokens)
    pen = update_penalty_state(state.penalties, tokens, smd)
    if pmd is None and n < attn.min_decode_rows and _pads_pay(model, params, attn):  # AttentionConfig.min_decode_rows
        md, padded = pad_decode_rows(dmd, tokens, attn.min_decode_rows)
        ms, hidden = model.forward_paged(params, state.model, padded, md, None, attn)
        hidden = hidden[:n]
    else:
        ms, hidden = model.forward_paged(params, state.model, tokens, dmd, pmd, attn)  # [N + T, H]
    s = smd.logits_indices.shape[0]
    p = smd.prompt_lp_targets.shape[0]  # prompt-logprob rows (0 in decode steps)
    plp_hidden = hidden[n + smd.prompt_lp_rows]  # [P, H]
    k = max(max_logprobs, 1)

    def plp_of(logits):
        return prompt_logprobs(logits, smd.prompt_lp_targets, max_logprobs=max_logprobs, cpu=attn.sampler_branches)

    def no_plp():
        return (jnp.zeros((p,), jnp.float32), jnp.zeros((p,), jnp.int32), jnp.zeros((p, k), jnp.int32),
                jnp.zeros((p, k), jnp.float32))

    if p and not attn.sampler_branches:  # one LM-head matmul for the sampled and the prompt-logprob rows
        both = model.compute_logits(params, jnp.concatenate([hidden[smd.logits_indices], plp_hidden]))
        logits, plp = both[:s], plp_of(both[s:])  # f32[S, V], P rows
    else:  # the CPU: the prompt rows' LM head only when asked (a conditional costs nothing there)
        logits = model.compute_logits(params, hidden[smd.logits_indices])  # f32[S, V]
        plp = no_plp() if not p else jax.lax.cond(
            jnp.any(smd.prompt_lp_targets >= 0), lambda h: plp_of(model.compute_logits(params, h)),
            lambda h: no_plp(), plp_hidden)
    return StepState(ms, pen), logits, plp, hidden


def _sample(logits: Array, pen: PenaltyState, smd: SamplingMetadata, plp: tuple, *, attn: AttentionConfig,
            max_logprobs: int, bitmask: Array | None = None) -> SampleOutput:
    tok, lp, rank, top_ids, top_lp = sample(logits, smd, pen, max_logprobs=max_logprobs,
                                            branches=attn.sampler_branches, skip=attn.sampler_skip, bitmask=bitmask,
                                            count_kernel=count_kernel(attn))
    return SampleOutput(tok, lp, rank, top_ids, top_lp, *plp)


def _step(params, state: StepState, dmd: AttnMetadata | None, pmd: BatchedAttnMetadata | None,
          tokens: Array, smd: SamplingMetadata, *, model, attn: AttentionConfig, max_logprobs: int,
          prev_tokens: Array | None = None, bitmask: Array | None = None,
          num_drafts: int = 0) -> tuple[StepState, SampleOutput]:
    """num_drafts: k of an MTP drafter (params["mtp"]) that runs after the sampler and returns the
    decode rows' next drafts (`engine/spec_decode.py`); 0 = none."""
    if pmd is not None and pmd.verify_width:  # speculative verify step
        from metrale_jax.engine.spec_decode import verify_step

        return verify_step(params, state, pmd, tokens, smd, model=model, attn=attn, max_logprobs=max_logprobs,
                           num_drafts=num_drafts, bitmask=bitmask, prev_tokens=prev_tokens)
    state, logits, plp, hidden = _forward(params, state, dmd, pmd, tokens, smd, model=model, attn=attn,
                                          max_logprobs=max_logprobs, prev_tokens=prev_tokens)
    out = _sample(logits, state.penalties, smd, plp, attn=attn, max_logprobs=max_logprobs, bitmask=bitmask)
    if num_drafts:
        from metrale_jax.engine.spec_decode import mtp_step_draft

        ms, drafts = mtp_step_draft(params, state.model, hidden, out.token_ids, dmd, pmd, smd, model=model,
                                    attn=attn, k=num_drafts)
        state, out = replace_model_state(state, ms), dataclasses.replace(out, drafts=drafts)
    return state, out


def decode_step(params, state: StepState, md: AttnMetadata, tokens: Array, smd: SamplingMetadata, *,
                model, attn: AttentionConfig = AttentionConfig(), max_logprobs: int = 20):
    """One token per row: tokens i32[N] at md.positions -> (state, SampleOutput over N rows)."""
    return _step(params, state, md, None, tokens, smd, model=model, attn=attn, max_logprobs=max_logprobs)


def mixed_step(params, state: StepState, dmd: AttnMetadata, pmd: BatchedAttnMetadata, tokens: Array,
               smd: SamplingMetadata, *, model, attn: AttentionConfig = AttentionConfig(),
               max_logprobs: int = 20):
    """Decode rows plus prefill chunks: tokens i32[N + T] -> (state, SampleOutput)."""
    return _step(params, state, dmd, pmd, tokens, smd, model=model, attn=attn, max_logprobs=max_logprobs)


def prefill_step(params, state: StepState, pmd: BatchedAttnMetadata, tokens: Array, smd: SamplingMetadata,
                 *, model, attn: AttentionConfig = AttentionConfig(), max_logprobs: int = 20):
    """Prefill chunks only: tokens i32[T] -> (state, SampleOutput)."""
    return _step(params, state, None, pmd, tokens, smd, model=model, attn=attn, max_logprobs=max_logprobs)


_STATIC = ("model", "attn", "max_logprobs", "placement", "num_drafts")


@functools.cache
def jit_step(kind: str):
    """The jitted step of `kind` ("decode" | "prefill" | "mixed"), donating the state.

    Every kind takes (params, state, dmd, pmd, tokens, smd) positionally, dmd / pmd None where
    the kind has none, so the engine calls all of them the same way.
    """

    def fn(params, state, dmd, pmd, tokens, smd, *, model, attn, max_logprobs, placement=None, num_drafts=0):
        if kind == "decode":
            assert pmd is None
        elif kind == "prefill":
            assert dmd is None
        state, out = _step(params, state, dmd, pmd, tokens, smd, model=model, attn=attn,
                           max_logprobs=max_logprobs, num_drafts=num_drafts)
        if placement is not None:
            state, out = placement.pin_state(state), placement.replicate(out)
        return state, out

    fn.__name__ = f"{kind}_step"
    return jax.jit(fn, static_argnames=_STATIC, donate_argnums=(1,))


def _next_tokens(out: SampleOutput, prev_tokens: Array, verify_width: int = 0) -> Array:
    """What the next step reads of this one, at the fixed width i32[2R] of `prev_tokens`: each
    sampled row's token (padded or cut to R), then each row's position shift (R). A verify step's
    row r gives the last token it emits (the sample after its accepted drafts) and, as its shift,
    the drafts it accepted, which the next step's window of that row moves by (overlapped verify
    steps: `engine/spec_decode.py`); other steps' shifts are 0."""
    r = prev_tokens.shape[0] // 2
    tok, shift = out.token_ids, None
    if verify_width:
        acc = out.spec_accepted
        tok = tok.reshape(-1, verify_width)[jnp.arange(acc.shape[0]), acc]
        shift = acc
    nxt = jnp.zeros_like(prev_tokens).at[:min(tok.shape[0], r)].set(tok[:r])
    if shift is not None:
        nxt = nxt.at[r:r + min(shift.shape[0], r)].set(shift[:r])
    return nxt


@functools.cache
def jit_packed_step(kind: str):
    """Like `jit_step`, but the metadata arrives as two flat buffers (i32, f32) described by the
    static `layout` (`metadata_builder.pack`): one host->device transfer per step. It also takes
    the previous step's sampled tokens and row shifts `prev_tokens` i32[2R] (R fixed for every
    bucket; `_next_tokens`) for inputs the host does not know yet (`smd.token_src`), and returns
    its own: `(state, SampleOutput, next_tokens i32[2R])`, so a step can be dispatched before the host has
    read the previous one's output. `bitmask` i32[S, ceil(V / 32)] (S = the bucket's sampled
    rows) is the structured-output token mask of each sampled row (-1 = unconstrained;
    `sampling.apply_token_bitmask`)."""
    from metrale_jax.metadata_builder import unpack

    def fn(params, state, ibuf, fbuf, prev_tokens, bitmask, *, layout, model, attn, max_logprobs,
           placement=None, num_drafts=0):
        dmd, pmd, tokens, smd = unpack(layout, ibuf, fbuf)
        state, out = _step(params, state, dmd, pmd, tokens, smd, model=model, attn=attn,
                           max_logprobs=max_logprobs, prev_tokens=prev_tokens,
                           bitmask=bitmask, num_drafts=num_drafts)
        nxt = _next_tokens(out, prev_tokens, pmd.verify_width if pmd is not None else 0)
        if placement is not None:  # tensor parallel (metrale_jax/parallel.py)
            state, out, nxt = placement.pin_state(state), placement.replicate(out), placement.replicate(nxt)
        return state, out, nxt

    fn.__name__ = f"{kind}_step_packed"
    return jax.jit(fn, static_argnames=("layout",) + _STATIC, donate_argnums=(1,))


@functools.cache
def jit_packed_forward(kind: str):
    """The first half of `jit_packed_step(kind)`, what the engine compiles for decode and mixed
    buckets: (params, state, ibuf, fbuf, prev_tokens, bitmask, sample bool[]) -> (state, logits
    f32[S, V], prompt logprobs, SampleOutput, next_tokens i32[2R]); the state is donated.

    A step whose rows follow grammars is launched before the host has their masks (they depend on
    the previous step's tokens), the host fills them while it runs, and `jit_packed_sample`
    finishes the step from the logits. With `AttentionConfig.sample_in_forward` (the GPU's
    default) this half samples too, with `bitmask`, as `jit_packed_step` does, so the other steps
    launch once (`sample` True); for a grammar step (`sample` False) the sampler's random draw and
    top logprobs are off through its flags (its skips, `sampler_skip`, leave an argmax) and the
    engine drops these samples. Without it the SampleOutput and next tokens are None and
    `bitmask` / `sample` go unused."""
    from metrale_jax.metadata_builder import unpack

    def fn(params, state, ibuf, fbuf, prev_tokens, bitmask, sample, *, layout, model, attn, max_logprobs,
           placement=None, num_drafts=0):
        assert not num_drafts, "an MTP drafter runs in whole steps (it needs the samples)"
        dmd, pmd, tokens, smd = unpack(layout, ibuf, fbuf)
        state, logits, plp, _ = _forward(params, state, dmd, pmd, tokens, smd, model=model, attn=attn,
                                         max_logprobs=max_logprobs, prev_tokens=prev_tokens)
        out = nxt = None
        if attn.sample_in_forward:
            smd_here = dataclasses.replace(smd, flags=jnp.logical_and(smd.flags, sample))
            out = _sample(logits, state.penalties, smd_here, plp, attn=attn, max_logprobs=max_logprobs,
                          bitmask=bitmask)
            nxt = _next_tokens(out, prev_tokens)
        if placement is not None:
            state, logits, plp = placement.pin_state(state), placement.replicate(logits), placement.replicate(plp)
            if out is not None:
                out, nxt = placement.replicate(out), placement.replicate(nxt)
        return state, logits, plp, out, nxt

    fn.__name__ = f"{kind}_forward_packed"
    return jax.jit(fn, static_argnames=("layout",) + _STATIC, donate_argnums=(1,))


@functools.cache
def jit_packed_sample(kind: str):
    """The second half of `jit_packed_step(kind)`: (logits, penalties, ibuf, fbuf, plp, bitmask,
    prev_tokens) -> (SampleOutput, next_tokens i32[R]) with the same values as the whole step's.
    `prev_tokens` only gives next_tokens its shape."""
    from metrale_jax.metadata_builder import unpack

    def fn(logits, penalties, ibuf, fbuf, plp, bitmask, prev_tokens, *, layout, model, attn, max_logprobs,
           placement=None, num_drafts=0):
        _, _, _, smd = unpack(layout, ibuf, fbuf)
        out = _sample(logits, penalties, smd, plp, attn=attn, max_logprobs=max_logprobs, bitmask=bitmask)
        nxt = _next_tokens(out, prev_tokens)
        if placement is not None:
            out, nxt = placement.replicate(out), placement.replicate(nxt)
        return out, nxt

    fn.__name__ = f"{kind}_sample_packed"
    return jax.jit(fn, static_argnames=("layout",) + _STATIC)


def replace_model_state(state: StepState, model_state) -> StepState:
    return dataclasses.replace(state, model=model_state)
