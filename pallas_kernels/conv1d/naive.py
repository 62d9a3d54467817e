"""Float32 references of the depthwise causal conv1d (transformers' Qwen3-Next / causal-conv1d).

Weights w f32[C, W]; tap W-1 multiplies the current input:

    y_t[c] = bias[c] + sum_{i<W} w[c, i] * x_{t-(W-1)+i}[c]      (then silu when asked)

A conv state f32[.., C, S] holds the last S inputs of a stream, oldest first (column S-1 is the
newest), as transformers' `causal_conv1d_update` and causal-conv1d's `causal_conv1d_update_ref`
keep it. Inputs before a stream's first token come from its state's last W-1 columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.naive import token_stream_ids


@jax.jit(static_argnames=("silu",))
def naive_causal_conv1d_varlen(
    x,  # [T, C]
    w,  # [C, W]
    bias,  # [C] or None
    *,
    cu_seqlens,  # i32[B + 1]
    initial_state,  # f32[B, C, W-1]
    silu: bool = True,
):
    """-> (y [T, C] in x.dtype, final_state f32[B, C, W-1]). A plain scan over tokens."""
    t_len, c = x.shape
    width = w.shape[1]
    num_streams = initial_state.shape[0]
    sid = token_stream_ids(cu_seqlens, t_len)
    wf = w.astype(jnp.float32)
    bf = jnp.zeros((c,), jnp.float32) if bias is None else bias.astype(jnp.float32)

    def step(states, xs):
        x_t, s_t = xs
        valid = s_t < num_streams
        sidx = jnp.minimum(s_t, num_streams - 1)
        window = jnp.concatenate([states[sidx], x_t[:, None]], axis=1)  # [C, W]
        y_t = jnp.sum(window * wf, axis=1) + bf
        if silu:
            y_t = jax.nn.silu(y_t)
        states = jnp.where(valid, states.at[sidx].set(window[:, 1:]), states)
        return states, jnp.where(valid, y_t, 0.0)

    if width == 1:  # no state to carry
        y = x.astype(jnp.float32) * wf[:, 0] + bf
        y = jax.nn.silu(y) if silu else y
        y = jnp.where((sid < num_streams)[:, None], y, 0.0)
        return y.astype(x.dtype), initial_state.astype(jnp.float32)
    final, y = jax.lax.scan(step, initial_state.astype(jnp.float32), (x.astype(jnp.float32), sid))
    return y.astype(x.dtype), final


@jax.jit(static_argnames=("silu",))
def naive_causal_conv1d_update(
    x,  # [N, C]
    conv_state,  # f32[N, C, S], S >= W-1
    w,  # [C, W]
    bias=None,  # [C] or None
    *,
    silu: bool = True,
):
    """-> (y [N, C] in x.dtype, new_state f32[N, C, S]): one token per row, state keeps the last S inputs."""
    width = w.shape[1]
    full = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=2)
    y = jnp.sum(full[:, :, -width:] * w.astype(jnp.float32)[None], axis=2)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)
    return y.astype(x.dtype), full[:, :, 1:]
