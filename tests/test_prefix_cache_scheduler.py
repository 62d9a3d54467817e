"""Prefix caching under the scheduler property test's conditions (tests/test_scheduler.py), through
the real engine loop over `FakeModel`: prompts that share prefixes and later turns that resend
earlier conversations, random arrivals, budgets, small pools (cached blocks evicted), preemption by
swap and by recompute, aborts, SSM snapshot slots few enough to be evicted, and a host tier that
evicted cached blocks go to and come back from. Every request ends with exactly FakeModel's
reference tokens (its cache holds token ids and its SSM state checks the position, so a wrong
cached block or a stale, misplaced or missing snapshot changes the tokens); no step writes into a
block that is shared or cached; afterwards every block, slot and snapshot slot is free (cached
blocks count as free) and the hit counters add up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from metrale_jax.cache.prefix_cache import CachingBlockAllocator, PrefixCache, block_hash
from metrale_jax.engine.testing import fake_engine, fake_greedy
from metrale_jax.sampling import SamplingParams
from tests.test_scheduler import _assert_pools_whole

# use_ssm, overrides
# FakeModel's blocks take 16 bytes: a host tier of 24 blocks
HOST_TIER = 24 * 16 / 1e9
ENGINES = {
    "kv-recompute-host-tier": (False, dict(enable_prefix_caching=True, kv_offloading_size=HOST_TIER,
                                           kv_offloading_restore=True)),
    "ssm-swap-3-snapshots-host-tier": (True, dict(enable_prefix_caching=True, max_ssm_snapshots=3,
                                                  kv_offloading_size=HOST_TIER, kv_offloading_restore=True)),
    "ssm-recompute": (True, dict(enable_prefix_caching=True, preemption_mode="recompute")),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request):
    use_ssm, kw = ENGINES[request.param]
    eng = fake_engine(use_ssm=use_ssm, **kw)
    assert eng.scheduler.prefix_cache is not None
    yield eng
    eng.scheduler = eng._new_scheduler()


def check_writes(sched, step) -> None:
    """No row of `step` writes into a block that another sequence shares or that is cached."""
    bs = sched.block_size
    pc = sched.prefix_cache
    writes = [(s, s.num_computed, 1) for s in step.decode] + [(c.seq, c.start, c.length) for c in step.chunks]
    for seq, start, n in writes:
        for b in {seq.blocks[p // bs] for p in range(start, start + n)}:
            assert sched.blocks.ref_count(b) == 1, f"block {b} written while shared"
            assert pc.blocks.key_of(b) is None, f"block {b} written while cached"


def assert_cache_whole(sched) -> None:
    _assert_pools_whole(sched)
    pc = sched.prefix_cache
    free = set(pc._free_snaps)
    held = set(pc._snaps.values())
    assert not free & held and free | held == set(pc.snapshot_slots), "snapshot slots leaked"
    assert len(pc._free_snaps) == len(free)
    for b in range(sched.blocks.num_blocks):  # the table and the reverse map agree
        k = pc.blocks.key_of(b)
        assert k is None or pc.blocks.cached(k) == b


request_st = st.fixed_dictionaries(dict(
    arrival=st.integers(0, 30),
    shared=st.integers(0, 40),  # leading tokens of the common base prompt
    extends=st.one_of(st.none(), st.integers(0, 8)),  # resend request j's prompt + output first
    tail=st.integers(1, 40),
    max_tokens=st.integers(1, 40),
    abort_after=st.one_of(st.none(), st.integers(0, 25)),
    prompt_logprobs=st.sampled_from([None, None, None, 0]),
    penalty=st.sampled_from([False, False, False, True]),
    n=st.sampled_from([1, 1, 1, 2]),
))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=9),
    num_blocks=st.integers(32, 44),
    budget=st.integers(4, 16),
    max_seqs=st.integers(2, 4),
    streams=st.integers(1, 2),
    ssm_slots=st.integers(1, 4),
    plp_rows=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_prefix_cache_property(engine, reqs, num_blocks, budget, max_seqs, streams, ssm_slots, plp_rows, seed):
    eng = engine
    w = np.asarray(eng.params["w"])
    limits = dict(num_ssm_slots=ssm_slots) if eng.uses_ssm else {}
    eng.scheduler = sched = eng._new_scheduler(
        num_blocks=num_blocks, max_num_batched_tokens=max(budget, max_seqs), max_num_seqs=max_seqs,
        max_prefill_streams=streams, max_prompt_lp_tokens=plp_rows, **limits)
    orig_schedule = sched.schedule

    def schedule():
        step = orig_schedule()
        check_writes(sched, step)
        plp = sum(min(c.length, sched._prompt_lp_positions(c.seq, c.start)) for c in step.chunks)
        assert plp <= plp_rows, f"{plp} prompt-logprob positions in one step (limit {plp_rows})"
        return step

    sched.schedule = schedule
    mml = eng.config.max_model_len
    rng = np.random.default_rng(seed)
    base = rng.integers(2, 64, 40).tolist()
    prompts, expected, final, added, aborted = {}, {}, {}, {}, set()
    step = 0
    while True:
        for i, r in enumerate(reqs):
            if r["arrival"] != step:
                continue
            j = r["extends"]
            if j is not None and j < i and f"r{j}" in expected:  # a later turn of request j's conversation
                head = prompts[f"r{j}"] + expected[f"r{j}"]
            else:
                head = base[: r["shared"]]
            prompt = (head + rng.integers(2, 64, r["tail"]).tolist())[: mml - r["max_tokens"]]
            rid = f"r{i}"
            pen = 0.5 if r["penalty"] else 0.0
            sp = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, n=r["n"],
                                prompt_logprobs=r["prompt_logprobs"], presence_penalty=pen)
            eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
            prompts[rid] = prompt
            added[rid] = (step, r)
            expected[rid] = fake_greedy(w, prompt, r["max_tokens"], use_ssm=eng.model.use_ssm,
                                        ignore_eos=True, max_len=mml, presence_penalty=pen)
        for rid, (t0, r) in added.items():
            if r["abort_after"] is not None and step == t0 + r["abort_after"] and rid not in final:
                eng.abort(rid)
                aborted.add(rid)
        for o in eng.step():
            assert o.request_id not in final and o.request_id not in aborted
            if o.finished:
                final[o.request_id] = o
        step += 1
        if step > max(r["arrival"] for r in reqs) and not eng.has_unfinished_requests():
            break
        assert step < 3000, "scheduler livelock"
    for rid, (_, r) in added.items():
        if rid in aborted and rid not in final:
            continue
        o = final[rid]
        assert [c.token_ids for c in o.outputs] == [expected[rid]] * r["n"], rid
        if r["prompt_logprobs"] is not None:  # computed, never skipped by a cache hit
            assert o.prompt_logprobs[0] is None and all(d is not None for d in o.prompt_logprobs[1:])
    assert_cache_whole(sched)
    s = eng.stats()
    assert 0 <= s.prefix_cache_hits <= s.prefix_cache_queries
    pc = sched.prefix_cache
    target(float(s.prefix_cache_hits), label="hits")
    target(float(sched.blocks.num_evictions), label="evictions")
    event(f"hits: {s.prefix_cache_hits > 0}")
    event(f"evictions: {sched.blocks.num_evictions > 0}")
    event(f"snapshot evictions: {pc.num_snapshot_evictions > 0}")
    event(f"preempted: {sched.num_preemptions > 0}")
    if pc.host_capacity:
        assert pc.num_host_blocks <= pc.host_capacity
        event(f"host tier hits: {pc.num_onloaded > 0}")


def test_allocator_lru_and_hash_chain():
    """Unit level: freed registered blocks stay cached (and count as free) until allocation needs
    them, least recently freed first, tail blocks of a sequence first; a hit revives a block; the
    key of a block depends on every token before it and on the extra key."""
    a = CachingBlockAllocator(4)
    pc = PrefixCache(a, 2)
    k0 = block_hash(None, [1, 2])
    k1 = block_hash(k0, [3, 4])
    assert k1 != block_hash(block_hash(None, [1, 5]), [3, 4]) and k1 != block_hash(k0, [3, 4], extra=7)
    b = a.allocate(2)
    assert a.register(b[0], k0) and a.register(b[1], k1) and not a.register(b[0], k1)
    a.free(b)
    assert a.num_free == 4 and a.num_used == 0 and a.cached(k0) == b[0]
    assert a.num_reclaimed([b[0]]) == 1
    a.share([b[0]])  # a hit
    assert a.ref_count(b[0]) == 1 and a.num_free == 3
    c = a.allocate(3)  # the 2 never-cached blocks, then evicts the cached tail block b[1]
    assert b[1] in c and a.cached(k1) is None and a.cached(k0) == b[0] and a.num_evictions == 1
    a.free(c + [b[0]])
    assert a.num_free == 4 and pc.queries == 0


def test_keys_follow_the_lora_adapter():
    """Blocks computed under one LoRA adapter are not hits for another adapter or the base model."""
    from types import SimpleNamespace

    from metrale_jax.engine.scheduler import Request, Sequence

    pc = PrefixCache(CachingBlockAllocator(8), 2)

    def keys(lora):
        req = Request("r", None, [5, 6, 7, 8, 9], SamplingParams(), arrival=0, seed=0, lora_request=lora)
        return pc.keys(Sequence(0, req, 0, [5, 6, 7, 8, 9], 5))

    a = SimpleNamespace(lora_int_id=1, lora_name="a", lora_path="/x/a")
    a2 = SimpleNamespace(lora_int_id=1, lora_name="a", lora_path="/x/a2")  # the id reused for another adapter
    base = keys(None)
    assert len(base) == 2 and keys(a) == keys(a) and len({base[1], keys(a)[1], keys(a2)[1]}) == 3


def test_host_tier_start_up_check(monkeypatch):
    """kv_offloading_restore=None times a restore against a recompute at start-up and keeps the
    host tier only when restoring is cheaper; True / False decide without timing."""
    from metrale_jax.engine.engine import LLMEngine

    calls = []

    def fake_check(self, pays):
        calls.append(pays)
        self.host_tier_costs = {"restore_ms_per_block": 1.0, "recompute_ms_per_block": 2.0 if pays else 0.5}
        return pays

    # (fake_engine caches engines by their config: each case its own host tier size)
    for i, pays in enumerate((True, False)):
        monkeypatch.setattr(LLMEngine, "_host_tier_pays", lambda self, p=pays: fake_check(self, p))
        eng = fake_engine(enable_prefix_caching=True, kv_offloading_size=HOST_TIER * (2 + i))
        assert eng.host_tier_on is pays and (eng.scheduler.prefix_cache.host_capacity > 0) is pays
    for i, forced in enumerate((True, False)):
        eng = fake_engine(enable_prefix_caching=True, kv_offloading_size=HOST_TIER * (4 + i),
                          kv_offloading_restore=forced)
        assert eng.host_tier_on is forced and (eng.scheduler.prefix_cache.host_capacity > 0) is forced
    assert calls == [True, False]  # the forced engines did not time anything
    monkeypatch.undo()
    # the real check runs (timing the fake model's executables) and records both costs
    eng = fake_engine(enable_prefix_caching=True, kv_offloading_size=HOST_TIER * 6)
    assert set(eng.host_tier_costs) == {"restore_ms_per_block", "recompute_ms_per_block"}
    assert all(v > 0 for v in eng.host_tier_costs.values())
    assert eng.host_tier_on == (eng.host_tier_costs["restore_ms_per_block"]
                                < eng.host_tier_costs["recompute_ms_per_block"])
