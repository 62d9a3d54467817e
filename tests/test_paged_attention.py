"""Paged-attention kernels (pallas_kernels/paged_attention) against their float32 references.

* The references are first checked against a naive dense softmax attention written here in
  numpy float64 over contiguous (un-paged) K/V.
* The kernels run in Pallas interpret mode on the CPU and, marked `gpu`, compiled on a GPU.
* Pools are NaN everywhere a kernel must not look: other layers, blocks no row owns, and slots
  past each row's length. Block tables are random permutations; unused entries point at other
  rows' blocks. Kernel outputs start NaN-filled (the `_poison` hook aliases a NaN buffer).
* The cases cover every GQA group 1..16, head_dim 64/128/256, block size 16/32/64, bf16/f32/fp8
  pools, sliding windows, split-K, and the lengths 0, 1, 15, 63, 64, 65 and 300; not the product.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    DecodeParams,
    PrefillParams,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_kv_write,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    paged_verify_attention,
    verify_supports,
)

ON_GPU = jax.devices()[0].platform == "gpu"
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="gpu", marks=needs_gpu)]

BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
ALL_LENS = (0, 1, 15, 63, 64, 65, 300)


# ---- paged problem builder ------------------------------------------------------------------------
def build_pools(rng, lens, *, num_layers, layer, block_size, hkv, d, kv_dtype, spare_blocks=3):
    """Random K/V for `lens` sequences in paged pools [L, NB, bs, Hkv, D], NaN where unowned.

    Returns (k_pool, v_pool, block_tables i32[R, MB], dense_k, dense_v) with dense_* a list of
    f32[len, Hkv, D] (the dequantized values a kernel should see), and the k/v scales (fp8 only).
    """
    need = [-(-n // block_size) for n in lens]
    mb = max(max(need), 1) + 1
    nb = sum(need) + spare_blocks
    perm = rng.permutation(nb)
    shape = (num_layers, nb, block_size, hkv, d)
    k_pool = np.full(shape, np.nan, np.float32)
    v_pool = np.full(shape, np.nan, np.float32)
    is_fp8 = jnp.dtype(kv_dtype) == jnp.dtype(FP8)
    k_scale, v_scale = (0.05, 0.03) if is_fp8 else (None, None)
    tables = np.zeros((len(lens), mb), np.int32)
    dense_k, dense_v = [], []
    cursor = 0
    for r, n in enumerate(lens):
        own = perm[cursor:cursor + need[r]]
        cursor += need[r]
        # Unused entries point at random blocks (other rows' or spare): never to be read.
        tables[r] = rng.choice(nb, size=mb)
        tables[r, :need[r]] = own
        k = rng.standard_normal((n, hkv, d)).astype(np.float32)
        v = rng.standard_normal((n, hkv, d)).astype(np.float32)
        if is_fp8:  # store k / scale in fp8; the kernel must multiply the scale back
            k8 = np.asarray(jnp.asarray(k * 8.0, FP8).astype(F32))
            v8 = np.asarray(jnp.asarray(v * 8.0, FP8).astype(F32))
            k, v = k8 * k_scale, v8 * v_scale
            stored_k, stored_v = k8, v8
        else:
            k = np.asarray(jnp.asarray(k, kv_dtype).astype(F32))
            v = np.asarray(jnp.asarray(v, kv_dtype).astype(F32))
            stored_k, stored_v = k, v
        for i in range(n):
            blk, off = own[i // block_size], i % block_size
            k_pool[layer, blk, off] = stored_k[i]
            v_pool[layer, blk, off] = stored_v[i]
        dense_k.append(k)
        dense_v.append(v)
    return (jnp.asarray(k_pool, kv_dtype), jnp.asarray(v_pool, kv_dtype), jnp.asarray(tables),
            dense_k, dense_v, k_scale, v_scale)


def naive_attention(q, k, v, q_pos, sm_scale, window):
    """numpy float64: q [Hq, D] at position q_pos over dense k/v [S, Hkv, D] (keys 0..q_pos)."""
    hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((hq, d))
    for h in range(hq):
        kh = k[: q_pos + 1, h // (hq // hkv)].astype(np.float64)
        vh = v[: q_pos + 1, h // (hq // hkv)].astype(np.float64)
        keep = np.arange(q_pos + 1)
        if window is not None:
            keep = keep[q_pos - keep < window]
        if len(keep) == 0:
            continue
        s = kh[keep] @ q[h].astype(np.float64) * sm_scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vh[keep]
    return out


def assert_close(out, ref, *, tol, what=""):
    out = np.asarray(jnp.asarray(out).astype(F32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), f"{what}: non-finite output at {np.argwhere(~np.isfinite(out))[:5]}"
    scale = max(np.abs(ref).max(), 1e-6)
    err = np.abs(out - ref).max() / scale
    assert err <= tol, f"{what}: max error {err:.3g} (relative to max |ref|) > {tol}"


def _tol(q_dtype, kv_dtype):
    return 2e-4 if (q_dtype == F32 and kv_dtype == F32) else 2.5e-2


# ---- decode ---------------------------------------------------------------------------------------
# (group, hkv, head_dim, block_size, kv_dtype, q_dtype, window, params, lens)
DECODE_CASES = [
    (1, 2, 64, 16, BF16, BF16, None, DecodeParams(block_k=32), ALL_LENS),
    (2, 1, 128, 32, BF16, BF16, None, DecodeParams(64, 3, heads_inner=True, prefetch=True), ALL_LENS),
    (3, 1, 256, 64, BF16, BF16, 40, DecodeParams(block_k=32, num_splits=2), ALL_LENS),
    (4, 2, 64, 16, FP8, BF16, None, DecodeParams(block_k=64, heads_inner=True, prefetch=True), (65, 0, 300)),
    (5, 1, 128, 64, F32, F32, None, DecodeParams(block_k=16, num_splits=4), (300, 1, 64)),
    (6, 1, 64, 32, FP8, BF16, 70, DecodeParams(block_k=32, num_splits=2, prefetch=True), (300, 63, 0)),
    (7, 1, 128, 16, BF16, F32, None, DecodeParams(block_k=64), (15, 65)),
    (8, 1, 256, 32, FP8, BF16, None, DecodeParams(block_k=16), (64, 300)),
    (9, 1, 64, 64, BF16, BF16, 1, None, (1, 65, 300)),
    (10, 2, 64, 16, BF16, BF16, None, DecodeParams(block_k=128, num_splits=8, heads_inner=True), (63, 0)),
    (11, 1, 128, 32, F32, BF16, None, DecodeParams(block_k=32), (65, 15)),
    (12, 1, 64, 64, BF16, BF16, None, DecodeParams(block_k=64, num_splits=2), (300, 1)),
    (13, 1, 64, 16, FP8, BF16, None, None, (64, 15)),
    (14, 1, 128, 32, BF16, BF16, 64, DecodeParams(block_k=32), (300, 0, 65)),
    (15, 1, 64, 64, BF16, BF16, None, DecodeParams(block_k=16, num_splits=3), (63, 1)),
    (16, 1, 64, 16, BF16, BF16, None, DecodeParams(block_k=64), ALL_LENS),
]


def _decode_problem(case, seed):
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, lens = case
    rng = np.random.default_rng(seed)
    k_pool, v_pool, tables, dk, dv, ks, vs = build_pools(
        rng, lens, num_layers=2, layer=1, block_size=bs, hkv=hkv, d=d, kv_dtype=kv_dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), g * hkv, d)), q_dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    return q, k_pool, v_pool, tables, seq_lens, dk, dv, ks, vs


@pytest.mark.parametrize("case", DECODE_CASES[:3] + DECODE_CASES[5:6], ids=lambda c: f"g{c[0]}")
def test_decode_reference_matches_naive_dense(case):
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, lens = case
    q, k_pool, v_pool, tables, seq_lens, dk, dv, ks, vs = _decode_problem(case, seed=1)
    sm_scale = 1.0 / math.sqrt(d)
    ref = paged_decode_attention_reference(q, k_pool, v_pool, 1, tables, seq_lens, sm_scale=sm_scale,
                                           sliding_window=window, k_scale=ks, v_scale=vs)
    qn = np.asarray(q.astype(F32))
    naive = np.stack([
        naive_attention(qn[r], dk[r], dv[r], n - 1, sm_scale, window) if n else np.zeros(qn[r].shape)
        for r, n in enumerate(lens)
    ])
    assert_close(ref, naive, tol=1e-5, what="decode reference")


def _grid(cases, ci: tuple[int, ...]):
    """(case, interpret) pairs: every case on the GPU; interpreted on the CPU, the cases numbered
    (g) in `ci` in CI and the others `slow` (`pytest -m slow`): interpret mode is slow."""
    out = []
    for c in cases:
        name = f"g{c[0]}-d{c[2]}-bs{c[3]}-{jnp.dtype(c[4]).name}"
        out.append(pytest.param(c, True, id=f"{name}-interpret", marks=() if c[0] in ci else pytest.mark.slow))
        out.append(pytest.param(c, False, id=f"{name}-gpu", marks=needs_gpu))
    return out


# CI: all lengths (1, 16), a window with splits and d 256 (3), FP8 with the heads inner and prefetch
# (4), f32 with 4 splits (5), FP8 with a window (6), a one-token window and the default parameters (9)
@pytest.mark.parametrize("case,interpret", _grid(DECODE_CASES, ci=(1, 3, 4, 5, 6, 9, 16)))
def test_decode_kernel(case, interpret):
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, lens = case
    q, k_pool, v_pool, tables, seq_lens, dk, dv, ks, vs = _decode_problem(case, seed=g)
    sm_scale = 1.0 / math.sqrt(d)
    kw = dict(sm_scale=sm_scale, sliding_window=window, k_scale=ks, v_scale=vs)
    out = paged_decode_attention(q, k_pool, v_pool, jnp.int32(1), tables, seq_lens, params=params,
                                 interpret=interpret, _poison=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = paged_decode_attention_reference(q, k_pool, v_pool, 1, tables, seq_lens, **kw)
    assert_close(out, ref, tol=_tol(q_dtype, kv_dtype), what="decode")
    zero_rows = np.asarray(seq_lens) == 0
    assert (np.asarray(out.astype(F32))[zero_rows] == 0).all()


# (group, hkv, head_dim, block_size, kv_dtype, q_dtype, window, params, lens), merged in the kernel
MERGE_CASES = [
    (4, 2, 64, 16, BF16, BF16, None, DecodeParams(block_k=32, num_splits=4), ALL_LENS),
    (1, 2, 128, 32, FP8, BF16, 40, DecodeParams(block_k=16, num_splits=2, heads_inner=True), (300, 0, 65)),
    (2, 1, 64, 16, F32, F32, None, DecodeParams(block_k=16, num_splits=16), (300, 1, 15)),
    (8, 1, 64, 16, BF16, BF16, None, DecodeParams(block_k=16, num_splits=3), (64, 1, 0, 63)),
]


@pytest.mark.parametrize("case,interpret", _grid(MERGE_CASES, ci=(4, 1, 8)))
def test_decode_kernel_merges_its_splits(case, interpret):
    """`tickets`: the last split program of each (row, KV head) merges the partials in the kernel,
    as the XLA combine does, at any split count; each launch leaves the tickets as they came (any
    multiples of the split count), so the next call (the next layer, the next step) merges as well."""
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, lens = case
    q, k_pool, v_pool, tables, seq_lens, dk, dv, ks, vs = _decode_problem(case, seed=10 + g)
    kw = dict(sm_scale=1.0 / math.sqrt(d), sliding_window=window, k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_reference(q, k_pool, v_pool, 1, tables, seq_lens, **kw)
    combined = paged_decode_attention(q, k_pool, v_pool, jnp.int32(1), tables, seq_lens, params=params,
                                      interpret=interpret, **kw)
    ns = params.num_splits
    # (more ticket rows than the batch's: the engine's buffer is sized for its largest batch; the extra
    # rows stay as they are)
    start = np.asarray(np.random.default_rng(g).integers(0, 1000, (hkv, len(lens) + 2)) * ns, np.int32)
    start[0, 0] = 0
    tickets = jnp.asarray(start)
    for _ in range(2):
        out, tickets = paged_decode_attention(q, k_pool, v_pool, jnp.int32(1), tables, seq_lens, params=params,
                                              tickets=tickets, interpret=interpret, _poison=True, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_close(out, ref, tol=_tol(q_dtype, kv_dtype), what="merged in the kernel")
        assert_close(out, combined, tol=_tol(q_dtype, kv_dtype) / 4, what="merged against the XLA combine")
        assert (np.asarray(out.astype(F32))[np.asarray(seq_lens) == 0] == 0).all()
    np.testing.assert_array_equal(np.asarray(tickets), start)


def test_decode_tickets_with_one_split_pass_through():
    """One split: nothing to merge, and the tickets come back as given; a misshapen buffer is refused."""
    case = (2, 2, 64, 16, BF16, BF16, None, None, (65, 1, 0))
    q, k_pool, v_pool, tables, seq_lens, *_ = _decode_problem(case, seed=3)
    ref = paged_decode_attention_reference(q, k_pool, v_pool, 1, tables, seq_lens, sm_scale=0.125)
    tickets = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out, t = paged_decode_attention(q, k_pool, v_pool, 1, tables, seq_lens, sm_scale=0.125, tickets=tickets,
                                    params=DecodeParams(block_k=16, num_splits=1), interpret=True)
    assert_close(out, ref, tol=2.5e-2, what="one split")
    np.testing.assert_array_equal(np.asarray(t), np.arange(6).reshape(2, 3))
    for bad in (tickets[:, :2], tickets.reshape(-1), tickets.T):
        with pytest.raises(ValueError, match="tickets"):
            paged_decode_attention(q, k_pool, v_pool, 1, tables, seq_lens, sm_scale=0.125, tickets=bad,
                                   interpret=True)


def _h200_mesh():
    """An abstract H200, to cross-lower the kernels for it on the CPU machine."""
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132,
                                                                                               "gpu"))


def test_decode_merge_lowers_for_h200():
    """The in-kernel merge (a CTA barrier, an atomic ticket, a branch, volatile loads) cross-lowers
    to Triton IR for an H200 on the CPU machine."""
    sds = jax.ShapeDtypeStruct
    pool = sds((2, 40, 16, 8, 128), BF16)
    args = (sds((1, 32, 128), BF16), pool, pool, sds((1, 64), jnp.int32), sds((1,), jnp.int32))

    def lowered(tickets=None):
        f = jax.jit(lambda q, kp, vp, t, s, tk: paged_decode_attention(
            q, kp, vp, jnp.int32(1), t, s, sm_scale=0.1, params=DecodeParams(num_splits=16), tickets=tk))
        return f.trace(*args, tickets).lower(lowering_platforms=("cuda",)).as_text()

    with jax.sharding.use_abstract_mesh(_h200_mesh()):
        text, combined = lowered(sds((8, 4), jnp.int32)), lowered()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.reduce" not in text and "stablehlo.reduce" in combined  # (no XLA combine after the merge)


def test_decode_traced_layer_in_scan():
    """The layer index comes from a lax.scan carry (traced), as in the engine's layer loop."""
    rng = np.random.default_rng(7)
    lens, bs, hkv, d, g, nl = (17, 40, 0), 16, 2, 64, 2, 3
    pools = [build_pools(np.random.default_rng(i), lens, num_layers=nl, layer=i, block_size=bs, hkv=hkv,
                         d=d, kv_dtype=BF16, spare_blocks=0) for i in range(nl)]
    # One shared block table; layer i's data lives in layer i of the stacked pools.
    tables = pools[0][2]
    k_pool = jnp.stack([p[0][i] for i, p in enumerate(pools)])
    v_pool = jnp.stack([p[1][i] for i, p in enumerate(pools)])
    for i, p in enumerate(pools):  # re-home every layer's data onto layer 0's block table
        t_i = np.asarray(p[2])
        k_i = np.asarray(p[0][i].astype(F32))
        v_i = np.asarray(p[1][i].astype(F32))
        knew = np.asarray(k_pool[i].astype(F32)).copy()
        vnew = np.asarray(v_pool[i].astype(F32)).copy()
        for r, n in enumerate(lens):
            for b in range(-(-n // bs)):
                knew[tables[r, b]] = k_i[t_i[r, b]]
                vnew[tables[r, b]] = v_i[t_i[r, b]]
        k_pool = k_pool.at[i].set(jnp.asarray(knew, BF16))
        v_pool = v_pool.at[i].set(jnp.asarray(vnew, BF16))
    q = jnp.asarray(rng.standard_normal((len(lens), g * hkv, d)), BF16)
    seq_lens = jnp.asarray(lens, jnp.int32)

    def body(carry, layer):
        o = paged_decode_attention(q, k_pool, v_pool, layer, tables, seq_lens, sm_scale=0.125,
                                   params=DecodeParams(block_k=16, num_splits=2), interpret=True)
        return carry, o

    _, outs = jax.lax.scan(body, 0, jnp.arange(nl, dtype=jnp.int32))
    for i in range(nl):
        ref = paged_decode_attention_reference(q, k_pool, v_pool, i, tables, seq_lens, sm_scale=0.125)
        assert_close(outs[i], ref, tol=2.5e-2, what=f"layer {i}")


def test_decode_rejects_bad_inputs():
    q = jnp.zeros((2, 4, 64), BF16)
    pool = jnp.zeros((1, 4, 16, 2, 64), BF16)
    tables = jnp.zeros((2, 2), jnp.int32)
    lens = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(jnp.zeros((2, 3, 64), BF16), pool, pool, 0, tables, lens, sm_scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(jnp.zeros((2, 4, 32), BF16), pool, pool, 0, tables, lens, sm_scale=1.0)
    with pytest.raises(ValueError, match="fp8|float8"):
        paged_decode_attention(q, pool, pool, 0, tables, lens, sm_scale=1.0, k_scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, pool, pool, 0, tables, lens[:1], sm_scale=1.0)
    with pytest.raises(ValueError, match="block_k"):
        DecodeParams(block_k=48)


# ---- ragged prefill -------------------------------------------------------------------------------
# streams: (new tokens, cached tokens); kv_len = new + cached
ALL_STREAMS = ((1, 0), (15, 0), (13, 50), (64, 0), (2, 63), (45, 255))
# (group, hkv, head_dim, block_size, kv_dtype, q_dtype, window, params, streams, pad_tokens)
PREFILL_CASES = [
    (1, 2, 64, 16, BF16, BF16, None, PrefillParams(block_rows=32, block_k=32), ALL_STREAMS, 5),
    (2, 1, 128, 32, BF16, BF16, None, PrefillParams(block_rows=64, block_k=64), ALL_STREAMS, 0),
    (3, 1, 256, 64, BF16, BF16, 20, PrefillParams(block_rows=32, block_k=16), ((45, 255), (0, 0), (15, 0)), 3),
    (4, 1, 64, 16, FP8, BF16, None, PrefillParams(block_rows=64, block_k=32), ((2, 63), (13, 50)), 7),
    (5, 1, 128, 64, F32, F32, None, PrefillParams(block_rows=32, block_k=16), ((1, 0), (64, 0)), 1),
    (6, 1, 64, 32, FP8, BF16, 33, PrefillParams(block_rows=64, block_k=64), ((45, 255), (1, 0)), 0),
    (7, 1, 128, 16, BF16, F32, None, PrefillParams(block_rows=64, block_k=16), ((15, 0), (2, 63)), 2),
    (8, 1, 256, 32, FP8, BF16, None, PrefillParams(block_rows=32, block_k=32), ((13, 50),), 4),
    (9, 1, 64, 64, BF16, BF16, 1, PrefillParams(block_rows=64, block_k=32), ((64, 0), (45, 255)), 0),
    (10, 1, 64, 16, BF16, BF16, None, None, ((1, 0), (2, 63)), 6),
    (11, 1, 128, 32, F32, BF16, None, PrefillParams(block_rows=32, block_k=32), ((15, 0), (0, 0)), 1),
    (12, 1, 64, 64, BF16, BF16, None, PrefillParams(block_rows=64, block_k=64), ((45, 255),), 0),
    (13, 1, 64, 16, FP8, BF16, None, PrefillParams(block_rows=32, block_k=16), ((13, 50), (1, 0)), 2),
    (14, 1, 128, 32, BF16, BF16, 64, PrefillParams(block_rows=64, block_k=32), ((2, 63), (45, 255)), 0),
    (15, 1, 64, 64, BF16, BF16, None, PrefillParams(block_rows=32, block_k=64), ((64, 0),), 3),
    (16, 1, 64, 16, BF16, BF16, None, PrefillParams(block_rows=16, block_k=16), ((15, 0), (13, 50)), 1),
]


def _prefill_problem(case, seed):
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, streams, pad = case
    rng = np.random.default_rng(seed)
    kv_lens = [n + c for n, c in streams]
    k_pool, v_pool, tables, dk, dv, ks, vs = build_pools(
        rng, kv_lens, num_layers=2, layer=1, block_size=bs, hkv=hkv, d=d, kv_dtype=kv_dtype)
    news = [n for n, _ in streams]
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    t = int(cu[-1]) + pad
    q = jnp.asarray(rng.standard_normal((t, g * hkv, d)), q_dtype)
    return q, k_pool, v_pool, tables, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), dk, dv, ks, vs


@pytest.mark.parametrize("case", [PREFILL_CASES[0], PREFILL_CASES[2], PREFILL_CASES[5]], ids=lambda c: f"g{c[0]}")
def test_prefill_reference_matches_naive_dense(case):
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, streams, pad = case
    q, k_pool, v_pool, tables, cu, kv_lens, dk, dv, ks, vs = _prefill_problem(case, seed=3)
    sm_scale = 1.0 / math.sqrt(d)
    ref = paged_prefill_attention_reference(q, k_pool, v_pool, 1, tables, cu, kv_lens, sm_scale=sm_scale,
                                            sliding_window=window, k_scale=ks, v_scale=vs)
    qn = np.asarray(q.astype(F32))
    naive = np.zeros(qn.shape)
    for b, (n, c) in enumerate(streams):
        for i in range(n):
            tok = int(cu[b]) + i
            naive[tok] = naive_attention(qn[tok], dk[b], dv[b], c + i, sm_scale, window)
    assert_close(ref, naive, tol=1e-5, what="prefill reference")


# CI: every stream shape (1), a window with d 256 (3), FP8 (4), f32 (5), FP8 with a window (6), the
# default parameters (10), a 64-token window (14)
@pytest.mark.parametrize("case,interpret", _grid(PREFILL_CASES, ci=(1, 3, 4, 5, 6, 10, 14)))
def test_prefill_kernel(case, interpret):
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, streams, pad = case
    q, k_pool, v_pool, tables, cu, kv_lens, dk, dv, ks, vs = _prefill_problem(case, seed=100 + g)
    kw = dict(sm_scale=1.0 / math.sqrt(d), sliding_window=window, k_scale=ks, v_scale=vs)
    out = paged_prefill_attention(q, k_pool, v_pool, jnp.int32(1), tables, cu, kv_lens, params=params,
                                  interpret=interpret, _poison=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = paged_prefill_attention_reference(q, k_pool, v_pool, 1, tables, cu, kv_lens, **kw)
    assert_close(out, ref, tol=_tol(q_dtype, kv_dtype), what="prefill")
    assert (np.asarray(out.astype(F32))[int(cu[-1]):] == 0).all(), "pad tokens must give zeros"


def test_prefill_rejects_bad_inputs():
    pool = jnp.zeros((1, 4, 16, 2, 64), BF16)
    q = jnp.zeros((8, 4, 64), BF16)
    tables = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        paged_prefill_attention(q, pool, pool, 0, tables, jnp.zeros((2,), jnp.int32),
                                jnp.zeros((2,), jnp.int32), sm_scale=1.0)
    with pytest.raises(ValueError, match="block_rows"):
        PrefillParams(block_rows=100)


# ---- speculative verify windows through the decode kernel ---------------------------------------
# (group, hkv, head_dim, block_size, kv_dtype, q_dtype, window, params, width, streams, pad_tokens):
# streams (window tokens <= width, cached tokens), as a verify step lays them out (pad streams (0, 0))
VERIFY_CASES = [
    (4, 2, 128, 16, BF16, BF16, None, DecodeParams(block_k=64), 5,
     ((5, 60), (1, 0), (3, 12), (5, 295), (2, 63), (0, 0)), 9),
    (8, 1, 64, 32, F32, F32, None, DecodeParams(block_k=16, num_splits=3), 3, ((3, 300), (1, 64), (2, 0)), 3),
    (2, 2, 64, 16, FP8, BF16, 20, DecodeParams(block_k=32, num_splits=2, prefetch=True), 5,
     ((5, 40), (4, 15), (0, 0)), 5),
    (1, 1, 256, 64, BF16, BF16, None, None, 2, ((2, 63), (1, 1)), 2),
    (16, 1, 128, 16, BF16, BF16, 7, DecodeParams(block_k=16, heads_inner=True), 3, ((3, 64), (3, 2)), 0),
    # the largest tile at d 256, 32 x 256 (Qwen3-Next, G 8, MTP k = 2 pads to it too; slow on the CPU)
    (6, 2, 256, 16, BF16, BF16, None, None, 3, ((3, 70), (2, 9), (3, 0)), 3),
]


@pytest.mark.parametrize("case,interpret", _grid(VERIFY_CASES, ci=(1, 2, 4, 8, 16)))
def test_verify_kernel(case, interpret):
    """`paged_verify_attention` against the f32 ragged-prefill reference on verify-shaped
    metadata: ragged windows up to the width, GQA groups up to 16 (rows = width x group), split-K,
    fp8 pools, sliding windows that cut inside the window, permuted block tables, pad streams and
    pad tokens (zeros), NaN-poisoned outputs."""
    g, hkv, d, bs, kv_dtype, q_dtype, window, params, width, streams, pad = case
    q, k_pool, v_pool, tables, cu, kv_lens, dk, dv, ks, vs = _prefill_problem(
        (g, hkv, d, bs, kv_dtype, q_dtype, window, None, streams, pad), seed=200 + g)
    kw = dict(sm_scale=1.0 / math.sqrt(d), sliding_window=window, k_scale=ks, v_scale=vs)
    out = paged_verify_attention(q, k_pool, v_pool, jnp.int32(1), tables, cu, kv_lens, width=width, params=params,
                                 interpret=interpret, _poison=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert verify_supports(q, k_pool, width), "the engine would send these windows to the prefill kernel"
    ref = paged_prefill_attention_reference(q, k_pool, v_pool, 1, tables, cu, kv_lens, **kw)
    assert_close(out, ref, tol=_tol(q_dtype, kv_dtype), what="verify")
    assert (np.asarray(out.astype(F32))[int(cu[-1]):] == 0).all(), "pad tokens must give zeros"


def test_verify_supports_bounds_the_tile():
    """Windows whose group rows x head_dim exceed the tiles run on the GPU go to the prefill kernel."""
    def ok(width, g, d, hkv=2):
        return verify_supports(jnp.zeros((1, g * hkv, d), BF16), jnp.zeros((1, 1, 16, hkv, d), BF16), width)

    assert ok(5, 4, 128) and ok(3, 16, 128) and ok(3, 8, 256) and ok(2, 1, 256)  # Llama-3 k=4, Qwen3-Next k=2
    assert not ok(5, 16, 128) and not ok(5, 8, 256) and not ok(9, 8, 128) and not ok(1, 4, 128)


# ---- compiled on the GPU at a realistic size ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_large_decode_and_prefill():
    rng = np.random.default_rng(11)
    hkv, g, d, bs = 8, 4, 128, 16
    lens = tuple(int(x) for x in rng.integers(1, 3000, size=24)) + (0, 4096)
    k_pool, v_pool, tables, *_ = build_pools(rng, lens, num_layers=2, layer=1, block_size=bs, hkv=hkv, d=d,
                                             kv_dtype=BF16)
    q = jnp.asarray(rng.standard_normal((len(lens), g * hkv, d)), BF16)
    seq_lens = jnp.asarray(lens, jnp.int32)
    for params in (None, DecodeParams(block_k=64, num_splits=8, num_warps=4, num_stages=3)):
        out = paged_decode_attention(q, k_pool, v_pool, 1, tables, seq_lens, sm_scale=d ** -0.5, params=params,
                                     _poison=True)
        ref = paged_decode_attention_reference(q, k_pool, v_pool, 1, tables, seq_lens, sm_scale=d ** -0.5)
        assert_close(out, ref, tol=2.5e-2, what=f"large decode {params}")
    news = [min(n, int(x)) for n, x in zip(lens, rng.integers(1, 700, size=len(lens)))]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(news)]), jnp.int32)
    qp = jnp.asarray(rng.standard_normal((int(cu[-1]) + 9, g * hkv, d)), BF16)
    out = paged_prefill_attention(qp, k_pool, v_pool, 1, tables, cu, seq_lens, sm_scale=d ** -0.5, _poison=True)
    ref = paged_prefill_attention_reference(qp, k_pool, v_pool, 1, tables, cu, seq_lens, sm_scale=d ** -0.5)
    assert_close(out, ref, tol=2.5e-2, what="large prefill")


# ---- K/V write ------------------------------------------------------------------------------------
@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kv_dtype,hkv,d", [(BF16, 3, 64), (FP8, 2, 128), (F32, 1, 256)],
                         ids=["bf16-h3", "fp8-h2", "f32-h1"])
