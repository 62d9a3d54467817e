"""allowed_token_ids and logit_bias: OpenAI's -100 / 100 as a token mask, other values added to
the logits; against a host oracle over FakeModel's exact logits (W[hash(ids)]), rows with and
without them in one batch."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_jax.engine.testing import fake_engine, fake_hash
from metrale_jax.errors import InvalidSamplingParamsError
from metrale_jax.sampling import SamplingParams


@pytest.fixture(scope="module")
def eng():
    e = fake_engine(use_ssm=True)
    e.scheduler = e._new_scheduler()
    return e


def masked_greedy(w, prompt, max_tokens, allowed=None, banned=(), eos=(1,), bias=None):
    """Greedy generation of FakeModel with the logits of tokens outside `allowed` / in `banned` at
    -inf, and `bias` {id: value} added."""
    ids, out = list(prompt), []
    v = w.shape[0]
    ok = np.zeros(v, bool)
    ok[list(allowed) if allowed is not None else slice(None)] = True
    ok[list(banned)] = False
    add = np.zeros(v)
    for t, b in (bias or {}).items():
        add[t] += b
    while len(out) < max_tokens:
        x = np.where(ok, w[fake_hash(ids, True, v)] + add, -np.inf)
        t = int(np.argmax(x))
        out.append(t)
        ids.append(t)
        if t in eos:
            break
    return out


def test_masks_match_the_oracle(eng):
    w = np.asarray(eng.params["w"])
    prompts = [[5, 9, 11], [20, 21, 22, 23], [7], [30, 31]]
    free = [masked_greedy(w, p, 12) for p in prompts]
    ban = sorted({t for f in free for t in f[:3]} - {1})  # the free runs' first tokens, banned
    allowed = [3, 8, 13, 21, 40, 1]
    # additive biases big enough to change the greedy path: the free run's first token down, others up
    wide = float(np.ptp(w))
    bias = {free[1][0]: -0.6 * wide, 17: 0.7 * wide, 25: 0.4 * wide, 6: -2.5}
    cases = [
        (SamplingParams(temperature=0, max_tokens=12), dict()),
        (SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed), dict(allowed=allowed)),
        (SamplingParams(temperature=0, max_tokens=12, logit_bias={t: -100 for t in ban}), dict(banned=ban)),
        (SamplingParams(temperature=0, max_tokens=12, logit_bias={4: 100, 9: 100, 33: 100, 12: 0}),
         dict(allowed=[4, 9, 33])),
        (SamplingParams(temperature=0, max_tokens=12, logit_bias=bias, logprobs=2), dict(bias=bias)),
    ]
    prompts.append(prompts[1])
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], [c[0] for c in cases])  # one batch
    for p, (sp, kw), o in zip(prompts, cases, outs):
        want = masked_greedy(w, p, 12, **kw)
        assert o.outputs[0].token_ids == want, (sp, kw)
    assert outs[0].outputs[0].token_ids == free[0]
    biased = outs[4].outputs[0]
    assert biased.token_ids != free[1]  # (the bias changed the path)
    # the logprobs stay the model's (vLLM's raw logprobs), not the biased ones
    x = w[fake_hash(prompts[4], True, w.shape[0])].astype(np.float64)
    raw = x - x.max() - np.log(np.exp(x - x.max()).sum())
    assert abs(biased.logprobs[0][biased.token_ids[0]].logprob - raw[biased.token_ids[0]]) < 1e-4
    assert not set(outs[2].outputs[0].token_ids) & set(ban)
    # sampled (not greedy), n > 1: every token allowed; allowed_token_ids and 100s intersect, -100 wins
    sp = SamplingParams(temperature=1.5, n=3, max_tokens=20, seed=4, allowed_token_ids=[2, 3, 5, 7, 11],
                        logit_bias={3: 100, 5: -100, 7: 100})
    for o in eng.generate({"prompt_token_ids": [9, 9, 9]}, sp)[0].outputs:
        assert set(o.token_ids) <= {3, 7}, o.token_ids
    assert eng.stats().kv_blocks_used == 0


def test_bad_masks(eng):
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={5: float("nan")})
    with pytest.raises(InvalidSamplingParamsError, match="max_suppress_ids"):  # the table's width
        eng.generate("hi", SamplingParams(logit_bias={t: 0.5 for t in range(3, 3 + eng.config.max_suppress_ids + 1)}))
    with pytest.raises(InvalidSamplingParamsError, match="outside the vocabulary"):
        eng.generate("hi", SamplingParams(logit_bias={eng.vocab_size: 2.0}))
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 100})
    with pytest.raises(InvalidSamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidSamplingParamsError, match="outside the vocabulary"):
        eng.generate("hi", SamplingParams(allowed_token_ids=[3, eng.vocab_size]))
    with pytest.raises(InvalidSamplingParamsError, match="no token"):
        eng.generate("hi", SamplingParams(allowed_token_ids=[3, 4], logit_bias={3: -100, 4: -100}))
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens"):
        eng.generate("hi", SamplingParams(allowed_token_ids=[1], min_tokens=2))  # (1 is EOS)
    assert not eng.has_unfinished_requests()
