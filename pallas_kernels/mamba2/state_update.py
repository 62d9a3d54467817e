"""Mamba-2 selective-state update (one decode token per row), in place on a state pool.

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU. Why: each row reads and writes
its state through a slot index loaded inside the kernel (the pool is updated in place, pad rows
with slot -1 skip), which Triton lowering expresses as a plain dynamic-offset load/store; Mosaic
GPU has no scalar-prefetch/dynamic-index path in its CPU interpret mode (DESIGN.md section 3),
and only two short GPU runs were available to this work. The kernel is a pure streaming one
(read + write the f32 state once, no matmul), so it needs nothing Triton lacks.

Per (row r, head h, block of headdim rows), with slot = state_indices[r]:
    dt    = clamp(softplus(dt_raw[r, h] + dt_bias[h]))      (the clamp is optional: transformers'
                                                             single-step path has none)
    state = state * exp(dt * A[h]) + (dt * x[r, h, :])[:, None] * B[r, g, None, :]
    y     = state @ C[r, g] + D[h] * x[r, h, :]
where g = h // (H // G). The whole math runs in f32 (transformers' torch path computes dt*B and
the output in the model dtype: bf16 models differ from it by that rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.mamba2.params import StateUpdateParams, _is_pow2, check_mixer_inputs, state_update_params_for
from pallas_kernels.mamba2.reference import softplus_dt

Array = jax.Array


def _ssu_kernel(
    idx_ref,  # i32[R]
    x_ref,  # [R, H, P]
    dt_ref,  # f32[R, H] (softplus'd, clamped)
    a_ref,  # f32[H]
    b_ref,  # [R, G, N]
    c_ref,  # [R, G, N]
    d_ref,  # f32[H]
    s_in_ref,  # f32[S, H, P, N]
    y_ref,  # [R, H, P] (out)
    s_out_ref,  # f32[S, H, P, N] (out, aliased to s_in)
    *,
    heads_per_group: int,
    block_p: int,
):
    r = pl.program_id(0)
    h = pl.program_id(1)
    pb = pl.program_id(2)
    g = h // heads_per_group
    p_sl = pl.ds(pl.multiple_of(pb * block_p, block_p), block_p)
    slot = idx_ref[r]

    @pl.when(slot >= 0)
    def _update():
        x = x_ref[r, h, p_sl].astype(jnp.float32)  # [bp]
        dt = dt_ref[r, h]
        bm = b_ref[r, g, :].astype(jnp.float32)  # [N]
        cm = c_ref[r, g, :].astype(jnp.float32)  # [N]
        st = s_in_ref[slot, h, p_sl, :]  # f32[bp, N]
        st = st * jnp.exp(dt * a_ref[h]) + (dt * x)[:, None] * bm[None, :]
        s_out_ref[slot, h, p_sl, :] = st
        y = jnp.sum(st * cm[None, :], axis=1) + d_ref[h] * x
        y_ref[r, h, p_sl] = y.astype(y_ref.dtype)

    @pl.when(slot < 0)
    def _pad():
        y_ref[r, h, p_sl] = jnp.zeros((block_p,), y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dt_min", "dt_max", "params", "out_dtype", "interpret"))
def selective_state_update(
    state: Array,
    x: Array,
    dt_raw: Array,
    A_log: Array,
    B: Array,
    C: Array,
    D: Array,
    dt_bias: Array,
    *,
    state_indices: Array | None = None,
    dt_min: float | None = None,
    dt_max: float | None = None,
    params: StateUpdateParams | None = None,
    out_dtype=None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """One Mamba-2 recurrent step for R rows.

    Args:
      state: f32[R, H, P, N] (transformers' ssm_states layout), or with `state_indices` the whole
        pool f32[S, H, P, N] of one layer.
      x: [R, H, P]; dt_raw: [R, H] (before dt_bias and softplus); A_log, D, dt_bias: f32[H];
      B, C: [R, G, N] (head h uses group h // (H // G)).
      state_indices: optional i32[R] pool slots (unique among non-negative entries); -1 marks a
        padding row, which gives y = 0 and touches no state. None means row r uses state[r].
      dt_min, dt_max: optional clamp of dt (transformers' single-step path has none: None).
      params: tuning (StateUpdateParams); None looks the shape up in the tuned table.
      out_dtype: dtype of y (default x.dtype).
      interpret: Pallas interpret mode (CPU tests).

    Returns:
      (y [R, H, P], new_state like `state`). new_state aliases `state`: donate it to update the pool
      in place (otherwise XLA copies it first).
    """
    rows, nheads, headdim, ngroups, d_state = check_mixer_inputs(x, dt_raw, A_log, B, C, D, dt_bias, "R")
    if state.ndim != 4 or state.shape[1:] != (nheads, headdim, d_state) or state.dtype != jnp.float32:
        raise ValueError(f"state must be f32[S, {nheads}, {headdim}, {d_state}], got {state.dtype}{list(state.shape)}")
    if state_indices is None:
        if state.shape[0] != rows:
            raise ValueError(f"{state.shape=} must have R={rows} rows when state_indices is None")
        state_indices = jnp.arange(rows, dtype=jnp.int32)
    elif state_indices.shape != (rows,) or state_indices.dtype != jnp.int32:
        raise ValueError(f"state_indices must be i32[{rows}], got {state_indices.dtype}{list(state_indices.shape)}")
    if params is None:
        params = state_update_params_for(nheads, headdim, d_state, ngroups, x.dtype)
    block_p = min(params.block_p, headdim)
    if headdim % block_p or not _is_pow2(block_p):
        raise ValueError(f"{headdim=} must be a multiple of a power-of-two block_p (got {block_p})")
    if not _is_pow2(d_state):
        raise ValueError(f"{d_state=} must be a power of two")
    if state.size >= 2**31:
        raise ValueError(f"the state pool must hold < 2**31 elements (int32 indexing), got {state.shape}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)

    A = -jnp.exp(A_log.astype(jnp.float32))
    dt = softplus_dt(dt_raw, dt_bias, dt_min, dt_max)  # f32[R, H]
    kernel = functools.partial(_ssu_kernel, heads_per_group=nheads // ngroups, block_p=block_p)
    y, new_state = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((rows, nheads, headdim), out_dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ),
        grid=(rows, nheads, headdim // block_p),
        input_output_aliases={7: 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="mamba2_state_update",
    )(state_indices, x, dt, A, B, C, D.astype(jnp.float32), state)
    return y, new_state
