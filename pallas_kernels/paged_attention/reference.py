"""Float32 pure-jnp references of the paged-attention kernels (same signatures, no tuning).

Both gather each sequence's keys and values through its block table into a dense
[rows, max_blocks * block_size, Hkv, D] float32 array, then run a masked softmax over it.
They are meant for tests and for tiny problems: they materialize the gathered context.

Masking rules (shared with the kernels):
* a decode row of seq_len S attends keys 0..S-1 (its own new key is the last one);
* a prefill token at absolute position p (the new tokens of stream b are the LAST
  cu[b+1]-cu[b] positions of its kv_len) attends keys 0..p;
* a sliding window W keeps only keys k with p - k < W (p = the query's position);
* rows that see no key (seq_len 0, pad tokens) give zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _dequant(x, scale):
    x = x.astype(jnp.float32)
    return x if scale is None else x * jnp.asarray(scale, jnp.float32)


def gather_kv(pool, layer, block_tables):
    """pool [L, NB, bs, Hkv, D], block_tables i32[R, MB] -> f32 [R, MB*bs, Hkv, D]."""
    layer_pool = jnp.take(pool, jnp.asarray(layer, jnp.int32).reshape(()), axis=0)
    r, mb = block_tables.shape
    _, bs, hkv, d = layer_pool.shape
    g = layer_pool[jnp.clip(block_tables, 0, layer_pool.shape[0] - 1)]  # [R, MB, bs, Hkv, D]
    return g.reshape(r, mb * bs, hkv, d).astype(jnp.float32)


def _masked_attention(q, k, v, mask, sm_scale):
    """q f32[R, Hq, D], k/v f32[R, S, Hkv, D], mask bool[R, S] -> f32[R, Hq, D] (0 for empty rows)."""
    r, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(r, hkv, hq // hkv, d)
    # Keys a row may not see are zeroed, so whatever sits in unowned pool slots never leaks in.
    k = jnp.where(mask[:, :, None, None], k, 0.0)
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    s = jnp.einsum("rhgd,rshd->rhgs", qg, k, precision=_HI) * sm_scale
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("rhgs,rshd->rhgd", p, v, precision=_HI)
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.reshape(r, hq, d)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window"))
def paged_decode_attention_reference(
    q, k_pool, v_pool, layer, block_tables, seq_lens, *, sm_scale, sliding_window=None,
    k_scale=None, v_scale=None,
):
    """q [N, Hq, D]; pools [L, NB, bs, Hkv, D]; block_tables i32[N, MB]; seq_lens i32[N] -> f32[N, Hq, D]."""
    k = _dequant(gather_kv(k_pool, layer, block_tables), k_scale)
    v = _dequant(gather_kv(v_pool, layer, block_tables), v_scale)
    pos = jnp.arange(k.shape[1])[None, :]  # key positions
    lens = seq_lens[:, None]
    mask = pos < lens
    if sliding_window is not None:
        mask &= (lens - 1) - pos < sliding_window
    return _masked_attention(q.astype(jnp.float32), k, v, mask, sm_scale)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "token_chunk"))
def paged_prefill_attention_reference(
    q, k_pool, v_pool, layer, block_tables, cu_seqlens, kv_lens, *, sm_scale, sliding_window=None,
    k_scale=None, v_scale=None, token_chunk=8,
):
    """q [T, Hq, D]; block_tables i32[B, MB]; cu_seqlens i32[B+1]; kv_lens i32[B] -> f32[T, Hq, D].

    Tokens are processed `token_chunk` at a time (lax.map) so that the per-token gathered context
    stays small; each stream's context is gathered once.
    """
    t, hq, d = q.shape
    b = block_tables.shape[0]
    tok = jnp.arange(t)
    # Stream of each token; tokens at or beyond cu_seqlens[B] are padding (stream = B).
    stream = jnp.sum(tok[:, None] >= cu_seqlens[None, 1:], axis=1)  # i32[T] in [0, B]
    valid = stream < b
    sc = jnp.minimum(stream, b - 1)
    kv_len = jnp.where(valid, kv_lens[sc], 0)
    pos = kv_len - cu_seqlens[sc + 1] + tok  # absolute position of each query token
    kd = _dequant(gather_kv(k_pool, layer, block_tables), k_scale)  # [B, S, Hkv, D]
    vd = _dequant(gather_kv(v_pool, layer, block_tables), v_scale)
    kpos = jnp.arange(kd.shape[1])[None, :]
    chunk = max(1, min(token_chunk, t))
    tp = -(-t // chunk) * chunk
    pad = lambda x: jnp.pad(x, [(0, tp - t)] + [(0, 0)] * (x.ndim - 1)).reshape(tp // chunk, chunk, *x.shape[1:])

    def one(args):
        qc, sc_c, pos_c, kvl_c, valid_c = args
        mask = valid_c[:, None] & (kpos <= pos_c[:, None]) & (kpos < kvl_c[:, None])
        if sliding_window is not None:
            mask &= pos_c[:, None] - kpos < sliding_window
        return _masked_attention(qc.astype(jnp.float32), kd[sc_c], vd[sc_c], mask, sm_scale)

    out = jax.lax.map(one, (pad(q), pad(sc), pad(pos), pad(kv_len), pad(valid)))
    return out.reshape(tp, hq, d)[:t]
