"""Rotary position embedding, Hugging Face's non-interleaved (rotate-half) form."""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: tuple[float, ...], scale: float = 1.0) -> jax.Array:
    """x [..., T, H, D], positions i32[..., T]; rotates the first 2*len(inv_freq) dims of D, with cos
    and sin times `scale` (yarn's attention factor, `config.rope_attention_factor`)."""
    rot = 2 * len(inv_freq)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., T, rot/2]
    cos = jnp.cos(ang)[..., None, :]  # [..., T, 1, rot/2]
    sin = jnp.sin(ang)[..., None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., : rot // 2], xf[..., rot // 2 : rot], xf[..., rot:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: tuple[float, ...], scale: float = 1.0) -> jax.Array:
    """positions i32[T] -> f32[T, rot]: the cosines of the T x rot/2 angles, then their sines, times
    `scale` (the table `pallas_kernels.paged_attention.rope_and_write_kv` rotates with)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cs = jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=-1)
    return cs * scale if scale != 1.0 else cs
