"""Shared pieces of the paged-attention kernels: input checks, scalar packing, in-kernel gathers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu_triton

LOG2E = math.log2(math.e)
NEG_BIG = -1e30  # finite "minus infinity" for running maxima: exp2(NEG_BIG - NEG_BIG) stays 1, never NaN

KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn))
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_pools(q, k_pool, v_pool, k_scale, v_scale):
    """Validates q [*, Hq, D] against pools [L, NB, bs, Hkv, D]; returns (L, NB, bs, Hkv, D)."""
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"k_pool / v_pool must both be [L, num_blocks, block_size, Hkv, D]; got {k_pool.shape} "
            f"and {v_pool.shape}"
        )
    if k_pool.dtype != v_pool.dtype or jnp.dtype(k_pool.dtype) not in KV_DTYPES:
        raise ValueError(f"pool dtypes {k_pool.dtype}/{v_pool.dtype} must match and be one of {KV_DTYPES}")
    if jnp.dtype(q.dtype) not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} must be one of {Q_DTYPES}")
    num_layers, num_blocks, block_size, hkv, d = k_pool.shape
    hq = q.shape[-2]
    if q.shape[-1] != d:
        raise ValueError(f"q head_dim {q.shape[-1]} != pool head_dim {d}")
    if d % 16 or d < 16 or (d & (d - 1)):
        raise ValueError(f"{d=} must be a power of two >= 16")
    if hq % hkv:
        raise ValueError(f"num q heads {hq} must be a multiple of num kv heads {hkv}")
    if hq // hkv > 64:
        raise ValueError(f"GQA group {hq // hkv} > 64 is not supported")
    is_fp8 = jnp.dtype(k_pool.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if not is_fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale apply to a float8_e4m3fn pool only")
    return num_layers, num_blocks, block_size, hkv, d


def pools_supported(q, k_pool, v_pool) -> bool:
    """Whether the Triton attention kernels take q and the pools (`check_pools`: head_dim a power of
    two >= 16, the GQA group <= 64, ...); the caller runs the XLA reference otherwise."""
    try:
        check_pools(q, k_pool, v_pool, None, None)
    except ValueError:
        return False
    return True


def check_ragged(q, block_tables, cu_seqlens, kv_lens, sliding_window):
    """Validates the ragged-prefill arguments: q [T, Hq, D], block_tables [B, MB], cu_seqlens
    [B+1], kv_lens [B], sliding_window None or >= 1."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D]; got {q.shape}")
    b = block_tables.shape[0]
    if block_tables.ndim != 2 or cu_seqlens.shape != (b + 1,) or kv_lens.shape != (b,):
        raise ValueError(
            f"block_tables {block_tables.shape}, cu_seqlens {cu_seqlens.shape}, kv_lens {kv_lens.shape} "
            f"must be [B, MB], [B+1], [B]"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 or None")


def pack_scalars(layer, sm_scale, k_scale, v_scale):
    """-> (layer i32[1], scales f32[2] = [sm_scale * k_scale * log2(e), v_scale])."""
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    ks = jnp.float32(1.0) if k_scale is None else jnp.asarray(k_scale, jnp.float32).reshape(())
    vs = jnp.float32(1.0) if v_scale is None else jnp.asarray(v_scale, jnp.float32).reshape(())
    scales = jnp.stack([ks * jnp.float32(sm_scale * LOG2E), vs]).astype(jnp.float32)
    return layer_arr, scales


def compute_dtype(q_dtype, kv_dtype):
    """Dot operand dtype: float32 if either side is float32, else bfloat16."""
    if jnp.dtype(q_dtype) == jnp.float32 or jnp.dtype(kv_dtype) == jnp.float32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.bfloat16)


def dot(a, b, *, trans_b=False):
    """f32-accumulating tile dot; exact (ieee) when the operands are float32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu_triton.dot(a, b, trans_b=trans_b, precision=prec).astype(jnp.float32)


def load_kv_rows(kv_ref, bt_ref, bt_base, layer, tok, tok_valid, *, head, num_blocks, block_size,
                 num_kv_heads, cdtype, head_major=False):
    """Gathers keys or values of token positions `tok` i32[BK] of one sequence and one KV head.

    kv_ref: the pool viewed as [L * NB * bs * Hkv, D] (a free reshape of [L, NB, bs, Hkv, D],
      or of [L, NB, Hkv, bs, D] with head_major=True).
    bt_ref: block tables flattened to i32[R * MB]; bt_base = row * MB (the row's first entry).
    Masked-out tokens read nothing and give 0.
    Returns [BK, D] in `cdtype` (in the pool's dtype when cdtype is None).
    """
    page = plgpu_triton.load(bt_ref.at[bt_base + tok // block_size], mask=tok_valid, other=0)  # i32[BK]
    if head_major:  # pool [L, NB, Hkv, bs, D] (measured alternative; not the engine's layout)
        row = ((layer * num_blocks + page) * num_kv_heads + head) * block_size + tok % block_size
    else:  # pool [L, NB, bs, Hkv, D]
        row = ((layer * num_blocks + page) * block_size + tok % block_size) * num_kv_heads + head
    # Pure integer-array indexing (not row + slice): Pallas interpret mode only discharges
    # gathers whose indexers are all arrays or all slices.
    cols = jnp.arange(kv_ref.shape[1], dtype=jnp.int32)
    x = plgpu_triton.load(kv_ref.at[row[:, None], cols[None, :]], mask=tok_valid[:, None], other=0.0)
    return x if cdtype is None else x.astype(cdtype)


def poison_like(shape, dtype):
    return jnp.full(shape, jnp.nan, dtype)
