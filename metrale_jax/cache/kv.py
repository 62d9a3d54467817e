"""The paged KV cache: one K and one V pool per attention layer, stacked over layers.

Layout (private to this module and the attention kernels):
    k, v: [num_attn_layers, num_blocks, block_size, kv_heads, head_dim]
A token's flat slot is `block_id * block_size + offset`. The pools are donated to every step,
so XLA updates them in place; the scan over layers carries them and indexes them by layer, so
no layer's pool is ever sliced out (that would copy it).

Who writes the new K/V: the step does, through `write_kv`, before attention runs; attention
(reference or Pallas) only reads the pools.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    k: Array  # [L, num_blocks, block_size, Hkv, D]  (bf16 / f32 / f8e4m3)
    v: Array  # [L, num_blocks, block_size, Hkv, D]
    k_scale: Array  # f32[L]  dequantization scale (1.0 unless the pool is fp8)
    v_scale: Array  # f32[L]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


def init_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    # Four distinct buffers: the state is donated, and one buffer may not be donated twice.
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.ones((num_layers,), jnp.float32),
                   jnp.ones((num_layers,), jnp.float32))


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def write_kv(cache: KVCache, layer: Array, slots: Array, k: Array, v: Array, *, kernel: bool = False,
             interpret: bool = False) -> KVCache:
    """Scatter new K/V rows into layer `layer`.

    layer: i32[]   slots: i32[T] (-1 = padding, never written)   k, v: [T, Hkv, D]
    kernel: write with the Pallas kernel (`pallas_kernels/paged_attention/kv_write.py`; the GPU
      path, `AttentionConfig.use_pallas`): one launch for K and V where XLA's scatter takes four
      at a decode step, and 2x faster on a long prefill. interpret: run it on the CPU (tests).
    """
    if kernel:
        from pallas_kernels.paged_attention import paged_kv_write

        new_k, new_v = paged_kv_write(cache.k, cache.v, layer, slots, k, v, **_scales(cache, layer),
                                      interpret=interpret)
        return dataclasses.replace(cache, k=new_k, v=new_v)
    bs = cache.block_size
    oob = cache.num_blocks  # out of range: mode="drop" discards the write
    blk = jnp.where(slots >= 0, slots // bs, oob)
    off = jnp.where(slots >= 0, slots % bs, 0)
    kd, vd = cache.k.dtype, cache.v.dtype
    if kd == jnp.float8_e4m3fn:
        k = k.astype(jnp.float32) / cache.k_scale[layer]
        v = v.astype(jnp.float32) / cache.v_scale[layer]
    new_k = cache.k.at[layer, blk, off].set(k.astype(kd), mode="drop")
    new_v = cache.v.at[layer, blk, off].set(v.astype(vd), mode="drop")
    return dataclasses.replace(cache, k=new_k, v=new_v)


def rope_and_write_kv(cache: KVCache, layer: Array, slots: Array, qkv: Array, cos_sin: Array, num_q_heads: int,
                      interpret: bool = False) -> tuple[KVCache, Array]:
    """RoPE on the q and k parts of a fused projection and the K/V write, in one Pallas kernel
    (`pallas_kernels/paged_attention/kv_write.py`; the GPU decode path of the Llama family).

    qkv: [T, (Hq + 2 Hkv) * D] (q heads, k heads, v heads)   cos_sin: f32[T, rotary_dim] (cos | sin,
    `layers.rope.rope_cos_sin`)   slots: i32[T] (-1 = padding). Returns (cache, q [T, Hq, D] rotated).
    """
    from pallas_kernels.paged_attention import rope_and_write_kv as kernel

    q, new_k, new_v = kernel(qkv, cos_sin, cache.k, cache.v, layer, slots, num_q_heads=num_q_heads,
                             **_scales(cache, layer), interpret=interpret)
    return dataclasses.replace(cache, k=new_k, v=new_v), q


def _scales(cache: KVCache, layer: Array) -> dict:
    """The kernels' k_scale / v_scale arguments: the layer's scales for an fp8 pool, else none."""
    if cache.k.dtype != jnp.float8_e4m3fn:
        return {}
    return dict(k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer])


def gather_kv(cache: KVCache, layer: Array, block_tables: Array) -> tuple[Array, Array]:
    """Reference read: the pages of each row, contiguous. block_tables i32[R, M] -> [R, M*bs, Hkv, D] f32."""
    r, m = block_tables.shape
    k = cache.k[layer, block_tables].astype(jnp.float32) * cache.k_scale[layer]
    v = cache.v[layer, block_tables].astype(jnp.float32) * cache.v_scale[layer]
    shape = (r, m * cache.block_size) + k.shape[3:]
    return k.reshape(shape), v.reshape(shape)
