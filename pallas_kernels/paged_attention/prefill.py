"""Ragged (varlen) chunked-prefill attention over paged, layer-stacked KV pools.

B streams stack their new tokens in q [T, Hq, D] (`cu_seqlens i32[B+1]`). The new tokens of
stream b are the LAST cu[b+1] - cu[b] positions of its `kv_lens[b]` keys: token i of the chunk
sits at position kv_lens[b] - (cu[b+1] - cu[b]) + i and attends causally to every key up to
itself (its cached prefix and the earlier new tokens), read through the stream's own block
table and never beyond its own kv_len. Tokens at or after cu[B] are padding and give zeros.

"Step writes, kernel reads": the new tokens' K/V must already be in the pools (the step writes
them by slot, slot -1 writing nothing: `paged_kv_write` in kv_write.py, or the engine's XLA
scatter). Measured on the H200 at 4 x 2048 new tokens (bench/results/paged_attention.md): the
XLA scatter takes ~170 us (27% of this kernel's 616 us), `paged_kv_write` 66-90 us; fusing the
write here could save at most those 66-90 us (<= 11% without cache, 4% with 4096 cached) and
would need new keys read from the activations rather than the pool, so it is not fused.

Mixed batches (decode rows + prefill chunks): serve them with TWO launches, the decode kernel
for the decode rows and this kernel for the chunks. Measured (64 decode rows at ctx 4096 + a
512-token chunk on 4096 cached): 562 us for two launches, 906 us for one launch of this kernel
with the decode rows as 1-token streams (a 1-token stream fills Gp of a tile's 128 rows).

Backend: `pl.pallas_call` lowered through Triton, for the reasons given in decode.py (gathered
per-token page lookups, GQA groups smaller than a wgmma tile, CPU-checkable lowering). Its Mosaic
GPU twin (prefill_mgpu.py: one TMA copy per page, wgmma over the GQA group's rows) measured
1.2-1.5x faster on the H200 and is the engine's GPU default where it applies (bf16 pools,
head_dim 64/128, power-of-two groups up to 16); this kernel serves fp8 and f32 pools, other head
dims and groups, and the CPU interpret path of those.

Tiling: the wrapper builds a tile schedule in XLA (a few tiny ops on cu_seqlens): each tile is
block_rows // Gp tokens of ONE stream (Gp = GQA group padded to a power of two) times the Gp query
heads of one KV head, so one gathered K/V block serves the whole group. The padding region
[cu[B], T) is scheduled as an extra stream with kv_len 0, so every output element is written
by the kernel. Tiles run longest-first (reverse token order). Each tile loops over its keys in
three phases: window-edge blocks (masked), fully visible blocks (no mask), diagonal blocks
(masked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.paged_attention import common
from pallas_kernels.paged_attention.params import PrefillParams, prefill_params_for


def _prefill_kernel(
    layer_ref,  # i32[1]
    scales_ref,  # f32[2]: [sm_scale * k_scale * log2(e), v_scale]
    tile_b_ref,  # i32[NT]: stream of each tile (B = padding stream), -1 = unused tile
    tile_t0_ref,  # i32[NT]: first token of each tile
    ends_ref,  # i32[B+1]: end token (exclusive) of each stream, then T
    kvl_ref,  # i32[B+1]: kv_len of each stream, then 0
    bt_ref,  # i32[B * MB]: block tables, flattened
    q_ref,  # [T * Hq, D]
    k_ref,  # [L*NB*bs*Hkv, D]
    v_ref,  # [L*NB*bs*Hkv, D]
    o_ref,  # [T * Hq, D]
    *,
    num_tiles: int,
    block_rows: int,
    num_q_heads: int,
    group: int,
    group_pad: int,
    max_blocks: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    block_k: int,
    sliding_window: int | None,
    cdtype,
):
    j = num_tiles - 1 - pl.program_id(0)  # longest tiles first
    h = pl.program_id(1)
    b = tile_b_ref[j]
    bm = block_rows
    d = q_ref.shape[1]

    @pl.when(b >= 0)
    def _():
        layer = layer_ref[0]
        qk_scale = scales_ref[0]
        v_scale = scales_ref[1]
        t0 = tile_t0_ref[j]
        e0 = ends_ref[b]
        kl = kvl_ref[b]
        bq = bm // group_pad
        r = jnp.arange(bm, dtype=jnp.int32)
        tok = t0 + r // group_pad  # i32[BM]
        gi = r % group_pad
        row_valid = (tok < e0) & (gi < group)
        # Masked-out rows point one past the end (never dereferenced on the GPU; interpret mode's
        # scatter drops them instead of letting them collide with a real row).
        qrow = jnp.where(row_valid, tok * num_q_heads + h * group + gi, q_ref.shape[0])
        cols = jnp.arange(d, dtype=jnp.int32)
        q = plgpu_triton.load(q_ref.at[qrow[:, None], cols[None, :]], mask=row_valid[:, None], other=0.0)
        q = q.astype(cdtype)  # [BM, D]
        shift = kl - e0  # position = token index + shift
        pos = tok + shift  # i32[BM]
        p_lo = t0 + shift
        p_hi = jnp.minimum(t0 + bq, e0) - 1 + shift
        k_lo = 0 if sliding_window is None else jnp.maximum(p_lo - sliding_window + 1, 0)
        kb_start = k_lo // block_k
        kb_end = pl.cdiv(p_hi + 1, block_k)
        kb_b = jnp.maximum((p_lo + 1) // block_k, kb_start)  # blocks before kb_b: keys <= p_lo
        if sliding_window is None:
            kb_a = kb_start
        else:  # blocks from kb_a on: keys within the window of every row of the tile
            kb_a = jnp.minimum(jnp.maximum(pl.cdiv(jnp.maximum(p_hi - sliding_window + 1, 0), block_k),
                                           kb_start), kb_b)
        load = functools.partial(
            common.load_kv_rows, bt_ref=bt_ref, bt_base=b * max_blocks, layer=layer, head=h,
            num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, cdtype=cdtype,
        )

        def step(i, carry, masked):
            o, m, l = carry
            key = i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[BK]
            if masked:
                kvalid = (key < kl) & (key >= k_lo)
            else:
                kvalid = jnp.full((block_k,), True)
            k = load(k_ref, tok=key, tok_valid=kvalid)
            v = load(v_ref, tok=key, tok_valid=kvalid)
            s = common.dot(q, k, trans_b=True) * qk_scale  # f32[BM, BK], log2 domain
            if masked:
                vis = kvalid[None, :] & (key[None, :] <= pos[:, None])
                if sliding_window is not None:
                    vis &= pos[:, None] - key[None, :] < sliding_window
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            o = o * alpha[:, None] + common.dot(p.astype(cdtype), v)
            return o, m_new, l

        carry = (
            jnp.zeros((bm, d), jnp.float32),
            jnp.full((bm,), common.NEG_BIG, jnp.float32),
            jnp.zeros((bm,), jnp.float32),
        )
        if sliding_window is not None:
            carry = jax.lax.fori_loop(kb_start, kb_a, functools.partial(step, masked=True), carry)
        carry = jax.lax.fori_loop(kb_a, kb_b, functools.partial(step, masked=False), carry)
        carry = jax.lax.fori_loop(kb_b, kb_end, functools.partial(step, masked=True), carry)
        o, m, l = carry
        nonempty = l > 0.0
        inv_l = jnp.where(nonempty, v_scale / jnp.where(nonempty, l, 1.0), 0.0)
        o = (o * inv_l[:, None]).astype(o_ref.dtype)
        plgpu_triton.store(o_ref.at[qrow[:, None], cols[None, :]], o, mask=row_valid[:, None])



def tile_schedule(cu_seqlens, num_tokens: int, block_q: int):
    """Tiles of <= block_q tokens, each inside one stream; the pad region is stream B.

    cu_seqlens i32[B+1] -> (tile_b i32[NT] with -1 for unused tiles, tile_t0 i32[NT],
    ends i32[B+1], NT) where NT = cdiv(T, block_q) + B + 1 bounds the tile count.
    """
    b = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    starts = cu  # stream b starts at cu[b]; the pad stream B at cu[B]
    ends = jnp.concatenate([cu[1:], jnp.full((1,), num_tokens, jnp.int32)])
    tiles = (jnp.maximum(ends - starts, 0) + block_q - 1) // block_q  # i32[B+1]
    cum = jnp.cumsum(tiles)
    nt = -(-num_tokens // block_q) + b + 1
    j = jnp.arange(nt, dtype=jnp.int32)
    stream = jnp.searchsorted(cum, j, side="right", method="compare_all").astype(jnp.int32)  # > B: unused
    used = stream <= b
    sc = jnp.minimum(stream, b)
    t0 = starts[sc] + (j - (cum[sc] - tiles[sc])) * block_q
    return jnp.where(used, stream, -1), jnp.where(used, t0, 0), ends, nt


def _prefill_call(q, k_pool, v_pool, layer_arr, scales, block_tables, cu_seqlens, kv_lens, *,
                  params: PrefillParams, sliding_window, interpret: bool, poison: bool):
    num_layers, num_blocks, block_size, hkv, d = k_pool.shape
    t, hq, _ = q.shape
    g = hq // hkv
    gp = common.next_pow2(g)
    bm = max(params.block_rows, gp)
    bq = bm // gp
    mb = block_tables.shape[1]
    cdtype = common.compute_dtype(q.dtype, k_pool.dtype)
    tile_b, tile_t0, ends, nt = tile_schedule(cu_seqlens, t, bq)
    kvl = jnp.concatenate([kv_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    rows = num_layers * num_blocks * block_size * hkv
    args = [layer_arr, scales, tile_b, tile_t0, ends, kvl, block_tables.astype(jnp.int32).reshape(-1),
            q.reshape(t * hq, d), k_pool.reshape(rows, d), v_pool.reshape(rows, d)]
    whole = pl.no_block_spec
    in_specs = [whole] * len(args)
    kernel = functools.partial(
        _prefill_kernel, num_tiles=nt, block_rows=bm, num_q_heads=hq, group=g, group_pad=gp,
        max_blocks=mb, num_blocks=num_blocks, block_size=block_size, num_kv_heads=hkv,
        block_k=params.block_k, sliding_window=sliding_window, cdtype=cdtype,
    )
    aliases = {}
    if poison:  # test hook: the output starts as NaN, so unwritten elements show
        aliases[len(args)] = 0
        args.append(common.poison_like((t * hq, d), q.dtype))
        in_specs.append(whole)
        kernel = _drop_poison_input(kernel)
    o = pl.pallas_call(
        kernel,
        grid=(nt, hkv),
        in_specs=in_specs,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((t * hq, d), q.dtype),
        input_output_aliases=aliases,
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="paged_prefill_attention",
    )(*args)
    return o.reshape(t, hq, d)


def _drop_poison_input(kernel):
    def wrapped(*refs):
        return kernel(*refs[:-2], refs[-1])

    return wrapped


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "params", "interpret", "_poison"))
def paged_prefill_attention(
    q,
    k_pool,
    v_pool,
    layer,
    block_tables,
    cu_seqlens,
    kv_lens,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale=None,
    v_scale=None,
    params: PrefillParams | None = None,
    interpret: bool = False,
    _poison: bool = False,
):
    """Causal ragged prefill attention over paged, layer-stacked KV pools.

    Args:
      q: [T, Hq, D] bf16 or f32: the new tokens of B streams, stacked in cu_seqlens order.
      k_pool, v_pool: [L, num_blocks, block_size, Hkv, D] bf16, f32 or float8_e4m3fn, already
        holding the new tokens' keys and values.
      layer: int32 scalar or i32[1] (may be traced).
      block_tables: i32[B, max_blocks]: each stream's pool blocks, in order.
      cu_seqlens: i32[B+1]: prefix sums of new-token counts; tokens >= cu_seqlens[B] are padding.
      kv_lens: i32[B]: keys per stream after this chunk (cached prefix + new tokens); must be
        >= the stream's new-token count. A padded stream has 0 new tokens.
      sm_scale: softmax scale (static).
      sliding_window: keep keys k with position - k < sliding_window; None = full causal.
      k_scale, v_scale: f32 scalars (may be traced) dequantizing a float8_e4m3fn pool.
      params: static `PrefillParams`; None picks the tuned table entry or a heuristic.
      interpret: run the kernel in Pallas interpret mode (CPU).
      _poison: test hook: NaN-fill the kernel's output buffer before it runs.

    Returns:
      [T, Hq, D] in q's dtype; zeros for padding tokens.
    """
    num_layers, num_blocks, block_size, hkv, d = common.check_pools(q, k_pool, v_pool, k_scale, v_scale)
    common.check_ragged(q, block_tables, cu_seqlens, kv_lens, sliding_window)
    if params is None:
        params = prefill_params_for(q.shape[0], q.shape[1], hkv, d, block_size, k_pool.dtype)
    layer_arr, scales = common.pack_scalars(layer, sm_scale, k_scale, v_scale)
    return _prefill_call(q, k_pool, v_pool, layer_arr, scales, block_tables, cu_seqlens, kv_lens,
                         params=params, sliding_window=sliding_window, interpret=interpret, poison=_poison)
