"""Single-token decode of the gated delta rule for N rows (one new token per sequence).

Same semantics as `naive.naive_gated_delta_rule` with one token per stream (transformers'
`torch_recurrent_gated_delta_rule` with sequence length 1). Per row n and value head hv:

    S <- S * exp(g);  delta = beta * (v - S^T k);  S <- S + k delta^T;  o = S^T (scale * q)

Grid (N, HV, V / block_v): a program streams one f32[K, block_v] block of the state in and out.
It is a memory-bound kernel: all the bytes are the state's (f32[HV, K, V] per row, read once and
written once), so the figure of merit is effective bandwidth over those bytes.

Pool form: with `state_indices` i32[N], `state` is a pool f32[S, HV, K, V] and row n reads and
writes pool row state_indices[n] in place (the output aliases the pool, so donate it); a negative
index is a padding row: its outputs are 0 and no state is touched. Without indices, state is
f32[N, HV, K, V] and a fresh new_state is returned.

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU (`plgpu.kernel`). Why: the
kernel is a gather of per-row state blocks chosen by a runtime index (pool slots), with
reductions over the K axis of a register tile; in Triton lowering that is one masked pointer load
per block, it runs unchanged in `interpret=True` on the CPU, and it reached 78% of memcpy
bandwidth on the H200 (bench/results/gated_delta.md). A Mosaic GPU version (TMA copies of the
slot's blocks) was not tried. The Pallas Triton backend is deprecated since jax 0.11 but is still
the default in 0.11.2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton  # noqa: F401  (CompilerParams)

from pallas_kernels.gated_delta import common
from pallas_kernels.gated_delta.params import RecurrentParams, recurrent_params_for


def _recurrent_kernel(
    idx_ref,  # i32[N]: state row of each decode row (< 0: padding)
    q_ref,  # [N, H*K]
    k_ref,  # [N, H*K]
    v_ref,  # [N, HV*V]
    g_ref,  # f32[N, HV]
    beta_ref,  # f32[N, HV]
    s_ref,  # f32[S, HV, K, V]
    o_ref,  # out [N, HV*V]
    s_out_ref,  # out f32[S, HV, K, V] (aliases s_ref in pool form)
    *,
    dk: int,
    dv: int,
    block_v: int,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
):
    n = pl.program_id(0)
    hv = pl.program_id(1)
    j = pl.program_id(2)
    h = hv // group
    slot = idx_ref[n]
    vcol = hv * dv + j * block_v

    @pl.when(slot >= 0)
    def _():
        q = q_ref[n, pl.ds(h * dk, dk)].astype(jnp.float32)  # f32[K]
        k = k_ref[n, pl.ds(h * dk, dk)].astype(jnp.float32)
        if use_qk_l2norm:
            q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6)
            k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
        v = v_ref[n, pl.ds(vcol, block_v)].astype(jnp.float32)  # f32[BV]
        g = g_ref[n, hv]
        beta = beta_ref[n, hv]
        st = s_ref[slot, hv, :, pl.ds(j * block_v, block_v)] * jnp.exp(g)  # f32[K, BV]
        delta = (v - jnp.sum(st * k[:, None], axis=0)) * beta  # f32[BV]
        st = st + k[:, None] * delta[None, :]
        o = jnp.sum(st * (q * scale)[:, None], axis=0)
        o_ref[n, pl.ds(vcol, block_v)] = o.astype(o_ref.dtype)
        s_out_ref[slot, hv, :, pl.ds(j * block_v, block_v)] = st

    @pl.when(slot < 0)
    def _():
        o_ref[n, pl.ds(vcol, block_v)] = jnp.zeros((block_v,), o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "params", "interpret"))
def fused_recurrent_gated_delta_rule(
    q,  # [N, H, K]
    k,  # [N, H, K]
    v,  # [N, HV, V]
    g,  # f32[N, HV]
    beta,  # f32[N, HV]
    state,  # f32[N, HV, K, V], or the pool f32[S, HV, K, V] with state_indices
    *,
    state_indices=None,  # i32[N] or None
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    params: RecurrentParams | None = None,
    interpret: bool = False,
):
    """One gated-delta step for N rows. -> (o [N, HV, V] in q.dtype, new_state like `state`)."""
    n_rows, h, hv, dk, dv = common.check_inputs(q, k, v, g, beta, state, rows_name="N")
    if state_indices is None:
        if state.shape[0] != n_rows:
            raise ValueError(f"state rows {state.shape[0]} != N={n_rows} (pass state_indices for a pool)")
        idx = jnp.arange(n_rows, dtype=jnp.int32)
    else:
        if state_indices.shape != (n_rows,):
            raise ValueError(f"state_indices must be i32[N={n_rows}]; got {state_indices.shape}")
        idx = state_indices.astype(jnp.int32)
    cdtype = common.compute_dtype(q.dtype, k.dtype, v.dtype)
    if params is None:
        params = recurrent_params_for(h, hv, dk, dv, cdtype.name)
    block_v = params.block_v
    if dv % block_v or not common.is_pow2(block_v):
        raise ValueError(f"block_v={block_v} must be a power of two dividing V={dv}")
    scale = float(dk**-0.5 if scale is None else scale)

    o, new_state = pl.pallas_call(
        functools.partial(
            _recurrent_kernel, dk=dk, dv=dv, block_v=block_v, group=hv // h, scale=scale,
            use_qk_l2norm=use_qk_l2norm,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((n_rows, hv * dv), q.dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ),
        grid=(n_rows, hv, dv // block_v),
        input_output_aliases={} if state_indices is None else {6: 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_fused_recurrent",
    )(
        idx, q.reshape(n_rows, h * dk), k.reshape(n_rows, h * dk), v.reshape(n_rows, hv * dv),
        g.astype(jnp.float32), beta.astype(jnp.float32), state,
    )
    return o.reshape(n_rows, hv, dv), new_state
