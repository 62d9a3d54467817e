"""Paged GQA decode attention (one new token per row) for the engine's stacked KV pools.

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU (`plgpu.kernel`). Why:
* Keys are gathered token by token through the block table (one gathered load of
  [block_k, D] per step, with a per-token page lookup), which Triton lowering expresses as
  one masked pointer gather and software-pipelines (`num_stages`). In Mosaic GPU every page
  would need its own TMA copy and barrier bookkeeping, and a GQA group (1..16 query heads)
  would fill only 1/64..1/4 of a wgmma's 64 rows.
* fp8 pools are converted in registers after the gather; in Mosaic GPU that needs an extra
  SMEM round trip before wgmma.
* Only a handful of GPU runs were available to this work; Triton lowering can be checked on
  the CPU machine (cross-lowering to the Triton IR) and the interpret mode runs the same code.
* Measured on the H200 (bench/results/paged_attention.md), this Triton kernel already reads
  bf16 pools at 94-99% of a device memcpy, so Mosaic GPU has little to add for bf16 decode;
  fp8 pools (42%) are where a Mosaic GPU / native-fp8 variant would pay.
The Pallas Triton backend is deprecated since jax 0.11 but still the default in 0.11.2; a
Mosaic GPU port becomes necessary when JAX removes it.

Layout: k_pool, v_pool [L, NB, bs, Hkv, D] (bf16, f32 or float8_e4m3fn with per-layer scales),
indexed by `layer` inside the kernel (the pool is viewed as [L*NB*bs*Hkv, D], a free reshape;
a layer is never sliced out). Flat slot = block_id * block_size + offset.

Grid: (N, Hkv, num_splits). A program computes all G = Hq / Hkv query heads of one KV head
(padded to a power of two >= 16 rows for the tensor cores; pad rows are neither read nor
stored, so no XLA pad/slice surrounds the kernel) over one split of the context, with
an online softmax in float32 (exp2 domain). num_splits > 1 is flash-decoding: each split writes
its normalized partial output and log-sum-exp, and a small XLA combine merges them; or, given
`tickets`, the split program of each row and KV head that finishes last merges them in the kernel
(`_merge_splits`), which saves the combine's launch but adds a tail (a barrier, an atomic, the
partials read back) to the last program: at one row (H100, session 52,
bench/kernels/decode_attention_b1.py, 16 splits at max_ctx 4096) 6.29 against 6.60 us a layer at a
128-token context, 13.43 against 11.08 at 2,048, so the engine runs the XLA combine (the
opt-in that threaded tickets through the engine's steps was taken out in session 53).
Rows with seq_len 0 give zeros, never NaN.

Verify windows (`paged_verify_attention`, speculative decoding): a row's 1 + k queries are its
last tokens, so one program takes all of them as (1 + k) x G rows (padded to a power of two),
each masked to the keys up to its own position: the window's keys are read once, as in decode,
where the ragged prefill kernels tile for long chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.paged_attention import common
from pallas_kernels.paged_attention.params import DecodeParams, decode_params_for


def _decode_kernel(
    layer_ref,  # i32[1]
    scales_ref,  # f32[2]: [sm_scale * k_scale * log2(e), v_scale]
    lens_ref,  # i32[N]
    bt_ref,  # i32[N * MB]
    *refs,  # (cu_ref i32[N + 1] when width > 1), q_ref [T * Hq, D], k_ref / v_ref [L*NB*bs*Hkv, D]
    # pools, then the outputs: o [S * T * Hq, D] (q dtype when S == 1, else f32); + lse
    # f32[S * T * Hq] when S > 1 (T = N for decode); + with `merge` the merged output [T * Hq, D]
    # (q dtype) and the tickets i32[Hkv * R] (R >= N rows)
    width: int,
    num_rows: int,
    num_q_heads: int,
    group: int,
    group_pad: int,
    max_blocks: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    block_k: int,
    num_splits: int,
    sliding_window: int | None,
    cdtype,
    head_major: bool,
    heads_inner: bool,
    prefetch: bool,
    merge: bool,
    ticket_rows: int,
    interpret: bool,
):
    if width > 1:
        cu_ref, q_ref, k_ref, v_ref, *out_refs = refs
    else:
        q_ref, k_ref, v_ref, *out_refs = refs
    if heads_inner:  # grid (Hkv, N, S)
        h, n = pl.program_id(0), pl.program_id(1)
    else:  # grid (N, Hkv, S)
        n, h = pl.program_id(0), pl.program_id(1)
    s = pl.program_id(2)
    layer = layer_ref[0]
    qk_scale = scales_ref[0]
    v_scale = scales_ref[1]
    seq_len = lens_ref[n]
    d = q_ref.shape[1]

    # Verify windows (width > 1): row n's queries are tokens cu[n] .. cu[n+1] - 1 (at most
    # `width`), the last ones of its seq_len keys; query j sees the keys up to its own position.
    qlen = cu_ref[n + 1] - cu_ref[n] if width > 1 else 1
    lo = 0 if sliding_window is None else jnp.maximum(seq_len - qlen + 1 - sliding_window, 0)
    blk_lo = lo // block_k
    blk_hi = pl.cdiv(seq_len, block_k)
    per = pl.cdiv(jnp.maximum(blk_hi - blk_lo, 0), num_splits)
    b0 = blk_lo + s * per
    b1 = jnp.minimum(b0 + per, blk_hi)

    # The G query heads of KV head h, padded to Gp >= 16 rows (tensor-core minimum); pad rows
    # read nothing and are never stored.
    gi = jnp.arange(group_pad, dtype=jnp.int32)
    if width > 1:  # rows j * G + g: query j of the window, head g of the group
        qj = gi // group
        row_valid = (gi < width * group) & (qj < qlen)
        qpos = seq_len - qlen + qj  # i32[Gp] each row's position
        qrow = jnp.where(row_valid, (cu_ref[n] + qj) * num_q_heads + h * group + gi % group, q_ref.shape[0])
    else:
        row_valid = gi < group
        qrow = jnp.where(row_valid, n * num_q_heads + h * group + gi, q_ref.shape[0])  # past the end if pad
    cols = jnp.arange(d, dtype=jnp.int32)
    q = plgpu_triton.load(q_ref.at[qrow[:, None], cols[None, :]], mask=row_valid[:, None], other=0.0)
    q = q.astype(cdtype)  # [Gp, D]
    load = functools.partial(
        common.load_kv_rows, bt_ref=bt_ref, bt_base=n * max_blocks, layer=layer, head=h,
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_major=head_major,
    )

    def tokens(i):
        tok = i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[BK]
        return tok, (tok < seq_len) & (tok >= lo) & (i < b1)

    def load_raw(i):  # K, V [BK, D] in the pool dtype
        tok, valid = tokens(i)
        return (load(k_ref, tok=tok, tok_valid=valid, cdtype=None),
                load(v_ref, tok=tok, tok_valid=valid, cdtype=None))

    def step(i, carry, k, v):
        o, m, l = carry
        _, valid = tokens(i)
        k = k.astype(cdtype)
        v = v.astype(cdtype)
        sc = common.dot(q, k, trans_b=True) * qk_scale  # f32[Gp, BK], log2 domain
        if width > 1:  # causal within the window (and each row's own sliding window)
            tok, _ = tokens(i)
            seen = valid[None, :] & (tok[None, :] <= qpos[:, None])
            if sliding_window is not None:
                seen &= tok[None, :] > qpos[:, None] - sliding_window
            sc = jnp.where(seen, sc, -jnp.inf)
        else:
            sc = jnp.where(valid[None, :], sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        o = o * alpha[:, None] + common.dot(p.astype(cdtype), v)
        return o, m_new, l

    o0 = jnp.zeros((group_pad, d), jnp.float32)
    m0 = jnp.full((group_pad,), common.NEG_BIG, jnp.float32)
    l0 = jnp.zeros((group_pad,), jnp.float32)
    if prefetch:
        def body(i, carry):
            acc, (k, v) = carry
            nxt = load_raw(i + 1)  # masked off past b1: reads nothing
            return step(i, acc, k, v), nxt

        (o, m, l), _ = jax.lax.fori_loop(b0, b1, body, ((o0, m0, l0), load_raw(b0)))
    else:
        o, m, l = jax.lax.fori_loop(b0, b1, lambda i, c: step(i, c, *load_raw(i)), (o0, m0, l0))
    nonempty = l > 0.0
    inv_l = jnp.where(nonempty, v_scale / jnp.where(nonempty, l, 1.0), 0.0)
    o = o * inv_l[:, None]
    o_ref = out_refs[0]
    orow = jnp.where(row_valid, s * num_rows + qrow, o_ref.shape[0])
    plgpu_triton.store(o_ref.at[orow[:, None], cols[None, :]], o.astype(o_ref.dtype), mask=row_valid[:, None])
    if num_splits > 1:
        lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), common.NEG_BIG)
        plgpu_triton.store(out_refs[1].at[orow], lse, mask=row_valid)
    if merge:  # (the splits past the row's blocks are empty: `used` of them have keys)
        used = jnp.maximum(pl.cdiv(jnp.maximum(blk_hi - blk_lo, 0), jnp.maximum(per, 1)), 1)
        _merge_splits(out_refs, h * ticket_rows + n, qrow, row_valid, cols, used, num_rows=num_rows,
                      num_splits=num_splits, interpret=interpret)


def _merge_splits(out_refs, slot, qrow, row_valid, cols, used, *, num_rows: int, num_splits: int,
                  interpret: bool, unroll: int = 4):
    """The split program of (row, KV head) `slot` that finishes last merges the first `used` (i32,
    >= 1: the others saw no keys) of the S partials into the final output (what `combine_splits`
    does in XLA, without its launch). Each program takes a ticket from tickets[slot] after its
    partials are stored: the one that draws S - 1 (counting from a multiple of S, zero in the
    engine) is the last, and it takes the S off again once it has merged, so every launch leaves
    the tickets as they came, whatever split count the next launch (the next layer, the next
    step's bucket) runs. The merge reads every split's log-sum-exp at once, then the partials
    `unroll` splits at a time, their loads independent of the sum (volatile: from L2, never a
    stale L1 line)."""
    o_ref, lse_ref, fin_ref, tickets_ref = out_refs
    if not interpret:  # (every warp's partials stored before the ticket; no barrier in interpret mode)
        plgpu_triton.debug_barrier()
    ticket = plgpu_triton.atomic_add(tickets_ref, slot, jnp.int32(1))  # (acquire-release, GPU scope)

    @pl.when(jax.lax.rem(ticket, jnp.int32(num_splits)) == num_splits - 1)
    def _():
        plgpu_triton.atomic_add(tickets_ref, slot, jnp.int32(-num_splits))  # (every split's ticket drawn)
        sidx = jnp.arange(common.next_pow2(num_splits), dtype=jnp.int32)
        lse = plgpu_triton.load(lse_ref.at[sidx[:, None] * num_rows + qrow[None, :]],
                                mask=(sidx < used)[:, None] & row_valid[None, :], other=common.NEG_BIG,
                                volatile=True)  # f32[Sp, Gp]
        m = jnp.max(lse, axis=0)  # (every split empty: m = NEG_BIG, each weight 1 on zeros)
        den = jnp.sum(jnp.exp2(lse - m[None, :]), axis=0)

        def body(j, acc):
            for u in range(unroll):
                sp = j * unroll + u
                live = row_valid & (sp < used)
                ls = plgpu_triton.load(lse_ref.at[sp * num_rows + qrow], mask=live, other=common.NEG_BIG,
                                       volatile=True)  # f32[Gp]
                part = plgpu_triton.load(o_ref.at[(sp * num_rows + qrow)[:, None], cols[None, :]],
                                         mask=live[:, None], other=0.0, volatile=True)  # f32[Gp, D]
                acc = acc + jnp.exp2(ls - m)[:, None] * part
            return acc

        acc = jax.lax.fori_loop(0, pl.cdiv(used, unroll), body,
                                jnp.zeros((qrow.shape[0], cols.shape[0]), jnp.float32))
        out = (acc / den[:, None]).astype(fin_ref.dtype)
        frow = jnp.where(row_valid, qrow, fin_ref.shape[0])
        plgpu_triton.store(fin_ref.at[frow[:, None], cols[None, :]], out, mask=row_valid[:, None])


def combine_splits(o_parts, lse_parts):
    """o_parts f32[S, ...rows, D] (each normalized), lse_parts f32[S, ...rows] (log2) -> f32[...rows, D]."""
    m = jnp.max(lse_parts, axis=0)
    w = jnp.exp2(lse_parts - m[None])  # empty splits (lse = NEG_BIG) get weight 0 next to a real one
    return jnp.sum(w[..., None] * o_parts, axis=0) / jnp.sum(w, axis=0)[..., None]


def _group_rows(width: int, group: int) -> int:
    """Rows one program takes: a window's `width` queries of each of the KV head's `group` query
    heads, padded to a power of two >= 16 (the tensor cores' minimum)."""
    return max(16, common.next_pow2(width * group))


def _decode_call(q, k_pool, v_pool, layer_arr, scales, block_tables, seq_lens, *, params: DecodeParams,
                 sliding_window, interpret: bool, poison: bool, head_major: bool = False,
                 cu_seqlens=None, width: int = 1, tickets=None):
    if head_major:  # [L, NB, Hkv, bs, D]: a layout the bench compares against; not public
        num_layers, num_blocks, hkv, block_size, d = k_pool.shape
    else:
        num_layers, num_blocks, block_size, hkv, d = k_pool.shape
    t, hq, _ = q.shape  # (T = N for decode)
    n, mb = block_tables.shape
    g = hq // hkv
    gp = _group_rows(width, g)
    cdtype = common.compute_dtype(q.dtype, k_pool.dtype)
    rows = num_layers * num_blocks * block_size * hkv
    ns = params.num_splits
    if ns == 1:
        out_shape = [jax.ShapeDtypeStruct((t * hq, d), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((ns * t * hq, d), jnp.float32),
                     jax.ShapeDtypeStruct((ns * t * hq,), jnp.float32)]
    merge = tickets is not None and ns > 1  # (one split: nothing to merge, the tickets pass through)
    if merge:  # + the merged output and the tickets (aliased: updated in place)
        out_shape += [jax.ShapeDtypeStruct((t * hq, d), q.dtype), jax.ShapeDtypeStruct((tickets.size,), jnp.int32)]
    args = [layer_arr, scales, seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1)]
    if width > 1:
        args.append(cu_seqlens.astype(jnp.int32))
    args += [q.reshape(t * hq, d), k_pool.reshape(rows, d), v_pool.reshape(rows, d)]
    num_args = len(args)  # (the aliased inputs after them reach the kernel only as its outputs)
    aliases = {}
    if merge:
        aliases[len(args)] = len(out_shape) - 1
        args.append(tickets.reshape(-1))
    kernel = functools.partial(
        _decode_kernel, width=width, num_rows=t * hq, num_q_heads=hq, group=g, group_pad=gp, max_blocks=mb,
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=hkv, block_k=params.block_k,
        num_splits=ns, sliding_window=sliding_window, cdtype=cdtype, head_major=head_major,
        heads_inner=params.heads_inner, prefetch=params.prefetch, merge=merge,
        ticket_rows=0 if tickets is None else tickets.shape[1], interpret=interpret,
    )
    if poison:  # test hook: outputs start as NaN (aliased inputs), so unwritten elements show
        for i, shp in enumerate(out_shape[:-1] if merge else out_shape):  # (not the tickets: aliased already)
            aliases[len(args)] = i
            args.append(common.poison_like(shp.shape, shp.dtype))
    if len(args) > num_args:
        kernel = _drop_inputs(kernel, num_args, len(args) - num_args)
    whole = pl.no_block_spec
    outs = pl.pallas_call(
        kernel,
        grid=(hkv, n, ns) if params.heads_inner else (n, hkv, ns),
        in_specs=[whole] * len(args),
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(*args)
    if merge:
        o, tickets = outs[2], outs[3].reshape(tickets.shape)
    elif ns == 1:
        o = outs[0]
    else:
        o = combine_splits(outs[0].reshape(ns, t * hq, d), outs[1].reshape(ns, t * hq)).astype(q.dtype)
    o = o.reshape(t, hq, d)
    if width > 1:  # tokens past the last window (the bucket's padding) are never written: zeros
        o = jnp.where((jnp.arange(t) < cu_seqlens[-1])[:, None, None], o, 0).astype(q.dtype)
    return o if tickets is None else (o, tickets)


# The largest query tile (rows x head_dim) a verify program takes: the GPU tests (session 21)
# cover 64 rows x 128 (a group of 16, width 3) and 32 x 256 (Qwen3-Next's group of 8, width 3);
# larger windows go to the ragged prefill kernel, whose query tiles do not grow with the group.
VERIFY_MAX_TILE = 64 * 128


def verify_supports(q, k_pool, width: int) -> bool:
    """Whether `paged_verify_attention` takes verify windows of `width` tokens for q [T, Hq, D]
    over pools [L, NB, bs, Hkv, D]: one program's rows (`_group_rows`) times D fit its tile."""
    return width >= 2 and _group_rows(width, q.shape[1] // k_pool.shape[-2]) * q.shape[-1] <= VERIFY_MAX_TILE


@functools.partial(jax.jit, static_argnames=("width", "sm_scale", "sliding_window", "params", "interpret", "_poison"))
def paged_verify_attention(
    q,
    k_pool,
    v_pool,
    layer,
    block_tables,
    cu_seqlens,
    kv_lens,
    *,
    width: int,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale=None,
    v_scale=None,
    params: DecodeParams | None = None,
    interpret: bool = False,
    _poison: bool = False,
):
    """Attention of speculative verify windows: the decode kernel with the queries of each row's
    window (at most `width`, its last token and drafts) as extra rows of its GQA group, causal
    within the window. The arguments of `paged_prefill_attention` (a verify step's ragged
    metadata: q [T, Hq, D], block_tables i32[N, MB], cu_seqlens i32[N + 1], kv_lens i32[N]), with
    every stream at most `width` (static) tokens long, the last of its kv_lens keys. Pad tokens
    (past cu_seqlens[-1]) give zeros. -> [T, Hq, D] in q's dtype."""
    num_layers, num_blocks, block_size, hkv, d = common.check_pools(q, k_pool, v_pool, k_scale, v_scale)
    common.check_ragged(q, block_tables, cu_seqlens, kv_lens, sliding_window)
    if width < 2:
        raise ValueError(f"{width=} must be >= 2 (a verify window: the last token and >= 1 draft)")
    n = block_tables.shape[0]
    if params is None:
        params = decode_params_for(n, q.shape[1], hkv, d, block_size, k_pool.dtype,
                                   block_tables.shape[1] * block_size)
    layer_arr, scales = common.pack_scalars(layer, sm_scale, k_scale, v_scale)
    return _decode_call(q, k_pool, v_pool, layer_arr, scales, block_tables, kv_lens, params=params,
                        sliding_window=sliding_window, interpret=interpret, poison=_poison,
                        cu_seqlens=cu_seqlens, width=width)


def _drop_inputs(kernel, start: int, count: int):
    """Kernel wrapper that ignores the refs start .. start + count - 1 (aliased inputs, after the
    kernel's own: the kernel writes them as its outputs)."""

    def wrapped(*refs):
        return kernel(*refs[:start], *refs[start + count:])

    return wrapped


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "params", "interpret", "_poison"))
def paged_decode_attention(
    q,
    k_pool,
    v_pool,
    layer,
    block_tables,
    seq_lens,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale=None,
    v_scale=None,
    params: DecodeParams | None = None,
    tickets=None,
    interpret: bool = False,
    _poison: bool = False,
):
    """Decode attention over paged, layer-stacked KV pools.

    Args:
      q: [N, Hq, D] bf16 or f32, one query token per row.
      k_pool, v_pool: [L, num_blocks, block_size, Hkv, D] bf16, f32 or float8_e4m3fn.
      layer: int32 scalar or i32[1] (may be traced): which layer of the pools to read.
      block_tables: i32[N, max_blocks]: the pool blocks of each row, in order.
      seq_lens: i32[N]: keys per row, its new token included; 0 marks a padded row (output 0).
      sm_scale: softmax scale (static).
      sliding_window: keep keys k with (seq_len - 1) - k < sliding_window; None = full context.
      k_scale, v_scale: f32 scalars (may be traced) dequantizing a float8_e4m3fn pool.
      params: static `DecodeParams`; None picks the tuned table entry or a heuristic.
      tickets: i32[Hkv, R] (R >= N) or None: with more than one split the kernel merges the splits
        itself (the last split program of each row and KV head to finish), in place of the XLA combine
        after it, counting in tickets[head, row]: zeros (or multiples of the split count), updated in
        place and left as they came, so one buffer serves every layer and step; heads first, so tensor
        parallelism would shard it with the pools. With one split they pass through untouched.
      interpret: run the kernel in Pallas interpret mode (CPU).
      _poison: test hook: NaN-fill the kernel's output buffers before it runs.

    Returns:
      [N, Hq, D] in q's dtype; with `tickets`, (that, the updated tickets).
    """
    num_layers, num_blocks, block_size, hkv, d = common.check_pools(q, k_pool, v_pool, k_scale, v_scale)
    if q.ndim != 3:
        raise ValueError(f"q must be [N, Hq, D]; got {q.shape}")
    n = q.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != n or seq_lens.shape != (n,):
        raise ValueError(f"block_tables {block_tables.shape} / seq_lens {seq_lens.shape} must be [{n}, MB] / [{n}]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 or None")
    if params is None:
        params = decode_params_for(n, q.shape[1], hkv, d, block_size, k_pool.dtype,
                                   block_tables.shape[1] * block_size)
    if tickets is not None and (tickets.ndim != 2 or tickets.shape[0] != hkv or tickets.shape[1] < n
                                or tickets.dtype != jnp.int32):
        raise ValueError(f"tickets {tickets.shape} {tickets.dtype} must be int32[Hkv={hkv}, >= N={n}]")
    layer_arr, scales = common.pack_scalars(layer, sm_scale, k_scale, v_scale)
    return _decode_call(q, k_pool, v_pool, layer_arr, scales, block_tables, seq_lens, params=params,
                        sliding_window=sliding_window, interpret=interpret, poison=_poison, tickets=tickets)
