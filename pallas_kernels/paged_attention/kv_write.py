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


def _kv_write_kernel(layer_ref, k_scale_ref, v_scale_ref, slots_ref, k_ref, v_ref, _k_in, _v_in, k_pool_ref,
                     v_pool_ref, *, num_tokens: int, slots_per_layer: int, row_width: int, block_tokens: int,
                     quantize: bool):
    """slots i32[T]; k/v [T, W] (W = Hkv*D); pools [L * NB * bs, W] (aliased to the outputs)."""
    i = pl.program_id(0)
    tok = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    in_range = tok < num_tokens
    slot = plgpu_triton.load(slots_ref.at[jnp.where(in_range, tok, 0)], mask=in_range, other=-1)
    row = _pool_rows(layer_ref, slot, in_range, slots_per_layer, k_pool_ref.shape[0])
    wp = common.next_pow2(row_width)
    cols = jnp.arange(wp, dtype=jnp.int32)
    col_ok = cols < row_width
    src_row = jnp.where(in_range, tok, 0)
    mask = (row < k_pool_ref.shape[0])[:, None] & col_ok[None, :]
    for scale_ref, src, dst in ((k_scale_ref, k_ref, k_pool_ref), (v_scale_ref, v_ref, v_pool_ref)):
        x = plgpu_triton.load(src.at[src_row[:, None], cols[None, :]], mask=mask, other=0.0)
        _store_rows(dst, row[:, None], cols[None, :], x, mask, scale_ref if quantize else None)


def _pool_rows(layer_ref, slot, ok, slots_per_layer: int, total_rows: int):
    """Pool rows of the tokens' slots in this layer; total_rows (past the end) where nothing is
    written: padding (slot -1), a slot outside the pool, or `ok` False."""
    valid = ok & (slot >= 0) & (slot < slots_per_layer)
    return jnp.where(valid, layer_ref[0] * slots_per_layer + slot, total_rows)


def _store_rows(dst, rows, cols, x, mask, scale_ref):
    """dst[rows, cols] = x (divided by the layer's scale for an fp8 pool: scale_ref not None)."""
    if scale_ref is not None:
        x = x.astype(jnp.float32) / scale_ref[0]
    plgpu_triton.store(dst.at[rows, cols], x.astype(dst.dtype), mask=mask)


def _scales(k_pool, k_scale, v_scale):
    """f32[1] each: the layer's K and V scales (1 unless the pool is fp8). Separate arrays, not a
    stacked pair: stacking took its own kernel launch per layer at decode."""
    one = jnp.ones((1,), jnp.float32)
    ks = one if k_scale is None else jnp.asarray(k_scale, jnp.float32).reshape(1)
    vs = one if v_scale is None else jnp.asarray(v_scale, jnp.float32).reshape(1)
    return ks, vs, jnp.dtype(k_pool.dtype) == jnp.dtype(jnp.float8_e4m3fn)


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
    ks, vs, quantize = _scales(k_pool, k_scale, v_scale)
    t = k.shape[0]
    w = hkv * d
    rows = num_layers * num_blocks * block_size
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_kv_write_kernel, num_tokens=t, slots_per_layer=num_blocks * block_size,
                               row_width=w, block_tokens=block_tokens, quantize=quantize)
    whole = pl.no_block_spec
    kp, vp = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_tokens),),
        in_specs=[whole] * 8,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((rows, w), k_pool.dtype), jax.ShapeDtypeStruct((rows, w), v_pool.dtype)],
        input_output_aliases={6: 0, 7: 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_kv_write",
    )(layer_arr, ks, vs, slots.astype(jnp.int32), k.reshape(t, w), v.reshape(t, w), k_pool.reshape(rows, w),
      v_pool.reshape(rows, w))
    return kp.reshape(k_pool.shape), vp.reshape(v_pool.shape)


