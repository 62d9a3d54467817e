"""`LLM.beam_search` (vLLM's request-level beam search) against a numpy oracle over FakeModel's
exact logits (log_softmax(W[hash(ids)]), computed on the host), and on a real tiny Llama against
the dense forward's float32 logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_jax import BeamSearchParams, load_model
from metrale_jax.engine.testing import fake_engine, fake_greedy, fake_hash
from metrale_jax.errors import InvalidPromptError, InvalidSamplingParamsError
from metrale_jax.llm import LLM
from tests.conftest import FIXTURES

EOS = (1,)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def oracle(w, prompt, width, max_tokens, *, use_ssm, ignore_eos=False, length_penalty=1.0, max_len=10 ** 9):
    """vLLM's algorithm over the exact logprobs: [(tokens, cum_logprob, finish_reason)], best first."""
    def score(b):
        n = len(b[0]) - (1 if b[0][-1] in EOS else 0)
        return b[1] / n ** length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        done += [(t, c, "length") for t, c in live if len(t) >= max_len]
        live = [(t, c) for t, c in live if len(t) < max_len]
        if not live:
            break
        grown = []
        for toks, cum in live:
            lp = _log_softmax(w[fake_hash(toks, use_ssm, w.shape[0])])
            for t in np.argsort(-lp)[: 2 * width]:
                nb = (toks + [int(t)], cum + lp[t])
                if int(t) in EOS and not ignore_eos:
                    done.append((*nb, "stop"))
                else:
                    grown.append(nb)
        live = sorted(grown, key=score, reverse=True)[:width]
    best = sorted(done + [(t, c, "length") for t, c in live], key=score, reverse=True)[:width]
    return best


@pytest.fixture(scope="module")
def llm():
    eng = fake_engine(use_ssm=True, max_logprobs=8)
    eng.scheduler = eng._new_scheduler()
    return LLM.from_engine(eng)


@pytest.mark.parametrize("width,max_tokens,kw", [(3, 6, {}), (4, 5, {"length_penalty": 0.0}),
                                                 (2, 7, {"ignore_eos": True}), (4, 4, {"length_penalty": 2.5})])
def test_matches_the_oracle(llm, width, max_tokens, kw):
    w = np.asarray(llm.llm_engine.params["w"])
    tok = llm.get_tokenizer()
    prompts = ["hello there", {"prompt_token_ids": [5, 9, 11, 3, 7]}, {"prompt": "abc"}]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kw))
    assert len(outs) == 3
    for p, out in zip([tok.encode("hello there"), [5, 9, 11, 3, 7], tok.encode("abc")], outs):
        want = oracle(w, p, width, max_tokens, use_ssm=True, **kw)
        got = [(s.tokens, s.cum_logprob, s.finish_reason) for s in out.sequences]
        assert [g[0] for g in got] == [x[0] for x in want]
        np.testing.assert_allclose([g[1] for g in got], [x[1] for x in want], rtol=1e-5, atol=1e-5)
        assert [g[2] for g in got] == [x[2] for x in want]
        for s in out.sequences:
            assert s.tokens[:len(p)] == p and len(s.logprobs) == len(s.tokens) - len(p)
            assert s.text == tok.decode(s.tokens, skip_special_tokens=False)
            assert abs(sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(p):])) - s.cum_logprob) < 1e-4
    assert llm.llm_engine.stats().kv_blocks_used == 0  # every round's requests finished and freed


