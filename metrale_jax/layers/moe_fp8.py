"""Routed experts with block-FP8 weights (`Fp8Linear` [E, N_pad, K] per layer) kept FP8 on the device.

Two static paths, by the number of (token, expert) pairs P = T * k against the expert count E:
* P < E, or P < 4E with the kernel (decode): each pair's matvec reads only its expert's FP8
  weights: with `use_kernel` (the engine's GPU default, `linear.use_fp8_kernel`) and bf16
  activations through the Pallas kernel `pallas_kernels/linear/expert_fp8.py`, otherwise by
  gathering the pairs' FP8 weights and dequantizing them in XLA;
* otherwise (prefill): dequantize every expert to the activation dtype and run the grouped GEMM
  of `moe.routed_experts` (a transient bf16 copy of the layer's experts).
No FP8 grouped-GEMM kernel for prefill yet. The weights stay FP8 in memory (half of bf16).
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
    # the dense path moves ~5 bytes per expert parameter (FP8 read, bf16 written and read again),
    # the kernel's gather 1 byte per pair and parameter: it pays up to P ~ 4E (a batch-64 decode
    # step of Qwen3-Next routes 640 pairs to 512 experts); XLA's gather materializes the pairs'
    # dequantized weights, so without the kernel only P < E
    kernel = w_down.use_kernel and x.dtype == jnp.bfloat16
    if t * k >= (4 if kernel else 1) * num_experts:
        return routed_experts(x, weights, experts, dense_experts(w_gate_up, x.dtype), dense_experts(w_down, x.dtype),
                              act=act, gated=gated, use_tokamax=use_tokamax)
    flat = experts.reshape(-1)  # i32[P]

    def matvec(xp, w: Fp8Linear):  # xp [P, K] -> f32[P, N]: each pair through its expert only
        if w.use_kernel and xp.dtype == jnp.bfloat16:
            from pallas_kernels.linear.expert_fp8 import expert_matvec_fp8

            y = expert_matvec_fp8(xp, w.w8, w.scale_inv, flat, interpret=w.interpret).astype(jnp.float32)
            return _select_rows(y[..., None], w.segments)[..., 0]  # f32[P, N_pad] -> [P, N]
        sub = Fp8Linear(w.w8[flat], w.scale_inv[flat], w.segments)  # gathered FP8 bytes [P, N_pad, K]
        wd = _select_rows(dequantize(sub, xp.dtype), w.segments)  # [P, N, K]
        return jnp.einsum("pk,pnk->pn", xp, wd, preferred_element_type=jnp.float32)

    xs = jnp.repeat(x, k, axis=0)  # [P, H]: pair p = (token p // k, its (p % k)-th expert)
    h = matvec(xs, w_gate_up)
    if gated:
        g, u = jnp.split(h, 2, axis=-1)
        a = act(g) * u
    else:
        a = act(h)
    y = matvec(a.astype(x.dtype), w_down)
    y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[:, None]
    return y.reshape(t, k, -1).sum(axis=1).astype(x.dtype)
