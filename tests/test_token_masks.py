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


def masked_greedy(w, prompt, max_tokens, allowed=None, banned=(), eos=(1,), bias=None, words=(), ssm=True):
    """Greedy generation of FakeModel (`ssm`: with its SSM layer) with the logits of tokens outside
    `allowed` / in `banned` at -inf, and `bias` {id: value} added; at each step also the last token
    of every word (a token tuple) whose other tokens end the output so far at -inf (vLLM's bad_words)."""
    ids, out = list(prompt), []
    v = w.shape[0]
    ok = np.zeros(v, bool)
    ok[list(allowed) if allowed is not None else slice(None)] = True
    ok[list(banned)] = False
    add = np.zeros(v)
    for t, b in (bias or {}).items():
        add[t] += b
    while len(out) < max_tokens:
        x = np.where(ok, w[fake_hash(ids, ssm, v)] + add, -np.inf)
        for word in words:
            k = len(word) - 1
            if k <= len(out) and out[len(out) - k:] == list(word[:k]):
                x[word[-1]] = -np.inf
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
    # the masks too leave the logprobs raw (vLLM computes them before allowed_token_ids, logit_bias, bad_words)
    for i, kw in ((1, dict(allowed_token_ids=allowed)), (3, dict(logit_bias={4: 100, 9: 100, 33: 100}))):
        o = eng.generate({"prompt_token_ids": prompts[i]},
                         SamplingParams(temperature=0, max_tokens=1, logprobs=3, **kw))[0].outputs[0]
        x = w[fake_hash(prompts[i], True, w.shape[0])].astype(np.float64)
        raw = x - x.max() - np.log(np.exp(x - x.max()).sum())
        t = o.token_ids[0]
        assert abs(o.logprobs[0][t].logprob - raw[t]) < 1e-4 and o.logprobs[0][t].rank == 1 + int(np.sum(raw > raw[t]))
        assert {j for j in o.logprobs[0] if j != t} <= set(np.argsort(-raw)[:3])
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


def test_bad_words_match_the_oracle(eng):
    """bad_words (vLLM's): words of one, two and three tokens taken from the free greedy runs, so
    each ban bites; rows with and without them, n > 1 and a logit_bias row in one batch; the
    multi-token bans need the previous step's sample, still on the device when the step is built."""
    w = np.asarray(eng.params["w"])
    tok = eng.tokenizer
    prompts = [[5, 9, 11], [20, 21, 22, 23], [30, 31], [7, 8]]
    free = [masked_greedy(w, p, 12) for p in prompts]
    text = [tok.decode(f, skip_special_tokens=False) for f in free]  # (ids 2..63: one character each)
    words = [text[0][1], text[0][3:5], text[1][2:5]]
    seqs = [tuple(tok.encode(x, add_special_tokens=False)) for x in words]
    assert [len(s) for s in seqs] == [1, 2, 3] and seqs[1] == tuple(free[0][3:5])
    sp = SamplingParams(temperature=0, max_tokens=12, bad_words=words)
    params = [sp, sp, SamplingParams(temperature=0, max_tokens=12), sp.clone(n=2, logit_bias={free[3][0]: -100})]
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, o in enumerate(outs):
        want = masked_greedy(w, prompts[i], 12, words=seqs if params[i].bad_words else (),
                             banned=[free[3][0]] if i == 3 else ())
        for c in o.outputs:
            assert c.token_ids == want, (i, words)
    assert outs[0].outputs[0].token_ids != free[0] and outs[1].outputs[0].token_ids != free[1]
    assert outs[2].outputs[0].token_ids == free[2]
    with pytest.raises(InvalidSamplingParamsError, match="bad_words"):
        SamplingParams(bad_words=["ok", " "])
    with pytest.raises(InvalidSamplingParamsError, match="leave no token"):  # every id but the specials
        eng.generate({"prompt_token_ids": [3]}, SamplingParams(bad_words=[tok.decode([i]) for i in range(2, 64)],
                                                               logit_bias={0: -100, 1: -100}))
    tokenizer, eng.tokenizer = eng.tokenizer, None
    try:
        with pytest.raises(InvalidSamplingParamsError, match="needs a tokenizer"):
            eng.generate({"prompt_token_ids": [3]}, SamplingParams(bad_words=["x"]))
    finally:
        eng.tokenizer = tokenizer
    assert eng.stats().kv_blocks_used == 0


