"""Varlen chunked prefill of the gated delta rule (Qwen3-Next's Gated DeltaNet).

Same semantics as `naive.naive_gated_delta_rule` (transformers' `torch_chunk_gated_delta_rule`),
computed chunk by chunk as in FLA's `chunk_gated_delta_rule`: within a chunk of C tokens, with
gc the in-chunk cumulative log decay and Gamma[i, j] = exp(gc_i - gc_j),

    A   = (I + strict_lower(diag(beta) K K^T * Gamma))^-1          (WY / UT transform, f32)
    W   = A (diag(beta e^gc) K)      U = A (diag(beta) V)          (kernel 1, parallel over chunks)
    V'  = U - W S                                                   (kernel 2, sequential per stream)
    O   = scale * ((Q e^gc) S + causal(Q K^T * Gamma) V')
    S  <- e^{gc_last} S + (K e^{gc_last - gc})^T V'

Layout: tokens of B streams are stacked along T and delimited by `cu_seqlens` (no per-stream
padding, a chunk never straddles two streams); state f32[B, HV, K, V] (transformers' layout).
Tokens at or after cu_seqlens[-1] produce zeros and touch no state. Grouped value heads: value
head hv reads q/k head hv // (HV // H).

Kernels:
1. `_prepare_kernel`, grid (max_chunks, HV): per chunk and value head, the in-chunk cumsum of g,
   the UT matrix inverted blockwise (16-row diagonal blocks by forward substitution, the rest by
   f32 block dots, as FLA's solve_tril), and W [T, HV, K], U [T, HV, V].
2. `_scan_kernel`, grid (B + 1, HV, V / block_v): per stream and value head, the state block
   f32[K, block_v] stays in registers across the stream's chunks; each chunk writes its outputs.
   Program B zero-fills the padded tail [cu_seqlens[-1], T).
Dot operands are bf16/f16 when the inputs are (f32 accumulate, as FLA), ieee f32 when they are f32.

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU (`plgpu.kernel`). Why:
* Chunks start at arbitrary token offsets (cu_seqlens need not be multiples of C); Triton
  lowering expresses that as masked pointer loads at a dynamic row offset. Mosaic GPU's TMA
  copies need aligned, in-bounds boxes, so it would need a padded copy of q/k/v per stream.
* The forward substitution extracts one row per step with masked reductions over 16x16
  register tiles; Mosaic GPU's register layouts (WGMMA fragments) do not support those
  axis-0 reductions and broadcasts without SMEM round trips.
* This work had two short GPU runs; Triton-lowered kernels run unchanged in `interpret=True`
  on the CPU, and their Triton IR can be produced on the CPU machine (no GPU needed).
The Pallas Triton backend is deprecated since jax 0.11 but still the default in 0.11.2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.gated_delta import common
from pallas_kernels.gated_delta.params import ChunkParams, chunk_params_for

SUB = 16  # rows of the diagonal blocks of the blocked UT inverse


def _unit_lower_inverse(blocks):
    """(I + a_d)^-1 for a tuple of strictly lower-triangular f32[SUB, SUB] tiles, by forward substitution.

    All tiles advance together, one row per step (SUB - 1 steps).
    """
    n = blocks[0].shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    col_ids = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)

    def body(i, xs):
        sel = rows == i
        out = []
        for a, x in zip(blocks, xs):
            a_i = jnp.sum(jnp.where(sel, a, 0.0), axis=0)  # f32[SUB]: row i of a
            row = jnp.where(col_ids == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * x, axis=0)  # e_i - a_i x
            out.append(jnp.where(sel, row[None, :], x))
        return tuple(out)

    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)
    return jax.lax.fori_loop(1, n, body, tuple(eye for _ in blocks))


def _prepare_kernel(
    start_ref,  # i32[NC]: first token of each chunk
    len_ref,  # i32[NC]: tokens in each chunk (0 = unused table entry)
    k_ref,  # [T, H*K]
    v_ref,  # [T, HV*V]
    g_ref,  # f32[T, HV]
    beta_ref,  # f32[T, HV]
    w_ref,  # out [T, HV*K] (cdtype)
    u_ref,  # out [T, HV*V] (cdtype)
    gc_ref,  # out f32[T, HV]: in-chunk cumulative g
    *,
    chunk: int,
    dk: int,
    dv: int,
    group: int,
    use_qk_l2norm: bool,
    cdtype,
):
    """Blocked WY transform of one chunk, in NB = chunk / SUB row blocks of SUB tokens.

    A = strict_lower(diag(beta) K K^T * Gamma) in blocks A_ij [SUB, SUB] (i >= j); the inverse
    X = (I + A)^-1 is block lower-triangular: X_ii by forward substitution (all NB together),
    X_ij = -X_ii sum_{j <= m < i} A_im X_mj (f32 dots). Then W_i = sum_j X_ij (beta e^gc K)_j and
    U_i = sum_j X_ij (beta V)_j.
    """
    c = pl.program_id(0)
    hv = pl.program_id(1)
    h = hv // group
    s = start_ref[c]
    n = len_ref[c]
    nb = chunk // SUB

    @pl.when(n > 0)
    def _():
        r1 = jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
        r2 = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
        c2 = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
        ks, kcs, vbs, gcs, betas, masks = [], [], [], [], [], []
        offset = jnp.float32(0.0)
        for i in range(nb):
            rows = pl.ds(s + i * SUB, SUB)
            m = r1 + i * SUB < n
            kt = plgpu_triton.load(k_ref.at[rows, pl.ds(h * dk, dk)], mask=m[:, None], other=0)
            kt = kt.astype(jnp.float32)
            if use_qk_l2norm:
                kt = common.l2norm_rows(kt)
            vt = plgpu_triton.load(v_ref.at[rows, pl.ds(hv * dv, dv)], mask=m[:, None], other=0)
            gt = plgpu_triton.load(g_ref.at[rows, hv], mask=m, other=0.0).astype(jnp.float32)
            bt = plgpu_triton.load(beta_ref.at[rows, hv], mask=m, other=0.0).astype(jnp.float32)
            gc = offset + jnp.sum(jnp.where(r2 >= c2, gt[None, :], 0.0), axis=1)  # f32[SUB]
            offset = offset + jnp.sum(gt)
            ks.append(kt)
            kcs.append(kt.astype(cdtype))
            vbs.append((vt.astype(jnp.float32) * bt[:, None]).astype(cdtype))
            gcs.append(gc)
            betas.append(bt)
            masks.append(m)

        def a_block(i, j):  # f32[SUB, SUB]
            blk = common.dot(kcs[i], kcs[j], trans_b=True) * betas[i][:, None]
            diff = gcs[i][:, None] - gcs[j][None, :]
            if i == j:
                strict = r2 > c2
                return jnp.where(strict, blk * jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
            return blk * jnp.exp(diff)

        a = {(i, j): a_block(i, j) for i in range(nb) for j in range(i + 1)}
        diag = _unit_lower_inverse(tuple(a[(i, i)] for i in range(nb)))
        x = {(i, i): diag[i] for i in range(nb)}
        for i in range(1, nb):
            for j in range(i - 1, -1, -1):
                acc = common.dot(a[(i, j)], x[(j, j)])
                for m in range(j + 1, i):
                    acc = acc + common.dot(a[(i, m)], x[(m, j)])
                x[(i, j)] = -common.dot(x[(i, i)], acc)
        kbs = [(ks[j] * (betas[j] * jnp.exp(gcs[j]))[:, None]).astype(cdtype) for j in range(nb)]
        for i in range(nb):
            rows = pl.ds(s + i * SUB, SUB)
            w = sum(common.dot(x[(i, j)].astype(cdtype), kbs[j]) for j in range(i + 1))  # f32[SUB, K]
            u = sum(common.dot(x[(i, j)].astype(cdtype), vbs[j]) for j in range(i + 1))  # f32[SUB, V]
            m2 = masks[i][:, None]
            plgpu_triton.store(w_ref.at[rows, pl.ds(hv * dk, dk)], w.astype(w_ref.dtype), mask=m2)
            plgpu_triton.store(u_ref.at[rows, pl.ds(hv * dv, dv)], u.astype(u_ref.dtype), mask=m2)
            plgpu_triton.store(gc_ref.at[rows, hv], gcs[i], mask=masks[i])


def _scan_kernel(
    cu_ref,  # i32[B + 1]
    q_ref,  # [T, H*K]
    k_ref,  # [T, H*K]
    w_ref,  # [T, HV*K]
    u_ref,  # [T, HV*V]
    gc_ref,  # f32[T, HV]
    h0_ref,  # f32[B, HV, K, V]
    o_ref,  # out [T, HV*V]
    ht_ref,  # out f32[B, HV, K, V]
    *,
    chunk: int,
    dk: int,
    dv: int,
    block_v: int,
    group: int,
    num_streams: int,
    num_tokens: int,
    scale: float,
    use_qk_l2norm: bool,
    cdtype,
):
    b = pl.program_id(0)
    hv = pl.program_id(1)
    j = pl.program_id(2)
    h = hv // group
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    vcol = hv * dv + j * block_v

    @pl.when(b < num_streams)
    def _():
        bos = cu_ref[b]
        eos = cu_ref[b + 1]
        r2 = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        c2 = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        causal = r2 >= c2

        def body(c, state):  # state f32[K, block_v]
            s = bos + c * chunk
            n = eos - s
            rmask = rows < n
            m2 = rmask[:, None]
            qt = plgpu_triton.load(q_ref.at[pl.ds(s, chunk), pl.ds(h * dk, dk)], mask=m2, other=0)
            kt = plgpu_triton.load(k_ref.at[pl.ds(s, chunk), pl.ds(h * dk, dk)], mask=m2, other=0)
            qt = qt.astype(jnp.float32)
            kt = kt.astype(jnp.float32)
            if use_qk_l2norm:
                qt = common.l2norm_rows(qt)
                kt = common.l2norm_rows(kt)
            wt = plgpu_triton.load(w_ref.at[pl.ds(s, chunk), pl.ds(hv * dk, dk)], mask=m2, other=0)
            ut = plgpu_triton.load(u_ref.at[pl.ds(s, chunk), pl.ds(vcol, block_v)], mask=m2, other=0)
            gc = plgpu_triton.load(gc_ref.at[pl.ds(s, chunk), hv], mask=rmask, other=0.0)
            g_last = jnp.sum(jnp.where(rows == jnp.minimum(n, chunk) - 1, gc, 0.0))
            sc = state.astype(cdtype)
            v_new = ut.astype(jnp.float32) - common.dot(wt.astype(cdtype), sc)  # f32[C, BV]
            vc = v_new.astype(cdtype)
            qs = qt * scale
            attn = common.dot(qs.astype(cdtype), kt.astype(cdtype), trans_b=True)  # f32[C, C]
            attn = jnp.where(causal, attn * jnp.exp(jnp.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
            o = common.dot((qs * jnp.exp(gc)[:, None]).astype(cdtype), sc) + common.dot(attn.astype(cdtype), vc)
            plgpu_triton.store(o_ref.at[pl.ds(s, chunk), pl.ds(vcol, block_v)], o.astype(o_ref.dtype), mask=m2)
            kd = (kt * jnp.exp(g_last - gc)[:, None]).astype(cdtype)  # rows past n are 0
            return state * jnp.exp(g_last) + common.dot(kd, vc, trans_a=True)

        h0 = h0_ref[b, hv, :, pl.ds(j * block_v, block_v)]
        ht = jax.lax.fori_loop(0, pl.cdiv(eos - bos, chunk), body, h0)
        ht_ref[b, hv, :, pl.ds(j * block_v, block_v)] = ht

    @pl.when(b == num_streams)
    def _():
        tail0 = cu_ref[num_streams]

        def zero(c, carry):
            s = tail0 + c * chunk
            m2 = (rows < num_tokens - s)[:, None]
            zeros = jnp.zeros((chunk, block_v), o_ref.dtype)
            plgpu_triton.store(o_ref.at[pl.ds(s, chunk), pl.ds(vcol, block_v)], zeros, mask=m2)
            return carry

        jax.lax.fori_loop(0, pl.cdiv(num_tokens - tail0, chunk), zero, 0)


def chunk_table(cu_seqlens, num_tokens: int, chunk: int):
    """Chunk starts and lengths, i32[NC] each, NC = T // chunk + B (an upper bound); unused entries have length 0."""
    num_streams = cu_seqlens.shape[0] - 1
    nc = num_tokens // chunk + num_streams
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    per = (lens + chunk - 1) // chunk  # i32[B]
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per).astype(jnp.int32)])  # i32[B+1]
    i = jnp.arange(nc, dtype=jnp.int32)
    b = jnp.sum(first[1:][None, :] <= i[:, None], axis=1).astype(jnp.int32)  # stream of chunk i (B = none)
    bc = jnp.minimum(b, num_streams - 1)
    start = cu_seqlens[bc] + (i - first[bc]) * chunk
    length = jnp.where(b < num_streams, jnp.clip(cu_seqlens[bc + 1] - start, 0, chunk), 0)
    return start.astype(jnp.int32), length.astype(jnp.int32)


