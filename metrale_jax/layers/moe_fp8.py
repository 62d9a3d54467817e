"""Routed experts with block-FP8 weights (`Fp8Linear` [E, N_pad, K] per layer) kept FP8 on the device.

Two static paths, by the number of (token, expert) pairs P = T * k against the expert count E:
* P < E (decode): gather the P pairs' expert weights (FP8 bytes and their scales), dequantize
  only those, and run one batched matvec per pair: the step reads P experts' FP8 weights instead
  of all E;
* otherwise (prefill): dequantize every expert to the activation dtype and run the grouped GEMM
  of `moe.routed_experts` (a transient bf16 copy of the layer's experts).
No FP8 grouped-GEMM kernel yet: both paths are XLA. The weights stay FP8 in memory (half of bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import Fp8Linear, dequantize


def _select_rows(w: jax.Array, segments) -> jax.Array:
    """[..., N_pad, K] -> [..., N, K]: the valid rows of each part, concatenated."""
    if len(segments) == 1 and segments[0][0] == 0 and segments[0][1] == w.shape[-2]:
        return w
    return jnp.concatenate([w[..., s:s + n, :] for s, n in segments], axis=-2)


def dense_experts(w: Fp8Linear, dtype) -> jax.Array:
    """Fp8Linear [E, N_pad, K] -> [E, K, N] in `dtype` (the layout `moe.routed_experts` takes)."""
    return jnp.swapaxes(_select_rows(dequantize(w, dtype), w.segments), -1, -2)


def fp8_routed_experts(x, weights, experts, w_gate_up: Fp8Linear, w_down: Fp8Linear, act=jax.nn.silu,
                       gated: bool = True, use_tokamax: bool = False):
    """As `moe.routed_experts` (x [T, H], weights f32[T, k], experts i32[T, k] -> [T, H]) for FP8 experts."""
    from metrale_jax.layers.moe import routed_experts

    t, k = experts.shape
    num_experts = w_down.w8.shape[0]
    if t * k >= num_experts:
        return routed_experts(x, weights, experts, dense_experts(w_gate_up, x.dtype), dense_experts(w_down, x.dtype),
                              act=act, gated=gated, use_tokamax=use_tokamax)
    flat = experts.reshape(-1)  # i32[P]

    def pick(w: Fp8Linear):  # [P, N, K] in x's dtype: the pairs' experts only
        sub = Fp8Linear(w.w8[flat], w.scale_inv[flat], w.segments)
        return _select_rows(dequantize(sub, x.dtype), w.segments)

    xs = jnp.repeat(x, k, axis=0)  # [P, H]: pair p = (token p // k, its (p % k)-th expert)
    h = jnp.einsum("ph,pnh->pn", xs, pick(w_gate_up), preferred_element_type=jnp.float32)
    if gated:
        g, u = jnp.split(h, 2, axis=-1)
        a = act(g) * u
    else:
        a = act(h)
    y = jnp.einsum("pi,pni->pn", a.astype(x.dtype), pick(w_down), preferred_element_type=jnp.float32)
    y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[:, None]
    return y.reshape(t, k, -1).sum(axis=1).astype(x.dtype)
