"""Writes new tokens' K/V into the layer-stacked paged pools (the step's "write" half).

Same contract as the engine's XLA scatter (`metrale_jax/cache/kv.py: write_kv`): token t goes to
flat slot slots[t] = block_id * block_size + offset of layer `layer`; slot -1 (padding) or any
slot outside the pool writes nothing; for a float8_e4m3fn pool the values are divided by the
layer's scale before the cast. The pools are aliased to the outputs, so under a jit that
donates them (the engine's step) the write happens in place.

Why a kernel: XLA's scatter of [T, Hkv, D] rows measured 0.4 TB/s on the H200 (166-171 us for
8192 tokens, Hkv=8, D=128, bf16: 27% of the prefill attention it feeds); this kernel took 66-90
us on the same write, bit-identical (bench/results/paged_attention.md). Not yet tuned
(block_tokens=8, 4 warps): it reaches only ~1 TB/s of the ~4 TB/s a copy can.

Backend: `pl.pallas_call` lowered through Triton (see decode.py for why). Each program copies
`block_tokens` whole token rows ([Hkv * D] contiguous in the pool, padded to a power of two
and masked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.paged_attention import common


def _kv_write_kernel(layer_ref, scales_ref, slots_ref, k_ref, v_ref, _k_in, _v_in, k_pool_ref, v_pool_ref, *,
                     num_tokens: int, slots_per_layer: int, row_width: int, block_tokens: int, quantize: bool):
    """slots i32[T]; k/v [T, W] (W = Hkv*D); pools [L * NB * bs, W] (aliased to the outputs)."""
    i = pl.program_id(0)
    tok = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    in_range = tok < num_tokens
    slot = plgpu_triton.load(slots_ref.at[jnp.where(in_range, tok, 0)], mask=in_range, other=-1)
    valid = in_range & (slot >= 0) & (slot < slots_per_layer)
    total_rows = k_pool_ref.shape[0]
    row = jnp.where(valid, layer_ref[0] * slots_per_layer + slot, total_rows)  # past the end if invalid
    wp = common.next_pow2(row_width)
    cols = jnp.arange(wp, dtype=jnp.int32)
    col_ok = cols < row_width
    src_row = jnp.where(in_range, tok, 0)
    mask = valid[:, None] & col_ok[None, :]
    for j, (src, dst) in enumerate(((k_ref, k_pool_ref), (v_ref, v_pool_ref))):
        x = plgpu_triton.load(src.at[src_row[:, None], cols[None, :]], mask=mask, other=0.0)
        if quantize:
            x = x.astype(jnp.float32) / scales_ref[j]
        plgpu_triton.store(dst.at[row[:, None], cols[None, :]], x.astype(dst.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
def paged_kv_write(k_pool, v_pool, layer, slots, k, v, *, k_scale=None, v_scale=None, block_tokens: int = 8,
                   interpret: bool = False):
    """Scatter new K/V rows into layer `layer` of the pools.

    Args:
      k_pool, v_pool: [L, num_blocks, block_size, Hkv, D] (bf16 / f32 / float8_e4m3fn).
      layer: int32 scalar or i32[1] (may be traced).
      slots: i32[T]: flat slot of each token; -1 (or out of range) = write nothing.
      k, v: [T, Hkv, D] in any float dtype; cast to the pool dtype (divided by k_scale / v_scale,
        f32 scalars, for a float8_e4m3fn pool).
      block_tokens: tokens per program (static).

    Returns:
      (k_pool, v_pool), updated (in place when the caller donates them).
    """
    num_layers, num_blocks, block_size, hkv, d = k_pool.shape
    if v_pool.shape != k_pool.shape or k.shape != v.shape or k.shape[1:] != (hkv, d) or slots.shape != k.shape[:1]:
        raise ValueError(f"shapes: pools {k_pool.shape}/{v_pool.shape}, slots {slots.shape}, k {k.shape}, v {v.shape}")
    quantize = jnp.dtype(k_pool.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    t = k.shape[0]
    w = hkv * d
    rows = num_layers * num_blocks * block_size
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    ks = jnp.float32(1.0) if k_scale is None else jnp.asarray(k_scale, jnp.float32).reshape(())
    vs = jnp.float32(1.0) if v_scale is None else jnp.asarray(v_scale, jnp.float32).reshape(())
    scales = jnp.stack([ks, vs])
    kernel = functools.partial(_kv_write_kernel, num_tokens=t, slots_per_layer=num_blocks * block_size,
                               row_width=w, block_tokens=block_tokens, quantize=quantize)
    whole = pl.no_block_spec
    kp, vp = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_tokens),),
        in_specs=[whole] * 7,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((rows, w), k_pool.dtype), jax.ShapeDtypeStruct((rows, w), v_pool.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_kv_write",
    )(layer_arr, scales, slots.astype(jnp.int32), k.reshape(t, w), v.reshape(t, w), k_pool.reshape(rows, w),
      v_pool.reshape(rows, w))
    return kp.reshape(k_pool.shape), vp.reshape(v_pool.shape)
