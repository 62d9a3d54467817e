"""Mosaic GPU (Hopper: TMA + wgmma) twin of `paged_prefill_attention` (prefill.py).

Same arguments, semantics and output as `paged_prefill_attention`: B streams stack their new
tokens in q [T, Hq, D] (`cu_seqlens i32[B+1]`); the new tokens of stream b are the LAST
cu[b+1] - cu[b] of its `kv_lens[b]` keys and attend causally (optionally within a sliding
window) to keys read through the stream's own block table, never past its kv_len's page.
Tokens at or after cu[B] are padding and give zeros.

Restrictions (a `ValueError` says which; the caller can fall back to the Triton kernel):
* q and both pools bfloat16 (no fp8 pools, so no k_scale / v_scale);
* head_dim 64 or 128; block_size 16, 32 or 64 with params.block_k a multiple of it;
* GQA group G = Hq / Hkv a power of two with block_m / G >= 8 (G <= 8 at block_m 64,
  G <= 16 at block_m 128).

Kernel (`plgpu.kernel`, Lane lowering semantics, grid (tiles, Hkv)):
* A compute warpgroup's tile is block_m // G consecutive tokens (bq) of ONE stream times the G
  query heads of one KV head (a CTA has num_compute_wgs of them, 1 by default). Rows are
  ordered (head-in-group, token): row r is token r % bq of query head h * G + r // bq, so the
  Q tile arrives as G TMA copies of [bq, D] (row stride Hq * D) into a swizzled [block_m, D] SMEM
  tile, and one wgmma of M = block_m serves the whole group.
* K/V tiles of block_k tokens are assembled from pages: one TMA copy per page of
  k_pool[layer, page, :, h, :] ([block_size, D], row stride Hkv * D), each with its own
  barrier, into a num_stages-deep ring of K and V buffers. With one warpgroup per CTA it refills
  a slot itself right after its wgmma has read it; with num_compute_wgs == 2 (FlashAttention-3
  style warp specialization) two compute warpgroups share the ring and a third warpgroup only
  issues TMA, refilling a slot once both released it (k_free / v_free barriers). Pages past the stream's last page are
  replaced by its last page (never read another stream's or an unowned block); keys past
  kv_len are masked in S and their V rows zeroed in SMEM on the (single) step that holds them,
  so unwritten pool slots (even NaN) never leak in.
* S = Q K^T (wgmma, f32), online softmax in f32 registers in the exp2 domain, P cast to bf16
  explicitly and fed to the PV wgmma from registers (or from SMEM with params.p_in_smem,
  which interpret mode forces: its wgmma reads both operands from memory).
  Keys are visited in three phases as in prefill.py: window-edge steps (masked), fully
  visible steps (no mask), diagonal steps (masked).
* The output goes registers -> SMEM -> GMEM: one TMA store per head of the group for a full
  tile, or one TMA store per valid row (under pl.when) for a tile that starts or ends inside its
  stream (tiles sit on a grid of whole CTA windows: TMA copies Q in 8-row tiles, `_grid_tiles`).

The tile schedule (a few tiny XLA ops on cu_seqlens / kv_lens) is precomputed in the wrapper
into i32[NT, 16], so the kernel only reads scalars.

Status (2026-11-30): the engine's GPU prefill attention where it applies
(`AttentionConfig.mosaic_prefill`; `supports` says where). On the H200, 4x2048 tokens, Hq 32 /
Hkv 8, D 128: 268-295 TFLOP/s without a cache and 428 with 4096 cached tokens, 0.66-0.73x /
0.69-0.73x cuDNN on the equivalent dense problems and 1.2-1.5x the Triton kernel
(bench/results/session4_2026-11-30.md); gpu tests compare it with the reference and the Triton
kernel. The warp-specialized variant (num_compute_wgs=2, the default) deadlocks the CPU
interpreter on 2 host cores (its blocking barrier waits starve XLA's host-callback threads), so
interpret mode runs one compute warpgroup. Not done: overlapping the next step's QK wgmma with
this step's softmax (FA3's intra-warpgroup pipelining), a persistent grid.

bf16 note: jax 0.11.2's bundled attention_mgpu fails with bf16 ("Expected dtypes to match but
src had type bfloat16 and dst had type float16") because its SMEM scratch is hard-coded
float16; here every SMEM buffer takes q's dtype and the P / output casts are explicit.

Interpret mode (`interpret=True`) runs the same kernel on the CPU through
`plgpu.InterpretGPUParams` (simulated SMEM, TMA, barriers, wgmma), with uninitialized memory
NaN-filled, so outputs the kernel forgets to write show as NaN (`_poison` is implied there; the
compiled kernel cannot alias a poisoned output buffer, so `_poison` is a no-op on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import common

_BF16 = jnp.dtype(jnp.bfloat16)

# Columns of the per-tile schedule i32[NT, _NCOL].
_B, _QS, _T0, _E0, _KL, _POS0, _KLO, _KB0, _KBA, _KBB, _KBE = range(11)
_NCOL = 16


@dataclasses.dataclass(frozen=True)
class PrefillMgpuParams:
    """Static tuning of `paged_prefill_attention_mgpu`.

    block_m: query rows per CTA, counted as (head-in-group, token) pairs: 64 or 128 (one
      warpgroup; the wgmma runs M = block_m).
    block_k: KV tokens per inner step (64 or 128), a multiple of the pool's block_size.
    num_stages: depth of the K/V TMA ring (>= 2).
    p_in_smem: feed P to the PV wgmma from SMEM instead of registers (forced in interpret mode).
    num_compute_wgs: 1 = one warpgroup per CTA computes and issues its own TMA copies; 2 = two
      compute warpgroups (block_m rows each, 2 * block_m // G tokens per CTA) share the K/V ring
      that a third, TMA-only warpgroup fills (warp specialization, as FlashAttention-3).
    """

    block_m: int = 64
    block_k: int = 64
    num_stages: int = 2
    p_in_smem: bool = False
    num_compute_wgs: int = 1

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"{self.block_m=} must be 64 or 128")
        if self.block_k not in (64, 128):
            raise ValueError(f"{self.block_k=} must be 64 or 128")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be >= 2")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"{self.num_compute_wgs=} must be 1 or 2")


def check_supported(q, k_pool, v_pool, params: PrefillMgpuParams, k_scale=None, v_scale=None):
    """Raises ValueError unless this kernel supports the problem; returns (L, NB, bs, Hkv, D, G)."""
    num_layers, num_blocks, block_size, hkv, d = common.check_pools(q, k_pool, v_pool, k_scale, v_scale)
    if jnp.dtype(q.dtype) != _BF16 or jnp.dtype(k_pool.dtype) != _BF16:
        raise ValueError(f"mgpu prefill supports bfloat16 q and pools only; got {q.dtype} / {k_pool.dtype}")
    if d not in (64, 128):
        raise ValueError(f"mgpu prefill supports head_dim 64 or 128; got {d}")
    if block_size not in (16, 32, 64) or params.block_k % block_size:
        raise ValueError(f"mgpu prefill needs block_size 16/32/64 dividing block_k {params.block_k}; "
                         f"got block_size {block_size}")
    g = q.shape[-2] // hkv
    if g & (g - 1) or params.block_m // g < 8:
        raise ValueError(f"mgpu prefill needs a power-of-two GQA group with block_m / group >= 8; "
                         f"got group {g}, block_m {params.block_m}")
    return num_layers, num_blocks, block_size, hkv, d, g


def _grid_tiles(cu_seqlens, num_tokens: int, tile: int):
    """Tiles on the grid of multiples of `tile`, each inside one stream; the pad region is stream B.

    TMA copies Q in 8-row tiles, so a tile's Q window must start at a multiple of 8 (a copy
    from an unaligned row silently lands rows of the aligned window: seen on the H200). A stream
    [s, e) gets the windows [a + k * tile, a + (k + 1) * tile) from a = floor(s / tile) * tile
    that overlap it; rows of a window outside the stream are computed and not stored.
    num_tokens must be a multiple of tile. Returns (tile_b i32[NT] (-1 = unused), tile_t0
    i32[NT] (first token of the stream in the window), tile_qs i32[NT] (window start), ends
    i32[B+1], NT) with NT = num_tokens / tile + 2 (B + 1) bounding the count.
    """
    b = cu_seqlens.shape[0] - 1
    starts = cu_seqlens.astype(jnp.int32)  # the pad stream B starts at cu[B]
    ends = jnp.concatenate([starts[1:], jnp.full((1,), num_tokens, jnp.int32)])  # i32[B+1]
    first = starts // tile * tile  # i32[B+1] first window of each stream
    tiles = jnp.where(ends > starts, (ends - first + tile - 1) // tile, 0)  # i32[B+1]
    cum = jnp.cumsum(tiles)
    nt = num_tokens // tile + 2 * (b + 1)
    j = jnp.arange(nt, dtype=jnp.int32)
    stream = jnp.searchsorted(cum, j, side="right", method="compare_all").astype(jnp.int32)  # > B: unused
    used = stream <= b
    sc = jnp.minimum(stream, b)
    qs = first[sc] + (j - (cum[sc] - tiles[sc])) * tile
    t0 = jnp.maximum(qs, starts[sc])
    return jnp.where(used, stream, -1), jnp.where(used, t0, 0), jnp.where(used, qs, 0), ends, nt


def _schedule(cu_seqlens, kv_lens, num_tokens: int, bq: int, block_k: int, sliding_window):
    """Per-tile scalars i32[NT, _NCOL] (see the column names above) and NT; bq = tokens per CTA.

    The pad region [cu[B], T) is one more stream with kv_len 0 (its tiles write zeros);
    unused tiles have b = -1.
    """
    tile_b, t0, qs, ends, nt = _grid_tiles(cu_seqlens, num_tokens, bq)  # i32[NT] x 3, i32[B+1]
    kvl = jnp.concatenate([kv_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])  # i32[B+1]
    bc = jnp.maximum(tile_b, 0)
    e0 = ends[bc]
    kl = kvl[bc]
    ntok = jnp.maximum(jnp.minimum(qs + bq - t0, e0 - t0), 1)  # the stream's tokens in the window
    shift = kl - e0  # position = token index + shift
    p_lo = t0 + shift
    p_hi = t0 + ntok - 1 + shift
    if sliding_window is None:
        k_lo = jnp.zeros_like(p_lo)
    else:
        k_lo = jnp.maximum(p_lo - sliding_window + 1, 0)
    live = (tile_b >= 0) & (kl > 0)
    p_lo = jnp.maximum(p_lo, 0)
    p_hi = jnp.maximum(p_hi, 0)
    kb0 = k_lo // block_k
    kbe = (p_hi + block_k) // block_k  # cdiv(p_hi + 1, block_k)
    kbb = jnp.clip((p_lo + 1) // block_k, kb0, kbe)  # steps before kbb: keys <= p_lo, no mask
    if sliding_window is None:
        kba = kb0
    else:  # steps from kba on: every key inside every row's window
        first_full = (jnp.maximum(p_hi - sliding_window + 1, 0) + block_k - 1) // block_k
        kba = jnp.clip(first_full, kb0, kbb)
    zero = jnp.zeros_like(kb0)
    kb0, kba, kbb, kbe = (jnp.where(live, x, zero) for x in (kb0, kba, kbb, kbe))
    cols = [tile_b, qs, t0, e0, kl, qs + shift, k_lo, kb0, kba, kbb, kbe]
    cols += [zero] * (_NCOL - len(cols))
    return jnp.stack(cols, axis=1).astype(jnp.int32), nt


def _kernel(
    sched_ref,  # i32[NT, _NCOL]: per-tile scalars
    layer_ref,  # i32[1]: layer * num_blocks (first pool row of the layer)
    bt_ref,  # i32[B, MB]: block tables
    q_ref,  # bf16[T, Hq, D]
    k_ref,  # bf16[L * NB, bs, Hkv, D]
    v_ref,  # bf16[L * NB, bs, Hkv, D]
    o_ref,  # bf16[T, Hq, D] (output)
    q_smem,  # bf16[W, M, D] swizzled (one [M, D] tile per compute warpgroup)
    k_smem,  # bf16[S, BK, D] swizzled
    v_smem,  # bf16[S, BK, D] swizzled
    p_smem,  # bf16[W, M, BK] swizzled, or None
    o_smem,  # bf16[W, M, D] plain
    q_bar,  # W * G barriers
    k_bar,  # S * ppt barriers (TMA)
    v_bar,  # S * ppt barriers (TMA)
    k_free,  # S barriers with W arrivals (K slot consumed), None when W == 1
    v_free,  # S barriers with W arrivals (V slot consumed), None when W == 1
    zero_bar,  # 1 barrier: compute warpgroup 0 zeroed the V tail, None when W == 1
    *,
    num_tiles: int,
    group: int,
    bq: int,
    block_m: int,
    block_k: int,
    block_size: int,
    num_stages: int,
    num_wgs: int,
    sm_scale_log2: float,
    sliding_window: int | None,
    accumulate_in_place: bool,
):
    j = num_tiles - 1 - lax.axis_index("tile")  # longest tiles first
    h = lax.axis_index("head")
    b = sched_ref[j, _B]
    ppt = block_k // block_size  # pages per K/V step
    d = q_ref.shape[-1]
    f32 = jnp.float32
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    specialized = num_wgs > 1  # W compute warpgroups + 1 TMA warpgroup

    @pl.when(b >= 0)
    def _():
        qs = sched_ref[j, _QS]
        t0 = sched_ref[j, _T0]
        e0 = sched_ref[j, _E0]
        kl = sched_ref[j, _KL]
        pos0 = sched_ref[j, _POS0]  # position of the tile's first SMEM row token
        k_lo = sched_ref[j, _KLO]
        kb0 = sched_ref[j, _KB0]
        kba = sched_ref[j, _KBA]
        kbb = sched_ref[j, _KBB]
        kbe = sched_ref[j, _KBE]
        nsteps = kbe - kb0
        layer_row = layer_ref[0]
        last_page = jnp.maximum(kl - 1, 0) // block_size

        def blocks(kb):  # pool blocks of step kb's ppt pages: scalar GMEM loads (i32 each)
            # Pages past the stream's last one re-read its last page (never an unowned block).
            return [bt_ref[b, jnp.minimum(kb * ppt + p, last_page)] for p in range(ppt)]

        def issue(pool_ref, smem, bar, kb, slot, blks=None):
            blks = blocks(kb) if blks is None else blks
            for p, blk in enumerate(blks):
                plgpu.copy_gmem_to_smem(pool_ref.at[layer_row + blk, :, h, :],
                                        smem.at[slot, pl.ds(p * block_size, block_size)],
                                        bar.at[slot * ppt + p])

        def wait(bar, slot):
            for p in range(ppt):
                plgpu.barrier_wait(bar.at[slot * ppt + p])

        def prologue():
            for s in range(num_stages):
                @pl.when(s < nsteps)
                def _(s=s):
                    issue(k_ref, k_smem, k_bar, kb0 + s, s)
                    issue(v_ref, v_smem, v_bar, kb0 + s, s)

        def compute(w):  # w: this compute warpgroup (0 when W == 1); its rows are tokens qs + w * bq ...
            qw = qs + w * bq
            q_w, o_w = q_smem.at[w], o_smem.at[w]
            p_w = None if p_smem is None else p_smem.at[w]
            for g in range(group):  # Q: G copies of [bq, D] (query head h * G + g)
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(qw, bq), h * group + g], q_w.at[pl.ds(g * bq, bq)],
                                        q_bar.at[w * group + g])
            if not specialized:
                prologue()
            for g in range(group):
                plgpu.barrier_wait(q_bar.at[w * group + g])

            def step(kb, carry, *, masked: bool):
                o, m, l = carry  # f32[M, D], f32[M], f32[M]
                i = kb - kb0
                slot = lax.rem(i, num_stages)
                # The refill's block ids are loaded now and used after the QK wgmma, which hides
                # their global-load latency (one warpgroup: it issues its own refills).
                nxt = None if specialized else blocks(kb + num_stages)
                wait(k_bar, slot)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_w, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return acc_ref[...]

                def release(free, pool_ref, smem, bar):  # this step is done with its `smem` slot
                    if specialized:  # the TMA warpgroup refills it once every compute warpgroup arrived
                        plgpu.barrier_arrive(free.at[slot])
                    else:
                        @pl.when(i + num_stages < nsteps)
                        def _():
                            issue(pool_ref, smem, bar, kb + num_stages, slot, nxt)

                s = pl.run_scoped(qk, plgpu.ACC((block_m, block_k), f32))  # f32[M, BK]
                release(k_free, k_ref, k_smem, k_bar)

                s = s * sm_scale_log2  # log2 domain
                if masked:
                    row = plgpu.broadcasted_iota(jnp.int32, (block_m, block_k), 0, layout=wgmma_layout)
                    col = plgpu.broadcasted_iota(jnp.int32, (block_m, block_k), 1, layout=wgmma_layout)
                    pos = lax.rem(row, bq) + (pos0 + w * bq)
                    key = col + kb * block_k
                    vis = (key <= pos) & (key < kl)
                    if sliding_window is not None:
                        vis = vis & (key >= k_lo) & (pos - key < sliding_window)
                    s = jnp.where(vis, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
                p16 = p.astype(q_smem.dtype)  # explicit bf16 P for the PV wgmma
                wait(v_bar, slot)
                if masked:
                    # The step holding kv_len: V rows at or past it may be unwritten (NaN in tests);
                    # P is 0 there but 0 * NaN is not, so zero them in SMEM (one warpgroup does it).
                    def zero_tail():
                        vs = v_smem.at[slot]
                        vrow = plgpu.broadcasted_iota(jnp.int32, (block_k, d), 0, layout=wgmma_layout)
                        vals = vs[...]
                        vs[...] = jnp.where(vrow + kb * block_k < kl, vals, jnp.zeros_like(vals))
                        plgpu.commit_smem()

                    @pl.when((kb + 1) * block_k > kl)
                    def _():
                        if not specialized:
                            zero_tail()
                        else:
                            @pl.when(w == 0)
                            def _():
                                zero_tail()
                                plgpu.barrier_arrive(zero_bar.at[0])

                            @pl.when(w != 0)
                            def _():
                                plgpu.barrier_wait(zero_bar.at[0])

                if p_w is not None:
                    p_w[...] = p16
                    plgpu.commit_smem()
                    a = p_w
                else:
                    a = p16
                if accumulate_in_place:  # o += P V inside the wgmma accumulator
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, a, v_smem.at[slot])

                    o = pl.run_state(pv)(plgpu.ACC.init(o))
                else:  # interpret mode does not run wgmma inside run_state: fresh accumulator, then add
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, a, v_smem.at[slot])
                        return acc_ref[...]

                    o = o + pl.run_scoped(pv, plgpu.ACC((block_m, d), f32))
                release(v_free, v_ref, v_smem, v_bar)

                return o, m_new, l

            carry = (
                plgpu.layout_cast(jnp.full((block_m, d), 0.0, f32), wgmma_layout),
                plgpu.layout_cast(jnp.full((block_m,), common.NEG_BIG, f32), row_layout),
                plgpu.layout_cast(jnp.full((block_m,), 0.0, f32), row_layout),
            )
            if sliding_window is not None:
                carry = lax.fori_loop(kb0, kba, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(kba, kbb, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(kbb, kbe, functools.partial(step, masked=True), carry)
            o, _, l = carry
            nonempty = l > 0.0
            inv_l = jnp.where(nonempty, 1.0 / jnp.where(nonempty, l, 1.0), 0.0)
            o = o * lax.broadcast_in_dim(inv_l, o.shape, [0])
            o_w[...] = o.astype(o_w.dtype)
            plgpu.commit_smem()

            full = (qs == t0) & (qw + bq <= e0)

            @pl.when(full)
            def _():
                for g in range(group):
                    plgpu.copy_smem_to_gmem(o_w.at[pl.ds(g * bq, bq)], o_ref.at[pl.ds(qw, bq), h * group + g])

            @pl.when(jnp.logical_not(full))
            def _():
                @pl.loop(0, block_m)
                def _(r):
                    tok = qw + lax.rem(r, bq)

                    @pl.when((tok >= t0) & (tok < e0))
                    def _():
                        plgpu.copy_smem_to_gmem(o_w.at[pl.ds(r, 1)],
                                                o_ref.at[pl.ds(tok, 1), h * group + lax.div(r, bq)])

            plgpu.wait_smem_to_gmem(0)

        if not specialized:
            compute(0)
            return
        wg = lax.axis_index("wg")

        @pl.when(wg < num_wgs)
        def _():
            plgpu.set_max_registers(232, action="increase")
            compute(wg)

        @pl.when(wg == num_wgs)
        def _():  # TMA warpgroup: refills a slot once every compute warpgroup has consumed it
            plgpu.set_max_registers(40, action="decrease")
            prologue()

            @pl.loop(num_stages, jnp.maximum(nsteps, num_stages))
            def _(i):
                slot = lax.rem(i, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                issue(k_ref, k_smem, k_bar, kb0 + i, slot)
                plgpu.barrier_wait(v_free.at[slot])
                issue(v_ref, v_smem, v_bar, kb0 + i, slot)

            # Observe the last consumptions too: every barrier phase is waited for (interpret mode
            # checks that at deallocation; on the GPU this only idles the TMA warpgroup).
            @pl.loop(jnp.maximum(nsteps - num_stages, 0), nsteps)
            def _(i):
                slot = lax.rem(i, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "params", "interpret", "_poison"))
def paged_prefill_attention_mgpu(
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
    params: PrefillMgpuParams | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    _poison: bool = False,
):
    """Causal ragged prefill attention over paged, layer-stacked KV pools (Mosaic GPU).

    Args (as `paged_prefill_attention`, within the restrictions in the module docstring):
      q: bf16[T, Hq, D]: the new tokens of B streams, stacked in cu_seqlens order.
      k_pool, v_pool: bf16[L, num_blocks, block_size, Hkv, D], already holding the new keys/values.
      layer: int32 scalar or i32[1] (may be traced).
      block_tables: i32[B, max_blocks]: each stream's pool blocks, in order.
      cu_seqlens: i32[B+1]: prefix sums of new-token counts; tokens >= cu_seqlens[B] are padding.
      kv_lens: i32[B]: keys per stream after this chunk (cached prefix + new tokens).
      sm_scale: softmax scale (static).
      sliding_window: keep keys k with position - k < sliding_window; None = full causal.
      k_scale, v_scale: must be None (bf16 pools only).
      params: static `PrefillMgpuParams`; None = defaults for the shape.
      interpret: True runs on the CPU under `plgpu.InterpretGPUParams(uninitialized_memory="nan")`;
        an `InterpretGPUParams` instance (e.g. with detect_races=True) is used as given.
      _poison: accepted for parity with `paged_prefill_attention` (see the module docstring).

    Returns:
      bf16[T, Hq, D]; zeros for padding tokens.
    """
    del _poison
    common.check_ragged(q, block_tables, cu_seqlens, kv_lens, sliding_window)
    if params is None:
        params = default_params(q.shape[-2], k_pool.shape[-2], k_pool.shape[2])
        if interpret is not False:  # warp specialization starves the CPU interpreter's threads
            params = dataclasses.replace(params, num_compute_wgs=1)
    num_layers, num_blocks, block_size, hkv, d, g = check_supported(q, k_pool, v_pool, params, k_scale, v_scale)
    t, hq, _ = q.shape
    bm, bk, stages = params.block_m, params.block_k, params.num_stages
    nw = params.num_compute_wgs
    bq = bm // g  # tokens per compute warpgroup; a CTA tile holds nw * bq tokens
    tp = -(-t // (nw * bq)) * nw * bq  # whole CTA windows (a multiple of TMA's 8-row tiling)
    qp = q if tp == t else jnp.pad(q, ((0, tp - t), (0, 0), (0, 0)))  # bf16[Tp, Hq, D]
    sched, nt = _schedule(cu_seqlens, kv_lens, tp, nw * bq, bk, sliding_window)  # i32[NT, 16]
    layer_row = (jnp.asarray(layer, jnp.int32).reshape(1) * num_blocks).astype(jnp.int32)  # i32[1]
    kp = k_pool.reshape(num_layers * num_blocks, block_size, hkv, d)  # bf16[L*NB, bs, Hkv, D]
    vp = v_pool.reshape(num_layers * num_blocks, block_size, hkv, d)
    interpret = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else bool(interpret)
    p_in_smem = params.p_in_smem or interpret is not False
    swz = plgpu.SwizzleTransform(128)
    tiled = (plgpu.TilingTransform((8, 128 // q.dtype.itemsize)), swz)
    ppt = bk // block_size
    spec = nw > 1
    scratch = [
        plgpu.SMEM((nw, bm, d), q.dtype, transforms=tiled),  # q
        plgpu.SMEM((stages, bk, d), q.dtype, transforms=tiled),  # k ring
        plgpu.SMEM((stages, bk, d), q.dtype, transforms=tiled),  # v ring
        plgpu.SMEM((nw, bm, bk), q.dtype, transforms=tiled) if p_in_smem else None,  # p
        plgpu.SMEM((nw, bm, d), q.dtype),  # o staging (plain: single rows are TMA-stored)
        plgpu.Barrier(num_barriers=nw * g),  # q
        plgpu.Barrier(num_barriers=stages * ppt),  # k landed
        plgpu.Barrier(num_barriers=stages * ppt),  # v landed
        plgpu.Barrier(num_arrivals=nw, num_barriers=stages) if spec else None,  # k slot free
        plgpu.Barrier(num_arrivals=nw, num_barriers=stages) if spec else None,  # v slot free
        plgpu.Barrier(num_barriers=1) if spec else None,  # V tail zeroed
    ]
    body = functools.partial(
        _kernel, num_tiles=nt, group=g, bq=bq, block_m=bm, block_k=bk, block_size=block_size,
        num_stages=stages, num_wgs=nw, sm_scale_log2=float(sm_scale * common.LOG2E), sliding_window=sliding_window,
        accumulate_in_place=interpret is False,
    )
    kw = dict(num_threads=nw + 1, thread_name="wg") if spec else {}
    if isinstance(interpret, plgpu.InterpretGPUParams):
        kw["interpret"] = interpret
    elif interpret:
        kw["interpret"] = plgpu.InterpretGPUParams(uninitialized_memory="nan")
    else:
        kw["compiler_params"] = plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tp, hq, d), q.dtype),
        scratch_types=scratch,
        grid=(nt, hkv),
        grid_names=("tile", "head"),
        kernel_name="paged_prefill_attention_mgpu",
        **kw,
    )(sched, layer_row, block_tables.astype(jnp.int32), qp, kp, vp)
    return out if tp == t else out[:t]


def default_params(hq: int, hkv: int, block_size: int) -> PrefillMgpuParams:
    """The H200 sweep's winner (bench/results/, 4x2048 tokens, Hq 32 / Hkv 8, D 128, with and
    without 4096 cached tokens): 64 query rows per warpgroup, two compute warpgroups fed by a TMA
    warpgroup, block_k 128, two stages. A GQA group of 16 needs 128 rows, and then block_k 64
    keeps the SMEM (Q, K/V ring, O staging) within the 227 KB."""
    g = hq // max(hkv, 1)
    bm = 64 if g <= 8 else 128
    return PrefillMgpuParams(block_m=bm, block_k=128 if bm == 64 else 64, num_stages=2, num_compute_wgs=2)


def supports(q, k_pool, v_pool, params: PrefillMgpuParams | None = None) -> bool:
    """Whether this kernel takes the problem (else the caller uses the Triton kernel)."""
    if params is None:
        params = default_params(q.shape[-2], k_pool.shape[-2], k_pool.shape[2])
    try:
        check_supported(q, k_pool, v_pool, params)
    except ValueError:
        return False
    return True
