"""Speculative decoding (engine/spec_decode.py, layers/spec_states.py) on the real tiny fixtures.

- greedy outputs with speculation (k = 2 and 4) equal plain greedy decoding for every family,
  drafts accepted and rejected: the n-gram drafter on repeated-token prompts (its drafts are
  rarely right on random-weight models), and an oracle drafter that proposes the reference
  continuation with one token corrupted at a varying place, so every accepted length 0..k occurs
  and the recurrent layers' write-on-accept is exercised at each window position;
- seeded random sampling with penalties, top-p, min-p and min_tokens gives the same tokens as
  without speculation (accepting while the target's sample equals the draft reproduces the same
  draws), and the first k+1 tokens' joint distribution passes a chi-square test against the
  exact one of a tiny-vocabulary model;
- swap preemption in the middle of speculative decoding keeps outputs exact; nothing compiles
  after start-up; every block and slot is free afterwards; `disable_by_batch_size` stops drafting
  while that many sequences run.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from metrale_jax import load_model
from metrale_jax.engine import spec_decode
from metrale_jax.engine.compile import CompileCounter
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.engine.spec_decode import NgramIndex, SpeculativeConfig, ngram_propose
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES
from tests.test_engine_hybrid import HYBRID_CONFIG, HYBRIDS, hybrid_engine
from tests.test_engine_models import TINY_CONFIG

FAMILIES = ["llama_tiny", "qwen3_tiny", "qwen3_moe_tiny", "qwen3_next_tiny", "nemotron_h_tiny", "mamba2_tiny"]

# the configs of tests/test_engine_models.py and test_engine_hybrid.py (block_size 4: windows cross
# blocks; prefill chunks beside decode rows): the plain steps compile to the executables those
# tests compiled (JAX's persistent cache serves them), only the verify steps are new
CONFIG = TINY_CONFIG
_MODELS: dict = {}
_ENGINES: dict = {}


def _engine(name: str, k: int | None) -> LLMEngine:
    """The plain engine (k None) or one speculating k tokens; the hybrids' plain engines are
    tests/test_engine_hybrid.py's (same greedy outputs whatever the buckets: batch invariance)."""
    if k is None and name in HYBRIDS:
        eng = hybrid_engine(name)[0]
        eng.scheduler = eng._new_scheduler()
        return eng
    if name not in _MODELS:
        _MODELS[name] = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    if (name, k) not in _ENGINES:
        spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
        # (test_engine_models' kernel choice: the reference attention, layers unrolled for qwen3_tiny)
        base = HYBRID_CONFIG if name in HYBRIDS else \
            CONFIG.replace(attention=AttentionConfig(unroll_layers=name == "qwen3_tiny"))
        _ENGINES[name, k] = LLMEngine(*_MODELS[name], base.replace(speculative_config=spec))
    return _ENGINES[name, k]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_whole(eng: LLMEngine):
    st = eng.stats()
    assert st.num_running == st.num_waiting == 0 and not eng.has_unfinished_requests()
    assert st.kv_blocks_free == st.kv_blocks_total
    s = eng.scheduler
    assert s.ssm_slots.num_free == s.ssm_slots.num_slots and s.pen_rows.num_free == s.pen_rows.num_slots


