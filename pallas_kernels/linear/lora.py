"""LoRA expand and add for decode-sized steps, one kernel per projection:

    out[t] = residual[t] + y[t, :N] + h[t, off + s*kR : off + (s+1)*kR] · B[s]     (s = slot[t] >= 0)
    out[t] = residual[t] + y[t, :N]                                                 (slot[t] < 0)

y [T, >= N] holds the base projection in its first N columns; h [T, >= off + S*kR] every slot's
shrink result x·A_s (with A folded into the base weight, `metrale_jax.lora.manager.fold_targets`,
h is y itself and off = N: the one GEMM gave both); B [S, kR, N]; the residual (optional) is the
residual stream the projection's output is added to (o / down), so that add is this kernel too;
for gate|up the kernel can return the SwiGLU activation silu(gate) * up instead (`silu_mul`).
With `row_sum_sq`, y (and h) are a float32 product before an RMSNorm's row scale
r = rsqrt(row_sum_sq / size + eps) (`metrale_jax.layers.norms.rms_norm_matmul`): y * r and h * r,
rounded to the output dtype, stand for y and h, so XLA need not write the scaled, rounded product
(nor r) with launches of their own.

Why a kernel: XLA runs a decode step's expand as a reduction of its own, or fuses it into the
residual add as a loop fusion that computes each output column's k-long dot in one thread (so a
4,096-column add runs on a few SMs: 5.2 us instead of 1.8 on the H200, session 22's profile of a
batch-1 Llama-3-8B step, where the LoRA step was 1.12x the base one, mostly these launches).
Here each program owns `block_n` columns of one token: it gathers its token's kR shrink values
and the matching [kR, block_n] tile of its slot's B (from L2 after the first token of a slot),
and writes residual + y + delta, summed in float32 and rounded once to the output dtype.

A fused projection of k parts (q|k|v, gate|up: `parts` = the parts' widths) has a block-diagonal
B (`metrale_jax/lora/adapter.py`): each column reads only its own part's R = kR / k rows, so the
zero blocks are never read. Lowered through Triton, as `skinny.py`; runs in interpret mode on
the CPU. (The q|k|v delta inside `rope_and_write_kv` instead, one launch fewer per layer, was
slower on the H200: that kernel went from 2.3 to 7.1-12.5 us per layer, batch 1 one adapter
1.107x the base step against 1.094x for this kernel followed by it, session 24.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

MAX_T = 64  # larger steps: the XLA path (`metrale_jax.lora.ops`), whose GEMMs read each B once


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _expand_add_kernel(slot_ref, y_ref, h_ref, b_ref, *refs, n_out, kr, rank, h_off, bounds, block_n, live,
                       silu_mul, norm, res):
    # slot_ref i32[T]; y_ref [T, >= N]; h_ref [T, >= h_off + S*kR]; b_ref [S, kR, N];
    # refs: (row_sum_sq f32[T],) (residual [T, N],) out [T, N] (silu_mul: [T, N/2])
    o_ref = refs[-1]
    dt = o_ref.dtype
    t = pl.program_id(0)
    r = jax.lax.rsqrt(refs[0][t] / norm[1] + norm[0]) if norm else None

    def scale(v):  # a product column as the rounded, row-scaled projection gives it
        return v.astype(jnp.float32) if r is None else (v.astype(jnp.float32) * r).astype(dt).astype(jnp.float32)
    s = slot_ref[t] if live == 0 else jnp.where(t < live, slot_ref[t], -1)
    sc = jnp.maximum(s, 0)
    rr = jnp.arange(_pow2(rank), dtype=jnp.int32)[:, None]  # i32[Rp, 1]
    tt = jnp.full((block_n,), t, jnp.int32)

    def columns(cols):  # f32[BN]: (residual +) y + delta of output columns `cols`
        ok = cols < n_out
        acc = scale(plgpu_triton.load(y_ref.at[tt, cols], mask=ok, other=0.0))
        if res:
            acc = acc + plgpu_triton.load(refs[-2].at[tt, cols], mask=ok, other=0.0).astype(jnp.float32)
        part = sum(((cols >= b).astype(jnp.int32) for b in bounds), jnp.zeros_like(cols))  # i32[BN] each column's part
        row = part[None, :] * rank + rr  # i32[Rp, BN] the rows of B (and of h) each column reads
        m = (rr < rank) & ok[None, :] & (s >= 0)
        tr = jnp.full(row.shape, t, jnp.int32)
        h = plgpu_triton.load(h_ref.at[tr, h_off + sc * kr + row], mask=m, other=0.0)  # [Rp, BN]
        b = plgpu_triton.load(b_ref.at[jnp.full(row.shape, sc, jnp.int32), row, jnp.broadcast_to(cols, row.shape)],
                              mask=m, other=0.0)  # [Rp, BN]
        return acc + jnp.sum(scale(h) * b.astype(jnp.float32), axis=0)

    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[BN]
    if silu_mul:  # gate column c and up column N/2 + c, rounded as `layers.mlp.silu_mul` rounds them
        half = n_out // 2
        g = columns(cols).astype(dt).astype(jnp.float32)
        u = columns(cols + half).astype(dt).astype(jnp.float32)
        out = (g / (1.0 + jnp.exp(-g))).astype(dt).astype(jnp.float32) * u
        plgpu_triton.store(o_ref.at[tt, cols], out.astype(dt), mask=cols < half)
    else:
        plgpu_triton.store(o_ref.at[tt, cols], columns(cols).astype(dt), mask=cols < n_out)


@functools.partial(jax.jit, static_argnames=("h_offset", "parts", "live", "silu_mul", "norm", "out_dtype",
                                             "block_n", "interpret"))
def lora_expand_add(y, h, slot, b, residual=None, row_sum_sq=None, *, h_offset: int = 0, parts: tuple[int, ...] = (),
                    live: int = 0, silu_mul: bool = False, norm: tuple[float, int] = (), out_dtype=None,
                    block_n: int = 256, interpret: bool = False):
    """residual + y[:, :N] + each token's shrink h under its slot times that slot's B (module
    docstring) -> [T, N] in `out_dtype` (default: y's dtype).

    y [T, >= N]; h [T, >= h_offset + S*kR] (may be y itself); slot i32[T] (< 0: no delta;
    must be < S); b [S, kR, N], block diagonal over `parts` (the widths of a fused projection's
    parts, summing to N; () = one part); residual [T, N] or None; live > 0:
    tokens from `live` on (a decode step's padded rows) get no delta; silu_mul: a gate|up
    projection (two equal parts, no residual) whose output is silu(gate) * up, [T, N / 2] (as
    `layers.mlp.silu_mul` of the sum: the SwiGLU activation in the same launch); row_sum_sq
    f32[T] or None, with norm = (eps, size): y and h are a product before the RMSNorm's row scale
    (module docstring). T in 1..64.
    """
    t = y.shape[0]
    s, kr, n = b.shape
    parts = parts or (n,)
    if not 1 <= t <= MAX_T:
        raise ValueError(f"lora_expand_add: {t} tokens; the kernel takes 1..{MAX_T} (larger steps: the XLA path)")
    if (sum(parts) != n or kr % len(parts) or y.shape[1] < n or h.shape[0] != t
            or h.shape[1] < h_offset + s * kr or slot.shape != (t,)
            or (residual is not None and residual.shape != (t, n))
            or (row_sum_sq is not None and (row_sum_sq.size != t or len(norm) != 2))
            or (silu_mul and (len(parts) != 2 or parts[0] != parts[1] or residual is not None))):
        raise ValueError(f"lora_expand_add: shapes disagree: y {y.shape}, h {h.shape} (offset {h_offset}), slot "
                         f"{slot.shape}, b {b.shape}, parts {parts}, residual "
                         f"{None if residual is None else residual.shape}, {silu_mul=}")
    bounds = tuple(sum(parts[:i]) for i in range(1, len(parts)))
    width = n // 2 if silu_mul else n  # output columns
    block_n = min(block_n, _pow2(width))
    kernel = functools.partial(_expand_add_kernel, n_out=n, kr=kr, rank=kr // len(parts), h_off=h_offset,
                               bounds=bounds, block_n=block_n, live=live, silu_mul=silu_mul,
                               norm=norm if row_sum_sq is not None else (), res=residual is not None)
    args = (slot.astype(jnp.int32), y, h, b)
    args += () if row_sum_sq is None else (row_sum_sq.reshape(t).astype(jnp.float32),)
    args += () if residual is None else (residual,)
    return pl.pallas_call(
        kernel,
        grid=(t, pl.cdiv(width, block_n)),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((t, width), out_dtype or y.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="lora_expand_add",
    )(*args)
