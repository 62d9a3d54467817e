"""GPU acceptance run: the engine as users run it, under mixed traffic, for every model family.

    python bench/gpu_acceptance.py [--family NAME ...] [--out DIR] [--cpu-smoke] [--skip traffic,server,twins,lone]
    bash bench/gpu_session.sh acceptance          (on the GPU machine)
    python bench/gpu_acceptance.py --engine-config '{"enable_prefix_caching":false}'   (a variant)

Per family (random weights, `random_model(shape_config(shape, layers), repeat_layers=True)`):

1. One `LLMEngine(model, params, EngineConfig(dtype="bfloat16", max_model_len=2048,
   num_kv_blocks=KV_BLOCKS))`: the default config (buckets, kernels, preemption mode) except for a
   KV pool of 384 blocks (6,144 tokens) where the default would size ~100 GB; the 40-request batch
   alone wants ~12,000 tokens resident (prompts are log-uniform in 1-1,500), so sequences are
   preempted (swap for the models with SSM state, recompute for attention-only ones).
   `show_progress=False` only quiets the bars.
   The model carries a synthetic tokenizer covering its vocabulary (token i decodes to a letter
   and a number, e.g. "k12"), so stop strings and streamed text work.
2. Traffic, inside `CompileCounter`: a batch through `LLM.from_engine(eng).generate` (40
   requests), then a staggered part driven by `add_request` / `step` / `abort` (60 requests
   arriving between steps, 10 of them aborted: 8 mid-stream, 2 on arrival; 4 whose stop id / stop
   string is a token the same prompt produced greedily in the batch part, so they must stop),
   then 6 greedy requests re-run one at a time (with the logprobs they had), then the HTTP server (the app on
   uvicorn in a thread, httpx clients in threads): plain, n=2, logprobs, SSE streams with usage,
   stop strings, and client disconnects mid-stream. Prompts 1-1,500 tokens, outputs 1-300
   tokens; greedy, temperature with top-k/top-p/min-p, the three penalties, n=2, logprobs=5 and 20,
   prompt_logprobs=3, stop strings and stop ids.
3. Checks (each pass/fail with details): no exception; every request finished by length (with
   exactly its token count) or stop (with a stop id / string / EOS that ends it), or was aborted
   as asked, with no output after its abort; well-formed logprobs / prompt_logprobs / n outputs;
   preemptions > 0 (and swaps > 0 in swap mode); zero lowerings and zero backend compiles after
   start-up; once all finished, no KV block with a nonzero reference count, no SSM slot or
   penalty row held, empty queues; greedy rows equal the same request run alone up to the first
   position where the lone run's top-2 logprob gap is below 0.05 (later divergences are
   reported, not failed); the derived stop requests stopped; the server's answers are complete.
   Greedy in bfloat16: a batched and a lone execution round differently (other tile shapes and
   reduction orders, prefill chunked otherwise): on the H200 (2026-12-01) 13 of 30 rows of these
   random-weight models differed where the lone run's top-2 gap was 0.05-0.42, each time taking
   the lone run's second token; on the CPU's XLA reference path (8-layer model) the same token's
   logprob differs by 0.04-0.08 between the two runs before any token does (`noise`), and by
   ~5e-5 in float32. So a
   bfloat16 row that differs before a 0.05 near tie passes if, at the divergence, each run's
   token is among the other's top logprobs (vLLM's `check_logprobs_close` rule); such rows are
   counted (`strict_divergences`) and the 0.05 rule is applied strictly in float32: to the
   --cpu-smoke traffic and, on the GPU, to the twins (`twins_alone`).
4. Small-width twins (same architecture and layer pattern, hidden 256, float32, XLA's dots at full
   precision): greedy ids of an engine with the default kernels (Pallas on the GPU) equal those of
   `attention=AttentionConfig()` (the XLA reference) exactly, and logprobs agree within 1e-3; and
   that engine's batched rows equal each prompt run alone (strict 0.05 rule, `twins_alone`; with
   prefix caching on, the default, the lone runs hit the cache), and the second turns of two
   conversations (turn 1 + its reply + 5 ids; cache hits, at least turn 1's block-aligned length
   minus a block) equal the reference's full prefill (`prefix_cache`).
   (The twins compile 4 buckets, not the default set, to keep the run short; float32 pools take
   the Triton prefill kernel, so the Mosaic prefill is covered only by the bf16 traffic, not by
   this comparison.)

Writes `acceptance_<date>.json` and `.md` under `--out` (rewritten after each family, so a run cut
short still leaves the finished families), prints a short table last, exits 1 if any check failed.
`--cpu-smoke` runs all of it on the CPU with tiny shapes, fewer requests and 3 step buckets
(`SMOKE_BUCKETS`; tests/test_gpu_acceptance_smoke.py uses it). On the H200 (2026-12-01, cold
compilation cache) a family took 95-175 s, so the five need two or three calls of `--family`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import gc
import json
import math
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from metrale_jax.engine.testing import synthetic_tokenizer  # noqa: E402

MIN_GAP = 0.05  # lone-run top-2 logprob gap below which a greedy divergence is reported, not failed
TWIN_TOL = 1e-3  # float32 twins: |logprob(Pallas) - logprob(XLA reference)|
KV_BLOCKS = 384  # GPU traffic KV pool (x 16 tokens)
KV_BLOCKS_SMOKE = 20  # --cpu-smoke KV pool (max_model_len 256 needs >= 16)


# ---- families ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    name: str  # --family name
    shape: str  # metrale_jax.engine.bench.SHAPES key
    layers: int | None  # depth of the GPU traffic model (None = full)
    twin: dict  # overrides of the small-width float32 twin (GPU)
    tiny: dict  # overrides of the --cpu-smoke model (traffic and twin)


_TINY_ATTN = dict(vocab_size=512, hidden_size=64, intermediate_size=128, max_position_embeddings=4096)
FAMILIES = {
    f.name: f for f in [
        Family("llama3-8b", "llama3-8b", None,
               twin=dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=128, num_hidden_layers=2),
               tiny=_TINY_ATTN | dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_hidden_layers=2)),
        Family("qwen3-next-80b-a3b", "qwen3-next-80b-a3b", 4,
               twin=dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=1, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=128, shared_expert_intermediate_size=128, num_hidden_layers=4,
                         layer_types=["linear_attention"] * 3 + ["full_attention"]),
               tiny=_TINY_ATTN | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=32, num_hidden_layers=4,
                                      layer_types=["linear_attention"] * 3 + ["full_attention"])),
        Family("qwen3-30b-a3b", "qwen3-30b-a3b", 4,
               twin=dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=1, head_dim=128, num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=128, num_hidden_layers=2),
               tiny=_TINY_ATTN | dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=2)),
        Family("nemotron-h-8b", "nemotron-h-8b", 13,
               twin=dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=128, attention_head_dim=128, mamba_num_heads=8,
                         mamba_head_dim=64, ssm_state_size=128, n_groups=2, hybrid_override_pattern="M-M*-",
                         num_hidden_layers=5),
               tiny=_TINY_ATTN | dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_head_dim=16,
                                      mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                                      chunk_size=16, hybrid_override_pattern="M*-", num_hidden_layers=3)),
        Family("mamba2-2.7b", "mamba2-2.7b", 8,
               twin=dict(vocab_size=2048, hidden_size=256, num_heads=8, head_dim=64, state_size=128,
                         num_hidden_layers=2),
               tiny=dict(vocab_size=512, hidden_size=64, num_heads=8, head_dim=16, state_size=16, chunk_size=16,
                         num_hidden_layers=2)),
    ]
}


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU defaults or the --cpu-smoke ones."""

    smoke: bool
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    max_prompt: int
    max_out: int
    n_batch: int
    n_staggered: int
    n_abort: int  # aborted mid-stream (plus 2 on arrival)
    n_lone: int
    n_server: int
    n_disconnect: int
    twin_prompts: tuple[int, ...]
    twin_max_tokens: int
    twin_seqs: int
    twin_tokens: int
    overrides: tuple = ()  # (name, value) EngineConfig fields set on the traffic engine (--engine-config)


