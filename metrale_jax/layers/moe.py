"""Sparse mixture-of-experts MLP: routers and the routed experts as a grouped GEMM.

The routed experts run as a grouped GEMM over the (token, expert) pairs sorted by expert:
`jax.lax.ragged_dot` (pure XLA, the CPU path), or on the GPU tokamax's `ragged_dot` (a Mosaic
GPU kernel). Measured on the H200 (bench/results/grouped_matmul_2026-11-29.md) tokamax ran
121-178 us where XLA's ragged_dot took 330-2425 us, and beat our own Pallas kernel (removed).
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from metrale_jax.layers.mlp import linear


def softmax_topk_router(x, w_router, top_k: int, norm_topk_prob: bool):
    """Qwen-style router. x [T, H], w_router [H, E] -> (weights f32[T, k], experts i32[T, k])."""
    logits = linear(x, w_router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype).astype(jnp.float32), idx.astype(jnp.int32)


def tokamax_available() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def grouped_matmul(x, w, sizes, use_tokamax: bool):
    """x [M, K] rows sorted by group, w [G, K, N], sizes i32[G] (summing to M) -> f32[M, N]."""
    if use_tokamax:
        import tokamax

        # tokamax's TMA tiling takes M <= 8 or a multiple of 8 rows (M = 10 for one token routed
        # to 10 experts failed on the H200): pad with rows of the last group, dropped after.
        m = x.shape[0]
        pad = -m % 8 if m > 8 else 0
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
            sizes = sizes.at[-1].add(pad)
        y = tokamax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32, implementation="mosaic")
        return y[:m]
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def routed_experts(x, weights, experts, w_gate_up, w_down, act=jax.nn.silu, gated: bool = True,
                   use_tokamax: bool = False):
    """Run each token through its k experts and sum the weighted outputs.

    x [T, H], weights f32[T, k], experts i32[T, k], w_gate_up [E, H, 2I] (gated) or [E, H, I],
    w_down [E, I, H] -> [T, H] in x's dtype. use_tokamax: the GPU grouped GEMM (see module doc).
    """
    t, k = experts.shape
    num_experts = w_down.shape[0]
    flat = experts.reshape(-1)  # i32[T*k]
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    tok = order // k  # i32[T*k]: the token of each sorted pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # i32[E]
    xs = x[tok]
    h = grouped_matmul(xs, w_gate_up.astype(x.dtype), sizes, use_tokamax)
    if gated:
        g, u = jnp.split(h, 2, axis=-1)
        a = act(g) * u
    else:
        a = act(h)
    y = grouped_matmul(a.astype(x.dtype), w_down.astype(x.dtype), sizes, use_tokamax)
    y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[tok].add(y).astype(x.dtype)