def chunk_prepare(start, length, k2, v2, g, beta, *, chunk, dk, dv, group, use_qk_l2norm, cdtype, num_warps,
                  interpret):
    """Kernel 1 over the chunk table. -> (w [T, HV*K], u [T, HV*V] in cdtype, gc f32[T, HV])."""
    t_len, hv = g.shape
    return pl.pallas_call(
        functools.partial(
            _prepare_kernel, chunk=chunk, dk=dk, dv=dv, group=group, use_qk_l2norm=use_qk_l2norm, cdtype=cdtype,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((t_len, hv * dk), cdtype),
            jax.ShapeDtypeStruct((t_len, hv * dv), cdtype),
            jax.ShapeDtypeStruct((t_len, hv), jnp.float32),
        ),
        grid=(start.shape[0], hv),
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_prepare",
    )(start, length, k2, v2, g, beta)


def chunk_scan(cu, q2, k2, w, u, gc, initial_state, *, chunk, dk, dv, group, scale, use_qk_l2norm, cdtype,
               out_dtype, params: ChunkParams, interpret):
    """Kernel 2 over (B + 1, HV, V / block_v). -> (o [T, HV*V] in out_dtype, final_state f32[B, HV, K, V])."""
    t_len, hv = gc.shape
    num_streams = initial_state.shape[0]
    block_v = params.block_v
    return pl.pallas_call(
        functools.partial(
            _scan_kernel, chunk=chunk, dk=dk, dv=dv, block_v=block_v, group=group,
            num_streams=num_streams, num_tokens=t_len, scale=scale, use_qk_l2norm=use_qk_l2norm,
            cdtype=cdtype,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((t_len, hv * dv), out_dtype),
            jax.ShapeDtypeStruct(initial_state.shape, jnp.float32),
        ),
        grid=(num_streams + 1, hv, dv // block_v),
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps_main, num_stages=params.num_stages),
        interpret=interpret,
        name="gdn_chunk_scan",
    )(cu, q2, k2, w, u, gc, initial_state)