def _oracle(refs: list[list[int]], vocab: int):
    """A drafter that knows the reference continuations: drafts them with the token at a place
    that varies with the length corrupted (or none), so each accepted length 0..k occurs."""
    def propose(seq, k, spec):  # spec_decode.draft_tokens' signature
        t = list(seq.token_ids)
        for ref in refs:
            if len(ref) > len(t) and ref[: len(t)] == t:
                d = ref[len(t): len(t) + k]
                c = (len(t) * 7) % (k + 2)
                if c < len(d):
                    d[c] = (d[c] + 1) % vocab
                return d
        return ngram_propose(t, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return propose


def _oracle_ahead(refs: list[list[int]], vocab: int):
    """`_oracle` for a row whose last step is still in flight (overlapped verify steps;
    `spec_decode.draft_past_inflight`'s signature): with the step's window [last known token,
    `inflight` drafts] it predicts exactly what that step emits and drafts the reference after
    it, corrupted as `_oracle` does."""
    real = spec_decode.draft_past_inflight

    def ahead(seq, inflight, k, spec):
        t = list(seq.token_ids)
        for ref in refs:
            if len(ref) > len(t) and ref[: len(t)] == t:
                cont = ref[len(t):]
                a = 0
                while a < len(inflight) and a < len(cont) and cont[a] == inflight[a]:
                    a += 1
                d = cont[a + 1: a + 1 + k]
                c = ((len(t) + a + 1) * 7) % (k + 2)
                if c < len(d):
                    d[c] = (d[c] + 1) % vocab
                return d
        return real(seq, inflight, k, spec)
    return ahead


def _patch_oracle(monkeypatch, refs: list[list[int]], vocab: int) -> list[int]:
    """Both drafters replaced by the oracle (`_oracle`, `_oracle_ahead`). Returns a list that
    counts, per verify step, its rows whose window follows a step still in flight."""
    real_build = spec_decode.build_verify_step
    overlapped = []

    def build(cfg, bucket, rows):
        overlapped.append(sum(r.src_row >= 0 for r in rows))
        return real_build(cfg, bucket, rows)

    monkeypatch.setattr(spec_decode, "draft_tokens", _oracle(refs, vocab))
    monkeypatch.setattr(spec_decode, "draft_past_inflight", _oracle_ahead(refs, vocab))
    monkeypatch.setattr(spec_decode, "build_verify_step", build)
    return overlapped


def _spec_delta(eng, before):
    st = eng.stats()
    return tuple(getattr(st, f) - b for f, b in zip(("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens"),
                                                      before))


def _spec_now(eng):
    st = eng.stats()
    return st.spec_num_drafts, st.spec_draft_tokens, st.spec_accepted_tokens


def test_ngram_propose_and_config():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 2, 4) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 2, 4) == [9, 2]  # longest n-gram (1 2 3) wins
    assert ngram_propose([5, 6, 7, 5, 6], 4, 2, 2) == [7, 5, 6]  # fewer when the history ends
    assert ngram_propose([1, 2, 3, 4], 3, 2, 4) == []
    assert ngram_propose([1, 1, 1], 0, 1, 2) == []
    # the engine's incremental index gives the same drafts as the scan, step by step
    rng = np.random.default_rng(0)
    for nmin, nmax in ((1, 1), (2, 4), (3, 3)):
        for _ in range(20):
            toks = rng.integers(0, 4, 60).tolist()
            idx = NgramIndex(nmin, nmax)
            grow = 1
            while grow <= len(toks):
                assert idx.propose(toks[:grow], 3) == ngram_propose(toks[:grow], 3, nmin, nmax), (toks[:grow], nmin)
                grow += int(rng.integers(1, 4))
    c = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative_config
    assert c == SpeculativeConfig("ngram", 3) and EngineConfig(speculative_config=c).speculative_config is c
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.of({"method": "ngram", "num_spec": 3})
    with pytest.raises(ValueError):
        SpeculativeConfig("eagle", 2)
    with pytest.raises(ValueError):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig("ngram", 2, disable_by_batch_size=0)


# CI runs k = 4 on the two hybrid kinds (GDN + gated attention + MoE; Mamba-2 + attention + MoE: their
# attention layers verify too); the rest (each 10-60 s of compiles on 2 cores) are `slow`:
# `pytest -m slow tests/test_spec_decode.py`
# in CI: a hybrid (synchronous verify steps, GDN states written on accept) and an attention-only
# model (overlapped verify steps); Nemotron-H's Mamba-2 states: test_swap_preemption_during_speculation
_FAST = {("qwen3_next_tiny", 4), ("llama_tiny", 4)}


@pytest.mark.parametrize("name,k", [(n, k) if (n, k) in _FAST else pytest.param(n, k, marks=pytest.mark.slow)
                                    for k in (4, 2) for n in FAMILIES])
