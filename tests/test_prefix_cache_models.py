"""Prefix caching on the real tiny fixtures (float32): outputs with the cache on equal those with it
off (greedy ids exactly, logprobs and prompt logprobs within 1e-5), and the hits show in the stats:

- a second turn that resends the first conversation (prompt + reply) and extends it hits at least
  the block-aligned length of turn 1 minus one block (hybrids: through the snapshot of the state
  that the first turn's last decode block boundary left; Nemotron-H's fixture, whose decode path
  does not clamp dt as its prefill does, reuses only turn 1's prompt: `decode_matches_prefill`);
- two prompts sharing a prefix of six blocks (hybrids: the first one's chunk boundary left a
  snapshot there); a prompt-logprobs request computes its whole prompt (no hit);
- a KV pool of one sequence plus two blocks: cached blocks evicted (to the host tier, and back on
  a hit), sequences swapped out and in between the turns.

The reference runs on the same engine with a scheduler that does not cache
(`_new_scheduler(prefix_caching=False)`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from metrale_jax import load_model
from metrale_jax.engine.compile import CompileCounter
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES
from tests.test_engine_hybrid import HYBRID_CONFIG
from tests.test_engine_models import TINY_CONFIG

# (pure Mamba-2 is slow: Nemotron-H's Mamba-2 layers cover its snapshots)
MODELS = ["llama_tiny", "qwen3_next_tiny", "nemotron_h_tiny", pytest.param("mamba2_tiny", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=MODELS)
def engine(request):
    model, params = load_model(FIXTURES / request.param, dtype="float32", show_progress=False)
    base = TINY_CONFIG if request.param == "llama_tiny" else HYBRID_CONFIG
    eng = LLMEngine(model, params, base.replace(enable_prefix_caching=True, preemption_mode="swap",
                                                kv_offloading_size=1e-3, kv_offloading_restore=True))
    assert eng.uses_ssm == (request.param != "llama_tiny")
    assert eng.config.max_ssm_snapshots == (4 if eng.uses_ssm else 0)
    yield eng
    eng.scheduler = eng._new_scheduler()


def _run(eng, prompts, sp):
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
             o.prompt_logprobs) for o in outs]


def _assert_same(got, ref, atol=1e-5):
    for (ids, lps, plp), (rids, rlps, rplp) in zip(got, ref):
        assert ids == rids
        np.testing.assert_allclose(lps, rlps, atol=atol, rtol=0)
        if rplp is not None:
            assert [d is None for d in plp] == [d is None for d in rplp]
            for d, rd in zip(plp[1:], rplp[1:]):
                assert d.keys() == rd.keys()
                np.testing.assert_allclose([v.logprob for v in d.values()], [v.logprob for v in rd.values()],
                                           atol=atol, rtol=0)


@pytest.fixture
def full_f32_matmuls():
    """XLA's float32 dots at full precision for the test (a global setting: the engine compiles its
    steps in worker threads, which a `jax.default_matmul_precision` context would not reach)."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


def _hits(eng) -> int:
    return eng.stats().prefix_cache_hits


def _idle(eng) -> None:
    st = eng.stats()
    assert st.num_running == st.num_waiting == st.kv_blocks_used == st.ssm_slots_used == 0


