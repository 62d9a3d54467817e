"""Mamba-2 SSD kernels: the reference against an independent numpy recurrence, the Pallas kernels
(interpret mode on CPU) against the reference, their Triton lowering for an H200 (cross-lowered on
CPU), and `gpu`-marked compiled runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mamba2 import (
    SSDParams,
    StateUpdateParams,
    selective_state_update,
    selective_state_update_reference,
    ssd_chunk_scan,
    ssd_chunk_scan_reference,
)

RAGGED = (1, 15, 63, 64, 65, 300)


# ---- inputs and the independent oracle ----------------------------------------------------------
def make_inputs(lens, *, nheads=4, headdim=32, d_state=16, ngroups=2, pad=7, dtype=np.float32, seed=0):
    """Random varlen inputs; rows past cu_seqlens[-1] (padding) are poisoned with NaN."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1]) + pad
    s = len(lens)
    inp = dict(
        x=rng.standard_normal((t, nheads, headdim)).astype(np.float32),
        dt_raw=(rng.standard_normal((t, nheads)) * 1.5 - 1.0).astype(np.float32),
        # slow heads (A ~ -0.02: state survives hundreds of tokens) to fast ones (A ~ -4.5)
        A_log=np.linspace(-4.0, 1.5, nheads).astype(np.float32),
        B=rng.standard_normal((t, ngroups, d_state)).astype(np.float32),
        C=rng.standard_normal((t, ngroups, d_state)).astype(np.float32),
        D=rng.standard_normal(nheads).astype(np.float32),
        dt_bias=(rng.standard_normal(nheads) * 0.5).astype(np.float32),
    )
    for k in ("x", "dt_raw", "B", "C"):
        inp[k][cu[-1] :] = np.nan
    for k in ("x", "B", "C"):
        inp[k] = inp[k].astype(dtype)
    s0 = rng.standard_normal((s, nheads, headdim, d_state)).astype(np.float32)
    return inp, cu, s0


def np_dt(dt_raw, dt_bias, dt_min, dt_max):
    with np.errstate(invalid="ignore"):  # NaN-poisoned padding rows
        dt = np.logaddexp(0.0, dt_raw.astype(np.float64) + dt_bias.astype(np.float64))
    return np.clip(dt, -np.inf if dt_min is None else dt_min, np.inf if dt_max is None else dt_max)


