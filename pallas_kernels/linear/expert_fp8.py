"""Routed-expert matvecs with block-FP8 weights for MoE decode: y[p] = x[p] @ W[experts[p]]^T.

At decode a step routes P = tokens * top_k (token, expert) pairs, fewer than the experts, so the
layer's time is the time to read the P routed experts' weights once. Each program handles one
pair and block_n output rows: it reads the pair's expert id, streams that expert's FP8 rows
[block_n, K] (128x128 block scales, the HF / DeepSeek-V3 `weight_scale_inv` format, folded
into x per column as `skinny.py` does: x * s, then multiply-and-reduce on the CUDA cores, the
M = 1 gemv of `skinny.py`) and writes y[p, rows]. Pairs routed to the same expert read its
weights again (from L2 when they run close together); at decode sizes (P < E) few pairs share.

Shapes: x bf16[P, K], w8 float8_e4m3fn[E, N, K], scale_inv f32[E, ceil(N/128), ceil(K/128)],
experts i32[P] -> bf16[P, N]; any N and K (masked partial tiles). block_n must divide 128 (one
scale row per program). Lowered through Triton like `skinny.py`; interpret mode on the CPU.
Untuned, not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class ExpertParams:
    """block_n: rows per program (a power of two dividing 128); block_k: K columns per step (power of two >= 16)."""

    block_n: int = 16
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        if self.block_n < 1 or FP8_BLOCK % self.block_n:
            raise ValueError(f"{self.block_n=} must divide {FP8_BLOCK}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"{self.block_k=} must be a power of two >= 16")


def _kernel(e_ref, x_ref, w_ref, s_ref, o_ref, *, n, k, block_n, block_k, num_steps):
    # e_ref i32[P]; x_ref bf16[P, K]; w_ref f8[E, N, K]; s_ref f32[E, NB, KB]; o_ref bf16[P, N]
    p = pl.program_id(0)
    j = pl.program_id(1)
    e = e_ref[p]  # the pair's expert
    kb = (k + FP8_BLOCK - 1) // FP8_BLOCK
    ncols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[BN] weight rows
    n_ok = ncols < n
    nb = (j * block_n) // FP8_BLOCK  # the program's scale row
    zk = jnp.zeros((block_k,), jnp.int32)

    def body(i, acc):
        kcols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[BK]
        k_ok = kcols < k
        x = plgpu_triton.load(x_ref.at[p + zk, kcols], mask=k_ok, other=0.0).astype(jnp.float32)  # f32[BK]
        s = plgpu_triton.load(s_ref.at[e + zk, nb + zk, jnp.minimum(kcols // FP8_BLOCK, kb - 1)])  # f32[BK]
        w = plgpu_triton.load(w_ref.at[e + jnp.zeros((block_n, 1), jnp.int32), ncols[:, None], kcols[None, :]],
                              mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                              eviction_policy="evict_first").astype(jnp.float32)  # f32[BN, BK]
        return acc + jnp.sum(w * (x * s)[None, :], axis=1)

    acc = jax.lax.fori_loop(0, num_steps, body, jnp.zeros((block_n,), jnp.float32))
    plgpu_triton.store(o_ref.at[p + jnp.zeros_like(ncols), ncols], acc.astype(o_ref.dtype), mask=n_ok)


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def expert_matvec_fp8(x, w8, scale_inv, experts, *, params: ExpertParams | None = None, interpret: bool = False):
    """x bf16[P, K], w8 float8_e4m3fn[E, N, K], scale_inv f32[E, ceil(N/128), ceil(K/128)],
    experts i32[P] (each in 0..E-1) -> bf16[P, N]: row p is x[p] @ (w8 * scale)[experts[p]]^T."""
    if x.ndim != 2 or w8.ndim != 3 or experts.shape != (x.shape[0],):
        raise ValueError(f"expert_matvec_fp8: x [P, K], w8 [E, N, K], experts [P]; got {x.shape}, {w8.shape}, "
                         f"{experts.shape}")
    num_e, n, k = w8.shape
    if x.shape[1] != k:
        raise ValueError(f"expert_matvec_fp8: x {x.shape} and w8 {w8.shape} disagree on K")
    want = (num_e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if scale_inv.shape != want:
        raise ValueError(f"expert_matvec_fp8: scale_inv {scale_inv.shape} must be {want}")
    if jnp.dtype(w8.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"expert_matvec_fp8: w8 must be float8_e4m3fn; got {w8.dtype}")
    params = params or ExpertParams()
    block_k = min(params.block_k, max(16, 1 << max(0, (k - 1).bit_length())))
    kernel = functools.partial(_kernel, n=n, k=k, block_n=params.block_n, block_k=block_k,
                               num_steps=-(-k // block_k))
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0], -(-n // params.block_n)),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), x.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="expert_matvec_fp8",
    )(experts.astype(jnp.int32), x, w8, scale_inv.astype(jnp.float32))


def expert_matvec_fp8_reference(x, w8, scale_inv, experts):
    """Float32 reference: gather the pairs' experts, dequantize, one matvec each -> f32[P, N]."""
    from pallas_kernels.linear.reference import dequantize_fp8_reference

    w = jax.vmap(dequantize_fp8_reference)(w8[experts], scale_inv[experts])  # f32[P, N, K]
    return jnp.einsum("pk,pnk->pn", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
