"""Shared pieces of the gated-delta kernels: input checks and in-kernel helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu_triton

IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def check_inputs(q, k, v, g, beta, state, *, rows_name: str):
    """Validates q/k [R, H, K], v [R, HV, V], g/beta [R, HV], state f32[*, HV, K, V]; -> (R, H, HV, K, V)."""
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [{rows_name}, H, K]; got {q.shape} and {k.shape}")
    r, h, dk = q.shape
    if v.ndim != 3 or v.shape[0] != r:
        raise ValueError(f"v must be [{rows_name}, HV, V] with {rows_name}={r}; got {v.shape}")
    hv, dv = v.shape[1], v.shape[2]
    if hv % h:
        raise ValueError(f"value heads HV={hv} must be a multiple of q/k heads H={h}")
    if g.shape != (r, hv) or beta.shape != (r, hv):
        raise ValueError(f"g and beta must be [{rows_name}, HV]=({r}, {hv}); got {g.shape} and {beta.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in IN_DTYPES:
            raise ValueError(f"{name} dtype {x.dtype} must be one of {IN_DTYPES}")
    if not (is_pow2(dk) and dk >= 16 and is_pow2(dv) and dv >= 16):
        raise ValueError(f"head dims K={dk}, V={dv} must be powers of two >= 16")
    if state.ndim != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state must be f32[*, HV, K, V]=[*, {hv}, {dk}, {dv}]; got {state.shape}")
    if jnp.dtype(state.dtype) != jnp.float32:
        raise ValueError(f"state dtype must be float32; got {state.dtype}")
    return r, h, hv, dk, dv


def compute_dtype(*dtypes):
    """Dot operand dtype: float32 if any input is float32, else the (16-bit) input dtype."""
    ds = {jnp.dtype(d) for d in dtypes}
    if jnp.dtype(jnp.float32) in ds:
        return jnp.dtype(jnp.float32)
    if len(ds) != 1:
        raise ValueError(f"q, k and v must share one 16-bit dtype; got {sorted(map(str, ds))}")
    return ds.pop()


def dot(a, b, *, trans_a=False, trans_b=False):
    """f32-accumulating tile dot; exact (ieee) when the operands are float32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu_triton.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=prec).astype(jnp.float32)


def l2norm_rows(x):
    """f32 rows scaled by rsqrt(sum(x^2) + 1e-6), as transformers' / FLA's l2norm."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
