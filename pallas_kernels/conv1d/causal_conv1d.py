"""Depthwise causal conv1d: varlen prefill and the single-step decode update.

Semantics of `naive.py` (transformers' `causal_conv1d_fn` / `causal_conv1d_update` in Qwen3-Next,
causal-conv1d's `causal_conv1d_update_ref`): weights w [C, W], tap W-1 on the current input,

    y_t[c] = bias[c] + sum_{i<W} w[c, i] * x_{t-(W-1)+i}[c],  then silu when `silu`.

Conv state f32[.., C, S]: the last S inputs of a stream, oldest first. Prefill (varlen) uses
S = W-1: inputs before a stream's first token come from its initial state, and the final state
is the stream's last W-1 inputs (reaching into the initial state for streams shorter than W-1).
Decode accepts any S >= W-1 (transformers' own cache keeps S = W; its newest W-1 columns are
this state).

Varlen kernel: grid (max_tiles, C / block_c) over tiles of block_t tokens that never straddle two
streams; tiles of the padded tail [cu_seqlens[-1], T) write zeros. Each tap is a load of block_t
rows shifted back by 0..W-1. A stream's first tile (where shifted rows fall before the stream)
takes a gather path that reads those from the initial state; every other tile uses contiguous
slice loads (the gather path everywhere ran at 0.09 TB/s on the H200).

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU. Why: stream starts are
arbitrary rows, and a tap reads rows before the tile (possibly from another array, the initial
state, with stride W-1 between channels); Triton lowering expresses that as masked pointer
gathers, while Mosaic GPU would need aligned TMA boxes plus a padded copy of x. The kernel is
memory-bound and elementwise, where Triton lowering has no handicap, and it runs unchanged in
`interpret=True` on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class ConvParams:
    """block_t: tokens per tile (varlen only); block_c: channels per program; num_warps: Triton warps."""

    block_t: int = 64
    block_c: int = 256
    num_warps: int = 4


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _pick_block_c(c: int, want: int) -> int:
    b = want
    while b > 1 and c % b:
        b //= 2
    return b


def _check_weights(x, w, bias):
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [rows, C] and w [C, W] with the same C; got {x.shape} and {w.shape}")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"bias must be [C]=({x.shape[1]},); got {bias.shape}")
    if jnp.dtype(x.dtype) not in IN_DTYPES:
        raise ValueError(f"x dtype {x.dtype} must be one of {IN_DTYPES}")
    return x.shape[1], w.shape[1]


def _silu(y):
    return y * jax.nn.sigmoid(y)


def _varlen_kernel(
    start_ref,  # i32[NT]: first token of each tile
    len_ref,  # i32[NT]: tokens in each tile (0 = unused entry)
    sid_ref,  # i32[NT]: stream of each tile (B = the padded tail: writes zeros)
    cu_ref,  # i32[B + 1]
    x_ref,  # [T, C]
    w_ref,  # f32[C, W]
    b_ref,  # f32[C]
    s0_ref,  # f32[B, C, W-1]
    y_ref,  # out [T, C]
    *,
    block_t: int,
    block_c: int,
    width: int,
    num_streams: int,
    silu: bool,
):
    i = pl.program_id(0)
    cb = pl.program_id(1)
    s = start_ref[i]
    n = len_ref[i]
    b = sid_ref[i]

    rows = jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
    cols = cb * block_c + jax.lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
    csl = pl.ds(cb * block_c, block_c)
    full = (block_t, block_c)
    bs = jnp.minimum(b, num_streams - 1)
    pos0 = s - cu_ref[bs]  # position of the tile's first row within its stream
    in_stream = (n > 0) & (b < num_streams)

    def finish(acc):
        if silu:
            acc = _silu(acc)
        y = jnp.where(rows < n, acc, 0.0).astype(y_ref.dtype)
        plgpu_triton.store(y_ref.at[pl.ds(s, block_t), csl], y, mask=jnp.broadcast_to(rows < n, full))

    @pl.when(in_stream & (pos0 >= width - 1))
    def _():  # every tap reads rows of this stream: contiguous slice loads
        acc = jnp.broadcast_to(b_ref[csl][None, :], full)
        for d in range(width):  # shift d uses tap W-1-d
            xd = plgpu_triton.load(x_ref.at[pl.ds(s - d, block_t), csl], mask=jnp.broadcast_to(rows < n, full),
                                   other=0)
            acc = acc + xd.astype(jnp.float32) * w_ref[csl, width - 1 - d][None, :]
        finish(acc)

    @pl.when(in_stream & (pos0 < width - 1))
    def _():  # a stream's first tile: rows before the stream come from its initial state (gathers)
        live = rows < n  # [BT, 1]
        pos = pos0 + rows
        acc = jnp.broadcast_to(b_ref[csl][None, :], full)
        for d in range(width):
            from_x = live & (pos >= d)
            src = jnp.broadcast_to(jnp.maximum(s + rows - d, 0), full)
            xd = plgpu_triton.load(
                x_ref.at[src, jnp.broadcast_to(cols, full)], mask=jnp.broadcast_to(from_x, full), other=0,
            ).astype(jnp.float32)
            if d > 0:
                from_s = live & (pos < d)
                scol = jnp.broadcast_to(jnp.maximum(width - 1 + pos - d, 0), full)
                xd = xd + plgpu_triton.load(
                    s0_ref.at[bs, jnp.broadcast_to(cols, full), scol], mask=jnp.broadcast_to(from_s, full),
                    other=0.0,
                )
            acc = acc + xd * w_ref[csl, width - 1 - d][None, :]
        finish(acc)

    @pl.when((n > 0) & (b >= num_streams))
    def _():  # the padded tail
        zeros = jnp.zeros(full, y_ref.dtype)
        plgpu_triton.store(y_ref.at[pl.ds(s, block_t), csl], zeros, mask=jnp.broadcast_to(rows < n, full))


def tile_table(cu_seqlens, num_tokens: int, block_t: int):
    """Tiles over B streams plus the padded tail as stream B: (start, length, stream), i32[NT] each."""
    num_streams = cu_seqlens.shape[0] - 1
    nt = num_tokens // block_t + num_streams + 1
    bounds = jnp.concatenate([cu_seqlens, jnp.full((1,), num_tokens, jnp.int32)])  # i32[B+2]
    lens = bounds[1:] - bounds[:-1]
    per = (lens + block_t - 1) // block_t
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per).astype(jnp.int32)])
    i = jnp.arange(nt, dtype=jnp.int32)
    b = jnp.sum(first[1:][None, :] <= i[:, None], axis=1).astype(jnp.int32)  # B+1 = unused
    bc = jnp.minimum(b, num_streams)
    start = bounds[bc] + (i - first[bc]) * block_t
    length = jnp.where(b <= num_streams, jnp.clip(bounds[bc + 1] - start, 0, block_t), 0)
    return start.astype(jnp.int32), length.astype(jnp.int32), bc.astype(jnp.int32)


def _final_state(x, cu, s0, width):
    """f32[B, C, W-1]: each stream's last W-1 inputs, reaching into its initial state when short."""
    m = jnp.arange(width - 1, dtype=jnp.int32)
    src = cu[1:, None] - (width - 1) + m[None, :]  # i32[B, W-1]: token index of state column m
    from_x = src >= cu[:-1, None]
    xs = jnp.take(x, jnp.clip(src, 0, x.shape[0] - 1), axis=0).astype(jnp.float32)  # [B, W-1, C]
    scol = jnp.clip(width - 1 + src - cu[:-1, None], 0, width - 2)  # [B, W-1]
    ss = jnp.take_along_axis(s0, scol[:, None, :], axis=2)  # [B, C, W-1]
    return jnp.where(from_x[:, None, :], jnp.swapaxes(xs, 1, 2), ss)