@functools.partial(
    jax.jit, static_argnames=("scale", "use_qk_l2norm", "chunk_size", "params", "interpret")
)
def chunk_gated_delta_rule(
    q,  # [T, H, K]
    k,  # [T, H, K]
    v,  # [T, HV, V]
    g,  # f32[T, HV]: log decay (<= 0)
    beta,  # f32[T, HV]
    *,
    cu_seqlens,  # i32[B + 1], nondecreasing, cu_seqlens[0] = 0, cu_seqlens[-1] <= T
    initial_state,  # f32[B, HV, K, V]
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    params: ChunkParams | None = None,
    interpret: bool = False,
):
    """Varlen chunked gated delta rule. -> (o [T, HV, V] in q.dtype, final_state f32[B, HV, K, V]).

    scale defaults to K ** -0.5. use_qk_l2norm normalizes q and k inside the kernels (as
    transformers' use_qk_l2norm_in_kernel). A stream of length 0 keeps its initial state.
    """
    t_len, h, hv, dk, dv = common.check_inputs(q, k, v, g, beta, initial_state, rows_name="T")
    if cu_seqlens.ndim != 1 or initial_state.shape[0] != cu_seqlens.shape[0] - 1:
        raise ValueError(
            f"cu_seqlens must be i32[B+1] with B = initial_state.shape[0] = {initial_state.shape[0]}; "
            f"got {cu_seqlens.shape}"
        )
    if not common.is_pow2(chunk_size) or chunk_size < 16:
        raise ValueError(f"{chunk_size=} must be a power of two >= 16")
    cdtype = common.compute_dtype(q.dtype, k.dtype, v.dtype)
    if params is None:
        params = chunk_params_for(h, hv, dk, dv, cdtype.name, initial_state.shape[0])
    block_v = params.block_v
    if dv % block_v or not common.is_pow2(block_v) or block_v < 16:
        raise ValueError(f"block_v={block_v} must be a power of two >= 16 dividing V={dv}")
    scale = float(dk**-0.5 if scale is None else scale)
    group = hv // h
    cu = cu_seqlens.astype(jnp.int32)

    q2 = q.reshape(t_len, h * dk)
    k2 = k.reshape(t_len, h * dk)
    v2 = v.reshape(t_len, hv * dv)
    g = g.astype(jnp.float32)
    beta = beta.astype(jnp.float32)
    start, length = chunk_table(cu, t_len, chunk_size)

    w, u, gc = chunk_prepare(
        start, length, k2, v2, g, beta, chunk=chunk_size, dk=dk, dv=dv, group=group,
        use_qk_l2norm=use_qk_l2norm, cdtype=cdtype, num_warps=params.num_warps_prepare, interpret=interpret,
    )
    o, ht = chunk_scan(
        cu, q2, k2, w, u, gc, initial_state, chunk=chunk_size, dk=dk, dv=dv, group=group, scale=scale,
        use_qk_l2norm=use_qk_l2norm, cdtype=cdtype, out_dtype=q.dtype, params=params, interpret=interpret,
    )
    return o.reshape(t_len, hv, dv), ht
