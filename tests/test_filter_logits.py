"""`filter_logits` (temperature -> min_p -> top_k -> top_p without a sort) against an independent
float64 sort-based reference with vLLM v1's semantics, at V = 4096; the sampled frequencies of
`sample` (chi-square); batch invariance; seeds; and the compiled sampler holding no sort, no
conditional and no loop."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from metrale_jax.metadata_builder import BuilderConfig, RowSampling, sampling_only
from metrale_jax.sampling import (
    CountKernel,
    FilterParams,
    filter_logits,
    init_penalty_state,
    row_gumbel,
    sample,
    seed_words,
)

V = 4096
CFG = BuilderConfig(block_size=4, max_blocks_per_seq=4, vocab_size=V, max_suppress_ids=1)


@functools.partial(jax.jit, static_argnames=("ways", "candidates", "kernel"))
def _filter(x, temperature, top_k, top_p, min_p, ways=None, candidates=0, kernel=False):
    return filter_logits(x, FilterParams(temperature, top_k, top_p, min_p), ways=ways, candidates=candidates,
                         count_kernel=CountKernel(interpret=True) if kernel else None)


_R = 24  # every call is padded to 24 rows (rows off, logits 0): one compilation per `ways`


def _run(x: np.ndarray, rows: list[tuple], ways=None, pad: bool = True, candidates: int = 0,
         kernel: bool = False) -> np.ndarray:
    """filter_logits over rows of (temperature, top_k, top_p, min_p)."""
    n = len(rows)
    if pad:
        x = np.concatenate([x, np.zeros((_R - n, V), np.float32)])
        rows = list(rows) + [(1.0, 0, 1.0, 0.0)] * (_R - n)
    t, k, p, m = (np.asarray(c) for c in zip(*rows, strict=True))
    out = _filter(jnp.asarray(x), jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32),
                  jnp.asarray(p, jnp.float32), jnp.asarray(m, jnp.float32), ways=ways, candidates=candidates,
                  kernel=kernel)
    return np.asarray(out)[:n]


# ---- the reference: sort-based, float64, written from vLLM v1's definitions ---------------------
def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def _ref_keep(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """bool[V] kept tokens of one row. The scaled logits are rounded to float32 as the sampler sees
    them (division by the temperature); everything after that is float64."""
    z = (x.astype(np.float32) / np.float32(temperature if temperature > 0 else 1.0)).astype(np.float64)
    p = _softmax(z)
    keep = p >= min_p * p.max()  # min_p
    if 0 < top_k < len(z):  # top_k: the k-th largest of the remaining logits, ties kept
        kth = np.sort(np.where(keep, z, -np.inf))[::-1][top_k - 1]
        keep &= z >= kth
    if top_p < 1:  # top_p renormalised inside what is left; a token stays if the mass above it < top_p
        q = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        q /= q.sum()
        order = np.argsort(-z, kind="stable")
        zs, qs = z[order], q[order]
        before = np.cumsum(qs) - qs  # mass of the tokens sorted before each one
        first = np.searchsorted(-zs, -zs, side="left")  # first token of each tied group
        above = np.empty_like(before)
        above[order] = before[first]  # mass strictly above each token
        keep &= above < top_p
    return keep


def _check_rows(out: np.ndarray, x: np.ndarray, rows: list[tuple], eps: float = 1e-5) -> None:
    """Each row keeps exactly the reference set, allowing only tokens within float rounding of a
    boundary: ref(top_p - eps, min_p (1 + eps)) <= kept <= ref(top_p + eps, min_p (1 - eps)).
    Kept tokens hold logits / temperature."""
    for i, (t, k, p, m) in enumerate(rows):
        kept = np.isfinite(out[i])
        lo = _ref_keep(x[i], t, k, max(p - eps, 1e-9) if p < 1 else p, m * (1 + eps))
        hi = _ref_keep(x[i], t, k, p + eps if p < 1 else p, m * (1 - eps))
        exact = _ref_keep(x[i], t, k, p, m)
        assert np.all(kept[lo]), f"row {i} {rows[i]}: dropped {np.flatnonzero(lo & ~kept)[:8]}"
        assert not np.any(kept & ~hi), f"row {i} {rows[i]}: kept {np.flatnonzero(kept & ~hi)[:8]}"
        assert kept.sum() >= 1 and (exact.sum() == kept.sum() or lo.sum() != hi.sum())
        scaled = x[i].astype(np.float32) / np.float32(t if t > 0 else 1.0)
        np.testing.assert_allclose(out[i][kept], scaled[kept], rtol=2e-7, atol=0)  # XLA: x * (1 / t)


_AWKWARD = (
    [(1.0, k, 1.0, 0.0) for k in (1, 15, 63, 64, 65, 300, V - 1, V)]
    + [(0.7, 0, p, 0.0) for p in (0.01, 0.5, 0.9, 0.999, 1.0)]
    + [(1.3, 0, 1.0, m) for m in (0.05, 0.5)]
    + [(0.7, 50, 0.9, 0.0), (1.0, 300, 0.5, 0.05), (2.0, 15, 0.999, 0.05), (0.5, 65, 0.01, 0.5),
       (1.0, V - 1, 0.9, 0.5), (0.9, 1, 0.9, 0.05), (1.1, 64, 1.0, 0.05), (0.0, 40, 0.8, 0.1)]
)


@pytest.mark.parametrize("ways,kernel", [(None, False), (16, False), (16, True)])
def test_membership_matches_reference(ways, kernel):
    """Awkward top_k / top_p / min_p and combinations on random logits of three scales: peaked
    (nuclei of a few tokens), moderate, and near-uniform (nuclei of most of the vocabulary);
    kernel: the searches count through the Pallas kernel (interpreted), as the GPU may."""
    rng = np.random.default_rng(0)
    for scale in (6.0, 1.5, 0.02):
        x = (rng.standard_normal((len(_AWKWARD), V)) * scale).astype(np.float32)
        out = _run(x, _AWKWARD, ways=ways, kernel=kernel)
        _check_rows(out, x, _AWKWARD)
    # the nuclei really span from one token to most of the vocabulary
    sizes = [int(_ref_keep(x[i], *r).sum()) for i, r in enumerate(_AWKWARD)]
    assert min(sizes) == 1 and max(s for s, r in zip(sizes, _AWKWARD, strict=True) if r[2] < 1) > V // 2


def test_candidate_thresholds_match_reference(monkeypatch):
    """`candidates` (the CPU's sampler): thresholds read off the largest logits when every row's
    top_k and nucleus fit in them; the searches (made useless here, so only the candidate path can
    pass) never run for such a batch. Ties at the boundaries are kept whole there too."""
    import metrale_jax.sampling as sampling

    monkeypatch.setattr(sampling, "_largest_threshold", lambda holds, lo, hi, ways: jnp.zeros(lo.shape))
    _filter.clear_cache()
    rng = np.random.default_rng(7)
    rows = [(1.0, 1, 1.0, 0.0), (0.7, 15, 0.9, 0.0), (1.0, 63, 1.0, 0.05), (1.3, 64, 0.5, 0.0),
            (1.0, 0, 0.01, 0.0), (0.8, 0, 0.9, 0.1), (1.0, 0, 1.0, 0.5), (0.0, 5, 0.8, 0.0)]
    x = (rng.standard_normal((len(rows), V)) * 6).astype(np.float32)
    x[3, :70] = 9.0  # a tie group across the candidate boundary: top_k 64 keeps all 70
    _check_rows(_run(x, rows, pad=False, candidates=64), x, rows)
    _filter.clear_cache()


@pytest.mark.parametrize("rows", [[(1.0, 300, 1.0, 0.0), (1.0, 0, 0.999, 0.0), (0.7, 15, 0.9, 0.0)],
                                  [(1.0, 0, 0.999, 0.0), (0.7, 15, 0.9, 0.0), (1.0, 64, 0.95, 0.0)]])
def test_candidate_fallback_to_the_search(rows):
    """A row whose top_k or nucleus reaches past the candidates sends the batch to the searches
    (the top-k search only when some row's top_k passes them: the second batch's top_k rows keep
    their candidate thresholds under the nucleus search)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((len(rows), V)) * 0.02).astype(np.float32)
    x[2] *= 300
    _check_rows(_run(x, rows, pad=False, candidates=64), x, rows)