def test_second_turn_and_shared_prefix(engine):
    eng = engine
    bs = eng.config.block_size
    rng = np.random.default_rng(17)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    sp_plp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    p1 = rng.integers(3, 250, 29).tolist()
    base = rng.integers(3, 250, 6 * bs).tolist()
    a, b, c = (base + rng.integers(3, 250, n).tolist() for n in (9, 5, 3))

    eng.scheduler = eng._new_scheduler(prefix_caching=False)
    ref1 = _run(eng, [p1], sp)
    turn2 = p1 + ref1[0][0] + rng.integers(3, 250, 7).tolist()
    ref = [_run(eng, [p], s)[0] for p, s in ((turn2, sp), (a, sp), (b, sp), (c, sp_plp))]
    assert eng.stats().prefix_cache_queries == 0

    eng.scheduler = eng._new_scheduler()
    with CompileCounter() as cc:
        _assert_same(_run(eng, [p1], sp), ref1)
        h = _hits(eng)
        got2 = _run(eng, [turn2], sp)
        turn1_len = len(p1) + len(ref1[0][0])
        if not eng.model.decode_matches_prefill:  # Nemotron-H's fixture: only turn 1's prompt is reused
            turn1_len = len(p1)
        assert _hits(eng) - h >= turn1_len // bs * bs - bs
        h = _hits(eng)
        got_a = _run(eng, [a], sp)
        got_b = _run(eng, [b], sp)
        assert _hits(eng) - h >= len(base)  # b reuses a's six blocks (and the snapshot after them)
        h = _hits(eng)
        got_c = _run(eng, [c], sp_plp)
        assert _hits(eng) == h  # prompt logprobs: computed, not read from the cache
    assert cc.lowerings == 0 and cc.backend_compiles == 0
    _assert_same(got2 + got_a + got_b + got_c, ref)
    _idle(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_next_tiny"])
def test_gpu_second_turn(name, full_f32_matmuls):
    """On the GPU with its default kernels: a second turn cached equals it uncached (logprobs within
    1e-3: the cached reply went through the decode kernels, the uncached one through prefill's;
    XLA's float32 dots at full precision, not the GPU's default TF32, which alone differed by 1.6e-3)."""
    model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    base = TINY_CONFIG if name == "llama_tiny" else HYBRID_CONFIG
    eng = LLMEngine(model, params, base.replace(enable_prefix_caching=True))
    bs = eng.config.block_size
    rng = np.random.default_rng(19)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    p1 = rng.integers(3, 250, 29).tolist()
    eng.scheduler = eng._new_scheduler(prefix_caching=False)
    ref1 = _run(eng, [p1], sp)
    turn2 = p1 + ref1[0][0] + rng.integers(3, 250, 7).tolist()
    ref2 = _run(eng, [turn2], sp)
    eng.scheduler = eng._new_scheduler()
    got = _run(eng, [p1], sp) + _run(eng, [turn2], sp)
    assert _hits(eng) >= (len(p1) + 12) // bs * bs - bs
    _assert_same(got, ref1 + ref2, atol=1e-3)


def test_eviction_and_swap_between_turns(engine):
    eng = engine
    bs = eng.config.block_size
    rng = np.random.default_rng(18)
    n_out = 40 if eng.uses_ssm else 30
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True, logprobs=0)
    base = rng.integers(3, 250, 5 * bs).tolist()
    first = [base + rng.integers(3, 250, n).tolist() for n in (9, 2, 14)] + [rng.integers(3, 250, 11).tolist()]

    eng.scheduler = eng._new_scheduler(prefix_caching=False)
    ref1 = _run(eng, first, sp)
    second = [p + r[0] + rng.integers(3, 250, 3).tolist() for p, r in zip(first[:2], ref1)]
    second = [s[: eng.config.max_model_len - n_out] for s in second]
    ref2 = _run(eng, second, sp)
    assert eng.stats().num_preemptions == 0

    small = eng.config.max_blocks_per_seq + 2  # one sequence plus two blocks
    eng.scheduler = s = eng._new_scheduler(num_blocks=small)
    got1 = _run(eng, first, sp)
    got2 = _run(eng, second, sp)
    st = eng.stats()
    assert st.num_swaps > 0 and st.num_swap_ins == st.num_swaps
    assert s.blocks.num_evictions > 0 and st.prefix_cache_hits > 0
    pc = s.prefix_cache
    if eng.model.num_attention_layers:  # the host tier (none for Mamba-2: its blocks hold nothing)
        assert pc.num_offloaded > 0 and 0 < pc.num_host_blocks <= pc.host_capacity
        if eng.model.decode_matches_prefill:  # (Nemotron-H's fixture caches prompts only: no host hit here)
            assert pc.num_onloaded > 0
    _assert_same(got1 + got2, ref1 + ref2)
    _idle(eng)
