"""Float32 reference of the gated delta rule: a plain loop over time (no chunking), varlen.

Semantics follow transformers' `torch_recurrent_gated_delta_rule` (Qwen3-Next) and FLA's
`fla/ops/gated_delta_rule/naive.py`. Per value head hv (served by q/k head h = hv // (HV // H)),
with the state S f32[K, V] (the layout of transformers' `recurrent_states`, [.., HV, K, V]):

    q_t, k_t <- l2norm(q_t), l2norm(k_t)          (only when use_qk_l2norm; eps 1e-6 inside rsqrt)
    q_t      <- q_t * scale                        (scale = K ** -0.5 unless given)
    S        <- S * exp(g_t)                       (decay first)
    delta    <- beta_t * (v_t - S^T k_t)           (f32[V]: the part of v_t the state does not predict)
    S        <- S + k_t delta^T                    (rank-1 write)
    o_t      <- S^T q_t                            (read after the write)

Streams are stacked along T and delimited by `cu_seqlens`; each starts from its own
`initial_state` row. Tokens at or after cu_seqlens[-1] produce zeros and touch no state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2norm(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis, as transformers' / FLA's `l2norm`."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def scaled_qk(q, k, v_heads: int, scale: float | None, use_qk_l2norm: bool):
    """q, k [T, H, K] -> f32[T, HV, K] each: optionally L2-normalised, repeated over the HV // H
    value heads of each key head, q times `scale` (K ** -0.5 when None)."""
    grp = v_heads // q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    return jnp.repeat(qf, grp, axis=1) * scale, jnp.repeat(kf, grp, axis=1)


def token_stream_ids(cu_seqlens, num_tokens: int):
    """i32[T]: the stream each token belongs to (B for tokens at or after cu_seqlens[-1])."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.sum(cu_seqlens[1:][None, :] <= t[:, None], axis=1).astype(jnp.int32)


@jax.jit(static_argnames=("scale", "use_qk_l2norm"))
def naive_gated_delta_rule(
    q,  # [T, H, K]
    k,  # [T, H, K]
    v,  # [T, HV, V]
    g,  # f32[T, HV] (log decay, <= 0)
    beta,  # f32[T, HV]
    *,
    cu_seqlens,  # i32[B + 1]
    initial_state,  # f32[B, HV, K, V]
    scale: float | None = None,
    use_qk_l2norm: bool = False,
):
    """-> (o [T, HV, V] in q.dtype, final_state f32[B, HV, K, V]). Plain f32 scan over tokens."""
    t_len = q.shape[0]
    qf, kf = scaled_qk(q, k, v.shape[1], scale, use_qk_l2norm)  # f32[T, HV, K]
    vf = v.astype(jnp.float32)
    sid = token_stream_ids(cu_seqlens, t_len)
    num_streams = initial_state.shape[0]

    def step(states, xs):
        q_t, k_t, v_t, g_t, b_t, s_t = xs
        valid = s_t < num_streams
        sidx = jnp.minimum(s_t, num_streams - 1)
        st = states[sidx] * jnp.exp(g_t)[:, None, None]  # [HV, K, V]
        kv_mem = jnp.einsum("hkv,hk->hv", st, k_t, precision="highest")
        delta = (v_t - kv_mem) * b_t[:, None]
        st = st + k_t[:, :, None] * delta[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", st, q_t, precision="highest")
        states = jnp.where(valid, states.at[sidx].set(st), states)
        return states, jnp.where(valid, o_t, 0.0)

    xs = (qf, kf, vf, g.astype(jnp.float32), beta.astype(jnp.float32), sid)
    final, o = jax.lax.scan(step, initial_state.astype(jnp.float32), xs)
    return o.astype(q.dtype), final
