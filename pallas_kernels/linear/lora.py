"""Fused per-token LoRA for decode-sized steps: y + x·A[slot]·B[slot] in one kernel.

    y [T, out], x [T, in], slot i32[T] (-1: no adapter), a [S, kR, in], b [S, kR, out] -> [T, out]

XLA runs a LoRA delta as four to six kernels (gather or shrink, mask, expand, add: with seven
projections and 32 layers, ~0.6 ms of a 4.9 ms Llama-3-8B batch-1 step on the H200, session 16,
almost all of it launches). This kernel does one projection's delta and the add in one launch.
Each program owns `block_n` output columns of every token; for each slot present in the batch
(`lax.cond` on the slot ids: absent slots cost nothing) it shrinks all T rows against A[s]
(kR x in, a few hundred KB, from L2 after the first program), keeps the rows of that slot, and
expands them against its columns of B[s]. The shrink is recomputed per program: cheap for the T
<= 64 it is meant for (T x in x kR multiply-adds). Rounding as `metrale_jax.lora.ops`: the shrink
result is rounded to x's dtype before the expand (as PEFT's lora_B(lora_A(x))), accumulation in
float32, the sum with y rounded to y's dtype. Lowered through Triton, as `skinny.py`; runs in
interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.linear.params import m_bucket

MAX_T = 64


def _lora_kernel(slot_ref, x_ref, a_ref, b_ref, y_ref, o_ref, *, t, tp, num_slots, kr, krp, k_in, n_out,
                 block_n, block_k):
    # slot_ref i32[T]; x_ref [T, in]; a_ref [S, kR, in]; b_ref [S, kR, out]; y_ref / o_ref [T, out]
    rows = jnp.arange(tp, dtype=jnp.int32)  # i32[Tp]
    row_ok = rows < t
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[BN]
    col_ok = cols < n_out
    rr = jnp.arange(krp, dtype=jnp.int32)  # i32[kRp]
    r_ok = rr < kr
    slot = plgpu_triton.load(slot_ref.at[rows], mask=row_ok, other=-1)  # i32[Tp]
    num_k = -(-k_in // block_k)

    def one_slot(s, acc):  # acc f32[Tp, BN]
        hit = slot == s  # bool[Tp]

        def delta(acc):
            def k_step(i, h):  # h f32[Tp, kRp]
                kc = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
                k_ok = kc < k_in
                xt = plgpu_triton.load(x_ref.at[rows[:, None], kc[None, :]], mask=row_ok[:, None] & k_ok[None, :],
                                       other=0.0)  # [Tp, BK]
                sa = jnp.full((krp, block_k), s, jnp.int32)
                at = plgpu_triton.load(a_ref.at[sa, rr[:, None], kc[None, :]], mask=r_ok[:, None] & k_ok[None, :],
                                       other=0.0)  # [kRp, BK]
                return h + plgpu_triton.dot(xt, at.astype(xt.dtype), trans_b=True).astype(jnp.float32)

            h = jax.lax.fori_loop(0, num_k, k_step, jnp.zeros((tp, krp), jnp.float32))
            h = jnp.where(hit[:, None], h, 0.0).astype(x_ref.dtype)  # the rows of this slot, rounded as PEFT
            sb = jnp.full((krp, block_n), s, jnp.int32)
            bt = plgpu_triton.load(b_ref.at[sb, rr[:, None], cols[None, :]], mask=r_ok[:, None] & col_ok[None, :],
                                   other=0.0)  # [kRp, BN]
            return acc + plgpu_triton.dot(h, bt.astype(h.dtype)).astype(jnp.float32)

        # (a sum, not jnp.any: Triton lowers integer sums for sure; an OR reduction is less certain)
        return jax.lax.cond(jnp.sum(hit.astype(jnp.int32)) > 0, delta, lambda acc: acc, acc)

    acc = jax.lax.fori_loop(0, num_slots, one_slot, jnp.zeros((tp, block_n), jnp.float32))
    mask = row_ok[:, None] & col_ok[None, :]
    y = plgpu_triton.load(y_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)
    plgpu_triton.store(o_ref.at[rows[:, None], cols[None, :]], (y + acc).astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "interpret"))
def lora_add(y, x, slot, a, b, *, block_n: int = 128, block_k: int = 256, interpret: bool = False):
    """y [T, out] plus each token's x [T, in] · a[slot] · b[slot] (a [S, kR, in], b [S, kR, out];
    slot i32[T], < 0 or >= S: no delta) -> [T, out] in y's dtype. T in 1..64."""
    t, k_in = x.shape
    s, kr, n_out = b.shape
    if not 1 <= t <= MAX_T:
        raise ValueError(f"lora_add: {t} tokens; the kernel takes 1..{MAX_T} (larger steps: the XLA path)")
    if y.shape != (t, n_out) or slot.shape != (t,) or a.shape != (s, kr, k_in):
        raise ValueError(f"lora_add: shapes disagree: y {y.shape}, x {x.shape}, slot {slot.shape}, a {a.shape}, "
                         f"b {b.shape}")
    block_k = min(block_k, m_bucket(k_in))
    block_n = min(block_n, m_bucket(n_out))
    kernel = functools.partial(_lora_kernel, t=t, tp=m_bucket(t), num_slots=s, kr=kr,
                               krp=m_bucket(kr), k_in=k_in, n_out=n_out,
                               block_n=block_n, block_k=block_k)
    return pl.pallas_call(
        kernel,
        grid=(-(-n_out // block_n),),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="lora_add",
    )(slot.astype(jnp.int32), x, a, b, y)