def test_width_one_is_greedy_and_eos_ends_a_beam(llm):
    w = np.asarray(llm.llm_engine.params["w"])
    for prompt in ([2, 4, 6], [7], list(range(3, 20))):
        (s,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=1, max_tokens=12))[0].sequences
        want = fake_greedy(w, prompt, 12, use_ssm=True)
        assert s.tokens == prompt + want
        assert s.finish_reason == ("stop" if want[-1] in EOS else "length")
    # a prompt whose oracle beams end in EOS (found by search over short prompts)
    hits = 0
    for a in range(2, 40):
        best = oracle(w, [a, a + 1], 2, 4, use_ssm=True)
        if any(r == "stop" for *_, r in best):
            out = llm.beam_search({"prompt_token_ids": [a, a + 1]}, BeamSearchParams(beam_width=2, max_tokens=4))
            assert [(s.tokens, s.finish_reason) for s in out[0].sequences] == [(t, r) for t, _, r in best]
            # the text keeps the special tokens (vLLM's LLM.beam_search), EOS's among them
            eos_text = llm.get_tokenizer().decode([EOS[0]], skip_special_tokens=False)
            assert all(s.text.endswith(eos_text) for s in out[0].sequences if s.finish_reason == "stop") and eos_text
            hits += 1
            if hits == 2:
                break
    assert hits, "no EOS-ending beam among the searched prompts"


def test_max_model_len_ends_beams(llm):
    w = np.asarray(llm.llm_engine.params["w"])
    max_len = llm.llm_engine.config.max_model_len
    prompt = [3 + i % 50 for i in range(max_len - 2)]
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=10))
    want = oracle(w, prompt, 2, 10, use_ssm=True, max_len=max_len)
    assert [(s.tokens, s.finish_reason) for s in out[0].sequences] == [(t, r) for t, _, r in want]
    assert all(len(s.tokens) <= max_len for s in out[0].sequences)


def test_bad_input(llm):
    with pytest.raises(InvalidSamplingParamsError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=True)
    with pytest.raises(InvalidSamplingParamsError, match="max_logprobs is 8"):
        llm.beam_search("hi", BeamSearchParams(beam_width=5, max_tokens=2))
    with pytest.raises(InvalidSamplingParamsError, match="BeamSearchParams"):
        llm.beam_search("hi", {"beam_width": 2})
    with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
        llm.beam_search(["ok", {"prompt_token_ids": [1, 9999]}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert llm.llm_engine.stats().kv_blocks_used == 0 and not llm.llm_engine.has_unfinished_requests()


def test_real_model_cum_logprobs_match_the_dense_forward():
    """Tiny Llama (float32): each returned beam's cum_logprob is the sum of the dense forward's
    log-softmax over its new tokens, and width 1 gives greedy generate's tokens."""
    import jax
    import jax.numpy as jnp

    from metrale_jax.sampling import SamplingParams

    llm = LLM(model=str(FIXTURES / "llama_tiny"), dtype="float32", max_model_len=64, num_kv_blocks=64,
              block_size=8, max_num_seqs=8, max_num_batched_tokens=64, show_progress=False)
    model, params = load_model(FIXTURES / "llama_tiny", dtype="float32", show_progress=False)
    prompt = [1, 17, 42, 99, 7, 3]
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=5))[0]
    fwd = jax.jit(model.forward)
    scores = []
    for s in out.sequences:
        lg = np.asarray(fwd(params, jnp.asarray([s.tokens], jnp.int32), None, None))[0]
        lp = sum(_log_softmax(lg[i - 1])[s.tokens[i]] for i in range(len(prompt), len(s.tokens)))
        assert abs(lp - s.cum_logprob) < 1e-3, (lp, s.cum_logprob)
        scores.append(s.cum_logprob / len(s.tokens))
    assert scores == sorted(scores, reverse=True) and len({tuple(s.tokens) for s in out.sequences}) == 3
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    (one,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=1, max_tokens=5,
                                                                            ignore_eos=True))[0].sequences
    assert one.tokens[len(prompt):] == greedy[0].outputs[0].token_ids


def test_rounds_keep_the_prompts_cache_salt(llm):
    """A salted prompt's rounds run under its salt: the blocks they leave serve the same salt only."""
    eng = llm.llm_engine
    eng.reset_prefix_cache()
    p = [4, 8, 15, 16, 23, 42, 7, 9, 11]  # two full blocks of 4
    llm.beam_search({"prompt_token_ids": p, "cache_salt": "tenant-a"}, BeamSearchParams(beam_width=2, max_tokens=3))
    from metrale_jax.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1)
    assert llm.generate({"prompt_token_ids": p}, sp)[0].num_cached_tokens == 0
    assert llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, sp)[0].num_cached_tokens == 8
