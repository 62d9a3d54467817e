"""Routed-expert matvecs with packed 4-bit weights for MoE decode: y[p] = x[p] @ W[experts[p]]^T.

The 4-bit twin of `expert_fp8.py`. At decode a step routes P = tokens * top_k (token, expert)
pairs, so a layer's time is the time to read the routed experts' weights; 4-bit codes are a
quarter of bf16's bytes. Each program handles one pair and block_n output rows: it reads the
pair's expert id, streams that expert's rows of packed bytes [block_n, block_k / 2] a step at a
time, splits each byte into its even-column (low nibble) and odd-column (high nibble) codes,
dequantizes both in registers with the byte's group scale (and zero point), rounded to x's dtype
as the dense path's weights are, multiplies them with x's even and odd columns and reduces on
the CUDA cores (the M = 1 gemv of `w4.py`'s plain variant, without its half2 PTX); NVFP4's
per-row global scale multiplies the f32 result.

The weights are `metrale_jax.layers.linear.W4Linear`'s layout with an expert axis in front:
    x bf16 | f16[P, K]         packed u8[E, N, ceil(K/2)]   (code 2j of a row in byte j's low nibble)
    scales [E, N, ceil(K/G)]   f16 | bf16 | f32 (int4), float8_e4m3fn (fp4)
    aux    zeros u8[E, N, ceil(K/G)] (int4: W = (code - zero) * scale)
           or row_scale f32[E, N] (fp4: W = e2m1(code) * scale * row_scale)
    experts i32[P] -> y [P, N] in x's dtype (float32 accumulation).
Any N and K (masked partial tiles); G even (a byte's two codes share a group). Lowered through
Triton like `w4.py`; interpret mode on the CPU. On the H100 (session 42, correct against float64
numpy) it streamed 0.44-0.70 TB/s of packed bytes, slower than XLA's gather of the pairs' experts,
so the engine leaves it off (`W4Linear.expert_kernel`; `bench/kernels/expert_fp8.py --w4` times
it). Untuned: the half2 PTX and scale tiles of `w4.py` are the levers not tried here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.linear.w4 import _codes_f32, _e2m1, _load_scale


@dataclasses.dataclass(frozen=True)
class ExpertW4Params:
    """block_n: rows per program (power of two); block_k: K columns per step (power of two >= 32,
    block_k / 2 bytes of each row)."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        if self.block_n < 1 or self.block_n & (self.block_n - 1):
            raise ValueError(f"{self.block_n=} must be a power of two")
        if self.block_k < 32 or self.block_k & (self.block_k - 1):
            raise ValueError(f"{self.block_k=} must be a power of two >= 32")


