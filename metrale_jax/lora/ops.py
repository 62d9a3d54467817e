"""LoRA deltas inside the step: per-token adapter slots and the batched x·A·B (scale folded in B).

Every token of a step carries its adapter slot (`token_slots`): decode rows read
`AttnMetadata.seq_slot`, prefill tokens their stream's `BatchedAttnMetadata.seq_slot` (found
from `cu_seqlens`); pad tokens and rows of the base model are -1.

Dense projections (`add_delta`), three static kernels (`AttentionConfig.lora_kernel`; "auto",
the default, takes "pallas" for steps of at most 16 tokens on the GPU, else "gather" when the
step has fewer tokens than slots and "masked" otherwise: the adapter bytes each reads are
min(T, S) slots' worth, and the bucket's T is static):
* "masked": shrink against every slot at once, `x [T, in] @ A [S*kR, in]^T`, zero the
  slots a token does not use, expand `[T, S*kR] @ B [S*kR, out]` (B block diagonal over the k
  parts of a fused projection, so q|k|v and gate|up take one expand each). Two plain GEMMs:
  weight bytes read once per step (S * R * (in + out)), FLOPs T * S * R * (in + out), which is
  what decode wants (the weight stream bounds it) and stays a few % of the base GEMMs for
  prefill at S <= 8. Rows < 0 match no slot and get exactly zero.
* "gather": gather each token's own A and B (`A[slot[t]]`) and contract per token: T * R *
  (in + out) FLOPs but T copies of the adapter bytes; better for very many slots and few tokens.
* "pallas": steps of at most 64 tokens run each projection's expand, its add to y and (o / down)
  the residual add or (gate|up) the SwiGLU activation as one kernel
  (`pallas_kernels/linear/lora.py`: XLA ran a batch-1 step's expands as reductions of their own
  or as loop fusions of the residual adds on a few SMs); larger steps take "masked". "auto"
  takes it where the step's other kernels are Pallas (`AttentionConfig.use_pallas`: the GPU
  default) and there is no tensor-parallel mesh.
  (A Pallas / `ragged_dot` kernel grouped by slot, as Punica's SGMV, for prefill at large S:
  not written.)

Folded shrink (the default where the base weight is a plain array, `manager.fold_targets`): the
engine appends every slot's A to the base weight as extra output columns, `[in, out + S*kR]`,
so the base GEMM computes the shrink of every slot too (S * kR * in more weight bytes, ~2% of
Llama-3-8B's at 8 rank-16 slots) and only the expand (`lora_expand`, "masked" or "gather" as
above) is a launch of its own: one kernel per projection instead of two, and the normed input
is not read a second time. FP8 / 4-bit base weights keep A apart (the shrink is then a GEMM of
its own, "masked" or "gather").

MoE experts (`expert_lora`): vLLM's "virtual experts": the (token, expert) pairs of tokens whose
`moe_row_adapter` >= 0 are grouped by `slot * E + expert`, the others by the all-zero group
V - 1, and shrink / expand run as two grouped GEMMs (`layers.moe.grouped_matmul`: tokamax on the
GPU, `jax.lax.ragged_dot` elsewhere), the same primitive as the experts themselves.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from metrale_jax.layers.mlp import silu_mul as swiglu
from metrale_jax.layers.norms import RowNorm
from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata
from pallas_kernels.linear.lora import MAX_T as KERNEL_MAX_T
from pallas_kernels.linear.lora import lora_expand_add

# "auto" takes the Pallas kernel for steps of at most this many tokens (H200, Llama-3-8B, 8 slots,
# session 23: batch 1, i.e. 8 rows with the padding, 1.110-1.119x the base step against
# 1.172-1.182x masked; batch 16 1.159x against 1.167x; batch 64 1.236x against 1.158x; session
# 24, the gate|up kernel reading the f32 product: batch 1 1.094-1.097x)
AUTO_PALLAS_MAX_T = 16


class LoRAInputs(NamedTuple):
    """One layer's LoRA leaves (see `adapter.py`) plus the step's per-token slots."""

    w: dict  # leaf -> per-layer array ([S, ...] dense, [V, ...] expert leaves)
    slot: jax.Array  # i32[N + T]  adapter slot per token; -1 = base
    moe_slot: jax.Array  # i32[N + T]  expert-LoRA slot per token; -1 = none
    kernel: str = "auto"
    interpret: bool = False  # the "pallas" kernel in interpret mode (CPU)
    live: int = 0  # > 0: only the first `live` tokens may carry a delta (`AttnMetadata.live_rows`)
    pallas: bool = False  # "auto" may take the "pallas" kernel (the step's other kernels are Pallas)


def token_slots(dmd: AttnMetadata | None, pmd: BatchedAttnMetadata | None, field: str = "seq_slot") -> jax.Array:
    """i32[N + T]: `field` ("seq_slot" | "moe_row_adapter") of each token's row; -1 for pads."""
    parts = []
    if dmd is not None:
        parts.append(getattr(dmd, field))
    if pmd is not None:
        j = jnp.arange(pmd.num_tokens, dtype=jnp.int32)
        # i32[T]: stream of each token (compare_all: no while loop in the step)
        stream = jnp.searchsorted(pmd.cu_seqlens[1:], j, side="right", method="compare_all")
        per = getattr(pmd, field)[jnp.clip(stream, 0, pmd.num_streams - 1)]
        parts.append(jnp.where(j < pmd.cu_seqlens[-1], per, -1).astype(jnp.int32))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _kernel(kernel: str, tokens: int, slots: int) -> str:
    """The XLA path for a step of `tokens` tokens ("pallas" past its 64 tokens: "masked")."""
    if kernel == "auto":
        return "gather" if tokens < slots else "masked"
    if kernel not in ("masked", "gather", "pallas"):
        raise ValueError(f"lora_kernel={kernel!r} must be 'auto', 'masked', 'gather' or 'pallas'")
    return "masked" if kernel == "pallas" else kernel


