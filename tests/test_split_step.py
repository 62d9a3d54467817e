"""The step split in two (`step.jit_packed_forward` + `step.jit_packed_sample`, for steps whose
sampling waits on the host's structured-output masks) gives the whole step's samples, logprobs,
prompt logprobs, next tokens and state exactly; so does the forward half sampling itself (the
engine's one launch for the other steps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import load_model
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.metadata_builder import (
    BuilderConfig,
    DecodeRow,
    PrefillChunk,
    RowSampling,
    StepBucket,
    build_step,
    pack,
    packed_layout,
)
from metrale_jax.step import init_step_state, jit_packed_forward, jit_packed_sample, jit_packed_step
from tests.conftest import FIXTURES


@pytest.mark.parametrize("branches", [False, True])  # the sampler's skips under lax.cond (the CPU's default)
@pytest.mark.parametrize("bucket", [StepBucket("decode", num_seqs=4),
                                    StepBucket("mixed", num_seqs=3, num_tokens=16, num_streams=2)])
def test_forward_then_sample_equals_the_step(bucket, branches):
    model, params = load_model(FIXTURES / "llama_tiny", dtype="float32", show_progress=False)
    v = model.cfg.vocab_size
    cfg = BuilderConfig(block_size=4, max_blocks_per_seq=6, vocab_size=v, max_suppress_ids=2)
    layout = packed_layout(cfg, bucket)
    rng = np.random.default_rng(7)
    kinds = [RowSampling(), RowSampling(temperature=0.8, top_p=0.9, seed=(1, 2, 3), logprobs=True),
             RowSampling(temperature=1.0, top_k=20, min_p=0.05, repetition_penalty=1.3, pen_row=1, seed=(4, 5, 6)),
             RowSampling(suppress_ids=(3, 4), frequency_penalty=0.5, pen_row=2, logprobs=True)]
    rows = [DecodeRow(int(rng.integers(3, v)), 5 + i, [4 * i + j for j in range(6)], kinds[i]) for i in range(3)]
    chunks = []
    if bucket.kind == "mixed":
        chunks = [PrefillChunk(rng.integers(3, v, 9).tolist(), 0, list(range(12, 18)), kinds[1],
                               prompt_lp_targets=rng.integers(3, v, 9).tolist()),
                  PrefillChunk(rng.integers(3, v, 4).tolist(), 4, list(range(18, 24)), None)]
    inputs = build_step(cfg, bucket, rows, chunks)
    _, ibuf, fbuf = pack(cfg, inputs)
    words = -(-v // 32)
    bitmask = np.full((bucket.num_sample_rows, words), -1, np.int32)
    bitmask[1] = rng.integers(-2**31, 2**31 - 1, words, dtype=np.int64).astype(np.int32)  # a constrained row
    prev = jnp.asarray(rng.integers(3, v, 8), jnp.int32)
    static = dict(layout=layout, model=model, attn=AttentionConfig(sampler_branches=branches, sample_in_forward=True),
                  max_logprobs=3)

    def state():
        s = init_step_state(model, 32, 4, penalty_rows=4)
        return jax.tree.map(lambda a: a + 0.01 if jnp.issubdtype(a.dtype, jnp.floating) else a, s)

    s1, out1, nxt1 = jit_packed_step(bucket.kind)(params, state(), ibuf, fbuf, prev, bitmask, **static)
    no_mask = np.full_like(bitmask, -1)
    s2, logits, plp, *_ = jit_packed_forward(bucket.kind)(params, state(), ibuf, fbuf, prev, no_mask, False, **static)
    out2, nxt2 = jit_packed_sample(bucket.kind)(logits, s2.penalties, ibuf, fbuf, plp, bitmask, prev, **static)
    for a, b in zip(jax.tree.leaves((s1, out1, nxt1)), jax.tree.leaves((s2, out2, nxt2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the forward half sampling itself (`sample_in_forward`: the one launch of a step without grammar rows)
    s3, _, _, out3, nxt3 = jit_packed_forward(bucket.kind)(params, state(), ibuf, fbuf, prev, bitmask, True, **static)
    for a, b in zip(jax.tree.leaves((s1, out1, nxt1)), jax.tree.leaves((s3, out3, nxt3))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the constrained row's token is one its mask allows; the test can fail: the masks matter
    t = int(out2.token_ids[1])
    assert (bitmask[1, t // 32] >> (t % 32)) & 1