def _kernel(e_ref, x_ref, p_ref, s_ref, a_ref, o_ref, *, n, k, group, block_n, block_k, num_steps, fp4):
    # e_ref i32[P]; x_ref [P, K]; p_ref u8[E, N, KB]; s_ref [E, N, NG]; a_ref u8[E, N, NG] | f32[E, N]; o_ref [P, N]
    p = pl.program_id(0)
    e = e_ref[p]  # the pair's expert
    half = block_k // 2
    kb, ng = (k + 1) // 2, (k + group - 1) // group
    rows = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[BN] weight rows
    n_ok = rows < n
    ze = e + jnp.zeros((block_n, 1), jnp.int32)
    zp = jnp.zeros((half,), jnp.int32) + p
    dt = x_ref.dtype

    def body(i, acc):
        j = i * half + jnp.arange(half, dtype=jnp.int32)  # i32[BK/2] byte columns
        ok = n_ok[:, None] & (j < kb)[None, :]
        at = (ze, rows[:, None], jnp.minimum(2 * j // group, ng - 1)[None, :])  # each byte's group
        b = plgpu_triton.load(p_ref.at[ze, rows[:, None], j[None, :]], mask=ok, other=0,
                              eviction_policy="evict_first").astype(jnp.int32)  # i32[BN, BK/2]
        s = _load_scale(s_ref.at[at], ok)  # f32[BN, BK/2]
        if fp4:  # e2m1 * e4m3 scale: exact in bf16 / f16
            we, wo = _e2m1(b & 15) * s, _e2m1(b >> 4) * s
        else:
            z = plgpu_triton.load(a_ref.at[at], mask=ok, other=0).astype(jnp.int32)
            we = (_codes_f32(b & 15) - _codes_f32(z)) * s
            wo = (_codes_f32(b >> 4) - _codes_f32(z)) * s
            we, wo = we.astype(dt).astype(jnp.float32), wo.astype(dt).astype(jnp.float32)
        xe = plgpu_triton.load(x_ref.at[zp, 2 * j], mask=2 * j < k, other=0.0).astype(jnp.float32)
        xo = plgpu_triton.load(x_ref.at[zp, 2 * j + 1], mask=2 * j + 1 < k, other=0.0).astype(jnp.float32)
        return acc + jnp.sum(we * xe[None, :] + wo * xo[None, :], axis=1)

    acc = jax.lax.fori_loop(0, num_steps, body, jnp.zeros((block_n,), jnp.float32))
    if fp4:
        acc = acc * plgpu_triton.load(a_ref.at[ze[:, 0], rows], mask=n_ok, other=0.0)
    plgpu_triton.store(o_ref.at[p + jnp.zeros_like(rows), rows], acc.astype(o_ref.dtype), mask=n_ok)


@functools.partial(jax.jit, static_argnames=("k", "group_size", "kind", "params", "interpret"))
def expert_matvec_w4(x, packed, scales, aux, experts, *, k: int, group_size: int, kind: str,
                     params: ExpertW4Params | None = None, interpret: bool = False):
    """x bf16 | f16[P, K], packed u8[E, N, ceil(K/2)], scales [E, N, ceil(K/G)], aux (zeros
    u8[E, N, ceil(K/G)] for kind "int4", row_scale f32[E, N] for "fp4"), experts i32[P] (each in
    0..E-1) -> [P, N] in x's dtype: row p is x[p] @ W[experts[p]]^T (see the module docstring)."""
    if kind not in ("int4", "fp4"):
        raise ValueError(f"expert_matvec_w4: kind must be 'int4' or 'fp4'; got {kind!r}")
    if x.ndim != 2 or packed.ndim != 3 or experts.shape != (x.shape[0],) or x.shape[1] != k:
        raise ValueError(f"expert_matvec_w4: x [P, K={k}], packed [E, N, K/2], experts [P]; got {x.shape}, "
                         f"{packed.shape}, {experts.shape}")
    num_e, n, kb = packed.shape
    ng = -(-k // group_size)
    if kb != -(-k // 2) or scales.shape != (num_e, n, ng) or group_size % 2:
        raise ValueError(f"expert_matvec_w4: packed {packed.shape} / scales {scales.shape} do not fit K={k} in "
                         f"groups of {group_size} (an even group size)")
    want = (num_e, n) if kind == "fp4" else (num_e, n, ng)
    if aux.shape != want:
        raise ValueError(f"expert_matvec_w4: {'row_scale' if kind == 'fp4' else 'zeros'} {aux.shape} must be {want}")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"expert_matvec_w4: x must be bfloat16 or float16; got {x.dtype}")
    params = params or ExpertW4Params()
    block_k = min(params.block_k, max(32, 1 << max(0, (k - 1).bit_length())))
    kernel = functools.partial(_kernel, n=n, k=k, group=group_size, block_n=params.block_n, block_k=block_k,
                               num_steps=-(-k // block_k), fp4=kind == "fp4")
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0], -(-n // params.block_n)),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), x.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
        interpret=interpret,
        name="expert_matvec_w4",
    )(experts.astype(jnp.int32), x, packed, scales, aux.astype(jnp.float32) if kind == "fp4" else aux)


def expert_matvec_w4_reference(x, packed, scales, aux, experts, *, k: int, group_size: int, kind: str):
    """Float32 reference: gather the pairs' experts, dequantize, one matvec each -> f32[P, N]."""
    from pallas_kernels.linear.reference import dequantize_w4_reference

    w = dequantize_w4_reference(packed[experts], scales[experts], aux[experts], k=k, group_size=group_size,
                                kind=kind)  # f32[P, N, K]
    return jnp.einsum("pk,pnk->pn", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