GPU_PLAN = Plan(False, "bfloat16", 2048, KV_BLOCKS, 1500, 300, 40, 60, 8, 6, 24, 2,
                (1, 17, 130, 300, 700, 1100), 24, 8, 512)
SMOKE_PLAN = Plan(True, "float32", 256, KV_BLOCKS_SMOKE, 200, 40, 8, 12, 2, 3, 6, 1, (1, 17, 60, 130), 8, 4, 64)


def family_config(fam: Family, plan: Plan, twin: bool = False) -> dict:
    """The config.json dict of the traffic model (twin=False) or of the twin."""
    from metrale_jax.engine.bench import shape_config

    if plan.smoke:
        return shape_config(fam.shape) | fam.tiny
    if twin:
        return shape_config(fam.shape) | fam.twin
    return shape_config(fam.shape, fam.layers)


# ---- random-weight vocabularies ------------------------------------------------------------------
def untile_vocab(params: dict, seed: int, scale: float = 0.2) -> dict:
    """Fresh draws for the embedding table and the LM head (`params["embed"]` f[V, H],
    `params["lm_head"]` f[H, V]): the random-weight reader tiles tensors above 16M elements with
    one 1M-element draw, so vocabulary rows repeat and their logits tie exactly (the greedy check
    then measures tie-breaking, not the engine)."""
    import jax

    key = jax.random.PRNGKey(seed + 7)
    for i, name in enumerate(("embed", "lm_head")):
        a = params.get(name)
        if isinstance(a, jax.Array):
            params[name] = (scale * jax.random.normal(jax.random.fold_in(key, i), a.shape, jax.numpy.float32)
                            ).astype(a.dtype)
    return params


def build_model(cfg: dict, dtype: str, seed: int, tokenizer: bool = True, mtp: bool = False,
                quantization: str | None = None):
    from metrale_jax.model import random_model

    model, params = random_model(cfg, dtype=dtype, seed=seed, repeat_layers=True, mtp=mtp, quantization=quantization)
    params = untile_vocab(params, seed)
    if tokenizer:
        model = dataclasses.replace(model, tokenizer=synthetic_tokenizer(model.cfg.vocab_size,
                                                                         tuple(model.eos_token_ids)))
    return model, params


# ---- traffic -------------------------------------------------------------------------------------
KINDS = ("greedy", "greedy_lp", "sample", "penalty", "n2", "prompt_lp", "stop_str", "stop_ids", "greedy_ignore_eos")
GREEDY_KINDS = ("greedy", "greedy_lp", "greedy_ignore_eos", "prompt_lp")


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    params: Any  # SamplingParams
    kind: str
    arrival: int = 0  # staggered part: the engine step before which it is added
    abort_after: int | None = None  # staggered part: abort once this many tokens arrived (0 = on arrival)
    expect_stop_at: int | None = None  # derived stop requests: must stop within this many tokens
    ref_ids: list[int] | None = None  # derived stop requests: the greedy tokens they were derived from


def lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    """n lengths in [lo, hi], log-uniform, with lo and hi themselves among them."""
    out = np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n)).astype(int).clip(lo, hi).tolist()
    out[0], out[-1] = lo, hi
    rng.shuffle(out)
    return [int(x) for x in out]


def make_params(kind: str, max_tokens: int, rng: np.random.Generator, vocab: int):
    from metrale_jax.sampling import SamplingParams

    seed = int(rng.integers(0, 2**31))
    kw: dict[str, Any] = dict(max_tokens=max_tokens)
    if kind == "greedy":  # (greedy rows carry top-5 logprobs, as the lone re-runs do: the
        # lone comparison reads both sides' and needs the same k on both, as vLLM's rule does)
        kw |= dict(temperature=0.0, logprobs=5)
    elif kind == "greedy_lp":
        kw |= dict(temperature=0.0, logprobs=20)
    elif kind == "greedy_ignore_eos":
        kw |= dict(temperature=0.0, ignore_eos=True, logprobs=5)
    elif kind == "sample":
        kw |= dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=seed)
    elif kind == "penalty":
        kw |= dict(temperature=0.7, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.5,
                   frequency_penalty=0.3, seed=seed)
    elif kind == "n2":
        kw |= dict(n=2, temperature=1.0, top_k=20, seed=seed)
    elif kind == "prompt_lp":
        kw |= dict(temperature=0.0, prompt_logprobs=3, logprobs=5)
    elif kind == "stop_str":
        kw |= dict(temperature=0.9, seed=seed, stop=["77", "q9"])
    elif kind == "stop_ids":
        kw |= dict(temperature=1.0, seed=seed, stop_token_ids=rng.integers(3, vocab, 48).tolist())
    else:
        raise ValueError(kind)
    return SamplingParams(**kw)


def random_prompt(rng: np.random.Generator, n: int, vocab: int, eos: tuple[int, ...]) -> list[int]:
    ids = rng.integers(3, vocab, n)
    for e in eos:  # prompts without EOS ids (they would read as ends of text)
        ids[ids == e] = 3
    return ids.tolist()