def _rope_kv_write_kernel(layer_ref, k_scale_ref, v_scale_ref, slots_ref, cs_ref, qkv_ref, _k_in, _v_in, q_ref,
                          k_pool_ref, v_pool_ref, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          rot_half: int, slots_per_layer: int, quantize: bool):
    """One token per program. qkv [T, (Hq + 2 Hkv) * D]; cs f32[T, 2 * rot_half] (cos | sin);
    q out [T, Hq * D]; pools [L * NB * bs, Hkv * D] (aliased to the outputs)."""
    t = pl.program_id(0)
    d = head_dim
    slot = slots_ref[t]
    row = _pool_rows(layer_ref, slot, True, slots_per_layer, k_pool_ref.shape[0])
    rp = common.next_pow2(rot_half)
    rc = jnp.arange(rp, dtype=jnp.int32)  # i32[RP] rotary column pairs (c, c + rot_half)
    rc_ok = rc < rot_half
    cos = plgpu_triton.load(cs_ref.at[t, rc], mask=rc_ok, other=0.0)  # f32[RP]
    sin = plgpu_triton.load(cs_ref.at[t, rot_half + rc], mask=rc_ok, other=0.0)
    pass_w = d - 2 * rot_half  # columns past the rotary part, copied as they are
    pc = jnp.arange(common.next_pow2(max(pass_w, 1)), dtype=jnp.int32)
    pc_ok = pc < pass_w

    def heads(first: int, count: int, dst, dst_row, scale_ref, rope: bool):
        # dst[dst_row, h * D + c] = qkv[t, (first + h) * D + c] (rotated) for heads h < count
        hp = common.next_pow2(count)
        h = jnp.arange(hp, dtype=jnp.int32)[:, None]  # i32[HP, 1]
        live = (h < count) & (dst_row < dst.shape[0])

        def copy(c, m, rotate=False):  # c: i32[1, C] head columns; rotate: c are rotary pairs (c, c + R)
            srow = jnp.full((hp, c.shape[1]), t, jnp.int32)
            drow = jnp.full((hp, c.shape[1]), dst_row, jnp.int32)
            if not rotate:
                x = plgpu_triton.load(qkv_ref.at[srow, (first + h) * d + c], mask=m, other=0.0)
                _store_rows(dst, drow, h * d + c, x, m, scale_ref)
                return
            x1 = plgpu_triton.load(qkv_ref.at[srow, (first + h) * d + c], mask=m, other=0.0).astype(jnp.float32)
            x2 = plgpu_triton.load(qkv_ref.at[srow, (first + h) * d + rot_half + c], mask=m,
                                   other=0.0).astype(jnp.float32)
            _store_rows(dst, drow, h * d + c, x1 * cos[None, :] - x2 * sin[None, :], m, scale_ref)
            _store_rows(dst, drow, h * d + rot_half + c, x2 * cos[None, :] + x1 * sin[None, :], m, scale_ref)

        if rope:
            copy(rc[None, :], live & rc_ok[None, :], rotate=True)
            if pass_w:
                copy(2 * rot_half + pc[None, :], live & pc_ok[None, :])
        else:
            c = jnp.arange(common.next_pow2(d), dtype=jnp.int32)[None, :]
            copy(c, live & (c < d))

    hq, hkv = num_q_heads, num_kv_heads
    heads(0, hq, q_ref, t, None, True)
    heads(hq, hkv, k_pool_ref, row, k_scale_ref if quantize else None, True)
    heads(hq + hkv, hkv, v_pool_ref, row, v_scale_ref if quantize else None, False)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "interpret"))
def rope_and_write_kv(qkv, cos_sin, k_pool, v_pool, layer, slots, *, num_q_heads: int, k_scale=None, v_scale=None,
                      interpret: bool = False):
    """RoPE on the q and k parts of a fused projection, and the new K/V written into the pools:
    one launch where XLA's rope fusions, slices and the write took four at a decode step.

    Args:
      qkv: [T, (Hq + 2 Hkv) * D]: per token the q heads, then k heads, then v heads.
      cos_sin: f32[T, 2 * R]: cos then sin of each token's rotary angles (R = rotary_dim / 2);
        Hugging Face's rotate-half form on the first 2R columns of each head, the rest copied.
      k_pool, v_pool: [L, num_blocks, block_size, Hkv, D] (bf16 / f32 / float8_e4m3fn).
      layer: int32 scalar or i32[1] (may be traced).
      slots: i32[T]: flat slot of each token; -1 (or out of range) = write nothing.
      num_q_heads: Hq (static).
      k_scale, v_scale: f32 scalars dividing the values written to an fp8 pool.

    Returns:
      (q [T, Hq, D] in qkv's dtype with RoPE applied, k_pool, v_pool).
    """
    num_layers, num_blocks, block_size, hkv, d = k_pool.shape
    t = qkv.shape[0]
    rot_half = cos_sin.shape[1] // 2
    if (v_pool.shape != k_pool.shape or qkv.shape != (t, (num_q_heads + 2 * hkv) * d) or slots.shape != (t,)
            or cos_sin.shape[0] != t or 2 * rot_half > d or cos_sin.shape[1] % 2):
        raise ValueError(f"shapes: qkv {qkv.shape} with Hq {num_q_heads}, pools {k_pool.shape}/{v_pool.shape}, "
                         f"slots {slots.shape}, cos_sin {cos_sin.shape}")
    ks, vs, quantize = _scales(k_pool, k_scale, v_scale)
    w = hkv * d
    rows = num_layers * num_blocks * block_size
    kernel = functools.partial(_rope_kv_write_kernel, num_q_heads=num_q_heads, num_kv_heads=hkv, head_dim=d,
                               rot_half=rot_half, slots_per_layer=num_blocks * block_size, quantize=quantize)
    whole = pl.no_block_spec
    q, kp, vp = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[whole] * 8,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((t, num_q_heads * d), qkv.dtype),
                   jax.ShapeDtypeStruct((rows, w), k_pool.dtype), jax.ShapeDtypeStruct((rows, w), v_pool.dtype)],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope_and_write_kv",
    )(jnp.asarray(layer, jnp.int32).reshape(1), ks, vs, slots.astype(jnp.int32), cos_sin.astype(jnp.float32), qkv,
      k_pool.reshape(rows, w), v_pool.reshape(rows, w))
    return q.reshape(t, num_q_heads, d), kp.reshape(k_pool.shape), vp.reshape(v_pool.shape)
