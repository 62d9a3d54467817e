"""Gated delta rule kernels (pallas_kernels/gated_delta) against references.

* The f32 naive reference is checked against independent numpy ports of transformers'
  `torch_recurrent_gated_delta_rule` (token loop) and `torch_chunk_gated_delta_rule` (chunked UT
  transform with a triangular solve), and against transformers itself where torch is installed.
* The Pallas kernels run in interpret mode on the CPU against the naive reference: lengths 1, 15,
  63, 64, 65, 300, ragged batches, empty streams, non-zero initial states, outputs and final
  states, a padded tail filled with NaN inputs (outputs there must be exactly 0). Interpret-mode
  outputs start as NaN, so any element a kernel forgets to write fails the test.
* `gpu` tests run the compiled kernels at Qwen3-Next shapes (bf16) on the GPU machine.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import (
    ChunkParams,
    RecurrentParams,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_gated_delta_rule,
)

# ---------------------------------------------------------------- inputs


def make_inputs(rng, t, h, hv, dk, dv, b, dtype=np.float32, poison_from=None):
    """Random q/k/v/g/beta/state; rows >= poison_from are NaN (padding that must be ignored)."""
    q = rng.standard_normal((t, h, dk)).astype(np.float32)
    k = rng.standard_normal((t, h, dk)).astype(np.float32)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    # Qwen3-Next: g = -exp(A_log) * softplus(a + dt_bias) < 0; beta = sigmoid(b).
    g = (-np.exp(rng.uniform(-2.0, 0.5, (1, hv))) * np.log1p(np.exp(rng.standard_normal((t, hv))))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((t, hv))))).astype(np.float32)
    h0 = (0.5 * rng.standard_normal((b, hv, dk, dv))).astype(np.float32)
    if poison_from is not None:
        for x in (q, k, v, g, beta):
            x[poison_from:] = np.nan
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0)


def cu_of(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


def assert_close(got, want, tol, what):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < tol, f"{what}: scaled max error {err:.3g} >= {tol}"


# ---------------------------------------------------------------- independent numpy ports of transformers


def np_l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def np_transformers_recurrent(q, k, v, g, beta, h0, l2):
    """transformers' torch_recurrent_gated_delta_rule for one stream: q/k [T,H,K], v [T,HV,V], h0 [HV,K,V]."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = np.repeat(q, rep, 1), np.repeat(k, rep, 1)
    if l2:
        q, k = np_l2norm(q), np_l2norm(k)
    q = q / np.sqrt(q.shape[-1])
    s = np.asarray(h0, np.float64).copy()
    out = np.zeros_like(v)
    for i in range(q.shape[0]):
        s = s * np.exp(g[i])[:, None, None]
        kv_mem = (s * k[i][:, :, None]).sum(-2)
        delta = (v[i] - kv_mem) * beta[i][:, None]
        s = s + k[i][:, :, None] * delta[:, None, :]
        out[i] = (s * q[i][:, :, None]).sum(-2)
    return out, s