def make_specs(rng: np.random.Generator, n: int, plan: Plan, vocab: int, eos: tuple[int, ...], prefix: str,
               kinds: tuple[str, ...] = KINDS) -> list[Spec]:
    pl = lengths(rng, n, 1, plan.max_prompt)
    ol = lengths(rng, n, 1, plan.max_out)
    specs = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        specs.append(Spec(f"{prefix}{i}", random_prompt(rng, pl[i], vocab, eos),
                          make_params(kind, ol[i], rng, vocab), kind))
    return specs


def batch_specs(rng, plan: Plan, vocab: int, eos) -> list[Spec]:
    """The LLM.generate part; its first 4 are greedy with >= 8 output tokens (stop-derivation sources)."""
    specs = make_specs(rng, plan.n_batch, plan, vocab, eos, "b")
    for s in specs[:4]:
        s.kind = "greedy"
        s.params = make_params("greedy", max(8, s.params.max_tokens), rng, vocab).clone(ignore_eos=True)
    return specs


def staggered_specs(rng, plan: Plan, vocab: int, eos, batch: list[Spec], batch_out: dict, tokenizer) -> list[Spec]:
    """The add_request/step part: staggered arrivals, aborts, and stop requests derived from the
    batch part's greedy outputs."""
    specs = make_specs(rng, plan.n_staggered, plan, vocab, eos, "s")
    t = 0
    for s in specs:
        t += int(rng.integers(0, 4))
        s.arrival = t
    # mid-stream aborts (long enough that they are still running), then 2 on arrival
    for s in specs[1:1 + plan.n_abort]:
        s.params = s.params.clone(max_tokens=max(s.params.max_tokens, min(100, plan.max_out)))
        s.abort_after = int(rng.integers(1, 8))
    for s in specs[1 + plan.n_abort:3 + plan.n_abort]:
        s.abort_after = 0
    # 4 derived stops: greedy with a stop id (2) or a stop string (2) that the greedy run produced
    from metrale_jax.sampling import SamplingParams

    for j, src in enumerate(batch[:4]):
        ref = list(batch_out[src.rid].outputs[0].token_ids)
        k = min(3, len(ref) - 1)
        s = specs[-1 - j]
        s.prompt, s.kind, s.ref_ids, s.expect_stop_at = list(src.prompt), "stop_derived", ref, k + 1
        s.abort_after = None
        if j % 2 == 0:
            s.params = SamplingParams(temperature=0.0, max_tokens=src.params.max_tokens, ignore_eos=True,
                                      stop_token_ids=[ref[k]])
        else:
            s.params = SamplingParams(temperature=0.0, max_tokens=src.params.max_tokens, ignore_eos=True,
                                      stop=[tokenizer.decode([ref[k]])])
    return specs


def drive_staggered(eng, specs: list[Spec], max_steps: int = 100_000) -> dict:
    """Add each request before its arrival step, step, abort as planned. Returns final outputs,
    the aborted ids (with how many tokens they had) and problems seen on the way."""
    pending = sorted(specs, key=lambda s: s.arrival)
    by_id = {s.rid: s for s in specs}
    last: dict[str, Any] = {}
    final: dict[str, Any] = {}
    aborted: dict[str, int] = {}
    problems: list[str] = []
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0].arrival <= step:
            s = pending.pop(0)
            eng.add_request(s.rid, s.prompt, s.params)
            if s.abort_after == 0:
                eng.abort(s.rid)
                aborted[s.rid] = 0
        for o in eng.step():
            if o.request_id in aborted:
                problems.append(f"{o.request_id}: output after its abort")
            last[o.request_id] = o
            if o.finished:
                final[o.request_id] = o
        for rid, o in last.items():
            s = by_id[rid]
            if s.abort_after and rid not in aborted and rid not in final:
                if max(len(c.token_ids) for c in o.outputs) >= s.abort_after:
                    eng.abort(rid)
                    aborted[rid] = max(len(c.token_ids) for c in o.outputs)
        step += 1
        if step > max_steps:
            problems.append(f"not done after {max_steps} steps")
            break
    return dict(final=final, aborted=aborted, problems=problems, steps=step)


# ---- checks (pure functions over outputs; tests doctor their inputs) -----------------------------
def check_request(out, prompt: list[int], params, eos_ids: tuple[int, ...], max_model_len: int) -> list[str]:
    """What is wrong with one finished request's output (empty = fine)."""
    rid = out.request_id
    bad = []
    if not out.finished:
        bad.append(f"{rid}: not finished")
    if len(out.outputs) != params.n:
        bad.append(f"{rid}: {len(out.outputs)} outputs for n={params.n}")
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    for c in out.outputs:
        ids = list(c.token_ids)
        tag = f"{rid}[{c.index}]"
        cap = min(params.max_tokens, max_model_len - len(prompt))
        if c.finish_reason == "length":
            if len(ids) != cap:
                bad.append(f"{tag}: finish_reason length after {len(ids)} tokens, expected {cap}")
        elif c.finish_reason == "stop":
            if not 1 <= len(ids) <= cap:
                bad.append(f"{tag}: stopped after {len(ids)} tokens (cap {cap})")
            elif isinstance(c.stop_reason, str):
                if c.stop_reason not in params.stop:
                    bad.append(f"{tag}: stop_reason {c.stop_reason!r} is not one of {params.stop}")
            elif ids[-1] not in stop_ids:
                bad.append(f"{tag}: stopped on token {ids[-1]}, not a stop id or EOS")
        else:
            bad.append(f"{tag}: finish_reason {c.finish_reason!r}")
            continue
        early = [t for t in ids[:-1] if t in stop_ids]
        if early:
            bad.append(f"{tag}: stop id {early[0]} generated before the end")
        if params.logprobs is not None:
            lps = c.logprobs or []
            if len(lps) != len(ids):
                bad.append(f"{tag}: {len(lps)} logprob entries for {len(ids)} tokens")
            else:
                for t, d in zip(ids, lps):
                    if t not in d or len(d) < params.logprobs or not all(x.logprob <= 1e-4 for x in d.values()):
                        bad.append(f"{tag}: bad logprobs entry {d!r} for token {t}")
                        break
    if params.prompt_logprobs is not None:
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(prompt) or plp[0] is not None:
            bad.append(f"{rid}: prompt_logprobs has {None if plp is None else len(plp)} entries for "
                       f"{len(prompt)} prompt tokens (first must be None)")
        else:
            for t, d in zip(prompt[1:], plp[1:]):
                if d is None or t not in d or len(d) < params.prompt_logprobs:
                    bad.append(f"{rid}: bad prompt_logprobs entry {d!r} for token {t}")
                    break
    return bad