def test_rows_with_everything_off_are_untouched():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, V)) * 3).astype(np.float32)
    x[2, ::7] = -np.inf  # already masked tokens (a grammar mask, suppression) stay masked
    rows = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.7, V, 1.0, 0.0), (1.0, 0, 1.0, 0.0)]
    out = _run(x, rows)
    np.testing.assert_array_equal(out[0], x[0])
    np.testing.assert_array_equal(out[1], x[1])  # temperature 0: not scaled
    np.testing.assert_allclose(out[2], x[2] / np.float32(0.7), rtol=2e-7, atol=0)
    np.testing.assert_array_equal(out[3], x[3])


def test_ties_at_the_thresholds_are_kept_whole():
    """Logits on a coarse grid, so many tokens tie at every threshold: top-k keeps the whole tied
    group at the k-th value (vLLM too); top-p keeps the whole group at its boundary."""
    rng = np.random.default_rng(2)
    x = np.round(rng.standard_normal((6, V)) * 2) / 2  # values in steps of 0.5
    x[5] = 0.0
    x[5, :3] = 4.0  # three tied maxima
    x = x.astype(np.float32)
    rows = [(1.0, 10, 1.0, 0.0), (1.0, 0, 0.3, 0.0), (1.0, 40, 0.6, 0.0), (1.0, 0, 0.95, 0.05),
            (1.0, 1, 1.0, 0.0), (1.0, 0, 0.01, 0.0)]
    out = _run(x, rows)
    _check_rows(out, x, rows, eps=0.0)
    kept = np.isfinite(out)
    # top_k 10 / top_k 1: the 10th / 1st largest value's whole group
    for i, k in ((0, 10), (4, 1)):
        kth = np.sort(x[i])[::-1][k - 1]
        np.testing.assert_array_equal(kept[i], x[i] >= kth)
        assert kept[i].sum() > k  # ties did widen the set
    np.testing.assert_array_equal(np.flatnonzero(kept[5]), [0, 1, 2])  # nucleus = the tied maxima