def np_transformers_chunk(q, k, v, g, beta, h0, l2, chunk=64):
    """transformers' torch_chunk_gated_delta_rule for one stream (UT transform, triangular solve)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    rep = v.shape[1] // q.shape[1]
    q, k = np.repeat(q, rep, 1), np.repeat(k, rep, 1)
    q, k, v, beta, g = (np.swapaxes(x, 0, 1) for x in (q, k, v, beta, g))  # head-major
    if l2:
        q, k = np_l2norm(q), np_l2norm(k)
    q = q * q.shape[-1] ** -0.5
    t = q.shape[1]
    pad = (chunk - t % chunk) % chunk
    q, k, v = (np.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    beta, g = (np.pad(x, ((0, 0), (0, pad))) for x in (beta, g))
    nh, tp = q.shape[0], q.shape[1]
    nc = tp // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    sh = lambda x: x.reshape(nh, nc, chunk, x.shape[-1])
    q, k, k_beta, v_beta = sh(q), sh(k), sh(k_beta), sh(v_beta)
    cum = g.reshape(nh, nc, chunk).cumsum(-1)
    upper = np.triu(np.ones((chunk, chunk), bool), 1)
    pair = np.where(upper, -np.inf, cum[..., :, None] - cum[..., None, :])
    pair = np.exp(pair)
    ut = (k_beta @ np.swapaxes(k, -1, -2)) * pair
    intra = (q @ np.swapaxes(k, -1, -2)) * pair
    dk_beta = k_beta * np.exp(cum)[..., None]
    unit = np.tril(ut, -1) + np.eye(chunk)  # solve_triangular(unitriangular=True) ignores ut's diagonal
    new_values = np.linalg.solve(unit, v_beta)
    k_cumdecay = np.linalg.solve(unit, dk_beta)
    s = np.asarray(h0, np.float64).copy()
    out = np.zeros_like(new_values)
    qd = q * np.exp(cum)[..., None]
    kd = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])[..., None, None]
    for i in range(nc):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = qd[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + np.swapaxes(kd[:, i], -1, -2) @ v_new
    out = out.reshape(nh, tp, -1)[:, :t]
    return np.swapaxes(out, 0, 1), s


@pytest.mark.parametrize("l2", [True, False])
def test_naive_matches_transformers_formulas(l2):
    rng = np.random.default_rng(1)
    lens = [1, 15, 70]  # 70 spans two of the numpy port's 64-chunks
    t = sum(lens)
    q, k, v, g, beta, h0 = make_inputs(rng, t + 3, 2, 4, 8, 8, len(lens))
    if not l2:  # the un-normalized rule is only stable for small keys
        k = k * 0.2
    cu = cu_of(lens)
    o, ht = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=l2)
    o, ht = np.asarray(o), np.asarray(ht)
    assert np.all(o[t:] == 0)
    c = np.asarray(cu)
    for i in range(len(lens)):
        sl = slice(c[i], c[i + 1])
        args = (q[sl], k[sl], v[sl], g[sl], beta[sl], h0[i], l2)
        for port in (np_transformers_recurrent, np_transformers_chunk):
            ro, rs = port(*args)
            assert_close(o[sl], ro, 2e-5, f"{port.__name__} o stream {i}")
            assert_close(ht[i], rs, 2e-5, f"{port.__name__} state stream {i}")


def test_naive_matches_transformers_itself():
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("with fla installed, transformers swaps its torch fallbacks for FLA's GPU kernels")
    rng = np.random.default_rng(2)
    t, lens = 70, [70]
    q, k, v, g, beta, h0 = make_inputs(rng, t, 2, 4, 16, 8, 1)
    tt = lambda x: torch.from_numpy(np.asarray(x, np.float32))[None]
    ref = {}
    fns = {n: getattr(mod, f"torch_{n}_gated_delta_rule", None) for n in ("chunk", "recurrent")}
    if None in fns.values():
        pytest.skip("this transformers version has no torch_*_gated_delta_rule fallbacks")
    for name, fn in fns.items():
        ro, rs = fn(tt(q), tt(k), tt(v), g=tt(g), beta=tt(beta), initial_state=torch.from_numpy(np.asarray(h0)),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        ref[name] = (ro[0].numpy(), rs.numpy())
    o, ht = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_of(lens), initial_state=h0, use_qk_l2norm=True)
    for name, (ro, rs) in ref.items():
        assert_close(o, ro, 1e-4, f"o vs transformers {name}")
        assert_close(ht, rs, 1e-4, f"state vs transformers {name}")


# ---------------------------------------------------------------- chunked prefill, interpret mode

H, HV, DK, DV = 1, 2, 16, 32  # grouped value heads (HV = 2 H); small for the CPU interpreter
CASES = [[1], [64], [1, 15, 63, 64, 65, 300], [0, 7, 0, 130]]
CASES += [pytest.param(x, marks=pytest.mark.slow) for x in ([15], [63], [65], [300])]  # (the ragged case has them)


@pytest.mark.parametrize("lens", CASES, ids=lambda x: "-".join(map(str, x)))
def test_chunk_matches_naive(lens):
    rng = np.random.default_rng(sum(lens) + len(lens))
    t = sum(lens)
    pad = 5
    q, k, v, g, beta, h0 = make_inputs(rng, t + pad, H, HV, DK, DV, len(lens), poison_from=t)
    cu = cu_of(lens)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True,
                                   params=ChunkParams(block_v=16), interpret=True)
    ro, rh = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True)
    assert np.all(np.asarray(o)[t:] == 0), "padded tail must be exactly 0"
    assert_close(o[:t], ro[:t], 2e-5, "o")
    assert_close(ht, rh, 2e-5, "final state")
    for i, n in enumerate(lens):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(ht[i]), np.asarray(h0[i]))


def test_chunk_options():
    """Smaller chunks, no in-kernel l2norm (caller-normalized keys), an explicit scale, bf16 inputs."""
    rng = np.random.default_rng(7)
    lens = [40, 1, 90]
    t = sum(lens)
    cu = cu_of(lens)
    q, k, v, g, beta, h0 = make_inputs(rng, t, H, HV, DK, DV, len(lens))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    kw = dict(cu_seqlens=cu, initial_state=h0, scale=0.3)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, **kw, chunk_size=16, interpret=True)
    ro, rh = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    assert_close(o, ro, 2e-5, "o (chunk 16, scale 0.3)")
    assert_close(ht, rh, 2e-5, "state (chunk 16, scale 0.3)")
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    o, ht = chunk_gated_delta_rule(qb, kb, vb, g, beta, **kw, interpret=True)
    ro, rh = naive_gated_delta_rule(qb, kb, vb, g, beta, **kw)
    assert o.dtype == jnp.bfloat16
    assert_close(o, ro, 3e-2, "o bf16")
    assert_close(ht, rh, 3e-2, "state bf16")


def test_bad_inputs_raise():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, h0 = make_inputs(rng, 8, 2, 3, 16, 16, 1)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_of([8]), initial_state=h0, interpret=True)
    q, k, v, g, beta, h0 = make_inputs(rng, 8, 1, 2, 16, 16, 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_of([8]), initial_state=h0, interpret=True)


# ---------------------------------------------------------------- decode, interpret mode


def test_recurrent_matches_naive():
    rng = np.random.default_rng(3)
    n = 5
    q, k, v, g, beta, s = make_inputs(rng, n, 2, 4, DK, DV, n)
    o, ns = fused_recurrent_gated_delta_rule(q, k, v, g, beta, s, use_qk_l2norm=True,
                                             params=RecurrentParams(block_v=16), interpret=True)
    ro, rs = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32),
                                    initial_state=s, use_qk_l2norm=True)
    assert_close(o, ro, 2e-5, "o")
    assert_close(ns, rs, 2e-5, "state")


def test_recurrent_pool_form():
    """state_indices into a pool: rows write their slot in place; slot -1 rows (NaN inputs) give 0."""
    rng = np.random.default_rng(4)
    n, slots = 6, 9
    q, k, v, g, beta, _ = make_inputs(rng, n, 2, 4, DK, DV, 1)
    pool = jnp.asarray((0.5 * rng.standard_normal((slots, 4, DK, DV))).astype(np.float32))
    idx = np.array([3, -1, 0, 8, -1, 5], np.int32)
    pad = idx < 0
    q, k, v = (x.at[pad].set(jnp.nan) for x in (q, k, v))
    g, beta = g.at[pad].set(jnp.nan), beta.at[pad].set(jnp.nan)
    o, new_pool = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=jnp.asarray(idx),
                                                   use_qk_l2norm=True, interpret=True)
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    live = np.flatnonzero(~pad)
    ro, rs = naive_gated_delta_rule(q[live], k[live], v[live], g[live], beta[live],
                                    cu_seqlens=jnp.arange(len(live) + 1, dtype=jnp.int32),
                                    initial_state=pool[idx[live]], use_qk_l2norm=True)
    assert_close(o[live], ro, 2e-5, "o")
    assert np.all(o[pad] == 0)
    assert_close(new_pool[idx[live]], rs, 2e-5, "written slots")
    untouched = np.setdiff1d(np.arange(slots), idx[live])
    np.testing.assert_array_equal(new_pool[untouched], np.asarray(pool)[untouched])


def test_prefill_then_decode_matches_one_pass():
    """Chunked prefill's final state carried into decode steps == the naive rule over the whole stream."""
    rng = np.random.default_rng(5)
    lens, steps = [70, 3], 3
    total = [n + steps for n in lens]
    q, k, v, g, beta, h0 = make_inputs(rng, sum(total), H, HV, DK, DV, len(lens))
    cu_all = np.asarray(cu_of(total))
    ro, rh = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=jnp.asarray(cu_all), initial_state=h0,
                                    use_qk_l2norm=True)
    pre = np.concatenate([np.arange(cu_all[i], cu_all[i] + n) for i, n in enumerate(lens)])
    o, st = chunk_gated_delta_rule(q[pre], k[pre], v[pre], g[pre], beta[pre], cu_seqlens=cu_of(lens),
                                   initial_state=h0, use_qk_l2norm=True, interpret=True)
    assert_close(o, ro[pre], 2e-5, "prefill o")
    for s in range(steps):
        rows = cu_all[:-1] + np.asarray(lens) + s
        o, st = fused_recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], st,
                                                 use_qk_l2norm=True, interpret=True)
        assert_close(o, ro[rows], 2e-5, f"decode step {s}")
    assert_close(st, rh, 2e-5, "state after decode")