def top2_gaps(logprobs: list[dict]) -> list[float]:
    """Per position, logprob(rank 1) - logprob(rank 2) of a run with logprobs >= 2."""
    gaps = []
    for d in logprobs:  # the entry holds the top k (k >= 2) and the chosen token: its two largest
        top = sorted((v.logprob for v in d.values()), reverse=True)  # (ranks alone break on exact ties)
        gaps.append(top[0] - top[1] if len(top) >= 2 else math.inf)
    return gaps


def compare_greedy(batch_ids: list[int], lone_ids: list[int], gaps: list[float], min_gap: float = MIN_GAP,
                   batch_lps: list[dict] | None = None, lone_lps: list[dict] | None = None,
                   allow_noise: bool = False) -> dict:
    """Greedy tokens of a batched run against the same request run alone.

    status: "match"; "diverged_after_near_tie" (they differ first at or after the first position
    where the lone run's top-2 gap < min_gap: reported, not failed); "diverged_within_noise"
    (only with allow_noise, for 16-bit runs: they differ before any such position, but there each
    run's token is among the other's top logprobs, vLLM's `check_logprobs_close` rule: reported,
    not failed); "mismatch" (a failure).

    With both runs' logprobs (dicts token -> Logprob, per position) it also reports `noise`: the
    largest |logprob(batched) - logprob(lone)| of the same token before the first difference,
    which is what the two executions' rounding differs by where their tokens still agree."""
    first_tie = next((i for i, g in enumerate(gaps) if g < min_gap), None)
    first_diff = next((i for i, (a, b) in enumerate(zip(batch_ids, lone_ids)) if a != b), None)
    if first_diff is None and len(batch_ids) != len(lone_ids):
        first_diff = min(len(batch_ids), len(lone_ids))
    noise, in_top = None, None
    if batch_lps is not None and lone_lps is not None:
        upto = len(lone_ids) if first_diff is None else first_diff
        diffs = [abs(b[t].logprob - a[t].logprob) for t, b, a in zip(lone_ids[:upto], batch_lps, lone_lps)
                 if t in b and t in a]
        noise = round(max(diffs, default=0.0), 5)
        i = first_diff
        if i is not None and i < min(len(batch_ids), len(lone_ids), len(batch_lps), len(lone_lps)):
            in_top = batch_ids[i] in lone_lps[i] and lone_ids[i] in batch_lps[i]
    if first_diff is None:
        status = "match"
    elif first_tie is not None and first_diff >= first_tie:
        status = "diverged_after_near_tie"
    elif allow_noise and in_top:
        status = "diverged_within_noise"
    else:
        status = "mismatch"
    return dict(status=status, first_diff=first_diff, first_near_tie=first_tie, length=len(lone_ids),
                gap_at_diff=None if first_diff is None or first_diff >= len(gaps) else round(gaps[first_diff], 5),
                noise=noise, in_top_at_diff=in_top)


def compare_twins(ref_ids: list[int], ref_lps: list[dict], ids: list[int], lps: list[dict], tol: float = TWIN_TOL
                  ) -> dict:
    """Greedy ids and logprobs of the kernel engine (`ids`, `lps`) against the XLA reference.

    pass: same ids, and every logprob both report (the chosen token's and the top-k) within tol
    up to the end; an id mismatch where the reference's top-2 gap is below tol (a tie within the
    tolerance) is reported as such and not failed, with the logprobs compared up to it."""
    first_diff = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), None)
    if first_diff is None and len(ref_ids) != len(ids):
        first_diff = min(len(ref_ids), len(ids))
    upto = len(ref_ids) if first_diff is None else first_diff
    max_err = 0.0
    for a, b in zip(ref_lps[:upto], lps[:upto]):
        for t, x in a.items():
            if t in b:
                max_err = max(max_err, abs(x.logprob - b[t].logprob))
    gaps = top2_gaps(ref_lps)
    differ = first_diff is not None and first_diff < min(len(ref_ids), len(ids))  # an id, not a length
    tie = differ and first_diff < len(gaps) and gaps[first_diff] < tol
    ok = max_err <= tol and (first_diff is None or tie)
    return dict(passed=bool(ok), first_diff=first_diff, tie_at_diff=bool(tie), max_logprob_err=float(max_err),
                length=len(ref_ids))


def check_pool(eng) -> list[str]:
    """Everything the scheduler holds once all requests are done (empty = nothing held)."""
    s = eng.scheduler
    bad = []
    held = [b for b in range(s.blocks.num_blocks) if s.blocks.ref_count(b) != 0]
    if held:
        bad.append(f"{len(held)} KV blocks with a nonzero reference count (e.g. {held[:5]})")
    if s.blocks.num_free != s.blocks.num_blocks:
        bad.append(f"{s.blocks.num_free} of {s.blocks.num_blocks} KV blocks on the free list")
    if s.ssm_slots.num_used:
        bad.append(f"{s.ssm_slots.num_used} SSM slots held")
    if s.pen_rows.num_used:
        bad.append(f"{s.pen_rows.num_used} penalty rows held")
    for q in ("waiting", "running", "swapped"):
        if getattr(s, q):
            bad.append(f"{len(getattr(s, q))} sequences still {q}")
    if s.swap_bytes:
        bad.append(f"{s.swap_bytes} bytes of swapped state still held")
    if eng.has_unfinished_requests():
        bad.append("the engine still has unfinished requests")
    return bad


def check(passed: bool | None, **detail) -> dict:
    return dict(passed=passed, **detail)


def family_passed(res: dict) -> bool:
    return res.get("error") is None and all(c["passed"] is not False for c in res.get("checks", {}).values())


