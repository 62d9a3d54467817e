"""Varlen chunked SSD scan (Mamba-2 prefill) as one fused Pallas kernel.

Backend: `pl.pallas_call` lowered through Triton, not Mosaic GPU (`plgpu.kernel`). Why:
* Each chunk needs a cumulative sum of dt*A and the [chunk, chunk] decay matrix
  exp(cumsum[l] - cumsum[s]); Mosaic GPU 0.11.2 registers no lowering for `cumsum`, and the
  outer difference needs row- and column-broadcast register layouts feeding wgmma fragments.
  Triton lowering has both (tt.scan, plain broadcasts) and picks the MMA layouts itself.
* Streams start at arbitrary token offsets (varlen, chunks aligned to each stream's start), so
  every chunk load is a masked load at an unaligned row offset with a dynamic trip count per
  program. Triton expresses that directly; in Mosaic GPU it needs manual TMA + barriers, and its
  CPU interpret mode lacks dynamic grids and moving pipelines (DESIGN.md section 3).
* Only two short GPU runs were available to this work. Triton lowering can be checked on the CPU
  machine (cross-lowering for an abstract H200, see tests/test_mamba2_kernels.py) and the
  interpret mode runs the same kernel body.
The Pallas Triton backend is deprecated since jax 0.11 but still the default in 0.11.2; a Mosaic
GPU port (wgmma with the decay matrix built in registers) is the follow-up.

Algorithm (per program = one head h, one block of headdim columns, one stream): walk the stream's
chunks in order, carrying the f32 state [block_p, d_state] in registers. Per chunk of L tokens:
    a = cumsum(dt * A)                                  f32[L]
    y = ((C B^T) * exp(a[l] - a[s]) * [l >= s]) (x dt)  intra-chunk, [L, L] @ [L, bp]
      + exp(a)[:, None] * (C state^T)                    entering state, [L, N] @ [N, bp]
      + D * x
    state = exp(a[-1]) state + ((x dt) * exp(a[-1] - a))^T B     [bp, L] @ [L, N]
The four matmuls run on the tensor cores (SSDParams.dot_mode). Because the recurrence is
independent across headdim, programs split headdim (block_p) for more parallelism. One extra
program row writes zeros to the tokens past cu_seqlens[-1] (padding), which touch no state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.mamba2.params import SSDParams, _is_pow2, check_mixer_inputs, ssd_params_for
from pallas_kernels.mamba2.reference import softplus_dt

Array = jax.Array


def resolve_dot_mode(dot_mode: str, dtype) -> str:
    """'auto' -> the 16-bit input dtype's own MMA ('bf16'/'f16'), or exact 'ieee' for f32 inputs
    (as the attention and gated-delta kernels: TF32's ~1e-3 error is the reduced precision a
    float32 model did not ask for)."""
    if dot_mode != "auto":
        return dot_mode
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return "bf16"
    if dtype == jnp.float16:
        return "f16"
    return "ieee"


def mm(a: Array, b: Array, contract: tuple[tuple[int], tuple[int]], mode: str) -> Array:
    """2-D matmul with f32 accumulation; `contract` = (lhs dims, rhs dims); operands per `mode`."""
    precision = None
    if mode in ("bf16", "f16"):
        dt = jnp.bfloat16 if mode == "bf16" else jnp.float16
        a, b = a.astype(dt), b.astype(dt)
    else:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        precision = lax.Precision.HIGHEST if mode == "ieee" else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _ssd_kernel(
    cu_ref,  # i32[S+1]
    x_ref,  # [T, H, P]
    dt_ref,  # f32[H, T] (softplus'd, clamped)
    a_ref,  # f32[H] (A = -exp(A_log))
    b_ref,  # [T, G, N]
    c_ref,  # [T, G, N]
    d_ref,  # f32[H]
    s0_ref,  # f32[S, H, P, N]
    y_ref,  # [T, H, P] (out)
    sf_ref,  # f32[S, H, P, N] (out, aliased to s0)
    *,
    num_streams: int,
    num_tokens: int,
    chunk_size: int,
    block_p: int,
    heads_per_group: int,
    mode: str,
):
    h = pl.program_id(0)
    pb = pl.program_id(1)
    s = pl.program_id(2)
    g = h // heads_per_group
    cs = chunk_size
    d_state = b_ref.shape[-1]
    p_sl = pl.ds(pl.multiple_of(pb * block_p, block_p), block_p)
    rows = lax.broadcasted_iota(jnp.int32, (cs,), 0)

    @pl.when(s < num_streams)
    def _stream():
        start = cu_ref[s]
        end = cu_ref[s + 1]
        a = a_ref[h]
        dskip = d_ref[h]
        causal = lax.broadcasted_iota(jnp.int32, (cs, cs), 0) >= lax.broadcasted_iota(jnp.int32, (cs, cs), 1)

        def body(c, state):  # state f32[bp, N]
            t0 = start + c * cs
            valid = t0 + rows < end  # bool[cs]
            valid_p = jnp.broadcast_to(valid[:, None], (cs, block_p))
            valid_n = jnp.broadcast_to(valid[:, None], (cs, d_state))
            dt = plgpu_triton.load(dt_ref.at[h, pl.ds(t0, cs)], mask=valid, other=0.0)  # f32[cs]
            x = plgpu_triton.load(x_ref.at[pl.ds(t0, cs), h, p_sl], mask=valid_p, other=0.0)  # [cs, bp]
            bm = plgpu_triton.load(b_ref.at[pl.ds(t0, cs), g, :], mask=valid_n, other=0.0)  # [cs, N]
            cm = plgpu_triton.load(c_ref.at[pl.ds(t0, cs), g, :], mask=valid_n, other=0.0)  # [cs, N]
            da = dt * a  # masked rows: 0 (no decay, no input)
            acs = jnp.cumsum(da)  # f32[cs]
            total = jnp.sum(da)
            xf = x.astype(jnp.float32)
            xdt = xf * dt[:, None]  # [cs, bp]
            cb = mm(cm, bm, ((1,), (1,)), mode)  # [cs, cs]
            decay = jnp.exp(jnp.where(causal, acs[:, None] - acs[None, :], -jnp.inf))
            y = mm(cb * decay, xdt, ((1,), (0,)), mode)  # [cs, bp]
            y = y + jnp.exp(acs)[:, None] * mm(cm, state, ((1,), (1,)), mode)  # [cs, N] x [bp, N]^T
            y = y + dskip * xf
            plgpu_triton.store(y_ref.at[pl.ds(t0, cs), h, p_sl], y.astype(y_ref.dtype), mask=valid_p)
            w = xdt * jnp.exp(total - acs)[:, None]  # [cs, bp]
            return state * jnp.exp(total) + mm(w, bm, ((0,), (0,)), mode)  # [bp, N]

        n_chunks = (end - start + cs - 1) // cs
        state = lax.fori_loop(0, n_chunks, body, s0_ref[s, h, p_sl, :].astype(jnp.float32))
        sf_ref[s, h, p_sl, :] = state

    @pl.when(s == num_streams)
    def _padding():
        tail = cu_ref[num_streams]
        zeros = jnp.zeros((cs, block_p), y_ref.dtype)

        def zbody(c, carry):
            t0 = tail + c * cs
            valid_p = jnp.broadcast_to((t0 + rows < num_tokens)[:, None], (cs, block_p))
            plgpu_triton.store(y_ref.at[pl.ds(t0, cs), h, p_sl], zeros, mask=valid_p)
            return carry

        lax.fori_loop(0, (num_tokens - tail + cs - 1) // cs, zbody, 0)


@functools.partial(jax.jit, static_argnames=("dt_min", "dt_max", "params", "out_dtype", "interpret"))
def ssd_chunk_scan(
    x: Array,
    dt_raw: Array,
    A_log: Array,
    B: Array,
    C: Array,
    D: Array,
    dt_bias: Array,
    *,
    cu_seqlens: Array,
    initial_states: Array,
    dt_min: float | None = 0.0,
    dt_max: float | None = float("inf"),
    params: SSDParams | None = None,
    out_dtype=None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Mamba-2 SSD over a varlen batch of streams stacked along tokens.

    Args:
      x: [T, H, P] (bf16 / f16 / f32), the conv'd x part of xBC.
      dt_raw: [T, H] raw dt from in_proj (before dt_bias and softplus).
      A_log, D, dt_bias: f32[H].
      B, C: [T, G, N]; head h uses group h // (H // G).
      cu_seqlens: i32[S+1], 0 = cu[0] <= ... <= cu[S] <= T; stream s is tokens cu[s]:cu[s+1].
      initial_states: f32[S, H, P, N] (transformers' ssm_states layout); zeros for a fresh prompt.
      dt_min, dt_max: clamp of dt after softplus (None = unbounded). transformers' chunked path
        clamps to (time_step_min, inf) in NemotronH and to config.time_step_limit in Mamba2.
      params: tuning (SSDParams); None looks the shape up in the tuned table.
      out_dtype: dtype of y (default x.dtype).
      interpret: run the kernel body in Pallas interpret mode (CPU tests).

    Returns:
      y [T, H, P] = SSD output + D * x (gating by z and the norm are the caller's); rows past
      cu_seqlens[-1] are 0. final_states f32[S, H, P, N] (aliased to initial_states: in place when
      the caller donates it).
    """
    num_tokens, nheads, headdim, ngroups, d_state = check_mixer_inputs(x, dt_raw, A_log, B, C, D, dt_bias, "T")
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype != jnp.int32:
        raise ValueError(f"cu_seqlens must be i32[S+1], got {cu_seqlens.dtype}{list(cu_seqlens.shape)}")
    num_streams = cu_seqlens.shape[0] - 1
    if initial_states.shape != (num_streams, nheads, headdim, d_state):
        raise ValueError(
            f"{initial_states.shape=} must be (S, nheads, headdim, d_state) = {(num_streams, nheads, headdim, d_state)}"
        )
    if params is None:
        params = ssd_params_for(nheads, headdim, d_state, ngroups, x.dtype, num_streams)
    block_p = min(params.block_p, headdim)
    if headdim % block_p or not _is_pow2(block_p) or block_p < 16:
        raise ValueError(f"{headdim=} must be a multiple of a power-of-two block_p >= 16 (got {block_p})")
    if not _is_pow2(d_state) or d_state < 16:
        raise ValueError(f"{d_state=} must be a power of two >= 16")
    if num_tokens * nheads * headdim >= 2**31 or num_streams * nheads * headdim * d_state >= 2**31:
        raise ValueError("x and initial_states must each hold < 2**31 elements (the kernel indexes in int32)")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)

    A = -jnp.exp(A_log.astype(jnp.float32))
    dt_t = softplus_dt(dt_raw, dt_bias, dt_min, dt_max).T  # f32[H, T]: contiguous per head
    kernel = functools.partial(
        _ssd_kernel,
        num_streams=num_streams,
        num_tokens=num_tokens,
        chunk_size=params.chunk_size,
        block_p=block_p,
        heads_per_group=nheads // ngroups,
        mode=resolve_dot_mode(params.dot_mode, x.dtype),
    )
    y, final = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, nheads, headdim), out_dtype),
            jax.ShapeDtypeStruct((num_streams, nheads, headdim, d_state), jnp.float32),
        ),
        grid=(nheads, headdim // block_p, num_streams + 1),
        input_output_aliases={7: 1},
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="mamba2_ssd_scan",
    )(
        cu_seqlens,
        x,
        dt_t,
        A,
        B,
        C,
        D.astype(jnp.float32),
        initial_states.astype(jnp.float32),
    )
    return y, final
