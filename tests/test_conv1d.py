"""Depthwise causal conv1d kernels (pallas_kernels/conv1d) against references.

* The naive reference is checked against independent numpy ports of transformers' Qwen3-Next
  `causal_conv1d_fn` (F.conv1d with left padding W-1) and `causal_conv1d_update` (state keeps
  the last S inputs), and against transformers itself where torch is installed.
* The Pallas kernels run in interpret mode against the naive reference: lengths 1, 15, 63, 64,
  65, 300, ragged batches, empty streams, streams shorter than W-1, non-zero initial states,
  outputs and final states, and a NaN-filled padded tail whose outputs must be exactly 0.
* `gpu` tests run the compiled kernels at Qwen3-Next's conv width (C = 8192, W = 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.conv1d import (
    ConvParams,
    causal_conv1d_update,
    causal_conv1d_varlen,
    naive_causal_conv1d_update,
    naive_causal_conv1d_varlen,
)


def cu_of(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


def assert_close(got, want, tol, what):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err <= tol, f"{what}: scaled max error {err:.3g} > {tol}"


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_transformers_fn(x, w, bias, silu):
    """causal_conv1d_fn: x [C, L] -> F.conv1d(x, w[:, None], bias, padding=W-1, groups=C)[..., :L]."""
    c, n = x.shape
    width = w.shape[1]
    xp = np.concatenate([np.zeros((c, width - 1)), x], axis=1)
    y = np.stack([(xp[:, t : t + width] * w).sum(1) for t in range(n)], axis=1)
    y = y + (0 if bias is None else bias[:, None])
    return np_silu(y) if silu else y


def np_transformers_update(x, conv_state, w, bias, silu):
    """causal_conv1d_update with one token: x [N, C], conv_state [N, C, S]."""
    full = np.concatenate([conv_state, x[:, :, None]], axis=-1)
    new_state = full[:, :, -conv_state.shape[-1] :]
    width = w.shape[1]
    y = (full[:, :, -width:] * w[None]).sum(-1) + (0 if bias is None else bias)
    return (np_silu(y) if silu else y), new_state


@pytest.mark.parametrize("silu", [True, False])
def test_naive_matches_transformers_formulas(silu):
    rng = np.random.default_rng(0)
    c, width = 6, 4
    w = rng.standard_normal((c, width))
    bias = rng.standard_normal(c)
    lens = [2, 9]  # a stream shorter than W-1 and a longer one
    x = rng.standard_normal((sum(lens), c))
    zeros = jnp.zeros((len(lens), c, width - 1), jnp.float32)
    cu = cu_of(lens)
    y, fs = naive_causal_conv1d_varlen(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                       jnp.asarray(bias, jnp.float32), cu_seqlens=cu, initial_state=zeros, silu=silu)
    c0 = np.asarray(cu)
    for i in range(len(lens)):
        xs = x[c0[i] : c0[i + 1]].T
        assert_close(np.asarray(y)[c0[i] : c0[i + 1]], np_transformers_fn(xs, w, bias, silu).T, 1e-5, f"y {i}")
        want = np.concatenate([np.zeros((c, width - 1)), xs], axis=1)[:, -(width - 1) :]
        assert_close(np.asarray(fs)[i], want, 1e-6, f"state {i}")
    for s_len in (width - 1, width):  # ours, and transformers' own cache width
        st = rng.standard_normal((3, c, s_len))
        xt = rng.standard_normal((3, c))
        ry, rs = np_transformers_update(xt, st, w, bias, silu)
        y, ns = naive_causal_conv1d_update(jnp.asarray(xt, jnp.float32), jnp.asarray(st, jnp.float32),
                                           jnp.asarray(w, jnp.float32), jnp.asarray(bias, jnp.float32), silu=silu)
        assert_close(y, ry, 1e-5, f"update y S={s_len}")
        assert_close(ns, rs, 1e-6, f"update state S={s_len}")


def test_naive_matches_transformers_itself():
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    if not (hasattr(mod, "causal_conv1d_fn") and hasattr(mod, "causal_conv1d_update")):
        pytest.skip("this transformers version has no causal_conv1d fallbacks")
    rng = np.random.default_rng(1)
    c, width, n = 8, 4, 11
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, width)).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32)
    ref = mod.causal_conv1d_fn(torch.from_numpy(x.T.copy())[None], torch.from_numpy(w), torch.from_numpy(bias),
                               activation="silu")[0].numpy().T
    y, fs = naive_causal_conv1d_varlen(x, w, bias, cu_seqlens=cu_of([n]),
                                       initial_state=jnp.zeros((1, c, width - 1), jnp.float32))
    assert_close(y, ref, 1e-5, "causal_conv1d_fn")
    st = rng.standard_normal((2, c, width)).astype(np.float32)
    xt = rng.standard_normal((2, c)).astype(np.float32)
    st_t = torch.from_numpy(st.copy())
    ref = mod.causal_conv1d_update(torch.from_numpy(xt)[:, :, None], st_t, torch.from_numpy(w),
                                   torch.from_numpy(bias), "silu")[:, :, 0].numpy()
    y, ns = naive_causal_conv1d_update(xt, st, w, bias)
    assert_close(y, ref, 1e-5, "causal_conv1d_update")
    assert_close(ns, st_t.numpy(), 1e-6, "updated state (in place in transformers)")


# ---------------------------------------------------------------- kernels, interpret mode

C, W = 48, 4  # 48 channels: three 16-wide channel blocks
CASES = [[1], [15], [63], [64], [65], [300], [1, 15, 63, 64, 65, 300], [2, 0, 1, 70, 0]]


def make(rng, t, b, c=C, width=W, poison_from=None, dtype=jnp.float32):
    x = rng.standard_normal((t, c)).astype(np.float32)
    if poison_from is not None:
        x[poison_from:] = np.nan
    w = rng.standard_normal((c, width)).astype(np.float32) * 0.5
    bias = rng.standard_normal(c).astype(np.float32)
    s0 = rng.standard_normal((b, c, width - 1)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(s0)


@pytest.mark.parametrize("lens", CASES, ids=lambda x: "-".join(map(str, x)))
def test_varlen_matches_naive(lens):
    rng = np.random.default_rng(sum(lens) + len(lens))
    t = sum(lens)
    x, w, bias, s0 = make(rng, t + 6, len(lens), poison_from=t)
    cu = cu_of(lens)
    params = ConvParams(block_t=32, block_c=16)
    y, fs = causal_conv1d_varlen(x, w, bias, cu_seqlens=cu, initial_state=s0, params=params, interpret=True)
    ry, rs = naive_causal_conv1d_varlen(x, w, bias, cu_seqlens=cu, initial_state=s0)
    assert np.all(np.asarray(y)[t:] == 0), "padded tail must be exactly 0"
    assert_close(y[:t], ry[:t], 1e-5, "y")
    assert_close(fs, rs, 1e-6, "final state")


def test_varlen_options():
    """No bias, no activation, width 2, bf16 input, default params."""
    rng = np.random.default_rng(9)
    lens = [5, 1, 40]
    cu = cu_of(lens)
    x, w, _, s0 = make(rng, sum(lens), len(lens), width=2)
    y, fs = causal_conv1d_varlen(x, w, None, cu_seqlens=cu, initial_state=s0, silu=False, interpret=True)
    ry, rs = naive_causal_conv1d_varlen(x, w, None, cu_seqlens=cu, initial_state=s0, silu=False)
    assert_close(y, ry, 1e-5, "y width 2")
    assert_close(fs, rs, 1e-6, "state width 2")
    x, w, bias, s0 = make(rng, sum(lens), len(lens), dtype=jnp.bfloat16)
    y, fs = causal_conv1d_varlen(x, w, bias, cu_seqlens=cu, initial_state=s0, interpret=True)
    ry, rs = naive_causal_conv1d_varlen(x, w, bias, cu_seqlens=cu, initial_state=s0)
    assert y.dtype == jnp.bfloat16
    assert_close(y, ry, 1e-2, "y bf16")
    assert_close(fs, rs, 1e-6, "state bf16")


@pytest.mark.parametrize("state_len", [W - 1, W])
def test_update_matches_naive(state_len):
    rng = np.random.default_rng(state_len)
    n = 5
    x = jnp.asarray(rng.standard_normal((n, C)).astype(np.float32))
    st = jnp.asarray(rng.standard_normal((n, C, state_len)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((C, W)).astype(np.float32))
    bias = jnp.asarray(rng.standard_normal(C).astype(np.float32))
    y, ns = causal_conv1d_update(x, st, w, bias, params=ConvParams(block_c=16), interpret=True)
    ry, rs = naive_causal_conv1d_update(x, st, w, bias)
    assert_close(y, ry, 1e-5, "y")
    assert_close(ns, rs, 0.0, "state")


def test_prefill_then_update_matches_one_pass():
    rng = np.random.default_rng(5)
    lens, steps = [2, 67], 3
    total = [n + steps for n in lens]
    x, w, bias, s0 = make(rng, sum(total), len(lens))
    cu_all = np.asarray(cu_of(total))
    ry, rs = naive_causal_conv1d_varlen(x, w, bias, cu_seqlens=jnp.asarray(cu_all), initial_state=s0)
    pre = np.concatenate([np.arange(cu_all[i], cu_all[i] + n) for i, n in enumerate(lens)])
    y, st = causal_conv1d_varlen(x[pre], w, bias, cu_seqlens=cu_of(lens), initial_state=s0, interpret=True)
    assert_close(y, ry[pre], 1e-5, "prefill")
    for s in range(steps):
        rows = cu_all[:-1] + np.asarray(lens) + s
        y, st = causal_conv1d_update(x[rows], st, w, bias, interpret=True)
        assert_close(y, ry[rows], 1e-5, f"step {s}")
    assert_close(st, rs, 1e-6, "state after decode")


def test_bad_inputs_raise():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_varlen(x, jnp.ones((8, 4)), None, cu_seqlens=cu_of([4]), initial_state=jnp.ones((1, 8, 4)))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x, jnp.ones((4, 8, 2)), jnp.ones((8, 4)))


def test_triton_lowering_at_qwen3_next_shapes():
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError:
        pytest.skip("jax internals moved")
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    orig = pallas_call_registration.gpu_info_lib.get_gpu_info
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200
    try:
        sd = jax.ShapeDtypeStruct
        bf, f32 = jnp.bfloat16, jnp.float32
        txt = jax.jit(causal_conv1d_varlen).trace(
            sd((4096, 8192), bf), sd((8192, 4), bf), None,
            cu_seqlens=sd((4,), jnp.int32), initial_state=sd((3, 8192, 3), f32),
        ).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in txt
        txt = jax.jit(causal_conv1d_update).trace(
            sd((64, 8192), bf), sd((64, 8192, 3), f32), sd((8192, 4), bf), sd((8192,), bf),
        ).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in txt
    finally:
        pallas_call_registration.gpu_info_lib.get_gpu_info = orig


@pytest.mark.gpu
def test_gpu_qwen3_next_width():
    rng = np.random.default_rng(3)
    lens = [1, 2, 63, 65, 300, 2048]
    t = sum(lens)
    x, w, bias, s0 = make(rng, t + 9, len(lens), c=8192, poison_from=t, dtype=jnp.bfloat16)
    cu = cu_of(lens)
    y, fs = causal_conv1d_varlen(x, w, None, cu_seqlens=cu, initial_state=s0)
    ry, rs = naive_causal_conv1d_varlen(x, w, None, cu_seqlens=cu, initial_state=s0)
    assert np.all(np.asarray(y)[t:] == 0)
    assert_close(y[:t], ry[:t], 1e-2, "y")
    assert_close(fs, rs, 1e-6, "final state")
    rows = np.asarray(cu)[1:] - 1
    y, ns = causal_conv1d_update(x[rows], s0, w, bias)
    ry, rns = naive_causal_conv1d_update(x[rows], s0, w, bias)
    assert_close(y, ry, 1e-2, "update y")
    assert_close(ns, rns, 1e-6, "update state")