def test_nucleus_of_one_token():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, V)) * 4).astype(np.float32)
    x[0, 17] = 30.0  # one token holds almost all the mass
    rows = [(1.0, 0, 0.5, 0.0), (1.0, 0, 0.01, 0.0), (1.0, 0, 0.999, 0.0)]
    kept = np.isfinite(_run(x, rows))
    np.testing.assert_array_equal(np.flatnonzero(kept[0]), [17])
    np.testing.assert_array_equal(np.flatnonzero(kept[1]), [x[1].argmax()])
    _check_rows(_run(x, rows), x, rows)


def test_batch_invariance_of_filter():
    """A row's output does not change when the other rows (their logits and parameters) do."""
    rng = np.random.default_rng(4)
    mine_x = (rng.standard_normal(V) * 2).astype(np.float32)
    mine = (0.8, 63, 0.9, 0.02)
    outs = []
    for trial in range(3):
        x = (rng.standard_normal((8, V)) * rng.uniform(0.01, 8)).astype(np.float32)
        rows = [tuple(_AWKWARD[(trial * 7 + j) % len(_AWKWARD)]) for j in range(8)]
        x[trial + 2], rows[trial + 2] = mine_x, mine
        outs.append(_run(x, rows)[trial + 2])
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    alone = _run(mine_x[None], [mine], pad=False)[0]  # another batch size: the same kept set and values
    np.testing.assert_array_equal(alone, outs[0])