# ---- the server part -----------------------------------------------------------------------------
def _sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            d = line[len("data: "):]
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def server_part(eng, plan: Plan, rng: np.random.Generator, vocab: int, eos) -> dict:
    try:
        import httpx

        from metrale_jax.server import BackgroundServer, ServerConfig
    except Exception as e:  # noqa: BLE001 - the GPU machine may lack the server stack
        return check(None, skipped=f"server stack not importable: {type(e).__name__}: {e}")
    reqs = []
    pl, ol = lengths(rng, plan.n_server, 1, plan.max_prompt), lengths(rng, plan.n_server, 1, plan.max_out)
    for i in range(plan.n_server):
        body: dict[str, Any] = dict(model="acceptance", prompt=random_prompt(rng, pl[i], vocab, eos),
                                    max_tokens=ol[i], ignore_eos=True, temperature=0.0)
        v = i % 6
        if v == 1:
            body |= dict(n=2, temperature=0.8, top_k=40, seed=i)
        elif v == 2:
            body |= dict(logprobs=3)
        elif v == 3:
            body |= dict(stream=True, stream_options=dict(include_usage=True))
        elif v == 4:
            body |= dict(stream=True, temperature=0.9, seed=i, stop=["77"], ignore_eos=False)
        elif v == 5:
            body |= dict(stream=True, stream_options=dict(include_usage=True), temperature=0.7, top_p=0.9,
                         repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2, seed=i)
        reqs.append(body)

    def one(body: dict) -> list[str]:
        bad = []
        n = body.get("n", 1)
        exact = body.get("ignore_eos") and not body.get("stop")
        with httpx.Client(base_url=url, timeout=600) as c:
            if not body.get("stream"):
                r = c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    return [f"HTTP {r.status_code}: {r.text[:200]}"]
                j = r.json()
                fins = [ch["finish_reason"] for ch in j["choices"]]
                got = j["usage"]["completion_tokens"]
                if len(fins) != n or any(f not in ("length", "stop") for f in fins):
                    bad.append(f"finish reasons {fins} for n={n}")
                if exact and got != n * body["max_tokens"]:
                    bad.append(f"{got} completion tokens, expected {n * body['max_tokens']}")
                if body.get("logprobs") is not None:
                    lp = j["choices"][0]["logprobs"]
                    if len(lp["tokens"]) != body["max_tokens"] or any(len(t) < 3 for t in lp["top_logprobs"]):
                        bad.append("logprobs incomplete")
                return bad
            with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return [f"HTTP {r.status_code}"]
                ev = _sse_events(r.iter_lines())
            if not ev or ev[-1] != "[DONE]":
                bad.append("stream did not end with [DONE]")
            fins = [ch["finish_reason"] for e in ev if isinstance(e, dict) for ch in e.get("choices", [])
                    if ch.get("finish_reason")]
            if len(fins) != n or any(f not in ("length", "stop") for f in fins):
                bad.append(f"stream finish reasons {fins}")
            usage = [e["usage"] for e in ev if isinstance(e, dict) and e.get("usage")]
            if body.get("stream_options") and (not usage or (exact and usage[-1]["completion_tokens"]
                                                              != n * body["max_tokens"])):
                bad.append(f"stream usage {usage[-1:] or 'missing'}")
        return bad

    def disconnect(i: int) -> list[str]:
        body = dict(model="acceptance", prompt=random_prompt(rng, 64, vocab, eos), max_tokens=plan.max_out,
                    ignore_eos=True, stream=True)
        with httpx.Client(base_url=url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got >= 3:
                        break  # leave mid-stream: closing the response hangs up
        return [] if got >= 3 else [f"disconnect stream {i}: only {got} events"]

    t0 = time.perf_counter()
    with BackgroundServer(eng, ServerConfig(model_names=("acceptance",)), log_level="warning") as srv:
        url = srv.url
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(one, b) for b in reqs] + [ex.submit(disconnect, i) for i in range(plan.n_disconnect)]
            problems = []
            for f in futs:
                try:
                    problems += f.result()
                except Exception as e:  # noqa: BLE001
                    problems.append(f"client error {type(e).__name__}: {e}")
        deadline = time.monotonic() + 60
        aborted = 0.0
        while time.monotonic() < deadline:
            aborted = _metric(httpx.get(url + "/metrics").text, "metrale_requests_aborted_total")
            if aborted >= plan.n_disconnect:
                break
            time.sleep(0.2)
        if aborted < plan.n_disconnect:
            problems.append(f"{aborted:g} aborts counted for {plan.n_disconnect} disconnects")
    return check(not problems, requests=len(reqs), disconnects=plan.n_disconnect, aborted=aborted,
                 wall_s=round(time.perf_counter() - t0, 2), problems=problems[:20])


# ---- one family ----------------------------------------------------------------------------------
# --cpu-smoke only: 3 step executables instead of the CPU default's 11 (a CPU test's compile time)
SMOKE_BUCKETS = dict(max_num_seqs=4, max_num_batched_tokens=64, decode_buckets=(4,), mixed_decode_buckets=(4,),
                     prefill_buckets=(64,))


def wants_mtp(plan: Plan) -> bool:
    """--engine-config asks for the MTP drafter: the models then get a (random) MTP head."""
    from metrale_jax.engine.spec_decode import SpeculativeConfig

    spec = SpeculativeConfig.of(dict(plan.overrides).get("speculative_config"))
    return spec is not None and spec.method == "mtp"


def engine_config(plan: Plan, attention=None):
    """The traffic engine's config: the defaults, but for dtype, max_model_len and the KV pool."""
    from metrale_jax.engine.config import EngineConfig

    kw = (SMOKE_BUCKETS if plan.smoke else {}) | dict(plan.overrides)
    return EngineConfig(dtype=plan.dtype, max_model_len=plan.max_model_len, num_kv_blocks=plan.num_kv_blocks,
                        show_progress=False, attention=attention, **kw)