# ---------------------------------------------------------------- Triton lowering on the CPU


def test_triton_lowering_at_qwen3_next_shapes():
    """The compiled (non-interpret) kernels lower to Triton IR for an H200, checked without a GPU."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError:
        pytest.skip("jax internals moved")
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    orig = pallas_call_registration.gpu_info_lib.get_gpu_info
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200
    try:
        sd = jax.ShapeDtypeStruct
        bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
        t, b, n = 4096, 3, 64
        qk = sd((t, 16, 128), bf)
        txt = jax.jit(lambda *a, **kw: chunk_gated_delta_rule(*a, **kw, use_qk_l2norm=True)).trace(
            qk, qk, sd((t, 32, 128), bf), sd((t, 32), f32), sd((t, 32), f32),
            cu_seqlens=sd((b + 1,), i32), initial_state=sd((b, 32, 128, 128), f32),
        ).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in txt
        qk = sd((n, 16, 128), bf)
        txt = jax.jit(lambda *a, **kw: fused_recurrent_gated_delta_rule(*a, **kw, use_qk_l2norm=True)).trace(
            qk, qk, sd((n, 32, 128), bf), sd((n, 32), f32), sd((n, 32), f32), sd((500, 32, 128, 128), f32),
            state_indices=sd((n,), i32),
        ).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in txt
    finally:
        pallas_call_registration.gpu_info_lib.get_gpu_info = orig


# ---------------------------------------------------------------- GPU (compiled kernels)


@pytest.mark.gpu
def test_gpu_chunk_qwen3_next_shapes():
    rng = np.random.default_rng(11)
    lens = [1, 15, 63, 64, 65, 300, 2048]
    t = sum(lens)
    q, k, v, g, beta, h0 = make_inputs(rng, t + 7, 16, 32, 128, 128, len(lens), dtype=jnp.bfloat16, poison_from=t)
    cu = cu_of(lens)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True)
    ro, rh = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True)
    assert np.all(np.asarray(o)[t:] == 0)
    assert_close(o[:t], ro[:t], 3e-2, "o")
    assert_close(ht, rh, 3e-2, "final state")


@pytest.mark.gpu
def test_gpu_recurrent_qwen3_next_shapes():
    rng = np.random.default_rng(12)
    n, slots = 64, 80
    q, k, v, g, beta, _ = make_inputs(rng, n, 16, 32, 128, 128, 1, dtype=jnp.bfloat16)
    pool = jnp.asarray((0.5 * rng.standard_normal((slots, 32, 128, 128))).astype(np.float32))
    idx = rng.permutation(slots)[:n].astype(np.int32)
    idx[[5, 17]] = -1
    live = np.flatnonzero(idx >= 0)
    ro, rs = naive_gated_delta_rule(q[live], k[live], v[live], g[live], beta[live],
                                    cu_seqlens=jnp.arange(len(live) + 1, dtype=jnp.int32),
                                    initial_state=pool[idx[live]], use_qk_l2norm=True)
    o, new_pool = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=jnp.asarray(idx),
                                                   use_qk_l2norm=True)
    o = np.asarray(o)
    assert_close(o[live], ro, 2e-2, "o")
    assert np.all(o[idx < 0] == 0)
    assert_close(np.asarray(new_pool)[idx[live]], rs, 1e-4, "written slots")
    o2, s2 = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool[np.maximum(idx, 0)], use_qk_l2norm=True)
    assert_close(np.asarray(o2)[live], ro, 2e-2, "o (plain form)")
