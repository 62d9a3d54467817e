"""Grouped GEMM for MoE experts, in Mosaic GPU (Hopper: TMA + wgmma): the contract of
`jax.lax.ragged_dot`.

    y[r] = x[r] @ w[g(r)]   for rows r in group g (groups are consecutive row ranges),
    y[r] = 0                for rows past sum(group_sizes).

Why Mosaic GPU and not a Triton-lowered `pallas_call`: the kernel is a pipelined TMA + wgmma
loop with data-dependent tile origins, which Mosaic GPU expresses directly, and all of it runs
in Mosaic GPU interpret mode on the CPU (`plgpu.InterpretGPUParams`: TMA, barriers, wgmma), so
CI checks the kernel itself. The pipeline has inputs only (its output goes out by explicit TMA
stores), which is the form interpret mode supports.

The algorithm (as in megablox, jax's `ragged_dot_mgpu` and tokamax's SM90 kernel):
* The wrapper computes, with a few small XLA ops, a task list i32[4, num_tasks]: each task is
  one row tile of one group. A group's tiles start at its first row rounded down to a multiple
  of 8 (`_ALIGN`) and step by block_m, so a tile may hold rows of the neighbouring groups; the
  task records its group, the tile's first row, and the offset and count of the rows it owns.
  num_tasks is a static bound (about cdiv(M, block_m) + E + 1); spare tasks own no rows.
* Rows past sum(group_sizes) form one more pseudo-group whose tiles skip the matmul and store
  zeros, so every output row is written exactly once and no zero-fill pass is needed.
* Static grid: num_tasks x cdiv(N, block_n) CTAs (flattened; `grid_minor` picks the order). A
  CTA reads its task, runs an `emit_pipeline` over K (x tile [block_m, block_k] at the task's
  row, w tile [block_k, block_n] of its group; TMA zero-fills past M, K and N), accumulates in
  f32 with wgmma, and stores its owned rows from SMEM by TMA in power-of-two row pieces (TMA
  boxes are static), the way `ragged_dot_mgpu` does. Columns past N are clipped by TMA.

Tiled (swizzled) TMA views each GMEM array as whole tiles, so M must be a multiple of 8 and K
and N multiples of 64 (one 128-byte swizzle tile of bf16). MoE shapes are (hidden and expert
sizes are multiples of 64, M = tokens * top_k); other shapes are zero-padded by the wrapper, a
copy of x and w that is correct but not fast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul.params import SMEM_LIMIT, GroupedMatmulParams, grouped_matmul_params_for

_ALIGN = 8  # a group's first tile starts at its first row rounded down to this
_TILE = 64  # K and N are padded to multiples of this (the 128-byte swizzle of bf16)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUT_DTYPES = _DTYPES + (jnp.dtype(jnp.float32),)


def num_tasks_bound(m: int, num_groups: int, block_m: int) -> int:
    """Static bound on the row tiles of all groups plus the zero pseudo-group.

    A group of s > 0 rows whose start lies r < _ALIGN rows past an aligned row needs
    cdiv(s + r, block_m) <= (s + block_m + _ALIGN - 2) / block_m tiles; sum over E + 1 groups.
    """
    return max(1, (m + (num_groups + 1) * (block_m + _ALIGN - 2)) // block_m)


def task_table(group_sizes, m: int, block_m: int, m_valid: int | None = None):
    """group_sizes i32[E] -> i32[4, num_tasks]: per task (group, tile row0, own offset, own rows).

    m: rows of the (padded) output; m_valid <= m: rows that groups may own (default m). Group E
    is the pseudo-group of rows past sum(group_sizes) (its tiles store zeros). Negative sizes
    count as 0; group rows past m_valid are cut off (ragged_dot's result has M rows).
    """
    num_groups = group_sizes.shape[0]
    n_tasks = num_tasks_bound(m, num_groups, block_m)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)  # i32[E]
    ends = jnp.minimum(jnp.cumsum(sizes), m if m_valid is None else m_valid)  # i32[E]
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # i32[E+1]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # i32[E+1]
    first_row = (starts // _ALIGN) * _ALIGN  # i32[E+1]
    tiles = jnp.where(ends > starts, -(-(ends - first_row) // block_m), 0)  # i32[E+1]
    tile_end = jnp.cumsum(tiles)  # i32[E+1]: the first task past each group
    t = jnp.arange(n_tasks, dtype=jnp.int32)  # i32[T]
    g = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)  # i32[T]; E+1 for spares
    gc = jnp.minimum(g, num_groups)
    row0 = first_row[gc] + block_m * (t - (tile_end[gc] - tiles[gc]))
    own0 = jnp.maximum(row0, starts[gc])
    own1 = jnp.minimum(row0 + block_m, ends[gc])
    rows = jnp.where(g <= num_groups, jnp.maximum(own1 - own0, 0), 0)
    return jnp.stack([gc, jnp.where(rows > 0, row0, 0), own0 - row0, rows]).astype(jnp.int32)


def _body(meta_gmem, x_gmem, w_gmem, o_gmem, *, m, k, num_groups, n_tiles, params: GroupedMatmulParams):
    """meta_gmem i32[4, T], x_gmem [M, K], w_gmem [E, K, N], o_gmem [M, N]."""
    bm, bn, bk = params.block_m, params.block_n, params.block_k
    pid = jax.lax.axis_index("t")
    if params.grid_minor == "n":
        ti, ni = pid // n_tiles, pid % n_tiles
    else:
        num_tasks = meta_gmem.shape[1]
        ti, ni = pid % num_tasks, pid // num_tasks
    g = meta_gmem[0, ti]
    row0 = pl.multiple_of(meta_gmem[1, ti], _ALIGN)
    own0 = meta_gmem[2, ti]
    rows = meta_gmem[3, ti]

    @pl.when(rows > 0)
    def _task():
        def acc_scope(acc_ref):
            @pl.when(g < num_groups)  # the pseudo-group past sum(group_sizes) keeps acc = 0
            def _matmul():
                def step(_, x_smem, w_smem):
                    plgpu.wgmma(acc_ref, x_smem, w_smem)
                    plgpu.wgmma_wait(1)  # one wgmma in flight; delay_release=1 keeps its tiles

                plgpu.emit_pipeline(
                    step,
                    grid=(pl.cdiv(k, bk),),
                    in_specs=[
                        plgpu.BlockSpec((pl.Element(bm), bk), lambda kk: (row0, kk), delay_release=1),
                        plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1),
                    ],
                    max_concurrent_steps=params.num_stages,
                )(x_gmem, w_gmem.at[g])

            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))  # f32[BM, BN]

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), o_gmem.dtype))
        def _store(o_smem):
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            # TMA boxes are static: store the owned rows [own0, own0 + rows) of the tile in
            # power-of-two pieces, largest first (the binary digits of `rows`).
            off = own0
            size = 1 << (min(bm, m).bit_length() - 1)
            while size:

                @pl.when(rows & size != 0)
                def _piece(off=off, size=size):
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[pl.ds(off, size)], o_gmem.at[pl.ds(row0 + off, size), pl.ds(ni * bn, bn)]
                    )

                off = off + (rows & size)
                size //= 2
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check(x, w, group_sizes, out_dtype):
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_matmul: x must be [M, K] and w [E, K, N]; got {x.shape} and {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        got = f"{group_sizes.dtype}{group_sizes.shape}"
        raise ValueError(f"grouped_matmul: group_sizes must be int[E={w.shape[0]}]; got {got}")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype) or jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"grouped_matmul: x and w must share a 16-bit float dtype; got {x.dtype} and {w.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"grouped_matmul: preferred_element_type must be one of {_OUT_DTYPES}; got {out_dtype}")


@functools.partial(jax.jit, static_argnames=("params", "interpret", "preferred_element_type"))
def grouped_matmul(
    x,
    w,
    group_sizes,
    *,
    params: GroupedMatmulParams | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    preferred_element_type=None,
):
    """x [M, K] @ w [E, K, N] by groups of rows -> [M, N] (the semantics of jax.lax.ragged_dot).

    x and w: bfloat16 (or float16), the same dtype. group_sizes int[E]: rows of each group, in
    order; rows past sum(group_sizes) give zeros, and sum(group_sizes) > M is cut off at M.
    preferred_element_type: the output dtype (x's dtype, or float32); accumulation is float32.
    params: static tuning (None: the tuned table, else a heuristic). interpret: run in Mosaic
    GPU interpret mode on the CPU (True, or an `InterpretGPUParams`, e.g. with detect_races).
    """
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    _check(x, w, group_sizes, out_dtype)
    m, k = x.shape
    num_groups, _, n = w.shape
    if params is None:
        params = grouped_matmul_params_for(m, k, n, num_groups, x.dtype, out_dtype)
    smem = params.smem_bytes(x.dtype.itemsize, out_dtype.itemsize)
    if smem > SMEM_LIMIT:
        raise ValueError(f"grouped_matmul: {params} needs {smem} bytes of shared memory > {SMEM_LIMIT}")
    # Tiled TMA takes whole tiles of GMEM: zero-pad M to a multiple of 8 and K, N to multiples
    # of 64 where needed (padded rows own no group; padded columns are sliced off).
    m_pad, k_pad, n_pad = -m % _ALIGN, -k % _TILE, -n % _TILE
    if m_pad or k_pad:
        x = jnp.pad(x, ((0, m_pad), (0, k_pad)))
    if k_pad or n_pad:
        w = jnp.pad(w, ((0, 0), (0, k_pad), (0, n_pad)))
    mp, kp, np_ = m + m_pad, k + k_pad, n + n_pad

    meta = task_table(group_sizes, mp, params.block_m, m)  # i32[4, T]
    n_tiles = pl.cdiv(np_, params.block_n)
    body = functools.partial(
        _body, m=mp, k=kp, num_groups=num_groups, n_tiles=n_tiles, params=params
    )
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(meta.shape[1] * n_tiles,),
        grid_names=("t",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
        kernel_name="grouped_matmul_mgpu",
    )(meta, x, w)
    return out[:m, :n] if m_pad or n_pad else out
