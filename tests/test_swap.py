"""Preemption by swap on the real hybrid fixtures: a KV pool that holds barely one long sequence
forces the engine to swap sequences out (their KV blocks in every attention layer and their SSM
slot row in every recurrent layer, to host memory) and back in. The greedy tokens and logprobs
must equal those of the same batch run without preemption, nothing may be recomputed (each
prompt token goes through the model once), nothing may compile while serving, and every block
and slot must be free afterwards.

Engines come from tests/test_engine_hybrid.py (built once per process, shared).
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale_jax.engine.compile import CompileCounter
from metrale_jax.sampling import SamplingParams
from tests.test_engine_hybrid import assert_pools_whole, hybrid_engine

# Nemotron-H too: its prefill path clamps dt and its decode path does not, so a recompute would
# change its tokens' numerics; a swap must not.
# (pure Mamba-2 is slow: Nemotron-H's Mamba-2 layers cover its slots)
SWAP_MODELS = ["qwen3_next_tiny", pytest.param("mamba2_tiny", marks=pytest.mark.slow), "nemotron_h_tiny"]


@pytest.fixture(scope="module", params=SWAP_MODELS)
def hybrid(request):
    eng, _ = hybrid_engine(request.param)
    assert eng.config.preemption_mode == "swap"  # the default for models with SSM state
    eng.scheduler = eng._new_scheduler()
    yield eng
    eng.scheduler = eng._new_scheduler()


def _run(eng, prompts, sp):
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def test_swap_keeps_outputs_exact(hybrid):
    eng = hybrid
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, n).tolist() for n in (29, 11, 46, 3)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)

    ref = _run(eng, prompts, sp)  # the whole pool: no preemption
    assert eng.stats().num_preemptions == 0
    assert_pools_whole(eng)

    # a pool of max_blocks_per_seq + 2 blocks: the four sequences (up to 86 tokens, 22 blocks
    # each) cannot all stay
    eng.scheduler = eng._new_scheduler(num_blocks=eng.config.max_blocks_per_seq + 2)
    prompt_tokens0 = eng.stats().prompt_tokens_total
    with CompileCounter() as cc:
        got = _run(eng, prompts, sp)
    st = eng.stats()
    assert st.num_swaps > 0 and st.num_swap_ins == st.num_swaps == st.num_preemptions
    assert st.prompt_tokens_total - prompt_tokens0 == sum(map(len, prompts))  # nothing recomputed
    assert cc.lowerings == 0 and cc.backend_compiles == 0
    for (ids, lps), (ref_ids, ref_lps) in zip(got, ref):
        assert ids == ref_ids
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)
    assert_pools_whole(eng)
    assert st.swap_bytes == 0 and eng.scheduler.swap_bytes == 0 and not eng.scheduler.swapped


def test_swap_mid_prefill_and_slots_shorter_than_rows(hybrid):
    """Two SSM slots for four decode rows, a 24-block pool, staggered arrivals: the 70-token prompt
    cannot finish its prefill beside the 40-token one, so it is swapped out in the middle of its
    prompt and resumes its chunked prefill later."""
    eng = hybrid
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 256, n).tolist() for n in (40, 70, 5, 33, 9)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    ref = _run(eng, prompts, sp)
    assert_pools_whole(eng)

    eng.scheduler = s = eng._new_scheduler(num_blocks=24, num_ssm_slots=2)
    mid_prefill = 0
    for i, p in enumerate(prompts):
        eng.add_request(f"s{i}", {"prompt_token_ids": p}, sp)
        eng.step()
        mid_prefill += sum(q.num_computed < q.prompt_len for q in s.swapped)
    final = {}
    while eng.has_unfinished_requests():
        mid_prefill += sum(q.num_computed < q.prompt_len for q in s.swapped)
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert s.num_swaps > 0 and mid_prefill > 0
    for i, (ref_ids, ref_lps) in enumerate(ref):
        c = final[f"s{i}"].outputs[0]
        assert c.token_ids == ref_ids
        np.testing.assert_allclose([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], ref_lps, atol=1e-4)
    assert_pools_whole(eng)


@pytest.mark.parametrize("bucket", [0, 64])
def test_host_tier_blocks_split_and_join_bfloat16(bucket):
    """The host tier's per-block copies (`split_blocks`) and their join for a scatter
    (`join_blocks`, optionally zero-padded to the scatter's bucket) keep bf16 bits exactly; the
    slot leaves pass through; each block is a copy of its own (dropping it frees its memory)."""
    import ml_dtypes

    from metrale_jax.engine.swap import SwapData, join_blocks, split_blocks

    roles = (("block", 1), ("slot", 0), ("block", 1))
    rng = np.random.default_rng(0)
    # cut from a gather of bucket 48, as `SwapData.to_host` leaves them: not contiguous
    k = rng.standard_normal((3, 48, 4, 2, 8)).astype(ml_dtypes.bfloat16)[:, :40]
    v = rng.standard_normal((3, 48, 4, 2, 8)).astype(ml_dtypes.bfloat16)[:, :40]
    assert not k.flags.c_contiguous
    slot = np.ones((5, 7), np.float32)
    blocks = split_blocks(SwapData(0, 40, (k, slot, v), on_host=True), roles)
    assert len(blocks) == 40 and blocks[3][0].shape == (3, 1, 4, 2, 8) and blocks[3][0].dtype == k.dtype
    assert not np.shares_memory(blocks[3][0], k) and blocks[3][0].base.nbytes == blocks[3][0].nbytes
    order = rng.permutation(40)
    joined = join_blocks([blocks[i] for i in order], roles, (slot,), bucket)
    for got, want in ((joined.arrays[0], k), (joined.arrays[2], v)):
        assert got.dtype == want.dtype and got.shape[1] == max(40, bucket)
        np.testing.assert_array_equal(got[:, :40].view(np.uint16), want[:, order].view(np.uint16))
        assert not got[:, 40:].view(np.uint16).any()
    assert joined.arrays[1] is slot
    padded = joined.padded(roles, 64)
    assert padded[0].shape[1] == 64 and not padded[0][:, 40:].view(np.uint16).any()
    np.testing.assert_array_equal(padded[2][:, :40].view(np.uint16), v[:, order].view(np.uint16))