def test_bad_words_tokenizations():
    """A word inside a text: with a space before it, where that tokenizes to another first token
    of the same length (vLLM's rule); leading spaces of the word itself are stripped."""
    from metrale_jax.sampling import bad_word_bans, bad_words_token_ids

    class Tok:
        def encode(self, text, add_special_tokens=True):
            vocab = {"foo": [7], " foo": [8], "bar baz": [3, 4], " bar baz": [9, 4], "qux": [5, 6], " qux": [2, 5, 6]}
            return vocab[text]

    assert bad_words_token_ids(["foo", "  bar baz", "qux"], Tok()) == [(7,), (8,), (3, 4), (9, 4), (5, 6)]
    words = [(7,), (3, 4), (1, 2, 3)]
    assert bad_word_bans(words, []) == [7]
    assert bad_word_bans(words, [5, 3]) == [7, 4]
    assert bad_word_bans(words, [1, 2]) == [7, 3]
    assert bad_word_bans(words, [2]) == [7]


@pytest.mark.parametrize("use_ssm", [True, False])
def test_bad_words_with_speculative_decoding(use_ssm, monkeypatch):
    """bad_words under n-gram speculation (vLLM bans them in every draft position): a drafter that
    proposes the unbanned greedy continuation, so drafts run into the bad words at varying window
    positions and are rejected there; the outputs equal the unspeculated oracle's, with synchronous
    verify steps (SSM state) and overlapped ones (attention only: a bad-words row syncs), a free
    row beside them."""
    from metrale_jax.engine import spec_decode
    from metrale_jax.engine.spec_decode import SpeculativeConfig
    from metrale_jax.engine.testing import fake_next_token

    eng = fake_engine(use_ssm=use_ssm, speculative_config=SpeculativeConfig("ngram", 3))
    w = np.asarray(eng.params["w"])
    tok = eng.tokenizer

    def free_drafts(seq, k, spec):  # spec_decode.draft_tokens' signature
        ids, out = list(seq.token_ids), []
        for _ in range(k):
            out.append(fake_next_token(w, ids, use_ssm))
            ids.append(out[-1])
        return out

    monkeypatch.setattr(spec_decode, "draft_tokens", free_drafts)
    prompts = [[5, 9, 11], [20, 21, 22, 23], [30, 31]]
    free = [masked_greedy(w, p, 14, ssm=use_ssm) for p in prompts]
    text = [tok.decode(f, skip_special_tokens=False) for f in free]
    words = [text[0][2:4], text[0][6:9], text[1][4:6], text[1][0]]
    seqs = [tuple(tok.encode(x, add_special_tokens=False)) for x in words]
    assert [len(q) for q in seqs] == [2, 3, 2, 1]
    sp = SamplingParams(temperature=0, max_tokens=14, bad_words=words)
    params = [sp, sp, SamplingParams(temperature=0, max_tokens=14)]
    before = eng.stats().spec_draft_tokens, eng.stats().spec_accepted_tokens
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, o in enumerate(outs):
        want = masked_greedy(w, prompts[i], 14, words=seqs if params[i].bad_words else (), ssm=use_ssm)
        assert o.outputs[0].token_ids == want, (i, words)
    assert outs[0].outputs[0].token_ids != free[0] and outs[1].outputs[0].token_ids != free[1]
    assert outs[2].outputs[0].token_ids == free[2]
    drafted, accepted = (eng.stats().spec_draft_tokens - before[0], eng.stats().spec_accepted_tokens - before[1])
    assert 0 < accepted < drafted, (drafted, accepted)  # (drafts accepted, and the banned ones rejected)
    assert eng.stats().kv_blocks_used == 0