def test_greedy_equals_plain_decoding(name, k, monkeypatch):
    base = _engine(name, None)
    vocab = base.vocab_size
    rng = np.random.default_rng(3)
    rep = rng.integers(3, vocab, 4).tolist()
    # repeated-token prompts (n-gram drafts), an odd-length random one, a long one prefilled in
    # chunks, one that runs into max_model_len (its rows draft fewer tokens near the end)
    mml = _engine(name, k).config.max_model_len
    prompts = [rep * 4, [7, 8, 7, 8, 7, 8, 7], rng.integers(3, vocab, 13).tolist(), rng.integers(3, vocab, 40).tolist(),
               rng.integers(3, vocab, mml - 13).tolist()]
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 17, 30, 9, 13)]
    ref = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], sp))
    eng = _engine(name, k)
    with CompileCounter() as cc:
        # the n-gram drafter alone
        b0 = _spec_now(eng)
        assert _ids(eng.generate([{"prompt_token_ids": p} for p in prompts], sp)) == ref
        nd, ntok, _ = _spec_delta(eng, b0)
        assert nd > 0 and ntok > 0
        # the oracle: accepted and rejected drafts at every window position
        overlapped = _patch_oracle(monkeypatch, [p + r for p, r in zip(prompts, ref)], vocab)
        b0 = _spec_now(eng)
        assert _ids(eng.generate([{"prompt_token_ids": p} for p in prompts], sp)) == ref
        nd, ntok, acc = _spec_delta(eng, b0)
        assert 0 < acc < ntok, (nd, ntok, acc)
        # attention-only models overlap their verify steps (windows moved on the device by what
        # the step in flight accepted); the hybrids' stay synchronous
        assert (sum(1 for n in overlapped if n) > len(overlapped) // 2) == eng._spec_overlap, overlapped
        assert eng._spec_overlap == (name not in HYBRIDS)
        monkeypatch.undo()
        if name == "llama_tiny":  # (a scheduler rule: one family suffices)
            _check_disable_by_batch_size(eng, prompts, sp, ref, monkeypatch)
    assert cc.lowerings == 0 and cc.backend_compiles == 0
    _assert_whole(eng)


def _check_disable_by_batch_size(eng, prompts, sp, ref, monkeypatch):
    """`disable_by_batch_size`: no row drafts while that many sequences run, and drafting resumes
    once fewer do (same outputs)."""
    real_build = spec_decode.build_verify_step
    drafted_at = []  # running sequences at each verify step that carries drafts

    def build(cfg, bucket, rows):
        if any(len(r.tokens) > 1 for r in rows):
            drafted_at.append(len(eng.scheduler.running))
        return real_build(cfg, bucket, rows)

    monkeypatch.setattr(spec_decode, "build_verify_step", build)
    spec = eng.config.speculative_config
    try:
        for off_at in (3, 1):
            monkeypatch.setattr(eng, "config", eng.config.replace(
                speculative_config=dataclasses.replace(spec, disable_by_batch_size=off_at)))
            eng.scheduler = eng._new_scheduler()
            drafted_at.clear()
            b0 = _spec_now(eng)
            assert _ids(eng.generate([{"prompt_token_ids": p} for p in prompts], sp)) == ref
            nd = _spec_delta(eng, b0)[0]
            assert all(n < off_at for n in drafted_at), (off_at, drafted_at)
            # (3: the two longest outputs run on alone, one of them repeating its prompt's 4 tokens)
            assert (nd > 0) == (off_at > 1) and (len(drafted_at) > 0) == (off_at > 1), (off_at, nd, drafted_at)
            _assert_whole(eng)
    finally:
        monkeypatch.undo()
        eng.scheduler = eng._new_scheduler()


@pytest.mark.parametrize("name", ["qwen3_next_tiny", "llama_tiny"])
def test_seeded_sampling_with_every_parameter_equals_plain(name, monkeypatch):
    """The same seeds give the same tokens with and without speculation: penalties (counted per
    window position), top-p, min-p, top-k, min_tokens suppression and logprobs all apply to the
    target distribution of every position (additive logit_bias too, beside min_tokens' stop ids in
    the same table); with overlapped verify steps (llama_tiny) too, whose output indices (the
    seeds' counters) move with the accepted drafts on the device."""
    base, eng = _engine(name, None), _engine(name, 4)
    vocab = base.vocab_size
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (6, 11, 3, 5, 7)]
    eos = base.eos_token_ids[0] if base.eos_token_ids else 1
    allowed = rng.choice(np.arange(3, vocab), 12, replace=False).tolist()
    sps = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=1, logprobs=1),
           SamplingParams(temperature=1.0, min_p=0.05, top_k=40, presence_penalty=0.7, frequency_penalty=0.4,
                          repetition_penalty=1.3, max_tokens=20, seed=2, min_tokens=12, stop_token_ids=[eos]),
           SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=16, ignore_eos=True, seed=3),
           # allowed_token_ids / logit_bias: every window position masked, drafts cut where it bans
           SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, seed=4, allowed_token_ids=allowed,
                          logit_bias={allowed[0]: -100, allowed[1]: -100}),
           SamplingParams(temperature=0.9, max_tokens=16, seed=5, min_tokens=8, stop_token_ids=[eos], logprobs=1,
                          logit_bias={allowed[2]: 4.0, allowed[3]: 2.5, allowed[4]: -3.0})]
    outs = base.generate([{"prompt_token_ids": p} for p in prompts], sps)
    ref = _ids(outs)
    assert set(ref[3]) <= set(allowed[2:])
    overlapped = _patch_oracle(monkeypatch, [p + r for p, r in zip(prompts, ref)], vocab)
    b0 = _spec_now(eng)
    got = eng.generate([{"prompt_token_ids": p} for p in prompts], sps)
    assert _ids(got) == ref
    _, ntok, acc = _spec_delta(eng, b0)
    assert 0 < acc < ntok
    assert any(overlapped) == eng._spec_overlap
    for a, b in zip(outs, got):
        lp_a = [d[t].logprob for t, d in zip(a.outputs[0].token_ids, a.outputs[0].logprobs or [])]
        lp_b = [d[t].logprob for t, d in zip(b.outputs[0].token_ids, b.outputs[0].logprobs or [])]
        np.testing.assert_allclose(lp_b, lp_a, atol=1e-4)
    _assert_whole(eng)


