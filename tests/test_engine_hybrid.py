"""The engine on the hybrid fixtures (Qwen3-Next: GDN + attention; Nemotron-H: Mamba-2 + attention +
MLP/MoE; Mamba2: recurrent only) against transformers' goldens, through `LLM.generate`:

- greedy ids from the golden prompt, and the logprobs of every generated token: the first against
  the prefill logits (`greedy_logits`), the rest against transformers' cached single-token path
  (`decode_logits`: Nemotron-H's prefill clamps dt and its decode does not, so the two differ);
- prompt logprobs of the 150-token prompt, prefilled in chunks that a concurrent request shifts
  to odd places (13, 36, 59, ... : not multiples of the SSD or GDN chunk), state carried between;
- batch invariance: prompts of very different lengths, alone and mixed with staggered arrivals;
- no leaks: every KV block and SSM slot is free again afterwards.

`hybrid_engine(name)` builds each engine once per process (tests/test_swap.py reuses them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from metrale_jax import load_model
from metrale_jax.engine.config import EngineConfig, default_kernels
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.llm import LLM
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES

HYBRIDS = ["qwen3_next_tiny", "nemotron_h_tiny", "mamba2_tiny"]

# Tiny buckets: 4-token blocks, a 24-token budget over 2 prefill streams, 3 step executables.
HYBRID_CONFIG = EngineConfig(
    dtype="float32", max_model_len=160, block_size=4, num_kv_blocks=100, max_num_seqs=4,
    max_num_batched_tokens=24, decode_buckets=(4,), mixed_decode_buckets=(4,), prefill_buckets=(24,),
    max_prefill_streams=2, max_logprobs=2, show_progress=False,
)

_ENGINES: dict[str, tuple[LLMEngine, dict]] = {}


def hybrid_engine(name: str) -> tuple[LLMEngine, dict]:
    """(engine, golden arrays) for fixture `name`, built once per process. Callers leave it idle
    and restore `engine.scheduler = engine._new_scheduler()` if they replace it."""
    if name not in _ENGINES:
        model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
        cfg = HYBRID_CONFIG
        if name != "qwen3_next_tiny":  # no experts: decode steps on 8 padded rows, as on the GPU
            cfg = dataclasses.replace(cfg, attention=dataclasses.replace(default_kernels(False), min_decode_rows=8))
        _ENGINES[name] = (LLMEngine(model, params, cfg), dict(np.load(FIXTURES / name / "golden.npz")))
    return _ENGINES[name]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def assert_pools_whole(eng: LLMEngine):
    st = eng.stats()
    assert st.num_waiting == 0 and st.num_running == 0 and not eng.has_unfinished_requests()
    assert st.kv_blocks_free == st.kv_blocks_total and st.kv_blocks_used == 0
    s = eng.scheduler
    assert st.ssm_slots_used == 0 and st.ssm_slots_total == s.ssm_slots.num_slots > 0
    assert s.ssm_slots.num_free == s.ssm_slots.num_slots and s.pen_rows.num_free == s.pen_rows.num_slots


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    eng, g = hybrid_engine(request.param)
    eng.scheduler = eng._new_scheduler()
    yield eng, g
    assert_pools_whole(eng)


def test_greedy_logprobs_and_chunked_prompt_logprobs(hybrid):
    eng, g = hybrid
    llm = LLM.from_engine(eng)
    prompt, ids = g["greedy_prompt"].tolist(), g["greedy_ids"].tolist()
    long = g["long_ids"].tolist()
    n = len(ids)
    # one batch: the greedy prompt (11 tokens) takes the first 11 of the step's 24, the long prompt
    # the other 13; then the greedy request decodes one token per step beside 23-token chunks.
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=2)
    sp_long = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": long}], [sp, sp_long])
    c = outs[0].outputs[0]
    assert c.token_ids == ids
    assert c.finish_reason == "length" and len(c.logprobs) == n
    prefill_lp = log_softmax(g["greedy_logits"][len(prompt) - 1])
    decode_lp = log_softmax(g["decode_logits"])  # row i feeds ids[i]: it predicts ids[i + 1]
    for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        row = prefill_lp if i == 0 else decode_lp[i - 1]
        assert abs(d[t].logprob - row[t]) < 1e-3, (eng.model_name, i, d[t].logprob, row[t])
        assert d[t].rank == 1 and set(d) == set(np.argsort(-row)[:2].tolist())
    assert abs(c.cumulative_logprob - sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))) < 1e-3

    o = outs[1]
    ref = log_softmax(g["long_logits"])
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(long)
    got = np.array([o.prompt_logprobs[i][long[i]].logprob for i in range(1, len(long))])
    want = ref[np.arange(len(long) - 1), long[1:]]
    np.testing.assert_allclose(got, want, atol=1e-3, err_msg=eng.model_name)
    for i in (1, 13, 14, 37, 80, 149):  # ranks and the top-2 around the chunk boundaries
        d = o.prompt_logprobs[i]
        assert d[long[i]].rank == int((ref[i - 1] >= ref[i - 1, long[i]] - 1e-6).sum())
        assert set(np.argsort(-ref[i - 1])[:2].tolist()) <= set(d)
    assert o.outputs[0].token_ids[0] == int(np.argmax(ref[-1]))
    assert_pools_whole(eng)


def test_last_prompt_token_alone_goes_through_prefill(hybrid):
    """A 10-token budget leaves the prompt's last token alone in a chunk: it must still take the
    prefill path (Nemotron-H's dt clamp binds there; a decode row was off by 9e-4 on this token)."""
    eng, g = hybrid
    prompt, ids = g["greedy_prompt"].tolist(), g["greedy_ids"].tolist()
    eng.scheduler = eng._new_scheduler(max_num_batched_tokens=10)
    try:
        o = eng.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, logprobs=1))
    finally:
        eng.scheduler = eng._new_scheduler()
    c = o[0].outputs[0]
    assert c.token_ids == ids[:4]
    ref = log_softmax(g["greedy_logits"][len(prompt) - 1])
    assert abs(c.logprobs[0][ids[0]].logprob - ref[ids[0]]) < 2e-4


def test_batch_invariance(hybrid):
    """Greedy tokens of prompts run alone equal those run together (very different lengths,
    staggered arrivals so chunk boundaries move, more prompts than decode rows)."""
    eng, g = hybrid
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 67, 1, 23, 101)]
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    alone = [eng.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]
    assert_pools_whole(eng)
    for i in (4, 0):
        eng.add_request(f"m{i}", {"prompt_token_ids": prompts[i]}, sp)
    eng.step()
    for i in (2, 1, 3):
        eng.add_request(f"m{i}", {"prompt_token_ids": prompts[i]}, sp)
        eng.step()
    final = eng.run_to_completion()
    assert [final[f"m{i}"].outputs[0].token_ids for i in range(5)] == alone
    assert_pools_whole(eng)
