"""On-device sampling: SamplingParams validation, greedy, seeds, the sampled distribution under
temperature/top-k/top-p/min-p, penalties (vLLM's formulas), suppression, logprobs and ranks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import InvalidRequestError, InvalidSamplingParamsError
from metrale_jax.metadata_builder import BuilderConfig, RowSampling, sampling_only
from metrale_jax.sampling import (
    SamplingParams,
    init_penalty_state,
    prompt_logprobs,
    sample,
    seed_words,
    update_penalty_state,
)

V = 37
K = 5
CFG = BuilderConfig(block_size=4, max_blocks_per_seq=4, vocab_size=V, max_suppress_ids=4)


@functools.partial(jax.jit, static_argnames="k")
def _sample(logits, smd, ps, k=K):
    return sample(logits, smd, ps, max_logprobs=k)


def _logits(rows: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * scale).astype(np.float32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---- SamplingParams ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
        (dict(seed="x"), "seed"),
    ],
)
def test_params_validation_names_the_field(kw, field):
    with pytest.raises(InvalidSamplingParamsError, match=field) as e:
        SamplingParams(**kw)
    assert isinstance(e.value, InvalidRequestError) and isinstance(e.value, ValueError)


def test_params_normalisation():
    sp = SamplingParams(stop="###", top_k=-1, stop_token_ids=None)
    assert sp.stop == ["###"] and sp.stop_token_ids == [] and sp.top_k_or_off == 0
    assert SamplingParams(top_k=0).top_k_or_off == 0 and SamplingParams(top_k=7).top_k_or_off == 7
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties
    # vLLM's: seed -1 means none; vLLM 0.10's guided_decoding=GuidedDecodingParams(...) is structured_outputs
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(logit_bias={"42": 100, 7: -5}).logit_bias == {42: 100, 7: -5}  # (JSON's string keys)
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1})
    from metrale_jax.sampling import GuidedDecodingParams
    from metrale_jax.structured_output import StructuredOutputsParams

    g = GuidedDecodingParams(choice=["a", "b"])
    sp = SamplingParams(guided_decoding=g)
    assert sp.structured_outputs is g and sp.guided_decoding is None and sp.clone(n=2).structured_outputs == g
    with pytest.raises(InvalidSamplingParamsError, match="not both"):
        SamplingParams(guided_decoding=g, structured_outputs=StructuredOutputsParams(regex="a"))


# ---- greedy / logprobs ---------------------------------------------------------------------------
def test_greedy_and_logprobs_match_numpy():
    s = 6
    x = _logits(s)
    rows = [RowSampling(logprobs=True) for _ in range(s)]
    tok, lp, rank, top_ids, top_lp = _sample(jnp.asarray(x), sampling_only(CFG, rows), init_penalty_state(0, V))
    ref = _log_softmax(x)
    np.testing.assert_array_equal(np.asarray(tok), x.argmax(-1))
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(s), x.argmax(-1)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rank), 1)
    order = np.argsort(-x, axis=-1)[:, :K]
    np.testing.assert_array_equal(np.asarray(top_ids), order)
    np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(ref, order, -1), atol=1e-5)


def test_rank_of_sampled_token_is_vllm_rank():
    # sample at high temperature so non-argmax tokens are chosen; rank = #logprobs >= chosen
    s = 64
    x = np.tile(_logits(1, seed=3, scale=1.0), (s, 1))
    rows = [RowSampling(temperature=5.0, seed=seed_words(7, 0), out_index=i, logprobs=True) for i in range(s)]
    tok, lp, rank, _, _ = _sample(jnp.asarray(x), sampling_only(CFG, rows), init_penalty_state(0, V))
    tok, rank = np.asarray(tok), np.asarray(rank)
    assert len(set(tok.tolist())) > 5
    ref = _log_softmax(x)
    for i in range(s):
        assert rank[i] == int((ref[i] >= ref[i, tok[i]]).sum())
        assert abs(float(lp[i]) - ref[i, tok[i]]) < 1e-5


# ---- seeds ---------------------------------------------------------------------------------------
def test_same_seed_same_token_whatever_the_batch():
    x = _logits(1, seed=1, scale=1.0)[0]
    mine = RowSampling(temperature=1.0, top_p=0.9, seed=seed_words(1234, 0), out_index=5)
    alone = _sample(jnp.asarray(x[None]), sampling_only(CFG, [mine]), init_penalty_state(0, V))[0]
    # the same row at position 5 of a batch of 8 with other rows, other logits
    others = _logits(8, seed=2)
    others[5] = x
    rows = [RowSampling(temperature=0.7, seed=seed_words(i, 0), out_index=i) for i in range(8)]
    rows[5] = mine
    batched = _sample(jnp.asarray(others), sampling_only(CFG, rows), init_penalty_state(0, V))[0]
    assert int(alone[0]) == int(batched[5])
    # and over many out_index values, the token sequence is the same alone and batched
    seq_alone, seq_batched = [], []
    for oi in range(20):
        r = RowSampling(temperature=1.0, seed=seed_words(99, 1), out_index=oi)
        seq_alone.append(int(_sample(jnp.asarray(x[None]), sampling_only(CFG, [r]), init_penalty_state(0, V))[0][0]))
        rows = [RowSampling(temperature=2.0, seed=seed_words(5, 0), out_index=oi) for _ in range(3)] + [r]
        xs = np.concatenate([_logits(3, seed=oi), x[None]])
        seq_batched.append(int(_sample(jnp.asarray(xs), sampling_only(CFG, rows), init_penalty_state(0, V))[0][3]))
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # it really samples
    # another seed or sequence index gives another sequence
    other = [int(_sample(jnp.asarray(x[None]), sampling_only(CFG, [RowSampling(
        temperature=1.0, seed=seed_words(99, 2), out_index=oi)]), init_penalty_state(0, V))[0][0]) for oi in range(20)]
    assert other != seq_alone


# ---- the sampled distribution --------------------------------------------------------------------
def _empirical(x: np.ndarray, rs: dict, n: int = 4000) -> np.ndarray:
    rows = [RowSampling(seed=seed_words(11, 0), out_index=i, **rs) for i in range(n)]
    cfg = BuilderConfig(block_size=4, max_blocks_per_seq=4, vocab_size=V, max_suppress_ids=1)
    tok = _sample(jnp.asarray(np.tile(x, (n, 1))), sampling_only(cfg, rows), init_penalty_state(0, V))[0]
    return np.bincount(np.asarray(tok), minlength=V) / n


def _expected(x: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    z = x.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0)
    q /= q.sum()
    cum = np.cumsum(q[order]) - q[order]
    keep[order[cum >= top_p]] = False
    q = np.where(keep, p, 0)
    return q / q.sum()


@pytest.mark.parametrize(
    "rs",
    [
        dict(temperature=1.0),
        dict(temperature=0.6, top_k=4),
        dict(temperature=1.3, top_p=0.7),
        dict(temperature=1.0, top_k=6, top_p=0.8),
        dict(temperature=0.9, min_p=0.2),
    ],
)
def test_distribution(rs):
    x = _logits(1, seed=5, scale=1.2)[0]
    emp = _empirical(x, rs)
    exp = _expected(x, **rs)
    assert np.all(emp[exp == 0] == 0), "sampled a token outside the kept set"
    # total variation distance of 4000 samples from a distribution over <= 37 tokens
    assert 0.5 * np.abs(emp - exp).sum() < 0.06


# ---- penalties and suppression -------------------------------------------------------------------
def test_penalties_match_vllm_formulas():
    s, rows_n = 3, 4
    x = _logits(s, seed=8)
    rng = np.random.default_rng(0)
    prompt = [rng.integers(0, V, 9) for _ in range(s)]
    outs = [rng.integers(0, V, 6) for _ in range(s)]
    pen_rows = [2, 0, 3]
    ps = init_penalty_state(rows_n, V)
    # pre-dirty row 2, reset it in the step that counts its tokens
    ps = ps.__class__(ps.prompt_seen.at[2, :5].set(True), ps.out_counts.at[2, 7].set(9))
    toks, trow, tout = [], [], []
    for i in range(s):
        toks += list(prompt[i]) + list(outs[i])
        trow += [pen_rows[i]] * (len(prompt[i]) + len(outs[i]))
        tout += [False] * len(prompt[i]) + [True] * len(outs[i])
    params = [(1.3, 0.5, 0.2), (0.8, -0.3, 0.7), (2.0, 0.0, -1.0)]
    rowspecs = [RowSampling(repetition_penalty=r, presence_penalty=p, frequency_penalty=f,
                            pen_row=pen_rows[i], logprobs=True) for i, (r, p, f) in enumerate(params)]
    smd = sampling_only(CFG, rowspecs)
    smd = smd.__class__(**{**smd.__dict__, "tok_pen_rows": np.asarray(trow, np.int32),
                           "tok_is_output": np.asarray(tout), "reset_rows": np.asarray([2, -1], np.int32)})
    ps = jax.jit(update_penalty_state)(ps, jnp.asarray(toks, jnp.int32), smd)
    # apply through sample(): greedy picks the argmax of the penalised logits
    tok, lp, *_ = _sample(jnp.asarray(x), smd, ps)
    for i, (r, p, f) in enumerate(params):
        counts = np.bincount(outs[i], minlength=V)
        seen = np.zeros(V, bool)
        seen[prompt[i]] = True
        ref = x[i].astype(np.float64)
        occurred = seen | (counts > 0)
        ref = np.where(occurred, np.where(ref > 0, ref / r, ref * r), ref)
        ref = ref - f * counts - p * (counts > 0)
        assert int(tok[i]) == int(ref.argmax())
        # logprobs stay raw
        assert abs(float(lp[i]) - _log_softmax(x[i])[int(tok[i])]) < 1e-5
    np.testing.assert_array_equal(np.asarray(ps.out_counts[1]), 0)  # untouched row


def test_suppressed_ids_are_never_sampled():
    x = _logits(2, seed=4)
    top2 = np.argsort(-x, -1)[:, :2]
    rows = [RowSampling(suppress_ids=tuple(top2[0])), RowSampling(temperature=1.0, suppress_ids=tuple(top2[1]),
                                                                 seed=seed_words(3, 0))]
    tok = np.asarray(_sample(jnp.asarray(x * 20), sampling_only(CFG, rows), init_penalty_state(0, V))[0])
    assert tok[0] not in top2[0] and tok[1] not in top2[1]
    assert tok[0] == np.argsort(-x[0])[2]


def test_logit_bias_is_added_to_the_logits():
    """Additive logit_bias (`RowSampling.bias`, the suppress table's values): greedy takes the
    argmax of logits + bias, a suppressed id stays banned beside biased ones, and the logprobs
    stay the model's."""
    x = _logits(3, seed=5) * 4
    low = np.argsort(x, -1)[:, :3]  # each row's three least likely tokens
    b = float(np.ptp(x)) + 1
    rows = [RowSampling(bias=((int(low[0, 0]), b),)),
            RowSampling(bias=((int(low[1, 0]), b), (int(low[1, 1]), b + 1)), suppress_ids=(int(low[1, 1]),)),
            RowSampling(bias=((int(np.argmax(x[2])), -b),), logprobs=True)]
    tok, lp = (np.asarray(a) for a in _sample(jnp.asarray(x), sampling_only(CFG, rows), init_penalty_state(0, V))[:2])
    assert tok[0] == low[0, 0] and tok[1] == low[1, 0]  # (low[1, 1]'s larger bias loses to its ban)
    assert tok[2] == np.argsort(-x[2])[1]
    for i in range(3):
        assert abs(float(lp[i]) - _log_softmax(x[i])[int(tok[i])]) < 1e-5


# ---- prompt logprobs -----------------------------------------------------------------------------
def test_prompt_logprobs_match_numpy():
    p, h = 23, 8
    rng = np.random.default_rng(6)
    w = rng.standard_normal((h, V)).astype(np.float32)
    hid = rng.standard_normal((p, h)).astype(np.float32)
    tgt = rng.integers(0, V, p).astype(np.int32)
    tgt[[0, 7, 22]] = -1
    f = jax.jit(lambda hid, tgt: prompt_logprobs(hid @ w, tgt, max_logprobs=K))
    lp, rank, ids, top = (np.asarray(a) for a in f(jnp.asarray(hid), jnp.asarray(tgt)))
    ref = _log_softmax(hid @ w)
    for i in range(p):
        if tgt[i] < 0:
            assert lp[i] == 0
            continue
        assert abs(lp[i] - ref[i, tgt[i]]) < 1e-4
        assert rank[i] == int((ref[i] >= ref[i, tgt[i]] - 1e-9).sum())
        np.testing.assert_array_equal(ids[i], np.argsort(-ref[i])[:K])
        np.testing.assert_allclose(top[i], np.sort(ref[i])[::-1][:K], atol=1e-4)


@pytest.mark.parametrize("how", ["branches", "skip"])
def test_branches_give_the_same_samples(how):
    """`sample(branches=True)` (the CPU default: filters, draw and top logprobs under `lax.cond`)
    and `sample(skip=True)` (the same skips with the GPU's algorithms) give exactly the
    branch-free sampler's outputs for greedy rows, seeded random rows with
    min_p, penalised rows (others untouched), suppressed ids and top-k/top-p/logprob rows; with no
    random row and no logprob row they skip both and still return the argmax."""
    s, rows_n = 7, 3
    x = jnp.asarray(_logits(s, seed=21))
    ps = init_penalty_state(rows_n, V)
    ps = ps.__class__(ps.prompt_seen.at[1, ::3].set(True), ps.out_counts.at[1, 4:9].set(2).at[2, 0:V:2].set(1))
    rows = [RowSampling(), RowSampling(temperature=0.8, seed=seed_words(5, 0), out_index=3),
            RowSampling(repetition_penalty=1.5, frequency_penalty=0.4, pen_row=1),
            RowSampling(temperature=1.3, min_p=0.1, presence_penalty=0.7, pen_row=2, seed=seed_words(9, 1)),
            RowSampling(suppress_ids=(int(jnp.argmax(x[4])),)),
            RowSampling(temperature=0.5, seed=seed_words(2, 0), suppress_ids=(1, 2)),
            RowSampling(temperature=0.9, top_k=5, top_p=0.8, seed=seed_words(3, 0), logprobs=True)]
    smd = sampling_only(CFG, rows)
    full = _sample(x, smd, ps)
    branched = jax.jit(functools.partial(sample, max_logprobs=K, **{how: True}))(x, smd, ps)
    for a, b in zip(branched, full, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a batch of greedy rows only: the argmax and its logprob, no top logprobs computed
    smd_g = sampling_only(CFG, [RowSampling()] * s)
    g = jax.jit(functools.partial(sample, max_logprobs=K, **{how: True}))(x, smd_g, init_penalty_state(0, V))
    np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(jnp.argmax(x, -1)))
    np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(_sample(x, smd_g, init_penalty_state(0, V))[1]))
    assert not np.any(np.asarray(g[3]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_next_tiny"])
def test_sampler_skip_in_the_engine_gpu(name):
    """The GPU's sampler skips (`AttentionConfig.sampler_skip`: `lax.cond` inside the step's CUDA
    graphs, the predicate read on the device) give the default engine's tokens and logprobs: a
    greedy batch (everything skipped), a batch mixing greedy, seeded top-p and logprob rows, and
    n-gram verify steps (a hybrid's recurrent states committed after the sampler)."""
    import dataclasses

    from metrale_jax import LLMEngine, SamplingParams, load_model
    from metrale_jax.engine.config import EngineConfig, default_kernels
    from tests.conftest import FIXTURES

    model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    base = default_kernels(True, getattr(model, "has_experts", False))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(5, 40)), [7] * 9, list(range(60, 20, -3))]
    mixed = [SamplingParams(temperature=0, max_tokens=10),
             SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=10),
             SamplingParams(temperature=0, logprobs=3, max_tokens=10),
             SamplingParams(temperature=1.1, top_k=5, min_p=0.05, seed=11, max_tokens=10, logprobs=2)]

    def run(skip: bool, spec=None):
        cfg = EngineConfig(dtype="float32", max_model_len=128, max_num_seqs=8, show_progress=False, num_kv_blocks=96,
                           attention=dataclasses.replace(base, sampler_skip=skip), speculative_config=spec)
        eng = LLMEngine(model, params, cfg)
        res = []
        for sp in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), mixed):
            for o in eng.generate(prompts, sp):
                c = o.outputs[0]
                lps = [sorted((t, round(lp.logprob, 4)) for t, lp in d.items()) for d in c.logprobs or []]
                res.append((c.token_ids, round(c.cumulative_logprob or 0.0, 3), lps))
        return res

    ref = run(False)
    assert run(True) == ref
    spec = run(True, {"method": "ngram", "num_speculative_tokens": 3})
    assert [r[0] for r in spec] == [r[0] for r in ref]
