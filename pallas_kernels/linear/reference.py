"""Float32 references of the skinny linear kernels (plain jnp; the tests' oracle besides numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_BLOCK = 128


def skinny_matmul_reference(x, w):
    """x [M, K], w [N, K] (any float dtypes) -> f32[M, N] = x @ w.T computed in float32."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def dequantize_fp8_reference(w8, scale_inv):
    """w8 float8_e4m3fn[N, K], scale_inv f32[ceil(N/128), ceil(K/128)] -> f32[N, K] = w8 * scale_inv."""
    n, k = w8.shape
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:n, :k]
    return w8.astype(jnp.float32) * s


def skinny_matmul_fp8_reference(x, w8, scale_inv):
    """x [M, K], w8 float8_e4m3fn[N, K], scale_inv f32[ceil(N/128), ceil(K/128)] -> f32[M, N]."""
    return skinny_matmul_reference(x, dequantize_fp8_reference(w8, scale_inv))


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_w4_reference(packed, scales, aux, *, k: int, group_size: int, kind: str):
    """packed u8[..., N, ceil(K/2)] (code 2j low nibble, 2j+1 high), scales [..., N, ceil(K/G)],
    aux: zeros u8[..., N, ceil(K/G)] ("int4") or row_scale f32[..., N] ("fp4") -> f32[..., N, K]:
    (code - zero) * scale, or e2m1(code) * scale * row_scale."""
    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))[..., :k]
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=-1)[..., :k]
    if kind == "fp4":
        return jnp.asarray(_E2M1, jnp.float32)[codes] * s * aux.astype(jnp.float32)[..., None]
    z = jnp.repeat(aux.astype(jnp.float32), group_size, axis=-1)[..., :k]
    return (codes.astype(jnp.float32) - z) * s


def skinny_matmul_w4_reference(x, packed, scales, aux, *, k: int, group_size: int, kind: str):
    """x [M, K] @ dequantize_w4_reference(...)^T -> f32[M, N]."""
    w = dequantize_w4_reference(packed, scales, aux, k=k, group_size=group_size, kind=kind)
    return skinny_matmul_reference(x, w)
