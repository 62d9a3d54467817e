"""LLMEngine semantics over FakeModel, whose logits a host loop computes exactly (W[h(ids)]):
stop conditions, min_tokens, n, seeds, logprobs and prompt logprobs, penalties, abort, every
bad-input case, streaming outputs and no compilation after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_jax.engine.compile import CompileCounter
from metrale_jax.engine.testing import fake_engine, fake_greedy, fake_hash
from metrale_jax.errors import (
    EmptyPromptError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    MaxTokensTooLargeError,
    PromptTooLongError,
)
from metrale_jax.sampling import RequestOutputKind, SamplingParams

EOS = 1


@pytest.fixture(scope="module")
def eng():
    e = fake_engine(use_ssm=True)
    e.scheduler = e._new_scheduler()
    yield e
    assert not e.has_unfinished_requests()


@pytest.fixture(scope="module")
def W(eng):
    return np.asarray(eng.params["w"], np.float64)


def _ids(n, seed):
    return np.random.default_rng(seed).integers(2, 64, n).tolist()


def _log_softmax(x):
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _run(eng, prompt_ids, sp, rid="x"):
    eng.add_request(rid, {"prompt_token_ids": prompt_ids}, sp)
    return eng.run_to_completion()[rid]


def _prompt_with_eos(W, max_tokens=20, start=0):
    for seed in range(start, start + 2000):
        p = _ids(7 + seed % 13, seed)
        out = fake_greedy(W, p, max_tokens, use_ssm=True)
        if out and out[-1] == EOS and len(out) >= 3:
            return p, out
    raise AssertionError("no prompt hits EOS")


# ---- stop conditions -----------------------------------------------------------------------------
def test_eos_is_in_token_ids_not_text(eng, W):
    p, ref = _prompt_with_eos(W)
    o = _run(eng, p, SamplingParams(temperature=0, max_tokens=20)).outputs[0]
    assert o.token_ids == ref and o.token_ids[-1] == EOS
    assert o.finish_reason == "stop" and o.stop_reason is None
    assert "</s>" not in o.text and o.text == eng.tokenizer.decode(ref[:-1])
    # with include_stop_str_in_output, EOS's text when special tokens are kept (vLLM's)
    for skip in (True, False):
        sp = SamplingParams(temperature=0, max_tokens=20, include_stop_str_in_output=True, skip_special_tokens=skip)
        o = _run(eng, p, sp).outputs[0]
        assert o.token_ids == ref and o.text == eng.tokenizer.decode(ref, skip_special_tokens=skip)
        assert o.text.endswith("</s>") != skip
    # ignore_eos runs on to max_tokens
    o2 = _run(eng, p, SamplingParams(temperature=0, max_tokens=len(ref) + 5, ignore_eos=True)).outputs[0]
    assert o2.token_ids == fake_greedy(W, p, len(ref) + 5, use_ssm=True, ignore_eos=True)
    assert o2.finish_reason == "length" and len(o2.token_ids) == len(ref) + 5


def test_stop_token_ids(eng, W):
    p = _ids(9, 1)
    full = fake_greedy(W, p, 30, use_ssm=True, ignore_eos=True)
    stop = full[4]
    first = full.index(stop)
    o = _run(eng, p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])).outputs[0]
    assert o.token_ids == full[: first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == eng.tokenizer.decode(full[:first])
    # include_stop_str_in_output: the stop token's text too (vLLM's)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop],
                        include_stop_str_in_output=True)
    o = _run(eng, p, sp).outputs[0]
    assert o.token_ids == full[: first + 1] and o.text == eng.tokenizer.decode(full[: first + 1]) != \
        eng.tokenizer.decode(full[:first])


def test_stop_strings(eng, W):
    p = _ids(11, 2)
    full = fake_greedy(W, p, 40, use_ssm=True, ignore_eos=True)
    text = eng.tokenizer.decode(full)
    stop = text[9:12]
    cut = text.find(stop)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "@never@"])
    o = _run(eng, p, sp).outputs[0]
    assert o.text == text[:cut] and o.finish_reason == "stop" and o.stop_reason == stop
    assert o.token_ids == full[: cut + len(stop)]  # up to the token that completed the stop string
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert _run(eng, p, sp).outputs[0].text == text[: cut + len(stop)]
    # detokenize=False: ids only, no text, no decoded tokens in the logprobs (vLLM's); stop strings
    # then need the text
    r = _run(eng, p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=2,
                                    prompt_logprobs=1))
    o = r.outputs[0]
    assert o.token_ids == full[:12] and o.text == ""
    assert all(x.decoded_token is None for d in [*o.logprobs, *r.prompt_logprobs[1:]] for x in d.values())
    r = _run(eng, p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=1))
    assert all(x.decoded_token for d in [*r.outputs[0].logprobs, *r.prompt_logprobs[1:]] for x in d.values())
    with pytest.raises(InvalidSamplingParamsError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_streamed_text_only_grows(eng, W):
    p = _ids(10, 3)
    full = fake_greedy(W, p, 30, use_ssm=True, ignore_eos=True)
    text = eng.tokenizer.decode(full)
    stop = text[14:17]
    eng.add_request("s", {"prompt_token_ids": p},
                    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop))
    prev, prev_ids = "", []
    while eng.has_unfinished_requests():
        for o in eng.step():
            c = o.outputs[0]
            assert c.text.startswith(prev) and c.token_ids[: len(prev_ids)] == prev_ids
            prev, prev_ids = c.text, c.token_ids
    assert prev == text[: text.find(stop)]


def test_output_kinds(eng, W):
    """CUMULATIVE (the default) reports a running request every step; FINAL_ONLY (what
    LLM.generate uses) once, finished, with the same tokens and text."""
    p = _ids(9, 5)
    seen = {}
    for rid, kind in (("cum", RequestOutputKind.CUMULATIVE), ("fin", RequestOutputKind.FINAL_ONLY)):
        eng.add_request(rid, {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind))
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
    assert len(seen["cum"]) == 12 and len(seen["fin"]) == 1 and seen["fin"][0].finished
    assert seen["fin"][0].outputs[0].token_ids == seen["cum"][-1].outputs[0].token_ids == \
        fake_greedy(W, p, 12, use_ssm=True, ignore_eos=True)
    assert seen["fin"][0].outputs[0].text == seen["cum"][-1].outputs[0].text
    with pytest.raises(InvalidSamplingParamsError, match="output_kind"):
        SamplingParams(output_kind=3)


def test_delta_outputs_concatenate_to_the_final_output(eng, W):
    """DELTA returns only what is new: its token ids, text and logprobs, concatenated over the
    steps, are the CUMULATIVE request's final ones (n=2, a stop string held back, logprobs and
    prompt logprobs, the latter sent once); no output comes with nothing new."""
    p = _ids(9, 5)
    text = eng.tokenizer.decode(fake_greedy(W, p, 30, use_ssm=True, ignore_eos=True))
    stop = text[20:23]
    kw = dict(temperature=0.8, seed=3, n=2, max_tokens=30, ignore_eos=True, stop=stop, logprobs=2, prompt_logprobs=1)
    for rid, kind in (("cum", RequestOutputKind.CUMULATIVE), ("delta", RequestOutputKind.DELTA)):
        eng.add_request(rid, {"prompt_token_ids": p}, SamplingParams(output_kind=kind, **kw))
    seen = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
    final = {c.index: c for c in seen["cum"][-1].outputs}
    assert [o.prompt_logprobs is not None for o in seen["delta"]].count(True) == 1
    assert seen["delta"][0].prompt_logprobs == seen["cum"][-1].prompt_logprobs
    assert all(o.finished or o.prompt_logprobs is not None or any(c.token_ids or c.text for c in o.outputs)
               for o in seen["delta"])
    for i in (0, 1):
        parts = [c for o in seen["delta"] for c in o.outputs if c.index == i]
        assert [t for c in parts for t in c.token_ids] == final[i].token_ids
        assert "".join(c.text for c in parts) == final[i].text and stop not in final[i].text
        assert [lp for c in parts for lp in c.logprobs] == final[i].logprobs
        assert parts[-1].finish_reason == final[i].finish_reason
    joined = seen["delta"][0]  # RequestOutput.add (the server's Subscription) joins deltas in place
    for o in seen["delta"][1:]:
        joined.add(o)
    assert joined.finished and joined.prompt_logprobs == seen["cum"][-1].prompt_logprobs
    assert sorted(joined.outputs, key=lambda c: c.index) == sorted(seen["cum"][-1].outputs, key=lambda c: c.index)


def test_delta_prompt_logprobs_of_a_one_step_request(eng, W):
    """A DELTA request that finishes in its prefill step (max_tokens=1: the scoring call) still
    gets its prompt logprobs, in that one output (they were dropped: its finished sequence counted
    no computed tokens, so the logprobs waited for an output that never came)."""
    p = _ids(7, 19)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        eng.add_request(f"one-{kind.name}", {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, output_kind=kind))
    seen = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
    delta, cum = seen["one-DELTA"], seen["one-CUMULATIVE"]
    assert [o.prompt_logprobs is not None for o in delta].count(True) == 1 and delta[-1].finished
    plp = next(o.prompt_logprobs for o in delta if o.prompt_logprobs is not None)
    assert plp == cum[-1].prompt_logprobs and plp[0] is None and all(d is not None for d in plp[1:])


def test_min_tokens_suppresses_eos(eng, W):
    p, ref = _prompt_with_eos(W, start=50)
    k = len(ref) + 3
    o = _run(eng, p, SamplingParams(temperature=0, max_tokens=k + 10, min_tokens=k)).outputs[0]
    # reference: greedy with EOS masked while fewer than k tokens were generated
    ids, exp = list(p), []
    while True:
        logits = W[fake_hash(ids, True, 64)].copy()
        if len(exp) < k:
            logits[EOS] = -np.inf
        t = int(np.argmax(logits))
        exp.append(t)
        ids.append(t)
        if (t == EOS and len(exp) >= k) or len(exp) == k + 10:
            break
    assert o.token_ids == exp and len(o.token_ids) >= k


def test_max_model_len_stops_with_length(eng, W):
    mml = eng.config.max_model_len
    p = _ids(mml - 6, 4)
    with pytest.raises(MaxTokensTooLargeError, match="maximum context length"):  # as vLLM: a 400, not a cap
        _run(eng, p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    o = _run(eng, p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)).outputs[0]
    assert len(o.token_ids) == 6 and o.finish_reason == "length"
    assert o.token_ids == fake_greedy(W, p, 6, use_ssm=True, ignore_eos=True)
    o = _run(eng, p, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)).outputs[0]
    assert len(o.token_ids) == 6


# ---- seeds and n ---------------------------------------------------------------------------------
def test_seeded_sampling_is_batch_invariant(eng):
    p = _ids(13, 5)
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=25, ignore_eos=True, seed=1234, n=2)
    alone = _run(eng, p, sp)
    # the same request among others of very different lengths, arriving in another order
    eng.add_request("o1", {"prompt_token_ids": _ids(61, 6)}, SamplingParams(temperature=0.7, max_tokens=9))
    eng.add_request("o2", {"prompt_token_ids": _ids(2, 7)}, SamplingParams(temperature=1.3, max_tokens=31))
    eng.step()
    eng.add_request("me", {"prompt_token_ids": p}, sp)
    eng.add_request("o3", {"prompt_token_ids": _ids(33, 8)}, SamplingParams(temperature=0, max_tokens=14))
    batched = eng.run_to_completion()["me"]
    a = [c.token_ids for c in alone.outputs]
    assert a == [c.token_ids for c in batched.outputs]
    assert a[0] != a[1], "the n sequences should differ"
    other = _run(eng, p, sp.clone(seed=99))
    assert [c.token_ids for c in other.outputs] != a


# ---- logprobs ------------------------------------------------------------------------------------
def test_cumulative_logprob_fetched_only_when_reported(eng, W):
    """logprobs=0 reports the sampled tokens' cumulative logprob (batched beside a row that reports
    none); a step where no row reports one does not fetch the logprobs at all."""
    fetched = []
    dispatch = eng._dispatch

    def recorded(sched):
        f = dispatch(sched)
        fetched.append("logprobs" in f.names)
        return f
    eng._dispatch = recorded
    try:
        p = _ids(11, 4)
        eng.add_request("lp0", {"prompt_token_ids": p}, SamplingParams(temperature=0.9, seed=5, max_tokens=9,
                                                                     ignore_eos=True, logprobs=0))
        eng.add_request("none", {"prompt_token_ids": _ids(7, 6)}, SamplingParams(temperature=0, max_tokens=13,
                                                                               ignore_eos=True))
        out = eng.run_to_completion()
        assert out["none"].outputs[0].cumulative_logprob is None
        c = out["lp0"].outputs[0]
        ids, cum = list(p), 0.0
        for t in c.token_ids:
            cum += _log_softmax(W[fake_hash(ids, True, 64)])[t]
            ids.append(t)
        assert len(c.token_ids) == 9 and abs(c.cumulative_logprob - cum) < 1e-3
        assert any(fetched) and not all(fetched)  # "none" decodes 4 steps alone: nothing to fetch then
        assert not fetched[-1]
    finally:
        del eng._dispatch  # (the instance attribute: the method shows again)


def test_logprobs_and_prompt_logprobs(eng, W):
    p = _ids(37, 9)  # chunked over several steps (prefill buckets 8/16)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    o = _run(eng, p, sp)
    c = o.outputs[0]
    ids = list(p)
    cum = 0.0
    for t, d in zip(c.token_ids, c.logprobs):
        ref = _log_softmax(W[fake_hash(ids, True, 64)])
        order = np.argsort(-ref)
        assert t in d and set(order[:3]) <= set(d) and len(d) <= 4
        assert abs(d[t].logprob - ref[t]) < 1e-4
        assert d[t].rank == int((ref >= ref[t]).sum())
        for j in range(3):
            assert d[int(order[j])].rank == j + 1
        assert d[t].decoded_token == eng.tokenizer.decode([t], skip_special_tokens=False)
        cum += ref[t]
        ids.append(t)
    assert abs(c.cumulative_logprob - cum) < 1e-3
    plp = o.prompt_logprobs
    assert len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        ref = _log_softmax(W[fake_hash(p[:i], True, 64)])
        d = plp[i]
        assert p[i] in d and abs(d[p[i]].logprob - ref[p[i]]) < 1e-4
        assert d[p[i]].rank == int((ref >= ref[p[i]]).sum())
        assert set(np.argsort(-ref)[:2]) <= set(d)


# ---- penalties -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rep, pres, freq", [(1.5, 0.0, 0.0), (1.0, 0.8, 0.0), (1.0, 0.0, 0.6), (0.7, -0.5, 0.9)])
def test_penalties_match_reference(eng, W, rep, pres, freq):
    p = _ids(21, 10)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=rep,
                        presence_penalty=pres, frequency_penalty=freq)
    o = _run(eng, p, sp).outputs[0]
    ids, exp = list(p), []
    for _ in range(20):
        x = W[fake_hash(ids, True, 64)].astype(np.float32).astype(np.float64)
        counts = np.bincount(exp, minlength=64) if exp else np.zeros(64, int)
        seen = np.zeros(64, bool)
        seen[p] = True
        occ = seen | (counts > 0)
        x = np.where(occ, np.where(x > 0, x / rep, x * rep), x) - freq * counts - pres * (counts > 0)
        t = int(np.argmax(x))
        exp.append(t)
        ids.append(t)
    assert o.token_ids == exp
    assert o.token_ids != fake_greedy(W, p, 20, use_ssm=True, ignore_eos=True)  # the penalty mattered


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_frees_everything(eng):
    s = eng.scheduler
    free0 = s.blocks.num_free
    eng.add_request("a", {"prompt_token_ids": _ids(50, 11)}, SamplingParams(max_tokens=70, ignore_eos=True,
                                                                            presence_penalty=0.3))
    eng.add_request("b", {"prompt_token_ids": _ids(5, 12)}, SamplingParams(max_tokens=100, ignore_eos=True))
    eng.add_request("c", {"prompt_token_ids": _ids(70, 13)}, SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert s.blocks.num_free < free0 and s.pen_rows.num_used == 1
    eng.abort("a")
    eng.abort_request(["unknown-id", "b"])  # (vLLM's name, with a list; unknown ids ignored)
    st = eng.stats()
    assert st.num_running + st.num_waiting == 1
    for o in eng.run_to_completion().values():
        assert o.request_id == "c"
    assert s.blocks.num_free == free0 and s.pen_rows.num_used == 0 and s.ssm_slots.num_used == 0
    st = eng.stats()
    assert (st.kv_blocks_used, st.kv_blocks_free, st.num_running, st.num_waiting) == (0, free0, 0, 0)


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_inputs_rejected_before_queuing(eng, W):
    good = _ids(12, 14)
    eng.add_request("good", {"prompt_token_ids": good}, SamplingParams(temperature=0, max_tokens=15,
                                                                       ignore_eos=True))
    eng.step()
    mml = eng.config.max_model_len
    bad_sp = SamplingParams()
    bad_sp.temperature = -1.0  # mutated after construction: the engine re-validates
    cases = [
        ({"prompt_token_ids": []}, SamplingParams(), EmptyPromptError),
        ("", SamplingParams(), EmptyPromptError),
        ({"prompt_token_ids": [3] * mml}, SamplingParams(), PromptTooLongError),
        ("a" * (mml + 3), SamplingParams(), PromptTooLongError),
        ({"prompt_token_ids": [3, 64]}, SamplingParams(), InvalidRequestError),
        ({"prompt_token_ids": [3, -1]}, SamplingParams(), InvalidRequestError),
        ({"prompt_token_ids": [3]}, bad_sp, InvalidSamplingParamsError),
        ({"prompt_token_ids": [3]}, SamplingParams(logprobs=6), InvalidSamplingParamsError),
        ({"prompt_token_ids": [3]}, SamplingParams(prompt_logprobs=9), InvalidSamplingParamsError),
        ({"prompt_token_ids": [3]}, SamplingParams(stop_token_ids=[64]), InvalidSamplingParamsError),
        ({"prompt_token_ids": [3]}, SamplingParams(min_tokens=2, stop_token_ids=[2, 3, 4, 5]),
         InvalidSamplingParamsError),
        ({"prompt_token_ids": [3]}, "greedy", InvalidSamplingParamsError),
        ({"prompt": "ab", "multi_modal_data": {"image": object()}}, SamplingParams(), InvalidPromptError),
        ({"prompt_token_ids": [3]}, SamplingParams(), InvalidRequestError),  # duplicate id "good"
        ({"oops": [3]}, SamplingParams(), InvalidRequestError),
    ]
    for i, (prompt, sp, exc) in enumerate(cases):
        rid = "good" if i == len(cases) - 2 else f"bad{i}"
        with pytest.raises(exc) as e:
            eng.add_request(rid, prompt, sp)
        assert str(e.value)
        assert rid == "good" or rid not in eng.requests
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidSamplingParamsError, match=field):
            eng.add_request("x", {"prompt_token_ids": [3]}, SamplingParams(**{field: 6}))
    assert set(eng.requests) == {"good"} and len(eng.scheduler.waiting) + len(eng.scheduler.running) == 1
    final = eng.run_to_completion()
    assert final["good"].outputs[0].token_ids == fake_greedy(W, good, 15, use_ssm=True, ignore_eos=True)


def test_no_tokenizer_takes_ids_only(eng, W):
    tok = eng.tokenizer
    eng.tokenizer = None
    try:
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            eng.add_request("t", "hello", SamplingParams())
        o = _run(eng, [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
        assert o.outputs[0].text == "" and o.outputs[0].token_ids == fake_greedy(W, [5, 6, 7], 4, use_ssm=True,
                                                                                  ignore_eos=True)
        assert all(lp.decoded_token is None for d in o.outputs[0].logprobs for lp in d.values())
    finally:
        eng.tokenizer = tok


def test_text_prompt(eng, W):
    eng.add_request("txt", "hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    o = eng.run_to_completion()["txt"]
    ids = eng.tokenizer.encode("hello world")
    assert o.prompt == "hello world" and o.prompt_token_ids == ids
    assert o.outputs[0].token_ids == fake_greedy(W, ids, 5, use_ssm=True, ignore_eos=True)


# ---- compilation ---------------------------------------------------------------------------------
def test_no_compilation_while_serving(eng):
    """A workload touching every step kind and sampling path compiles nothing after start-up."""
    with CompileCounter() as cc:
        sps = [
            SamplingParams(temperature=0, max_tokens=7),
            SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, seed=1, max_tokens=20, logprobs=2),
            SamplingParams(temperature=1.0, max_tokens=3, prompt_logprobs=1, n=2),
            SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.2, frequency_penalty=0.3,
                           min_tokens=4, stop=["ab"]),
        ]
        for i, sp in enumerate(sps * 2):
            eng.add_request(f"w{i}", {"prompt_token_ids": _ids(3 + 11 * i, 20 + i)}, sp)
            eng.step()
        eng.run_to_completion()
        eng.abort("w0")
    assert (cc.lowerings, cc.backend_compiles) == (0, 0)
    # every bucket ran through a precompiled executable; a bucket that was not listed raises
    from metrale_jax.metadata_builder import StepBucket

    with pytest.raises(RuntimeError, match="not compiled"):
        eng.compiler.run(StepBucket("decode", num_seqs=3), eng.params, eng.state, ())




def test_steps_without_grammar_rows_launch_once(W):
    """With `AttentionConfig.sample_in_forward` (the GPU's default) a decode or mixed step whose rows
    follow no grammar is one launch: its forward executable samples too (the sample executable is
    for steps whose masks the host fills while the forward runs). Greedy rows still give the
    reference's tokens."""
    import dataclasses

    from metrale_jax.engine.config import default_kernels

    eng = fake_engine(use_ssm=True, attention=dataclasses.replace(default_kernels(False), sample_in_forward=True))
    comp = eng.compiler
    saved = dict(comp.split_executables)
    calls: dict = {}

    def counted(key, exe):
        def call(*args):
            calls[key[0], key[1].kind] = calls.get((key[0], key[1].kind), 0) + 1
            return exe(*args)
        return call

    prompts = [_ids(5, 70), _ids(40, 71), _ids(9, 72)]  # the long one prefills beside the others' decoding
    sps = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=6),
           SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, logprobs=2)]
    try:
        comp.split_executables.update({k: counted(k, e) for k, e in saved.items()})
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            eng.add_request(f"once{i}", {"prompt_token_ids": p}, sp)
        outs = eng.run_to_completion()
    finally:
        comp.split_executables.update(saved)
    assert calls.get(("forward", "decode"), 0) > 0 and calls.get(("forward", "mixed"), 0) > 0, calls
    assert not any(half == "sample" for half, _ in calls), calls
    for i in (0, 1):
        assert outs[f"once{i}"].outputs[0].token_ids == fake_greedy(W, prompts[i], sps[i].max_tokens, use_ssm=True)
    assert len(outs["once2"].outputs[0].logprobs) == 8


