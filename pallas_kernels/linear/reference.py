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