@functools.partial(jax.jit, static_argnames=("silu", "params", "interpret"))
def causal_conv1d_varlen(
    x,  # [T, C]
    w,  # [C, W]
    bias=None,  # [C] or None
    *,
    cu_seqlens,  # i32[B + 1]
    initial_state,  # f32[B, C, W-1]
    silu: bool = True,
    params: ConvParams | None = None,
    interpret: bool = False,
):
    """Varlen depthwise causal conv1d. -> (y [T, C] in x.dtype, final_state f32[B, C, W-1]).

    Tokens at or after cu_seqlens[-1] give 0. A stream of length 0 keeps its initial state.
    """
    c, width = _check_weights(x, w, bias)
    t_len = x.shape[0]
    num_streams = cu_seqlens.shape[0] - 1
    if width < 2:
        raise ValueError(f"kernel width W={width} must be >= 2")
    if initial_state.shape != (num_streams, c, width - 1):
        raise ValueError(f"initial_state must be f32[B, C, W-1]=({num_streams}, {c}, {width - 1}); "
                         f"got {initial_state.shape}")
    params = params or ConvParams()
    if not _is_pow2(params.block_t):
        raise ValueError(f"block_t={params.block_t} must be a power of two")
    block_c = _pick_block_c(c, params.block_c)
    cu = cu_seqlens.astype(jnp.int32)
    s0 = initial_state.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    bf = jnp.zeros((c,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    start, length, sid = tile_table(cu, t_len, params.block_t)
    y = pl.pallas_call(
        functools.partial(
            _varlen_kernel, block_t=params.block_t, block_c=block_c, width=width,
            num_streams=num_streams, silu=silu,
        ),
        out_shape=jax.ShapeDtypeStruct((t_len, c), x.dtype),
        grid=(start.shape[0], c // block_c),
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_varlen",
    )(start, length, sid, cu, x, wf, bf, s0)
    return y, _final_state(x, cu, s0, width)


def _update_kernel(
    x_ref,  # [N, C]
    w_ref,  # f32[C, W]
    b_ref,  # f32[C]
    s_ref,  # f32[N, C, S]
    y_ref,  # out [N, C]
    s_out_ref,  # out f32[N, C, S]
    *,
    block_c: int,
    width: int,
    state_len: int,
    silu: bool,
):
    n = pl.program_id(0)
    cs = pl.ds(pl.program_id(1) * block_c, block_c)
    x = x_ref[n, cs].astype(jnp.float32)  # f32[BC]
    acc = b_ref[cs] + w_ref[cs, width - 1] * x
    for m in range(state_len):  # state column m holds x_{t - S + m}
        col = s_ref[n, cs, m]
        tap = m - state_len + width - 1
        if tap >= 0:
            acc = acc + w_ref[cs, tap] * col
        if m >= 1:
            s_out_ref[n, cs, m - 1] = col
    s_out_ref[n, cs, state_len - 1] = x
    if silu:
        acc = _silu(acc)
    y_ref[n, cs] = acc.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("silu", "params", "interpret"))
def causal_conv1d_update(
    x,  # [N, C]: one new input per row
    conv_state,  # f32[N, C, S], S >= W-1
    w,  # [C, W]
    bias=None,  # [C] or None
    *,
    silu: bool = True,
    params: ConvParams | None = None,
    interpret: bool = False,
):
    """One decode step of the causal conv. -> (y [N, C] in x.dtype, new_state f32[N, C, S])."""
    c, width = _check_weights(x, w, bias)
    n_rows = x.shape[0]
    if conv_state.ndim != 3 or conv_state.shape[:2] != (n_rows, c) or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state must be f32[N, C, S>=W-1]=({n_rows}, {c}, >={width - 1}); "
                         f"got {conv_state.shape}")
    state_len = conv_state.shape[2]
    if state_len < 1:
        raise ValueError("conv_state needs at least one column")
    params = params or ConvParams()
    block_c = _pick_block_c(c, params.block_c)
    bf = jnp.zeros((c,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    return pl.pallas_call(
        functools.partial(_update_kernel, block_c=block_c, width=width, state_len=state_len, silu=silu),
        out_shape=(
            jax.ShapeDtypeStruct((n_rows, c), x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, jnp.float32),
        ),
        grid=(n_rows, c // block_c),
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_update",
    )(x, w.astype(jnp.float32), bf, conv_state.astype(jnp.float32))