# ---- prompt logprobs: bounded rows per step, no conditional on the GPU path ------------------------
def test_prompt_logprobs_rows_per_step_are_bounded(W):
    """The GPU's form (`sampler_branches=False`: no `lax.cond`, prompt rows in the sampled rows'
    LM-head matmul) with max_prompt_logprobs_tokens=5: a 37-token prompt asking prompt logprobs
    prefills at most 5 tokens per step (the builder refuses a step with more), beside a request
    that does not ask, and both match the host reference. (The CPU's conditional form is the
    other tests'; the scheduler property test draws the limit.)"""
    from metrale_jax.layers.attention import AttentionConfig

    e = fake_engine(use_ssm=True, max_prompt_logprobs_tokens=5, attention=AttentionConfig(sampler_branches=False))
    text = e.compiler.lower(e.compiler.buckets[-1], e.params, e.state).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text  # mixed step: no conditional
    p, q = _ids(37, 21), _ids(20, 22)
    steps0 = e.stats().num_steps
    e.add_request("plp", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    e.add_request("other", {"prompt_token_ids": q}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = e.run_to_completion()
    assert e.stats().num_steps - steps0 >= 36 // 5  # 36 prompt positions, 5 per step
    assert outs["other"].outputs[0].token_ids == fake_greedy(W, q, 6, use_ssm=True, ignore_eos=True)
    plp = outs["plp"].prompt_logprobs
    assert len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        ref = _log_softmax(W[fake_hash(p[:i], True, 64)])
        assert abs(plp[i][p[i]].logprob - ref[p[i]]) < 1e-4
        assert plp[i][p[i]].rank == int((ref >= ref[p[i]]).sum())
        assert set(np.argsort(-ref)[:2]) <= set(plp[i])