def np_ssd_sequential(inp, cu, s0, dt_min, dt_max):
    """Token-by-token float64 recurrence (no chunking): -> (y [T, H, P], final [S, H, P, N])."""
    x = inp["x"].astype(np.float64)
    b = inp["B"].astype(np.float64)
    c = inp["C"].astype(np.float64)
    nheads = x.shape[1]
    group = np.arange(nheads) // (nheads // b.shape[1])
    a = -np.exp(inp["A_log"].astype(np.float64))
    dt = np_dt(inp["dt_raw"], inp["dt_bias"], dt_min, dt_max)
    y = np.zeros(x.shape)
    finals = []
    for s in range(len(cu) - 1):
        st = s0[s].astype(np.float64).copy()  # [H, P, N]
        for t in range(cu[s], cu[s + 1]):
            bt, ct = b[t][group], c[t][group]  # [H, N]
            st = st * np.exp(dt[t] * a)[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * bt[:, None, :]
            y[t] = np.einsum("hpn,hn->hp", st, ct) + inp["D"][:, None] * x[t]
        finals.append(st)
    return y, np.stack(finals)


def run_ssd(inp, cu, s0, *, interpret=True, **kw):
    y, f = ssd_chunk_scan(
        *(jnp.asarray(inp[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")),
        cu_seqlens=jnp.asarray(cu),
        initial_states=jnp.asarray(s0),
        interpret=interpret,
        **kw,
    )
    return np.asarray(y.astype(jnp.float32)), np.asarray(f)


def run_ssd_ref(inp, cu, s0, **kw):
    y, f = ssd_chunk_scan_reference(
        *(jnp.asarray(inp[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")),
        cu_seqlens=cu,
        initial_states=jnp.asarray(s0),
        **kw,
    )
    return np.asarray(y), np.asarray(f)


def assert_close(got, want, rel, what):
    """Max error relative to the largest reference magnitude (outputs span decades)."""
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = np.abs(got.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
    assert err <= rel, f"{what}: max error {err:.3g} > {rel:g} (relative to max |ref|)"


# ---- the reference against the numpy recurrence ------------------------------------------------
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_reference_matches_sequential_recurrence(chunk_size):
    inp, cu, s0 = make_inputs(RAGGED, seed=1)
    want_y, want_f = np_ssd_sequential(inp, cu, s0, 0.05, 1.5)
    y, f = run_ssd_ref(inp, cu, s0, dt_min=0.05, dt_max=1.5, chunk_size=chunk_size)
    n = cu[-1]
    assert_close(y[:n], want_y[:n], 2e-5, "reference y")
    assert (y[n:] == 0).all()
    assert_close(f, want_f, 2e-5, "reference final states")


def test_state_update_reference_matches_numpy_step():
    inp, cu, s0 = make_inputs((1,) * 5, pad=0, seed=2)
    want_y, want_f = np_ssd_sequential(inp, cu, s0, None, None)  # one token per stream = one step
    y, f = selective_state_update_reference(
        jnp.asarray(s0), *(jnp.asarray(inp[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias"))
    )
    assert_close(np.asarray(y), want_y, 1e-5, "step y")
    assert_close(np.asarray(f), want_f, 1e-5, "step state")


# ---- the SSD kernel in interpret mode -------------------------------------------------------------
SSD_CASES = {
    # ragged, non-zero initial states, both clamps binding, NaN-poisoned padding, 2 headdim blocks
    "ragged_clamped": dict(lens=RAGGED, clamp=(0.05, 1.5), params=SSDParams(chunk_size=64, block_p=16)),
    # one stream of 300 over chunks of 16 (19 chunks), ngroups 1, an empty stream after it
    "single_chunk16": dict(lens=(300, 0), clamp=(0.0, None), ngroups=1, params=SSDParams(chunk_size=16, block_p=32)),
    # bf16 inputs, bf16 MMAs (as on the GPU), chunk 32 with lengths around it
    "bf16": dict(lens=(31, 32, 33, 100), clamp=(0.05, None), dtype=jnp.bfloat16, params=SSDParams(chunk_size=32)),
}


@pytest.mark.parametrize("case", list(SSD_CASES))
def test_ssd_chunk_scan_interpret(case):
    cfg = SSD_CASES[case]
    inp, cu, s0 = make_inputs(cfg["lens"], ngroups=cfg.get("ngroups", 2), dtype=cfg.get("dtype", np.float32))
    dt_min, dt_max = cfg["clamp"]
    if case == "ragged_clamped":  # the clamp really binds, at both ends
        raw = np.logaddexp(0, inp["dt_raw"][: cu[-1]] + inp["dt_bias"])
        assert (raw < dt_min).mean() > 0.05 and (raw > dt_max).mean() > 0.02
    y, f = run_ssd(inp, cu, s0, dt_min=dt_min, dt_max=dt_max, params=cfg["params"])
    want_y, want_f = run_ssd_ref(inp, cu, s0, dt_min=dt_min, dt_max=dt_max)
    n = cu[-1]
    assert (y[n:] == 0).all(), "padding rows must be zero"
    rel = 2e-2 if case == "bf16" else 2e-5
    assert_close(y, want_y, rel, "y")
    assert_close(f, want_f, rel, "final states")
    if case == "single_chunk16":  # the empty stream keeps its initial state exactly
        np.testing.assert_array_equal(f[1], s0[1])


def test_ssd_split_prefill_and_decode_match_one_shot():
    """Prefill in two kernel calls (state carried) + 3 decode steps == one call over all tokens."""
    inp, cu, s0 = make_inputs((203,), pad=0, ngroups=1, seed=3)
    params = SSDParams(chunk_size=64, block_p=32)
    full_y, full_f = run_ssd(inp, cu, s0, dt_min=None, dt_max=None, params=params)
    part = lambda lo, hi: {k: (v[lo:hi] if v.ndim >= 2 else v) for k, v in inp.items()}
    y1, f1 = run_ssd(part(0, 70), np.array([0, 70], np.int32), s0, dt_min=None, dt_max=None, params=params)
    y2, f2 = run_ssd(part(70, 200), np.array([0, 130], np.int32), f1, dt_min=None, dt_max=None, params=params)
    state, ys = f2, []
    for t in range(200, 203):
        p = part(t, t + 1)
        yt, state = selective_state_update(
            jnp.asarray(state),
            *(jnp.asarray(p[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")),
            params=StateUpdateParams(block_p=16),
            interpret=True,
        )
        ys.append(np.asarray(yt))
    got = np.concatenate([y1, y2, *ys])
    assert_close(got, full_y.astype(np.float64), 2e-5, "split y")
    assert_close(np.asarray(state), full_f.astype(np.float64), 2e-5, "split final state")


# ---- the selective-state update in interpret mode ---------------------------------------------------
@pytest.mark.parametrize("clamp", [(None, None), (0.05, 1.5)])
def test_selective_state_update_pool_interpret(clamp):
    """Rows update pool slots in place; slot -1 rows (NaN inputs) give 0 and touch nothing."""
    rng = np.random.default_rng(4)
    rows, slots, nheads, headdim, d_state, ngroups = 6, 9, 4, 32, 16, 2
    inp, _, _ = make_inputs((1,) * rows, nheads=nheads, headdim=headdim, d_state=d_state, ngroups=ngroups, pad=0)
    idx = np.array([7, -1, 0, 3, -1, 8], np.int32)
    for k in ("x", "dt_raw", "B", "C"):
        inp[k][idx < 0] = np.nan
    pool = rng.standard_normal((slots, nheads, headdim, d_state)).astype(np.float32)
    args = [jnp.asarray(inp[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")]
    y, new = selective_state_update(
        jnp.asarray(pool),
        *args,
        state_indices=jnp.asarray(idx),
        dt_min=clamp[0],
        dt_max=clamp[1],
        params=StateUpdateParams(block_p=16),
        interpret=True,
    )
    want_y, want_new = selective_state_update_reference(
        jnp.asarray(pool), *args, state_indices=jnp.asarray(idx), dt_min=clamp[0], dt_max=clamp[1]
    )
    y, new = np.asarray(y), np.asarray(new)
    assert (y[idx < 0] == 0).all()
    assert_close(y, np.asarray(want_y), 1e-5, "y")
    assert_close(new, np.asarray(want_new), 1e-5, "pool")
    untouched = np.setdiff1d(np.arange(slots), idx)
    np.testing.assert_array_equal(new[untouched], pool[untouched])


def test_bad_inputs_raise():
    inp, cu, s0 = make_inputs((5,), pad=0)
    with pytest.raises(ValueError, match="initial_states"):
        run_ssd(inp, cu, s0[:, :, :, :8])
    with pytest.raises(ValueError, match="cu_seqlens"):
        run_ssd(inp, cu.astype(np.int64) + 0.5, s0)
    with pytest.raises(ValueError, match="block_p"):
        SSDParams(block_p=24)
    with pytest.raises(ValueError, match="state_indices"):
        selective_state_update(
            jnp.asarray(s0),
            *(jnp.asarray(inp[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")),
            state_indices=jnp.zeros((2,), jnp.int32),
            interpret=True,
        )


def test_tuned_table_lookup_by_stream_count():
    from pallas_kernels.mamba2.params import ssd_params_for

    bf = jnp.bfloat16
    # the table holds 1 and 4 streams (measured): 2-3 streams take the 1-stream entry, 5+ the 4-stream one
    assert ssd_params_for(128, 64, 128, 1, bf, 1).num_stages == 3
    assert ssd_params_for(128, 64, 128, 1, bf, 3).num_stages == 3
    assert ssd_params_for(128, 64, 128, 8, bf, 4).num_stages == 2
    assert ssd_params_for(128, 64, 128, 8, bf, 16).num_stages == 2
    # untabled shapes: heuristic by program count
    assert ssd_params_for(8, 64, 128, 1, bf, 1).num_stages == 3
    assert ssd_params_for(64, 64, 128, 1, bf, 8).num_stages == 2
    # float32 tiles are twice the bytes: two stages fit the H200's shared memory, three did not
    assert ssd_params_for(8, 64, 128, 1, jnp.float32, 4).num_stages == 2


def test_dot_mode_auto_is_exact_for_float32():
    from pallas_kernels.mamba2.ssd import resolve_dot_mode

    assert resolve_dot_mode("auto", jnp.bfloat16) == "bf16"
    assert resolve_dot_mode("auto", jnp.float16) == "f16"
    assert resolve_dot_mode("auto", jnp.float32) == "ieee"  # not TF32: a float32 model asked for float32
    assert resolve_dot_mode("tf32", jnp.float32) == "tf32"


# ---- Triton lowering for an H200, checked on the CPU machine -------------------------------------
def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("ngroups", [1, 8])
def test_kernels_lower_for_h200(ngroups):
    """Cross-lower both kernels to the Triton IR at the benchmark shapes (catches unsupported ops,
    shapes and layouts without a GPU; the Triton->PTX step still needs the GPU run)."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    )
    t, h, p, n, s, r = 8192, 128, 64, 128, 4, 64
    bf, f32 = jnp.bfloat16, jnp.float32
    with jax.sharding.use_abstract_mesh(mesh):
        for params in (SSDParams(), SSDParams(block_p=32, num_warps=8, num_stages=3)):
            low = ssd_chunk_scan.trace(
                _sds((t, h, p), bf),
                _sds((t, h), f32),
                _sds((h,), f32),
                _sds((t, ngroups, n), bf),
                _sds((t, ngroups, n), bf),
                _sds((h,), f32),
                _sds((h,), f32),
                cu_seqlens=_sds((s + 1,), jnp.int32),
                initial_states=_sds((s, h, p, n), f32),
                params=params,
            ).lower(lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in low.as_text()
        low = selective_state_update.trace(
            _sds((256, h, p, n), f32),
            _sds((r, h, p), bf),
            _sds((r, h), f32),
            _sds((h,), f32),
            _sds((r, ngroups, n), bf),
            _sds((r, ngroups, n), bf),
            _sds((h,), f32),
            _sds((h,), f32),
            state_indices=_sds((r,), jnp.int32),
        ).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in low.as_text()


# ---- compiled on the GPU ---------------------------------------------------------------------------
def _rel_l2(got, want):
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,ngroups,params,tol",
    [
        (jnp.bfloat16, 1, SSDParams(), 2e-2),
        (jnp.bfloat16, 2, SSDParams(block_p=32, num_warps=8), 2e-2),
        (jnp.float32, 2, SSDParams(dot_mode="tf32"), 5e-3),
        (jnp.float32, 2, SSDParams(dot_mode="ieee"), 1e-4),
        (jnp.float32, 1, SSDParams(), 1e-4),  # auto: exact for float32 inputs
    ],
)
def test_ssd_chunk_scan_gpu(dtype, ngroups, params, tol):
    lens = (1, 15, 64, 65, 300, 1000)
    inp, cu, s0 = make_inputs(lens, nheads=16, headdim=64, d_state=128, ngroups=ngroups, pad=33, dtype=dtype, seed=5)
    y, f = run_ssd(inp, cu, s0, interpret=False, dt_min=0.05, dt_max=None, params=params)
    want_y, want_f = run_ssd_ref(inp, cu, s0, dt_min=0.05, dt_max=None)
    n = cu[-1]
    assert (y[n:] == 0).all()
    assert np.isfinite(y).all() and np.isfinite(f).all()
    assert _rel_l2(y[:n], want_y[:n]) < tol
    assert _rel_l2(f, want_f) < tol


@pytest.mark.gpu
def test_selective_state_update_gpu():
    rng = np.random.default_rng(6)
    rows, slots, nheads, headdim, d_state, ngroups = 64, 80, 16, 64, 128, 2
    inp, _, _ = make_inputs(
        (1,) * rows, nheads=nheads, headdim=headdim, d_state=d_state, ngroups=ngroups, pad=0, dtype=jnp.bfloat16
    )
    idx = rng.permutation(slots)[:rows].astype(np.int32)
    idx[::7] = -1
    pool = rng.standard_normal((slots, nheads, headdim, d_state)).astype(np.float32)
    args = [jnp.asarray(inp[k]) for k in ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")]
    y, new = selective_state_update(jnp.asarray(pool), *args, state_indices=jnp.asarray(idx))
    want_y, want_new = selective_state_update_reference(jnp.asarray(pool), *args, state_indices=jnp.asarray(idx))
    y = np.asarray(y.astype(jnp.float32))
    assert (y[idx < 0] == 0).all()
    assert _rel_l2(y, np.asarray(want_y)) < 1e-2  # y is stored in bf16
    assert _rel_l2(np.asarray(new), np.asarray(want_new)) < 1e-5
