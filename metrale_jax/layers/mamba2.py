"""Mamba-2 pieces in plain XLA: dt discretization, the varlen SSD recurrence, the gated group norm.

The recurrence here is the token-by-token form (`lax.scan` over the stacked tokens of all
streams), the CPU default; `pallas_kernels/mamba2` holds the chunked GPU kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.naive import token_stream_ids


def softplus(v):
    """torch.nn.functional.softplus (threshold 20)."""
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def ssd_varlen(x, dt, A, B, C, D, *, cu_seqlens, initial_state):
    """The selective state-space recurrence over varlen streams, one token at a time.

    x [T, H, P], dt f32[T, H] (softplus'd and clamped), A f32[H] (< 0), B/C [T, G, N], D f32[H],
    cu_seqlens i32[S+1], initial_state f32[S, H, P, N]
    -> (y f32[T, H, P], final f32[S, H, P, N]). Tokens past cu_seqlens[-1] give 0.
    """
    t_len, h, _ = x.shape
    rep = h // B.shape[1]
    Bh = jnp.repeat(B.astype(jnp.float32), rep, axis=1)  # [T, H, N]
    Ch = jnp.repeat(C.astype(jnp.float32), rep, axis=1)
    sid = token_stream_ids(cu_seqlens, t_len)
    num_streams = initial_state.shape[0]
    xf = x.astype(jnp.float32)

    def step(states, xs):
        x_t, dt_t, b_t, c_t, s_t = xs
        valid = s_t < num_streams
        i = jnp.minimum(s_t, num_streams - 1)
        st = states[i] * jnp.exp(dt_t * A)[:, None, None] + (dt_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]
        y = jnp.einsum("hpn,hn->hp", st, c_t, precision="highest") + D[:, None] * x_t
        return jnp.where(valid, states.at[i].set(st), states), jnp.where(valid, y, 0.0)

    final, y = jax.lax.scan(step, initial_state.astype(jnp.float32), (xf, dt, Bh, Ch, sid))
    return y, final


def gated_group_rms_norm(x, z, w, groups: int, eps: float):
    """NemotronH / Mamba2 gated norm: multiply by silu(z) first, then RMS-normalize per group.

    x, z [T, I], w [I] -> [T, I] in x's dtype.
    """
    y = x.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    t, i = y.shape
    yg = y.reshape(t, groups, i // groups)
    yg = yg * jax.lax.rsqrt(jnp.mean(yg * yg, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * yg.reshape(t, i)).astype(x.dtype)