def twin_config(plan: Plan, attention=None):
    """The twins' config: float32, 4 buckets (GPU); with --cpu-smoke the traffic engine's own (its
    executables then come from the persistent compilation cache)."""
    from metrale_jax.engine.config import EngineConfig

    if plan.smoke:
        return engine_config(plan, attention)
    n, t = plan.twin_seqs, plan.twin_tokens
    mbps = -(-plan.max_model_len // 16)
    return EngineConfig(dtype="float32", max_model_len=plan.max_model_len, max_num_seqs=n, max_num_batched_tokens=t,
                        decode_buckets=(n,), mixed_decode_buckets=(n,), prefill_buckets=(t,),
                        num_kv_blocks=n * mbps + 8, attention=attention, show_progress=False)


def _free():
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


def run_traffic(fam: Family, plan: Plan, seed: int, skip: set[str], res: dict) -> None:
    import jax

    from metrale_jax.engine import LLMEngine
    from metrale_jax.engine.compile import CompileCounter
    from metrale_jax.llm import LLM

    checks = res["checks"]
    t0 = time.perf_counter()
    # (--engine-config's quantization: the traffic engine's weights quantized as `LLM(quantization=...)` would)
    model, params = build_model(family_config(fam, plan), plan.dtype, seed, mtp=wants_mtp(plan),
                                quantization=dict(plan.overrides).get("quantization"))
    jax.block_until_ready(params)
    res["load_s"] = round(time.perf_counter() - t0, 2)
    eng = LLMEngine(model, params, engine_config(plan))
    del params
    c = eng.config
    comp = eng.compiler
    res |= dict(startup_s=round(eng.startup_seconds, 2), compile_s=round(comp.compile_seconds, 2),
                executables=comp.num_executables, swap_executables=len(getattr(comp, "swap_executables", {})),
                num_kv_blocks=eng.num_blocks, preemption_mode=c.preemption_mode, max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens, kernels="Pallas" if c.attention.use_pallas else "XLA")
    vocab, eos, mml = model.cfg.vocab_size, tuple(model.eos_token_ids), c.max_model_len
    rng = np.random.default_rng(seed)
    llm = LLM.from_engine(eng)
    problems: list[str] = []
    with CompileCounter() as cc:
        # 1. a batch through LLM.generate
        batch = batch_specs(rng, plan, vocab, eos)
        g0 = eng.stats().generation_tokens_total
        t1 = time.perf_counter()
        outs = llm.generate([s.prompt for s in batch], [s.params for s in batch])
        batch_wall = time.perf_counter() - t1
        batch_out = {s.rid: o for s, o in zip(batch, outs)}
        for s in batch:
            problems += check_request(batch_out[s.rid], s.prompt, s.params, eos, mml)
        # 2. staggered arrivals with aborts through add_request / step / abort
        stag = staggered_specs(rng, plan, vocab, eos, batch, batch_out, model.tokenizer)
        t1 = time.perf_counter()
        run = drive_staggered(eng, stag)
        stag_wall = time.perf_counter() - t1
        gen_tokens = eng.stats().generation_tokens_total - g0
        problems += run["problems"]
        abort_bad, stop_bad, stop_div = [], [], []
        for s in stag:
            o = run["final"].get(s.rid)
            if s.abort_after is not None:
                if s.rid in run["aborted"]:
                    if s.rid in run["final"]:
                        abort_bad.append(f"{s.rid}: finished although aborted")
                elif o is None:
                    abort_bad.append(f"{s.rid}: neither aborted nor finished")
                else:  # finished before it reached abort_after tokens (a short request): still checked
                    problems += check_request(o, s.prompt, s.params, eos, mml)
                continue
            if o is None:
                problems.append(f"{s.rid}: never finished")
                continue
            problems += check_request(o, s.prompt, s.params, eos, mml)
            if s.expect_stop_at is not None:
                ids = list(o.outputs[0].token_ids)
                if ids != s.ref_ids[:len(ids)]:
                    stop_div.append(f"{s.rid}: tokens differ from the greedy run it was derived from")
                elif o.outputs[0].finish_reason != "stop" or len(ids) > s.expect_stop_at:
                    stop_bad.append(f"{s.rid}: {o.outputs[0].finish_reason} after {len(ids)} tokens, expected a "
                                    f"stop within {s.expect_stop_at} ({s.params.stop or s.params.stop_token_ids})")
        st = eng.stats()
        n_req = len(batch) + len(stag)
        res["traffic"] = dict(
            requests=n_req, batch_requests=len(batch), staggered_requests=len(stag), aborted=len(run["aborted"]),
            steps=st.num_steps, batch_wall_s=round(batch_wall, 2), staggered_wall_s=round(stag_wall, 2),
            generated_tokens=int(gen_tokens), prompt_tokens=int(st.prompt_tokens_total),
            tokens_per_s=round(gen_tokens / max(batch_wall + stag_wall, 1e-9), 1),
            preemptions=st.num_preemptions, swaps=st.num_swaps, swap_ins=st.num_swap_ins,
            prefix_cache_hits=st.prefix_cache_hits, spec_num_drafts=st.spec_num_drafts,
            spec_draft_tokens=st.spec_draft_tokens, spec_accepted_tokens=st.spec_accepted_tokens)
        checks["all_finished"] = check(not problems, problems=problems[:20], num_problems=len(problems))
        checks["aborts"] = check(not abort_bad, aborted=len(run["aborted"]), problems=abort_bad)
        checks["stop_derived"] = check(not stop_bad, problems=stop_bad, divergences=stop_div)
        swap_ok = c.preemption_mode != "swap" or st.num_swaps > 0
        checks["preemption"] = check(st.num_preemptions > 0 and swap_ok, preemptions=st.num_preemptions,
                                     swaps=st.num_swaps, mode=c.preemption_mode)
        # 3. greedy requests alone
        if "lone" not in skip:
            cands = [s for s in batch if s.kind in GREEDY_KINDS]
            cands += [s for s in stag if s.kind in GREEDY_KINDS and s.abort_after is None]
            cands = [s for s in cands if s.params.n == 1 and s.rid in (batch_out.keys() | run["final"].keys())]
            # the longest outputs first
            cands.sort(key=lambda s: -s.params.max_tokens)
            picks = cands[:plan.n_lone]
            results, div = [], []
            for s in picks:
                o = batch_out.get(s.rid) or run["final"][s.rid]
                lone = llm.generate([s.prompt], [s.params.clone()])[0]
                cmp = compare_greedy(list(o.outputs[0].token_ids), list(lone.outputs[0].token_ids),
                                     top2_gaps(lone.outputs[0].logprobs), batch_lps=o.outputs[0].logprobs,
                                     lone_lps=lone.outputs[0].logprobs, allow_noise=plan.dtype != "float32")
                cmp["rid"] = s.rid
                if cmp["first_diff"] is not None:  # what the two runs saw there
                    i = cmp["first_diff"]
                    lps = lone.outputs[0].logprobs
                    cmp["lone_top_at_diff"] = sorted(((t, round(v.logprob, 4)) for t, v in lps[i].items()),
                                                     key=lambda x: -x[1])[:3] if i < len(lps) else None
                    cmp["ids_at_diff"] = [list(o.outputs[0].token_ids)[i:i + 1],
                                          list(lone.outputs[0].token_ids)[i:i + 1]]
                    cmp["min_gap_before_diff"] = round(min(top2_gaps(lps)[:i + 1] or [math.inf]), 5)
                results.append(cmp)
                if cmp["status"].startswith("diverged"):
                    div.append(cmp)
            checks["greedy_alone"] = check(
                all(r["status"] != "mismatch" for r in results), compared=len(results),
                strict_divergences=sum(r["status"] == "diverged_within_noise" for r in results),
                max_noise=max((r["noise"] for r in results if r["noise"] is not None), default=None),
                results=results)
            res["divergences"] = div
        # 4. the HTTP server
        if "server" not in skip:
            checks["server"] = server_part(eng, plan, rng, vocab, eos)
    checks["no_compiles"] = check(cc.backend_compiles == 0 and cc.lowerings == 0,
                                  backend_compiles=cc.backend_compiles, lowerings=cc.lowerings)
    pool = check_pool(eng)
    checks["pool_empty"] = check(not pool, problems=pool)
    del llm, eng, model
    _free()


TURN2_NEW = 5  # new ids a twin's second turn adds after turn 1 and its reply


def run_twins(fam: Family, plan: Plan, seed: int) -> dict[str, dict]:
    """Float32 twins: "twins", greedy ids and logprobs of the default kernels against the XLA
    reference; "twins_alone", the default kernels' batched greedy rows against each prompt run
    alone on the same engine, strictly (in float32 the two executions differ by ~1e-4, so only a
    lone-run top-2 gap below MIN_GAP excuses a difference)."""
    import jax

    from metrale_jax.engine import LLMEngine
    from metrale_jax.layers.attention import AttentionConfig
    from metrale_jax.llm import LLM
    from metrale_jax.sampling import SamplingParams

    cfg = family_config(fam, plan, twin=True)
    rng = np.random.default_rng(seed + 1)
    vocab = cfg["vocab_size"]
    prompts = [random_prompt(rng, n, vocab, ()) for n in plan.twin_prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=plan.twin_max_tokens, ignore_eos=True, logprobs=5)
    outs, kernels, alone = {}, {}, []
    caching, turn2, hits = False, [], {}
    # XLA's float32 dots default to TF32 on the GPU (~1e-3 relative): both engines compile their
    # XLA dots at full float32, so what differs is the kernels
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        for name, attn in (("default", None), ("xla_reference", AttentionConfig())):
            model, params = build_model(cfg, "float32", seed, tokenizer=False, mtp=plan.smoke and wants_mtp(plan))
            ecfg = twin_config(plan, attn)
            if name == "xla_reference":  # the reference computes every token (no prefix cache)
                ecfg = dataclasses.replace(ecfg, enable_prefix_caching=False)
            eng = LLMEngine(model, params, ecfg)
            kernels[name] = "Pallas" if eng.config.attention.use_pallas else "XLA"
            llm = LLM.from_engine(eng)
            outs[name] = llm.generate(prompts, sp)
            if name == "default":
                caching = eng.config.enable_prefix_caching
                h0 = eng.stats().prefix_cache_hits
                alone = [llm.generate([p], sp)[0] for p in prompts]  # with caching on: cache hits
                # second turns of the two longest conversations: turn 1 + its reply + new ids
                turn2 = [p + list(o.outputs[0].token_ids) + random_prompt(rng, TURN2_NEW, vocab, ())
                         for p, o in list(zip(prompts, outs[name]))[-2:]]
                h1 = eng.stats().prefix_cache_hits
                outs["turn2"] = llm.generate(turn2, sp)
                hits = dict(alone=h1 - h0, turn2=eng.stats().prefix_cache_hits - h1, block_size=eng.config.block_size,
                            cache_decoded=getattr(eng.scheduler.prefix_cache, "cache_decoded", True),
                            turn1_prompts=[len(p) for p in prompts[-2:]])
            else:
                outs["turn2_reference"] = llm.generate(turn2, sp)
            del eng, model, params, llm
            _free()
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    results = []
    for ref, got, p in zip(outs["xla_reference"], outs["default"], plan.twin_prompts):
        r = compare_twins(list(ref.outputs[0].token_ids), ref.outputs[0].logprobs, list(got.outputs[0].token_ids),
                          got.outputs[0].logprobs)
        r["prompt_len"] = p
        results.append(r)
    lone_res = []
    for got, lone, p in zip(outs["default"], alone, plan.twin_prompts):
        g, one = got.outputs[0], lone.outputs[0]
        r = compare_greedy(list(g.token_ids), list(one.token_ids), top2_gaps(one.logprobs), batch_lps=g.logprobs,
                           lone_lps=one.logprobs)
        r["prompt_len"] = p
        lone_res.append(r)
    out = {}
    if caching:  # the default engine's second turns (cache hits) against the reference's full prefill
        bs = hits["block_size"]
        # issue 17's bar: hits >= turn 1's block-aligned length (prompt + reply) minus one block; a
        # model whose decode path differs from its prefill path (Nemotron-H with dt limits:
        # `Model.decode_matches_prefill`) caches only what prefill computed: turn 1's prompt
        turn1 = [len(p) - TURN2_NEW for p in turn2] if hits["cache_decoded"] else hits["turn1_prompts"]
        want = sum(max(0, n // bs * bs - bs) for n in turn1)
        t2 = [compare_twins(list(r.outputs[0].token_ids), r.outputs[0].logprobs, list(g.outputs[0].token_ids),
                            g.outputs[0].logprobs) for r, g in zip(outs["turn2_reference"], outs["turn2"])]
        out["prefix_cache"] = check(all(r["passed"] for r in t2) and hits["turn2"] >= want, hits=hits,
                                    turn2_min_hits=want, turn2_lens=[len(p) for p in turn2], results=t2)
    return out | dict(
        twins=check(all(r["passed"] for r in results), kernels=kernels, hidden=cfg["hidden_size"],
                    layers=cfg["num_hidden_layers"], max_logprob_err=max(r["max_logprob_err"] for r in results),
                    results=results),
        twins_alone=check(all(r["status"] != "mismatch" for r in lone_res),
                          max_noise=max(r["noise"] for r in lone_res), results=lone_res))


def run_family(fam: Family, plan: Plan, seed: int, skip: set[str]) -> dict:
    res: dict[str, Any] = dict(family=fam.name, shape=fam.shape, checks={}, error=None)
    res["num_layers"] = family_config(fam, plan).get("num_hidden_layers")
    t0 = time.perf_counter()
    try:
        if "traffic" not in skip:
            run_traffic(fam, plan, seed, skip, res)
    except Exception as e:  # noqa: BLE001 - reported, the other families still run
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        res["checks"]["no_exception"] = check(False, where="traffic", error=res["error"])
    _free()
    if "twins" not in skip:
        try:
            res["checks"] |= run_twins(fam, plan, seed)
        except Exception as e:  # noqa: BLE001
            res["checks"]["twins"] = check(False, error=f"{type(e).__name__}: {e}",
                                           traceback=traceback.format_exc()[-3000:])
        _free()
    res["checks"].setdefault("no_exception", check(res["error"] is None))
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["passed"] = family_passed(res)
    return res


# ---- report --------------------------------------------------------------------------------------
def environment() -> dict:
    import jax

    env = dict(date_utc=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
               device=f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}", jax=jax.__version__,
               python=platform.python_version())
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        env["jaxlib"] = "?"
    try:
        import torch

        env["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        env["torch"] = "not installed"
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        env["git_commit"] = "unknown"
    return env


CHECK_ORDER = ("no_exception", "all_finished", "aborts", "stop_derived", "preemption", "no_compiles", "pool_empty",
               "greedy_alone", "server", "twins", "twins_alone", "prefix_cache")  # (the last: with caching on)


def _mark(c: dict | None) -> str:
    if c is None:
        return "-"
    return {True: "pass", False: "FAIL", None: "skip"}[c["passed"]]


def table(results: list[dict]) -> str:
    head = ["family", "layers", "startup s", "exes", "traffic s", "tok/s", "preempt/swap", "result"]
    rows = []
    for r in results:
        t = r.get("traffic", {})
        fails = [k for k in CHECK_ORDER if r["checks"].get(k, {}).get("passed") is False]
        rows.append([r["family"], str(r.get("num_layers")), f"{r.get('startup_s', '-')}",
                     str(r.get("executables", "-")),
                     f"{t.get('batch_wall_s', 0) + t.get('staggered_wall_s', 0):.1f}" if t else "-",
                     f"{t.get('tokens_per_s', '-')}", f"{t.get('preemptions', '-')}/{t.get('swaps', '-')}",
                     "PASS" if r["passed"] else "FAIL " + ",".join(fails)])
    w = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(row)) for row in [head] + rows)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU acceptance run, {env['date_utc']} UTC", "",
             f"{env['device']}; jax {env['jax']}, jaxlib {env['jaxlib']}, torch {env['torch']}; commit "
             f"`{env['git_commit']}`; {'--cpu-smoke' if report['cpu_smoke'] else 'GPU plan'}; "
             f"engine: {report['engine_config']}", "", "```", table(report["families"]), "```", ""]
    for r in report["families"]:
        lines += [f"## {r['family']} ({r.get('num_layers')} layers): {'PASS' if r['passed'] else 'FAIL'}", ""]
        if r.get("error"):
            lines += ["```", r.get("traceback", r["error"]), "```", ""]
        keys = ("load_s", "startup_s", "compile_s", "executables", "swap_executables", "num_kv_blocks",
                "preemption_mode", "kernels", "wall_s")
        lines.append("- " + ", ".join(f"{k} {r[k]}" for k in keys if k in r))
        if r.get("traffic"):
            lines.append("- traffic: " + ", ".join(f"{k} {v}" for k, v in r["traffic"].items()))
        for k in CHECK_ORDER:
            c = r["checks"].get(k)
            if c is not None:
                detail = {a: b for a, b in c.items() if a not in ("passed", "traceback")}
                lines.append(f"- **{k}**: {_mark(c)} — `{json.dumps(detail, default=str)[:600]}`")
        for d in r.get("divergences", []):
            lines.append(f"- divergence after a near tie: {d}")
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict, out: Path, stem: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / f"{stem}.json", out / f"{stem}.md"
    jp.write_text(json.dumps(report, indent=1, default=str))
    mp.write_text(markdown(report))
    return jp, mp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", default=None,
                   help=f"family to run (repeatable or comma list; default all): {', '.join(FAMILIES)}")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of acceptance_<date>.{json,md}")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes and fewer requests, on the CPU")
    p.add_argument("--skip", default="", help="comma list of parts to leave out: traffic, server, twins, lone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--git-commit", default=None, help="record this commit (where the tree has no .git)")
    p.add_argument("--engine-config", default="{}",
                   help='JSON of EngineConfig fields for the traffic engine, e.g. \'{"enable_prefix_caching": true}\' '
                        "(a variant beside the defaults; the twins keep theirs)")
    args = p.parse_args(argv)
    names = [n for f in (args.family or [",".join(FAMILIES)]) for n in f.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown family {unknown}; choose from {list(FAMILIES)}")
    skip = {s for s in args.skip.split(",") if s}
    if skip - {"traffic", "server", "twins", "lone"}:
        p.error(f"--skip takes traffic, server, twins, lone; got {sorted(skip)}")
    if args.cpu_smoke:
        import jax

        jax.config.update("jax_platforms", "cpu")
    plan = SMOKE_PLAN if args.cpu_smoke else GPU_PLAN
    try:
        overrides = json.loads(args.engine_config)
    except ValueError:
        overrides = None
    if not isinstance(overrides, dict):
        p.error(f"--engine-config must be a JSON object; got {args.engine_config!r}")
    plan = dataclasses.replace(plan, overrides=tuple(sorted(overrides.items())))
    env = environment()
    if args.git_commit:
        env["git_commit"] = args.git_commit
    stem = "acceptance_" + env["date_utc"][:10] + ("_cpu_smoke" if args.cpu_smoke else "") + (
        "_" + "_".join(k for k, _ in plan.overrides) if plan.overrides else "")
    report = dict(environment=env, cpu_smoke=args.cpu_smoke, skip=sorted(skip), families=[],
                  engine_config=f"EngineConfig(dtype={plan.dtype!r}, max_model_len={plan.max_model_len}, "
                                f"num_kv_blocks={plan.num_kv_blocks}, show_progress=False"
                                + "".join(f", {k}={v!r}" for k, v in plan.overrides) + ")")
    for name in names:
        print(f"[acceptance] {name} ...", flush=True)
        r = run_family(FAMILIES[name], plan, args.seed, skip)
        report["families"].append(r)
        write_report(report, Path(args.out), stem)
        print(f"[acceptance] {name}: {'PASS' if r['passed'] else 'FAIL'} in {r['wall_s']} s"
              + (f" ({r['error']})" if r.get("error") else ""), flush=True)
    report["passed"] = all(r["passed"] for r in report["families"])
    jp, _ = write_report(report, Path(args.out), stem)
    for r in report["families"]:
        for k in CHECK_ORDER:
            c = r["checks"].get(k)
            if c is not None and c["passed"] is False:
                detail = {a: b for a, b in c.items() if a not in ("passed", "traceback", "results")}
                print(f"  {r['family']} {k}: {json.dumps(detail, default=str)[:400]}")
    print(f"results: {jp}")
    print(table(report["families"]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