# ---- sample(): frequencies, batch invariance, seeds ---------------------------------------------
@functools.partial(jax.jit, static_argnames="k")
def _sample(logits, smd, k=1):
    return sample(logits, smd, init_penalty_state(0, V), max_logprobs=k)


def _expected(x: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    keep = _ref_keep(x, temperature, top_k, top_p, min_p)
    z = x.astype(np.float64) / temperature
    q = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return q / q.sum()


_SETTINGS = [  # (logit scale, sampling parameters)
    (3.0, dict(temperature=0.7, top_p=0.9)),
    (3.0, dict(temperature=1.0, top_k=15)),
    (1.0, dict(temperature=1.3, top_k=300, top_p=0.5)),
    (2.0, dict(temperature=0.9, min_p=0.05)),
    (3.0, dict(temperature=0.7, top_p=0.8)),  # draws for the power check
]
_DRAWS = 1024


@functools.cache
def _draws() -> tuple[np.ndarray, np.ndarray]:
    """(logits f32[len(_SETTINGS), V], tokens i32[len(_SETTINGS), _DRAWS]): _DRAWS seeded draws of
    one row per setting, all settings in one call of `sample`."""
    rng = np.random.default_rng(5)
    xs = np.stack([rng.standard_normal(V) * scale for scale, _ in _SETTINGS]).astype(np.float32)
    rows = [RowSampling(seed=seed_words(17, j), out_index=i, **rs)
            for j, (_, rs) in enumerate(_SETTINGS) for i in range(_DRAWS)]
    tok = _sample(jnp.asarray(np.repeat(xs, _DRAWS, axis=0)), sampling_only(CFG, rows))[0]
    return xs, np.asarray(tok).reshape(len(_SETTINGS), _DRAWS)


def _chi_square_p(tok: np.ndarray, exp: np.ndarray) -> float:
    """p-value of the counts of `tok` against probabilities `exp`, tokens binned in order of
    probability so that each bin expects >= 10 draws."""
    n = len(tok)
    counts = np.bincount(tok, minlength=V).astype(np.float64)
    order = np.argsort(-exp)
    order = order[exp[order] > 0]
    obs, want = [], []
    o = e = 0.0
    for t in order:
        o += counts[t]
        e += exp[t] * n
        if e >= 10:
            obs.append(o)
            want.append(e)
            o = e = 0.0
    if e > 0:
        obs[-1] += o
        want[-1] += e
    obs, want = np.asarray(obs), np.asarray(want)
    assert len(obs) >= 3, "the test needs a kept set of several tokens"
    return float(chi2.sf(((obs - want) ** 2 / want).sum(), len(obs) - 1))


@pytest.mark.parametrize("i", range(len(_SETTINGS) - 1))
def test_sampled_frequencies_chi_square(i):
    """Seeded draws of one row: nothing outside the kept set, and a chi-square test of the counts
    against the reference distribution."""
    xs, tok = _draws()
    exp = _expected(xs[i], **_SETTINGS[i][1])
    assert np.all(exp[tok[i]] > 0), "sampled a token outside the kept set"
    assert _chi_square_p(tok[i], exp) > 1e-4


def test_chi_square_has_power():
    """The same test rejects draws from a slightly wrong nucleus (top_p 0.8 against 0.9)."""
    xs, tok = _draws()
    assert _SETTINGS[4][1]["top_p"] == 0.8 and _SETTINGS[0][1]["top_p"] == 0.9
    assert _chi_square_p(tok[4], _expected(xs[4], temperature=0.7, top_p=0.9)) < 1e-4
    assert _chi_square_p(tok[4], _expected(xs[4], temperature=0.7, top_p=0.8)) > 1e-4


def test_sampled_token_is_batch_invariant_and_seeded():
    """A seeded row samples the same token whatever the rest of the batch; same seed, same tokens;
    another seed, other tokens."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(V) * 1.5).astype(np.float32)

    def mine(oi, seed=42):
        return RowSampling(temperature=0.8, top_k=300, top_p=0.9, min_p=0.01, seed=seed_words(seed, 3), out_index=oi)

    def batch(oi, other_seed):
        xs = (rng.standard_normal((6, V)) * rng.uniform(0.1, 5)).astype(np.float32)
        xs[4] = x
        rows = [RowSampling(temperature=rng.uniform(0.2, 2), top_k=int(rng.integers(0, 500)),
                            top_p=float(rng.uniform(0.05, 1)), seed=seed_words(other_seed, j), out_index=oi)
                for j in range(6)]
        rows[4] = mine(oi)
        return int(np.asarray(_sample(jnp.asarray(xs), sampling_only(CFG, rows))[0])[4])

    alone = [int(np.asarray(_sample(jnp.asarray(x[None]), sampling_only(CFG, [mine(oi)]))[0])[0]) for oi in range(12)]
    assert [batch(oi, 1) for oi in range(12)] == alone
    assert [batch(oi, 2) for oi in range(12)] == alone
    assert len(set(alone)) > 3
    other = [int(np.asarray(_sample(jnp.asarray(x[None]), sampling_only(CFG, [mine(oi, seed=43)]))[0])[0])
             for oi in range(12)]
    assert other != alone


def test_greedy_rows_take_the_argmax_beside_filtered_rows():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, V)) * 2).astype(np.float32)
    rows = [RowSampling(), RowSampling(temperature=0.7, top_p=0.1, seed=seed_words(1, 0)),
            RowSampling(top_k=5, top_p=0.2), RowSampling(temperature=1.0, top_k=1, seed=seed_words(2, 0)),
            RowSampling(), RowSampling()]
    tok, lp, rank, ids, top = (np.asarray(a) for a in _sample(jnp.asarray(x), sampling_only(CFG, rows), k=20))
    assert tok[0] == x[0].argmax() and tok[2] == x[2].argmax() and tok[3] == x[3].argmax()
    # top logprobs (20: two rounds of lax.top_k) are the raw log-softmax's, best first
    ref = x.astype(np.float64) - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    order = np.argsort(-x, axis=-1, kind="stable")[:, :20]
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_allclose(top, np.take_along_axis(ref, order, -1), atol=2e-5)
    np.testing.assert_array_equal(rank, [int((ref[i] >= ref[i, tok[i]]).sum()) for i in range(6)])


@pytest.mark.parametrize("v,chunk", [(1000, 64), (4096, 256), (300, 16)])
def test_chunked_top_k_equals_lax_top_k(v, chunk):
    """`_top_k` through chunks (padded when V is not a multiple) gives lax.top_k's ids and values,
    ties in id order: rows of few distinct values (many ties), a row mostly -inf (fewer finite
    values than n), a row of one value; and the top 20 logprobs by every plan (`top_k_plan`: one
    round over chunks, whole rows in rounds of 8 / 16 with the taken ids masked, chunks in rounds)."""
    from metrale_jax.sampling import _top_k, _top_logprobs

    rng = np.random.default_rng(v)
    x = rng.standard_normal((5, v)).astype(np.float32)
    x[1] = rng.integers(0, 3, v)  # ties everywhere
    x[2] = -np.inf
    x[2, rng.choice(v, 5, replace=False)] = rng.standard_normal(5)
    x[3] = 0.5
    x[4, -7:] = 9.0  # the best ones in the last, padded chunk
    for n in (1, 5, 16):
        want_val, want_idx = jax.lax.top_k(jnp.asarray(x), n)
        val, idx = _top_k(jnp.asarray(x), n, chunk)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
        np.testing.assert_array_equal(np.asarray(val), np.asarray(want_val))
    ref_vals, ref_ids = jax.lax.top_k(jnp.asarray(x), 20)
    for plan in ((chunk, 20), (0, 8), (0, 16), (chunk, 8), (0, 20)):
        ids, vals = _top_logprobs(jnp.asarray(x), 20, *plan)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids), err_msg=str(plan))
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals), err_msg=str(plan))
    order = np.argsort(-x[0], kind="stable")[:20]
    np.testing.assert_array_equal(np.asarray(ids)[0], order)


def test_sampler_has_no_sort_no_conditional_no_loop():
    """The lowered sampler (what XLA is given) holds no sort, no conditional and no loop."""
    for n, tops in ((6, (20,)), (64, (8, 4))):  # top 20 logprobs: one lax.top_k, or rounds of 8 (`top_k_plan`)
        rows = [RowSampling(temperature=0.7, top_p=0.9, top_k=50, seed=seed_words(1, 0), logprobs=True)] * n
        text = jax.jit(functools.partial(sample, max_logprobs=20)).lower(
            jnp.zeros((n, V)), sampling_only(CFG, rows), init_penalty_state(2, V)).as_text()
        ops = set(re.findall(r"(?:stablehlo|chlo)\.[a-z_]+", text))
        assert "chlo.top_k" in ops
        assert not ops & {"stablehlo.sort", "stablehlo.if", "stablehlo.case", "stablehlo.while"}, ops
        assert all(f"tensor<{n}x{k}xf32>" in text for k in tops)


def test_gumbel_noise_is_finite():
    """The hash's top value once rounded u to 1.0 and the noise to +inf (a uniform draw in 2**-24
    of the tokens); this batch (256 rows of V = 131072) holds one such hash."""
    cfg = BuilderConfig(block_size=4, max_blocks_per_seq=4, vocab_size=131072, max_suppress_ids=1)
    smd = sampling_only(cfg, [RowSampling(seed=seed_words(s, 0), out_index=i) for s in range(4) for i in range(64)])
    g = jax.jit(row_gumbel, static_argnums=1)(smd, 131072)
    assert bool(jnp.all(jnp.isfinite(g)))
    assert 16 < float(jnp.max(g)) < 17  # -log(-log(1 - 2**-24))


@pytest.mark.parametrize("variadic,kernel", [(True, None), (False, None), (False, "one chunk"), (False, "chunks"),
                                             pytest.param(False, "gpu", marks=pytest.mark.gpu)])
def test_threshold_sums_every_form(variadic, kernel):
    """The searches' counts and masses over {x >= t} (one variadic reduction, the CPU's and a
    verify step's; a reduction per threshold, the GPU's for fewer rows; the Pallas kernel over one
    chunk of the row or several, the last partial) against numpy, with -inf entries and
    thresholds equal to entries (ties count)."""
    from metrale_jax.sampling import _sums_ge
    from pallas_kernels.sampling import sums_ge

    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    x[:, ::7] = -np.inf
    th = np.sort(np.concatenate([x[:, 1:4], rng.standard_normal((5, 12)).astype(np.float32)], 1), axis=1)
    th[0, 0] = -np.inf
    w = np.exp(np.where(np.isfinite(x), x, -np.inf)).astype(np.float32)
    ge = x[:, None, :] >= th[:, :, None]
    if kernel is None:
        counts = np.asarray(_sums_ge(jnp.asarray(x), jnp.asarray(th), variadic=variadic))
        masses = np.asarray(_sums_ge(jnp.asarray(x), jnp.asarray(th), jnp.asarray(w), variadic=variadic))
    else:
        blocks = dict(block_v=128, sub=32) if kernel == "chunks" else {}  # 300 = 2 x 128 + 44
        blocks["interpret"] = kernel != "gpu"
        counts = np.asarray(sums_ge(jnp.asarray(x), jnp.asarray(th), **blocks))
        masses = np.asarray(sums_ge(jnp.asarray(x), jnp.asarray(th), jnp.asarray(w), **blocks))
    np.testing.assert_array_equal(counts, ge.sum(-1))
    np.testing.assert_allclose(masses, np.where(ge, w[:, None, :], 0).sum(-1), rtol=1e-5)