def lora_delta(x: jax.Array, slot: jax.Array, a: jax.Array, b: jax.Array, kernel: str = "auto",
               out_dtype=jnp.float32) -> jax.Array:
    """Each token's x·A·B under its adapter slot, for one (possibly fused) projection.

    x [T, in], slot i32[T] (-1: no delta), a [S, kR, in], b [S, kR, out] (block diagonal for a
    fused projection of k parts; scale folded in) -> out_dtype[T, out] (accumulated in f32). The
    shrink result is rounded to x's dtype before the expand, as PEFT's lora_B(lora_A(x)) is.
    """
    s = a.shape[0]
    if _kernel(kernel, x.shape[0], s) == "gather":  # each token's own A only
        own = a[jnp.clip(slot, 0, s - 1)].astype(x.dtype)  # [T, kR, in]
        h = jnp.einsum("ti,tri->tr", x, own, preferred_element_type=jnp.float32)  # [T, kR]
    else:
        h = _shrink_all(x, a)
    return lora_expand(h.astype(x.dtype), slot, b, kernel, out_dtype)


def _shrink_all(x: jax.Array, a: jax.Array) -> jax.Array:
    """x [T, in] against every slot's A [S, kR, in] -> f32[T, S, kR]."""
    return jnp.einsum("ti,sri->tsr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)


def lora_expand(h: jax.Array, slot: jax.Array, b: jax.Array, kernel: str = "auto", out_dtype=jnp.float32) -> jax.Array:
    """The expand of shrink results h: [T, S, kR] (every slot's, as a folded or "masked" shrink
    gives them) or [T, kR] (each token's own slot's), b [S, kR, out] -> out_dtype[T, out]: each
    token's h under its slot times that slot's B (zero for slot < 0)."""
    s = b.shape[0]
    if h.ndim == 3 and _kernel(kernel, h.shape[0], s) == "gather":  # keep the token's own slot
        h = jnp.take_along_axis(h, jnp.clip(slot, 0, s - 1)[:, None, None], axis=1)[:, 0]
    if h.ndim == 3:  # masked: zero the slots a token does not use, one GEMM over all slots' B
        hit = slot[:, None, None] == jnp.arange(s, dtype=slot.dtype)[None, :, None]
        h = jnp.where(hit, h, jnp.zeros((), h.dtype))
        return jnp.einsum("tsr,sro->to", h, b.astype(h.dtype), preferred_element_type=out_dtype)
    # (the rows without an adapter zeroed in the result, where XLA fuses the select into the add
    # that consumes it: on h it took a kernel of its own per projection, H200 session 22)
    d = jnp.einsum("tr,tro->to", h, b[jnp.clip(slot, 0, s - 1)].astype(h.dtype), preferred_element_type=out_dtype)
    return jnp.where((slot >= 0)[:, None], d, jnp.zeros((), d.dtype))


def _kernel_step(t: int, lora: LoRAInputs) -> bool:
    """Whether a step of t tokens takes the expand-add kernel (`lora.kernel`: "pallas", or "auto"
    on the GPU up to AUTO_PALLAS_MAX_T)."""
    return t <= (KERNEL_MAX_T if lora.kernel == "pallas" else
                 AUTO_PALLAS_MAX_T if lora.kernel == "auto" and lora.pallas else 0)


def add_delta(y: jax.Array, x: jax.Array, lora: LoRAInputs | None, a: str, b: str, parts: tuple[int, ...] = (),
              residual: jax.Array | None = None, silu_mul: bool = False,
              row_norm: RowNorm | None = None) -> jax.Array:
    """(residual +) y + the LoRA delta of input x (leaves `a`, `b` of `lora.w`); no delta without LoRA.

    Folded projections (`a` absent from `lora.w`: the engine appended every slot's A to the base
    weight, `manager.fold_targets`): y is then [..., out + S*kR], the base GEMM's output followed
    by every slot's shrink x·A_s (x itself is unused), and the result is [..., out].
    parts: the widths of a fused projection's parts (q|k|v, gate|up), read by the "pallas" kernel
    (its B is block diagonal over them); residual: the residual stream this output is added to;
    silu_mul: a gate|up projection whose SwiGLU activation `layers.mlp.silu_mul` of the sum is
    returned ([..., out / 2]; the "pallas" kernel computes it in the same launch); row_norm: y
    is the f32 product before an RMSNorm's row scale (`layers.norms.rms_norm_matmul`), standing
    for (y * row_norm.scale()) rounded to x's dtype (the kernel applies it as it reads y).
    """
    t = math.prod(y.shape[:-1])
    kernel_step = lora is not None and _kernel_step(t, lora)
    folded = lora is not None and a not in lora.w
    if row_norm is not None and not (kernel_step and folded):  # (the kernel scales folded products)
        y, row_norm = (y * row_norm.scale()).astype(x.dtype), None
    if lora is None:
        y = y if residual is None else residual + y
        return swiglu(y) if silu_mul else y
    bw = lora.w[b]  # [S, kR, out]
    n = bw.shape[-1]
    live = lora.live if 0 < lora.live < t else t  # decode rows padded by the step: deltas of the live rows only
    y2 = y.reshape(t, -1)
    if kernel_step:
        # one kernel: expand, add, residual add or activation (h: the folded GEMM's extra columns, or the shrink)
        h = y2 if folded else _shrink_all(x.reshape(t, -1), lora.w[a]).astype(x.dtype).reshape(t, -1)
        res = None if residual is None else residual.reshape(t, n)
        ss, norm = (None, ()) if row_norm is None else (row_norm.sum_sq.reshape(t), (row_norm.eps, row_norm.size))
        out = lora_expand_add(y2, h, lora.slot, bw, res, ss, h_offset=n if folded else 0, parts=parts,
                              live=live if live < t else 0, silu_mul=silu_mul, norm=norm, out_dtype=x.dtype,
                              interpret=lora.interpret)
        return out.reshape(y.shape[:-1] + out.shape[-1:])
    if folded:
        s, kr = bw.shape[:2]
        h = y2[:live, n:].reshape(live, s, kr)
        y = y2[:, :n].reshape(y.shape[:-1] + (n,))
        d = lora_expand(h, lora.slot[:live], bw, lora.kernel, out_dtype=y.dtype)
    else:
        d = lora_delta(x.reshape(t, -1)[:live], lora.slot[:live], lora.w[a], bw, lora.kernel, out_dtype=y.dtype)
    # the expand in y's dtype, added to y as is: on the H200 XLA fuses the add with the residual
    # add and the next norm (batch-64 Llama-3-8B step with 8 adapters 1.241x the base, from 1.257x
    # with an f32 delta and its own add; session 18)
    if live < t:
        d = jnp.pad(d, ((0, t - live), (0, 0)))
    y = y + d.reshape(y.shape)
    y = y if residual is None else residual + y
    return swiglu(y) if silu_mul else y


class ExpertGroups(NamedTuple):
    """How the expert-sorted (token, expert) pairs regroup by virtual expert."""

    perm: jax.Array  # i32[P]  positions in the expert-sorted order, grouped by virtual expert
    sizes: jax.Array  # i32[V]  pairs per virtual expert


def expert_groups(moe_slot: jax.Array, flat_experts: jax.Array, order: jax.Array, k: int, num_experts: int,
                  num_virtual: int) -> ExpertGroups:
    """moe_slot i32[T], flat_experts i32[T*k] (the router's choices), order i32[T*k] (the pairs
    sorted by expert, as `routed_experts` runs them) -> the virtual-expert grouping."""
    e = flat_experts[order]  # expert of each sorted pair
    s = moe_slot[order // k]
    v = jnp.where(s >= 0, s * num_experts + e, num_virtual - 1)
    perm = jnp.argsort(v, stable=True).astype(jnp.int32)
    return ExpertGroups(perm, jnp.bincount(v, length=num_virtual).astype(jnp.int32))


def expert_lora(xs: jax.Array, g: ExpertGroups, a: jax.Array, b: jax.Array, use_tokamax: bool) -> jax.Array:
    """Expert LoRA deltas of the expert-sorted pair inputs xs [P, in]: a [V, in, kR], b [V, kR, out]
    (block diagonal for gate|up) -> f32[P, out] in the same (expert-sorted) order."""
    from metrale_jax.layers.moe import grouped_matmul

    xv = xs[g.perm]
    h = grouped_matmul(xv, a.astype(xs.dtype), g.sizes, use_tokamax).astype(xs.dtype)  # [P, kR]
    d = grouped_matmul(h, b.astype(xs.dtype), g.sizes, use_tokamax)  # [P, out]
    return jnp.zeros_like(d).at[g.perm].set(d)
