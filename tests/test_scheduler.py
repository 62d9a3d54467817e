"""Scheduler properties, run through the real engine loop, metadata builder and compiled steps
over `FakeModel` (whose greedy continuation a host loop computes exactly): random arrivals,
prompt lengths, budgets, pool sizes (blocks, SSM slots, swap space), aborts and bad requests,
under preemption by swap and by recompute, with and without SSM state. Every request finishes
with exactly the reference tokens or is rejected cleanly; the pools are whole again afterwards.
FakeModel's per-slot state (a running sum, a token count checked against the position, the last
two tokens) turns a swap that restores the wrong, stale or no state into wrong tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from metrale_jax.engine import spec_decode
from metrale_jax.engine.scheduler import Scheduler, SeqStatus
from metrale_jax.engine.spec_decode import SpeculativeConfig
from metrale_jax.engine.testing import fake_engine, fake_greedy, fake_next_token
from metrale_jax.errors import PromptTooLongError
from metrale_jax.sampling import SamplingParams

# (use_ssm, preemption_mode): the defaults ("auto": swap with SSM state, recompute without) and
# the other two combinations
ENGINES = {"ssm-swap": (True, "auto"), "kv-only-recompute": (False, "auto"),
           "ssm-recompute": (True, "recompute"), "kv-only-swap": (False, "swap"),
           # speculative decoding (k = 3) with an oracle drafter (`_spec_oracle`): synchronous verify
           # steps with SSM state, overlapped ones without (engine/spec_decode.py `overlaps`)
           "ssm-swap-spec": (True, "auto"), "kv-only-recompute-spec": (False, "auto"),
           "kv-only-swap-spec": (False, "swap")}
SPEC = SpeculativeConfig("ngram", 3)


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k == "kv-only-swap-spec" else k
                                        for k in ENGINES])
def engine(request):
    use_ssm, mode = ENGINES[request.param]
    kw = {} if mode == "auto" else {"preemption_mode": mode}
    if request.param.endswith("-spec"):
        kw["speculative_config"] = SPEC
    eng = fake_engine(use_ssm=use_ssm, **kw)
    assert eng.config.preemption_mode == ("swap" if "swap" in request.param else "recompute")
    yield eng
    eng.scheduler = eng._new_scheduler()


def _assert_pools_whole(s: Scheduler):
    assert not s.waiting and not s.running and not s.swapped
    assert s.blocks.num_free == s.blocks.num_blocks
    assert all(s.blocks.ref_count(b) == 0 for b in range(s.blocks.num_blocks))
    assert s.pen_rows.num_free == s.pen_rows.num_slots
    assert s.ssm_slots.num_free == s.ssm_slots.num_slots
    assert s.swap_bytes == 0


def _spec_oracle(w, use_ssm: bool):
    """A drafter that knows FakeModel's greedy continuation (no penalties) and corrupts one draft
    at a place that varies with the length, so drafts are accepted and rejected at every offset."""
    def propose(seq, k, spec):  # spec_decode.draft_tokens' signature
        ids, out = list(seq.token_ids), []
        for _ in range(k):
            out.append(fake_next_token(w, ids, use_ssm))
            ids.append(out[-1])
        c = (len(seq.token_ids) * 7) % (k + 2)
        if c < k:
            out[c] = (out[c] + 1) % w.shape[0]
        return out
    return propose


def _spec_oracle_ahead(w, use_ssm: bool):
    """`_spec_oracle` for a row whose last step is still in flight (spec_decode.draft_past_inflight's
    signature): the greedy continuation predicts what that step emits, the drafts follow it."""
    def propose(seq, inflight, k, spec):
        ids, cont = list(seq.token_ids), []
        for _ in range(len(inflight) + 1 + k):
            cont.append(fake_next_token(w, ids, use_ssm))
            ids.append(cont[-1])
        a = next((i for i, d in enumerate(inflight) if cont[i] != d), len(inflight))
        out = cont[a + 1: a + 1 + k]
        c = ((len(seq.token_ids) + a + 1) * 7) % (k + 2)
        if c < len(out):
            out[c] = (out[c] + 1) % w.shape[0]
        return out
    return propose


request_st = st.fixed_dictionaries(dict(
    arrival=st.integers(0, 30),
    prompt_len=st.integers(1, 70),
    max_tokens=st.integers(1, 40),
    ignore_eos=st.booleans(),
    n=st.sampled_from([1, 1, 1, 2]),
    abort_after=st.one_of(st.none(), st.integers(0, 25)),
    penalty=st.booleans(),
    seed=st.integers(0, 2**31),
))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=9),
    num_blocks=st.integers(32, 48),
    budget=st.integers(4, 16),
    max_seqs=st.integers(2, 4),
    streams=st.integers(1, 2),
    max_prefill=st.sampled_from([8, 16]),
    too_long=st.booleans(),
    ssm_slots=st.integers(1, 4),
    swap_space=st.sampled_from([None, None, None, 0, 400]),  # bytes (a 30-token sequence takes 144)
    lookahead=st.sampled_from([0, 0, 3]),  # blocks past a decode row's window (an MTP drafter's k - 1)
)
def test_scheduler_property(engine, reqs, num_blocks, budget, max_seqs, streams, max_prefill, too_long,
                            ssm_slots, swap_space, lookahead):
    eng = engine
    w = np.asarray(eng.params["w"])
    if eng.config.speculative_config is not None:
        orig = spec_decode.draft_tokens, spec_decode.draft_past_inflight
        spec_decode.draft_tokens = _spec_oracle(w, eng.model.use_ssm)
        spec_decode.draft_past_inflight = _spec_oracle_ahead(w, eng.model.use_ssm)
        try:
            _run_property(eng, w, reqs, num_blocks, budget, max_seqs, streams, max_prefill, too_long, ssm_slots,
                          swap_space, lookahead)
        finally:
            spec_decode.draft_tokens, spec_decode.draft_past_inflight = orig
        st_ = eng.stats()
        assert st_.spec_accepted_tokens <= st_.spec_draft_tokens
        event(f"spec accepted: {st_.spec_accepted_tokens > 0}")
    else:
        _run_property(eng, w, reqs, num_blocks, budget, max_seqs, streams, max_prefill, too_long, ssm_slots,
                      swap_space, lookahead)


def _run_property(eng, w, reqs, num_blocks, budget, max_seqs, streams, max_prefill, too_long, ssm_slots,
                  swap_space, lookahead=0):
    limits = dict(num_ssm_slots=ssm_slots) if eng.uses_ssm else {}
    if swap_space is not None:
        limits["swap_space_bytes"] = swap_space
    eng.scheduler = eng._new_scheduler(
        num_blocks=num_blocks, max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs,
        max_prefill_streams=streams, max_prefill_tokens=max_prefill, **limits)
    eng.scheduler.num_lookahead_tokens = lookahead  # (the engine sets it only with an MTP drafter)
    free0 = (eng.scheduler.blocks.num_free, eng.scheduler.ssm_slots.num_free, eng.scheduler.pen_rows.num_free)
    mml = eng.config.max_model_len
    rng = np.random.default_rng(len(reqs) * 1000 + num_blocks)
    prompts = [rng.integers(2, 64, r["prompt_len"]).tolist() for r in reqs]
    expected, final, added, aborted = {}, {}, {}, set()
    step = 0
    while True:
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                rid = f"r{i}"
                # greedy or penalised-greedy (the penalty rows survive a swap, and are recounted
                # after a recompute)
                pen = 0.5 if r["penalty"] else 0.0
                sp = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                                    n=r["n"], seed=r["seed"], presence_penalty=pen)
                eng.add_request(rid, {"prompt_token_ids": prompts[i]}, sp)
                added[rid] = (step, r)
                expected[rid] = fake_greedy(w, prompts[i], r["max_tokens"], use_ssm=eng.model.use_ssm,
                                            ignore_eos=r["ignore_eos"], max_len=mml, presence_penalty=pen)
        if too_long and step == 3:
            with pytest.raises(PromptTooLongError):
                eng.add_request("bad", {"prompt_token_ids": [5] * mml}, SamplingParams())
            assert "bad" not in eng.requests
        for rid, (t0, r) in added.items():
            if r["abort_after"] is not None and step == t0 + r["abort_after"] and rid not in final:
                eng.abort(rid)
                aborted.add(rid)
        for o in eng.step():
            assert o.request_id not in final, "output after finish"
            assert o.request_id not in aborted, "output after abort"
            if o.finished:
                final[o.request_id] = o
        step += 1
        if step > max(r["arrival"] for r in reqs) and not eng.has_unfinished_requests():
            break
        assert step < 3000, "scheduler livelock"
    for rid, (_, r) in added.items():
        if rid in aborted and rid not in final:
            continue
        assert rid in final, f"{rid} never finished"
        o = final[rid]
        assert len(o.outputs) == r["n"]
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length")
            if rid in expected:
                assert c.token_ids == expected[rid], f"{rid}: {c.token_ids} != {expected[rid]}"
    s = eng.scheduler
    _assert_pools_whole(s)
    assert (s.blocks.num_free, s.ssm_slots.num_free, s.pen_rows.num_free) == free0
    if eng.config.preemption_mode == "recompute" or swap_space == 0:
        assert s.num_swaps == 0
    elif swap_space is None:
        assert s.num_swaps == s.num_preemptions  # every preemption swapped
    assert s.num_swap_ins <= s.num_swaps
    st_ = eng.stats()
    assert (st_.num_swaps, st_.num_swap_ins, st_.num_swapped, st_.swap_bytes) == (s.num_swaps, s.num_swap_ins, 0, 0)
    target(float(s.num_preemptions), label="preemptions")
    target(float(s.num_swaps), label="swaps")
    event(f"preempted: {s.num_preemptions > 0}")
    event(f"swapped: {s.num_swaps > 0}")
    event(f"aborted: {bool(aborted)}")


def test_preemption_keeps_outputs_exact(engine):
    """A pool that holds barely one long sequence: preemption must happen, and recompute must
    reproduce exactly the tokens an unpreempted run gives."""
    eng = engine
    w = np.asarray(eng.params["w"])
    eng.scheduler = eng._new_scheduler(num_blocks=eng.config.max_blocks_per_seq + 2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 64, n).tolist() for n in (30, 11, 45, 3)]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt_tokens0 = eng.stats().prompt_tokens_total
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert eng.scheduler.num_preemptions > 0
    if eng.config.preemption_mode == "swap":  # every preemption swapped, and every swap came back
        assert eng.scheduler.num_swaps == eng.scheduler.num_swap_ins == eng.scheduler.num_preemptions
        # swapping recomputes nothing: each prompt token went through the model once
        assert eng.stats().prompt_tokens_total - prompt_tokens0 == sum(map(len, prompts))
    else:
        assert eng.scheduler.num_swaps == 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == fake_greedy(w, p, 60, use_ssm=eng.model.use_ssm, ignore_eos=True,
                                                     max_len=eng.config.max_model_len)
    _assert_pools_whole(eng.scheduler)
    assert eng.stats().num_preemptions == eng.scheduler.num_preemptions
    eng.scheduler = eng._new_scheduler()


def test_budget_streams_and_decode_first(engine):
    """Per step: tokens <= budget, streams <= max, decode rows always scheduled (never stalled by
    a long prefill), and a long prompt is chunked."""
    eng = engine
    s = eng._new_scheduler(max_num_batched_tokens=8, max_prefill_streams=2)
    eng.scheduler = s
    eng.add_request("short", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=30,
                                                                              ignore_eos=True))
    eng.step()  # prefills "short" and samples its first token
    eng.add_request("long", {"prompt_token_ids": list(range(2, 62))}, SamplingParams(temperature=0, max_tokens=2))
    short = eng.requests["short"].seqs[0]
    chunks_seen = 0
    while eng.requests.get("long") is not None and eng.requests["long"].seqs[0].num_outputs == 0:
        # tokens sampled, read or still on the device (with speculation on, a step may stay in
        # flight, or be read at once: spec_decode.sync_for_drafts)
        before = short.num_outputs + short.inflight
        eng.step()
        if eng.requests.get("short") is not None:
            assert short.num_outputs + short.inflight == before + 1, "decode stalled behind a prefill"
        chunks_seen += 1
    assert chunks_seen >= 60 // 7  # chunked: at most budget - 1 prefill tokens per step
    eng.run_to_completion()
    _assert_pools_whole(s)
    assert short.status == SeqStatus.FINISHED
    eng.scheduler = eng._new_scheduler()


def test_parallel_sampling_shares_the_prompt(engine):
    """n > 1 without SSM state: followers share the leader's whole prompt blocks (ref counts), and
    their seeded samples equal those of the same sequences run without sharing."""
    eng = engine
    eng.scheduler = eng._new_scheduler()
    s = eng.scheduler
    bs = eng.config.block_size
    p = np.random.default_rng(9).integers(2, 64, 45).tolist()
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=3, ignore_eos=True)
    eng.add_request("n3", {"prompt_token_ids": p}, sp)
    seqs = eng.requests["n3"].seqs
    peak_refs = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak_refs = max([peak_refs] + [s.blocks.ref_count(b) for b in range(s.blocks.num_blocks)])
    shared = (len(p) - 1) // bs
    if eng.model.use_ssm:  # no leader to share with; prefix caching (the default) may share cached blocks
        assert all(q.leader is None for q in seqs[1:])
        assert peak_refs == 1 or eng.config.enable_prefix_caching
    else:
        assert peak_refs == 3, "the followers did not share the prompt blocks"
        assert eng.stats().prompt_tokens_total >= len(p) + 2 * (len(p) - shared * bs)
    _assert_pools_whole(s)
    # the same three sequences, each alone as n=1 with its sequence index: same tokens
    got = None
    eng.add_request("n3b", {"prompt_token_ids": p}, sp)
    got = [c.token_ids for c in eng.run_to_completion()["n3b"].outputs]
    assert len({tuple(g) for g in got}) == 3
    eng.add_request("n1", {"prompt_token_ids": p}, sp.clone(n=1))
    assert eng.run_to_completion()["n1"].outputs[0].token_ids == got[0]