def test_swap_preemption_during_speculation():
    name = "nemotron_h_tiny"
    base, eng = _engine(name, None), _engine(name, 4)
    rng = np.random.default_rng(7)
    rep = rng.integers(3, 256, 3).tolist()
    prompts = [rep * 7, rng.integers(3, 256, 11).tolist(), rep * 5 + [9], rng.integers(3, 256, 3).tolist()]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], sp))
    eng.scheduler = eng._new_scheduler(num_blocks=eng.config.max_blocks_per_seq + 4)
    try:
        assert _ids(eng.generate([{"prompt_token_ids": p} for p in prompts], sp)) == ref
        st = eng.stats()
        assert st.num_swaps > 0 and st.num_swap_ins == st.num_swaps
        _assert_whole(eng)
    finally:
        eng.scheduler = eng._new_scheduler()


def test_random_sampling_chi_square():
    """Joint law of the first k+1 = 3 sampled tokens of a 4-token-vocabulary model, with n-gram
    drafts on a repetitive prompt: speculative samples against the exact law (model.forward)."""
    from scipy import stats

    from metrale_jax.model import random_model

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 4, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    model, params = random_model(cfg, scale=0.3, seed=1)  # a spread-out law (draft acceptance ~0.3)
    k = 2
    econf = EngineConfig(dtype="float32", max_model_len=32, block_size=4, num_kv_blocks=200, max_num_seqs=16,
                         max_num_batched_tokens=128, decode_buckets=(16,), mixed_decode_buckets=(16,),
                         prefill_buckets=(128,), max_prefill_streams=16, max_logprobs=0, show_progress=False,
                         speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1})
    eng = LLMEngine(model, params, econf)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    n = 1500
    sp = [SamplingParams(temperature=1.0, max_tokens=k + 1, ignore_eos=True, seed=i) for i in range(n)]
    got = _ids(eng.generate([{"prompt_token_ids": prompt}] * n, sp))
    st = eng.stats()
    assert st.spec_accepted_tokens > 0 and st.spec_accepted_tokens < st.spec_draft_tokens
    conts = list(itertools.product(range(4), repeat=k + 1))
    toks = np.asarray([prompt + list(c) for c in conts], np.int32)
    logits = np.asarray(model.forward(params, toks), np.float64)  # [64, L, V]
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    p0 = len(prompt) - 1
    exact = np.exp([sum(lp[i, p0 + j, c[j]] for j in range(k + 1)) for i, c in enumerate(conts)])
    counts = np.zeros(len(conts))
    for g in got:
        counts[conts.index(tuple(g))] += 1
    keep = exact * n >= 5  # pool the rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp_ = np.append(exact[keep], exact[~keep].sum()) * n
    obs, exp_ = obs[exp_ > 0], exp_[exp_ > 0]
    _, pval = stats.chisquare(obs, exp_)
    assert pval > 1e-3, (pval, obs, exp_)


def test_cli_serve_option_and_metrics():
    import argparse

    from metrale_jax import cli
    from metrale_jax.server.cli import add_engine_args, engine_config_from_args
    from metrale_jax.server.engine_loop import StatsSnapshot
    from metrale_jax.server.metrics import ServerMetrics

    text = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--speculative-config", text]), "m")
    assert cfg.speculative_config == SpeculativeConfig("ngram", 2, prompt_lookup_max=3)
    args = cli.build_parser().parse_args(["generate", "x", "--speculative-config", text])
    assert cli.engine_config_from_args(args).speculative_config == cfg.speculative_config
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--speculative-config", '{"method": "medusa"}'])
    m = ServerMetrics()
    m.attach_engine(lambda: StatsSnapshot(spec_num_drafts=3, spec_draft_tokens=9, spec_accepted_tokens=5), lambda: 0)
    out = m.render().decode()
    for name, v in (("num_drafts", 3), ("num_draft_tokens", 9), ("num_accepted_tokens", 5)):
        assert f"metrale_spec_decode_{name}_total {v}.0" in out


