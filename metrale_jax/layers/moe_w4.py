"""Routed experts with packed 4-bit weights (`W4Linear` [E, N, K/2] per layer: GPTQ, AWQ,
compressed-tensors W4A16 and NVFP4 checkpoints, `loading/experts.py`) kept 4-bit on the device.

The same two static paths as the FP8 experts (`moe_fp8.py`), picked by `use_pairs` on the
number of (token, expert) pairs P = T * k against the expert count E:
* few pairs (P < E; P < 8E with the kernel: decode): each pair's matvec reads only its expert's
  packed weights (`pair_matvec` under `moe.pair_experts`), by gathering the pairs' packed weights
  and dequantizing them in XLA, or with `W4Linear.expert_kernel` and bf16 / f16 activations
  through the Pallas kernel `pallas_kernels/linear/expert_w4.py`. The kernel is off by default: on
  the H100 (session 42, `bench/results/expert_w4_h100_2026-12-05_s42.md`) one Qwen3-30B-A3B layer's
  routed int4 experts took 44.8 / 226 us on it at 1 / 8 tokens against 30.1 / 156 us gathered by
  XLA (bf16 experts: 55 / 200 us), and 1,646 us at 64 tokens against bf16's 444;
* otherwise (prefill): `moe.routed_experts`' grouped GEMM over the layer's experts dequantized to
  the activation dtype (`w4_grouped_matmul`: a transient dense copy of one layer's experts, e.g.
  1.2 GB for a Qwen3-30B-A3B layer, written and read once per step).
The weights stay 4-bit in memory (a quarter of bf16, plus the group scales), so a 4-bit
Qwen3-30B-A3B takes ~17 GB instead of 61, and Qwen3-Next-80B-A3B fits one GPU. GPTQ act-order
experts (`perm`): the pair paths gather x's columns into each expert's packed order, the grouped
path puts the dequantized weights' columns back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.layers.linear import Fp8Linear, W4Linear, is_experts
from metrale_jax.layers.linear_w4 import dequantize_w4
from metrale_jax.layers.moe_fp8 import tokamax_takes


def _kernel_takes(x, w: W4Linear) -> bool:
    return w.expert_kernel and x.dtype in (jnp.bfloat16, jnp.float16) and w.group_size % 2 == 0


def use_pairs(x, experts, w_down: W4Linear) -> bool:
    """Whether the P = T * k pairs of `experts` i32[T, k] take the per-pair path (`moe.pair_experts`)."""
    # the kernel (opt-in) reads half a byte per pair and parameter; the grouped path reads the codes
    # and writes and reads the layer's experts dense (~4.5 bytes per parameter): by bytes they tie
    # near P = 9E, hence P < 8E with it (but on the H100 the kernel reached 0.2-0.7 TB/s: a batch-64
    # Qwen3-30B-A3B layer, 512 pairs, took 1,646 us on it). XLA's gather materializes the pairs'
    # dequantized weights, so without the kernel only P < E
    return experts.size < (8 if _kernel_takes(x, w_down) else 1) * w_down.packed.shape[0]


def pair_matvec(xp, w: W4Linear, flat) -> jax.Array:
    """xp [P, K], w `W4Linear` [E, N, K/2], flat i32[P] -> f32[P, N]: row p through expert flat[p]
    alone (`moe.pair_experts`), on the kernel or by gathering the pairs' packed weights in XLA."""
    if w.perm is not None:  # each pair's x in its expert's packed column order
        xp = jnp.take_along_axis(xp, w.perm[flat], axis=-1)
    if _kernel_takes(xp, w):
        from pallas_kernels.linear.expert_w4 import expert_matvec_w4

        return expert_matvec_w4(xp, w.packed, w.scales, w.aux, flat, k=w.k, group_size=w.group_size, kind=w.kind,
                                interpret=w.interpret).astype(jnp.float32)
    sub = jax.tree.map(lambda a: a[flat], dataclasses.replace(w, perm=None))  # the pairs' experts [P, N, K/2]
    return jnp.einsum("pk,pnk->pn", xp, dequantize_w4(sub, xp.dtype), preferred_element_type=jnp.float32)


def dense_experts(w: W4Linear, dtype) -> jax.Array:
    """W4Linear [..., E, N, K/2] -> [..., E, K, N] in `dtype` (the layout `moe.grouped_matmul` takes,
    and a dense linear's [K, N]), the columns of act-order weights back in the input's order."""
    wd = dequantize_w4(w, dtype)  # [..., N, K] in the packed column order
    if w.perm is not None:
        wd = jnp.take_along_axis(wd, jnp.argsort(w.perm, axis=-1)[..., None, :], axis=-1)
    return jnp.swapaxes(wd, -1, -2)


def w4_grouped_matmul(x, w: W4Linear, sizes, use_tokamax: bool):
    """x [M, K] rows sorted by group, w `W4Linear` [G, N, K/2], sizes i32[G] -> f32[M, N]: the
    experts dequantized to x's dtype, then `moe.grouped_matmul` (tokamax's GEMM on the GPU)."""
    from metrale_jax.layers import moe

    return moe.grouped_matmul(x, dense_experts(w, x.dtype), sizes, use_tokamax)


def dequantized_scratch_bytes(params, dtype, tokamax: bool = False) -> int:
    """Device scratch of a prefill step's grouped GEMM over one layer's quantized experts
    dequantized to `dtype` (gate|up and down: `dense_experts`' copies), for the engine's KV-pool
    sizing to hold back (a 4-bit Qwen3-Next layer: 3.2 GB in bf16): 4-bit experts always
    (`w4_grouped_matmul`), FP8 ones where tokamax's FP8 grouped GEMM does not take them
    (`moe_fp8.tokamax_takes`: `tokamax` off, activations other than bf16, K not a
    multiple of 128). 0 without quantized experts."""
    from metrale_jax.layers.stack import Unstacked

    kinds = (W4Linear, Fp8Linear)
    total = 0
    for path, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda a: isinstance(a, kinds))[0]:
        if not (isinstance(w, kinds) and is_experts(path)):
            continue
        arr = w.packed if isinstance(w, W4Linear) else w.w8
        arr = arr.parts[0] if isinstance(arr, Unstacked) else arr
        e, n, k = *arr.shape[-3:-1], (w.k if isinstance(w, W4Linear) else arr.shape[-1])
        if isinstance(w, Fp8Linear) and tokamax_takes(dtype, k, tokamax):
            continue  # (tokamax's FP8 kernel: no dense copy)
        total += e * n * k * jnp.dtype(dtype).itemsize
    return total