def test_kv_write_matches_engine_scatter(kv_dtype, hkv, d, interpret):
    from metrale_jax.cache.kv import KVCache, write_kv

    rng = np.random.default_rng(5)
    nl, nb, bs, t = 3, 9, 16, 37
    shape = (nl, nb, bs, hkv, d)
    k_pool = jnp.asarray(rng.standard_normal(shape), kv_dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), kv_dtype)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[[3, 17, 36]] = -1  # padding tokens write nothing
    slots[5] = nb * bs + 4  # out of range: dropped
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), BF16)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), BF16)
    is_fp8 = kv_dtype == FP8
    ks = jnp.full((nl,), 0.05 if is_fp8 else 1.0, F32)
    vs = jnp.full((nl,), 0.03 if is_fp8 else 1.0, F32)
    want = write_kv(KVCache(k_pool, v_pool, ks, vs), jnp.int32(2), jnp.asarray(slots), k, v)
    got_k, got_v = paged_kv_write(k_pool, v_pool, jnp.int32(2), jnp.asarray(slots), k, v,
                                  k_scale=ks[2] if is_fp8 else None, v_scale=vs[2] if is_fp8 else None,
                                  interpret=interpret)
    for got, ref in ((got_k, want.k), (got_v, want.v)):
        got, ref = np.asarray(got.astype(F32)), np.asarray(ref.astype(F32))
        if is_fp8:  # x / scale may round a tie the other way (x * (1/scale)): allow one fp8 step
            np.testing.assert_allclose(got, ref, rtol=0.13, atol=0)
            assert (got != ref).mean() < 0.01
        else:
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kv_dtype,hq,hkv,d,rot,t", [(BF16, 8, 2, 128, 128, 1), (BF16, 6, 3, 64, 40, 65),
                                                     (FP8, 4, 4, 128, 64, 15), (F32, 16, 1, 64, 64, 63)],
                         ids=["bf16-g4-full-t1", "bf16-g2-partial-t65", "fp8-mha-t15", "f32-g16-t63"])