@pytest.mark.slow
@pytest.mark.parametrize("name,verify_decode_kernel", [("qwen3_next_tiny", True), ("nemotron_h_tiny", True),
                                                       ("llama_tiny", False), ("llama_tiny", True)])
def test_verify_with_pallas_kernels_interpreted(name, verify_decode_kernel, monkeypatch):
    """The GPU path of a verify step (the decode kernel over the windows, the GPU default, or the
    Pallas prefill attention without `verify_decode_kernel`; conv1d and KV-write kernels, the
    Python layer loop), interpreted on the CPU: the same greedy tokens as plain decoding; for
    llama_tiny with overlapped verify steps (windows moved on the device)."""
    base = _engine(name, None)
    att = AttentionConfig(use_pallas=True, interpret=True, unroll_layers=True,
                          verify_decode_kernel=verify_decode_kernel)
    # (its own copy of the weights: unroll_layers splits them in place, and _MODELS' serve other engines)
    eng = LLMEngine(*load_model(FIXTURES / name, dtype="float32", show_progress=False),
                    CONFIG.replace(attention=att, speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 12, 30)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = _ids(base.generate([{"prompt_token_ids": p} for p in prompts], sp))
    overlapped = _patch_oracle(monkeypatch, [p + r for p, r in zip(prompts, ref)], 256)
    assert _ids(eng.generate([{"prompt_token_ids": p} for p in prompts], sp)) == ref
    st = eng.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert any(overlapped) == eng._spec_overlap == (name == "llama_tiny")


@pytest.mark.slow
def test_lora_adapters_with_speculation(monkeypatch):
    """Multi-LoRA (expert adapters on Qwen3-Next) under speculation: each row's verify window runs
    its own adapter; greedy ids and logprobs equal transformers + peft's goldens."""
    from tests.test_lora import LLM as _LLM
    from tests.test_lora import LORA, LoRARequest, _check, _engine, _run

    eng = _engine("qwen3_next_tiny", preemption_mode="recompute",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    g = dict(np.load(LORA / "qwen3_next_tiny" / "golden.npz"))
    reqs = {"base": None, "experts": LoRARequest("e1", 1, str(LORA / "qwen3_next_tiny" / "experts")),
            "experts2": LoRARequest("e2", 2, str(LORA / "qwen3_next_tiny" / "experts2"))}
    names = ["experts", "base", "experts2", "experts"]
    refs = [g["prompts"][i, : g["prompt_lens"][i]].tolist() + g[f"{n}_greedy"][i].tolist() for i, n in enumerate(names)]
    monkeypatch.setattr(spec_decode, "draft_tokens", _oracle(refs, eng.vocab_size))
    _check(_run(_LLM.from_engine(eng), g, names, reqs), g, names)
    st = eng.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens


@pytest.mark.slow
def test_prefix_caching_with_speculation(monkeypatch):
    """Prefix caching (KV blocks and SSM snapshots, decode-time ones included) on Qwen3-Next with
    speculation: a second turn restores the first turn's cached state, and the snapshots taken
    after verify steps are of verified states at block boundaries: the same tokens as plain."""
    name = "qwen3_next_tiny"
    base = _engine(name, None)
    model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    eng = LLMEngine(model, params, HYBRID_CONFIG.replace(
        enable_prefix_caching=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    rng = np.random.default_rng(11)
    first = [rng.integers(3, 256, n).tolist() for n in (9, 14)]
    sp = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    ref1 = _ids(base.generate([{"prompt_token_ids": p} for p in first], sp))
    second = [p + r + [7, 8] for p, r in zip(first, ref1)]
    ref2 = _ids(base.generate([{"prompt_token_ids": p} for p in second], sp))
    refs = [p + r for p, r in zip(first + second, ref1 + ref2)]
    monkeypatch.setattr(spec_decode, "draft_tokens", _oracle(refs, 256))
    assert _ids(eng.generate([{"prompt_token_ids": p} for p in first], sp)) == ref1
    assert _ids(eng.generate([{"prompt_token_ids": p} for p in second], sp)) == ref2
    st = eng.stats()
    assert st.prefix_cache_hits > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    _assert_whole(eng)
