"""The routed-experts block against a per-token loop, and tokamax's grouped GEMM (the GPU path)
against jax.lax.ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.layers.moe import routed_experts, softmax_topk_router, tokamax_available


def _case(t=37, h=48, inter=40, e=8, k=3, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h)).astype(np.float32)
    router = rng.standard_normal((h, e)).astype(np.float32)
    wgu = (rng.standard_normal((e, h, 2 * inter)) / np.sqrt(h)).astype(np.float32)
    wd = (rng.standard_normal((e, inter, h)) / np.sqrt(inter)).astype(np.float32)
    x, router, wgu, wd = (jnp.asarray(a, dtype) for a in (x, router, wgu, wd))
    w, idx = softmax_topk_router(x, router, k, True)
    return x, w, idx, wgu, wd


def _loop_reference(x, w, idx, wgu, wd):
    x, w, idx, wgu, wd = (np.asarray(a, np.float64) if a.dtype != jnp.int32 else np.asarray(a)
                          for a in (x, w, idx, wgu, wd))
    out = np.zeros_like(x)
    inter = wd.shape[1]
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            hgu = x[t] @ wgu[idx[t, j]]
            g, u = hgu[:inter], hgu[inter:]
            out[t] += w[t, j] * ((g / (1 + np.exp(-g))) * u) @ wd[idx[t, j]]
    return out


def test_routed_experts_match_per_token_loop():
    x, w, idx, wgu, wd = _case()
    got = np.asarray(jax.jit(routed_experts)(x, w, idx, wgu, wd))
    np.testing.assert_allclose(got, _loop_reference(x, w, idx, wgu, wd), rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 8), (15, 8), (300, 8), (1, 10), (15, 10), (13, 3)])
def test_tokamax_grouped_gemm_matches_ragged_dot(t, k):
    """T*k rows: 8, 120, 2400, then 10, 150 and 39 (not multiples of 8: padded for tokamax)."""
    if not tokamax_available():
        pytest.skip("tokamax is not installed")
    x, w, idx, wgu, wd = _case(t=t, h=256, inter=128, e=64, k=k, seed=t, dtype=jnp.bfloat16)
    f = jax.jit(routed_experts, static_argnames=("use_tokamax",))
    want = np.asarray(f(x, w, idx, wgu, wd, use_tokamax=False), np.float32)
    got = np.asarray(f(x, w, idx, wgu, wd, use_tokamax=True), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