def test_rope_and_write_kv_matches_xla(kv_dtype, hq, hkv, d, rot, t, interpret):
    """`rope_and_write_kv` (the decode path's fused RoPE + K/V write) against XLA's apply_rope and
    the engine's scatter: q rotated, k rotated and written, v written, padding and out-of-range
    slots writing nothing, every other pool row untouched (random, never zeros); full and
    partial rotary dims (40: a rotary half that is not a power of two; cos and sin scaled, as yarn's),
    fp8 pools with scales."""
    from metrale_jax.cache.kv import KVCache, write_kv
    from metrale_jax.layers.rope import apply_rope, rope_cos_sin
    from pallas_kernels.paged_attention import rope_and_write_kv

    rng = np.random.default_rng(7)
    nl, nb, bs = 2, 7, 16
    shape = (nl, nb, bs, hkv, d)
    k_pool = jnp.asarray(rng.standard_normal(shape), kv_dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), kv_dtype)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    if t > 3:
        slots[[1, t - 1]] = -1
        slots[2] = nb * bs + 3
    qkv_dtype = F32 if kv_dtype == F32 else BF16
    qkv = jnp.asarray(rng.standard_normal((t, (hq + 2 * hkv) * d)), qkv_dtype)
    positions = jnp.asarray(rng.integers(0, 5000, t), jnp.int32)
    inv = tuple(float(x) for x in 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot))
    is_fp8 = kv_dtype == FP8
    ks = jnp.full((nl,), 0.05 if is_fp8 else 1.0, F32)
    vs = jnp.full((nl,), 0.03 if is_fp8 else 1.0, F32)
    scale = 1.0 if rot == d else 1.2  # (yarn's attention factor: the rotated dims only)
    q_ref = apply_rope(qkv[:, :hq * d].reshape(t, hq, d), positions, inv, scale)
    k_ref = apply_rope(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), positions, inv, scale)
    v_ref = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    want = write_kv(KVCache(k_pool, v_pool, ks, vs), jnp.int32(1), jnp.asarray(slots), k_ref, v_ref)
    q, got_k, got_v = rope_and_write_kv(qkv, rope_cos_sin(positions, inv, scale), k_pool, v_pool, jnp.int32(1),
                                        jnp.asarray(slots), num_q_heads=hq, k_scale=ks[1] if is_fp8 else None,
                                        v_scale=vs[1] if is_fp8 else None, interpret=interpret)
    tol = 1e-5 if qkv_dtype == F32 else 1e-2
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(q_ref, np.float32), rtol=tol, atol=tol)
    for got, ref in ((got_k, want.k), (got_v, want.v)):
        got, ref = np.asarray(got.astype(F32)), np.asarray(ref.astype(F32))
        if is_fp8:
            np.testing.assert_allclose(got, ref, rtol=0.13, atol=0)
            assert (got != ref).mean() < 0.01
        else:
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_kv_write_kernels_lower_for_h200():
    """Cross-lowers both K/V write kernels to Triton IR for an H200 on the CPU machine (bf16 and
    fp8 pools, full and partial rotary dims): unsupported indexing shows here without a GPU."""
    from pallas_kernels.paged_attention import rope_and_write_kv

    sds = jax.ShapeDtypeStruct
    fp8_scales = dict(k_scale=np.float32(0.5), v_scale=np.float32(0.5))
    with jax.sharding.use_abstract_mesh(_h200_mesh()):
        for hq, hkv, d, rot, kv_dtype in ((32, 8, 128, 128, BF16), (6, 3, 64, 40, FP8)):
            pool, slots = sds((2, 7, 16, hkv, d), kv_dtype), sds((5,), jnp.int32)
            scales = fp8_scales if kv_dtype == FP8 else {}
            low = jax.jit(lambda qkv, cs, kp, vp, sl, hq=hq, scales=scales: rope_and_write_kv(
                qkv, cs, kp, vp, jnp.int32(1), sl, num_q_heads=hq, **scales)).trace(
                sds((5, (hq + 2 * hkv) * d), BF16), sds((5, rot), F32), pool, pool, slots).lower(
                lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in low.as_text()
            low = jax.jit(lambda kp, vp, sl, k, scales=scales: paged_kv_write(kp, vp, jnp.int32(1), sl, k, k,
                                                                               **scales)).trace(
                pool, pool, slots, sds((5, hkv, d), BF16)).lower(lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in low.as_text()
