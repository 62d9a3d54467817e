"""Recurrent layers in a speculative verify step: the state after every position of the window.

A verify step (`BatchedAttnMetadata.verify_width` W = 1 + k > 0) feeds each of its N rows
1 + k_r tokens (the last sampled token, then k_r <= k drafts) as one stream of the ragged
prefill layout. Attention needs nothing more (a rejected position's K/V is written but lies past
the sequence's length, and the next step overwrites it). A recurrent layer must not commit its
state after the whole window, since only a prefix is accepted: in a verify step it computes the
state after every position j of the window (`*_per_position` below, token by token) and writes
them into the step's scratch `ssm[SCRATCH][kind][name]` f32[N * W, L, ...] (row r * W + j), not
into the pool. Once the step has sampled and accepted, `commit` copies row r * W + a_r (a_r =
accepted drafts of row r) into the sequence's pool slot: write-on-accept. The pool thus only ever
holds verified states (what swap-out, prefix-cache snapshots and the next step read); unverified
states live only inside the step.

Positions j >= 1 + k_r of a row (padded drafts) carry the state unchanged; they are never selected.
Recurrent layers treat verify tokens as decode tokens (Mamba-2: dt not clamped), so a verify
window computes what the same tokens would compute one decode step at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.naive import scaled_qk

SCRATCH = "verify_scratch"  # key of the per-position states in the SSM dict during a verify step


def verify_grid(md):
    """The window layout of a verify metadata `md` (BatchedAttnMetadata, W = md.verify_width):
    -> (idx i32[N, W] index of row r's position j among the step's tokens (clipped), mask bool[N, W]
    whether that position holds a token)."""
    w = md.verify_width
    n_new = md.cu_seqlens[1:] - md.cu_seqlens[:-1]  # i32[N]
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    t = md.positions.shape[0]
    idx = jnp.clip(md.cu_seqlens[:-1, None] + j, 0, t - 1)
    return idx, j < n_new[:, None]


def conv_states_per_position(x, conv0, idx):
    """Conv states after each window position. x [T, C] (the conv's inputs), conv0 f32[N, C, K-1],
    idx i32[N, W] -> f32[N, W, C, K-1]: the last K-1 inputs up to and including position j."""
    km1 = conv0.shape[-1]
    w = idx.shape[1]
    xs = jnp.swapaxes(x[idx].astype(jnp.float32), 1, 2)  # [N, C, W]
    full = jnp.concatenate([conv0.astype(jnp.float32), xs], axis=2)  # [N, C, K-1+W]
    return jnp.stack([full[:, :, j + 1: j + 1 + km1] for j in range(w)], axis=1)


def _scatter_tokens(grid_vals, idx, mask, t: int):
    """[N, W, ...] values back to the step's token order [T, ...] (padding positions dropped)."""
    flat = jnp.where(mask, idx, t).reshape(-1)
    out = jnp.zeros((t,) + grid_vals.shape[2:], grid_vals.dtype)
    return out.at[flat].set(grid_vals.reshape((-1,) + grid_vals.shape[2:]), mode="drop")


def gated_delta_per_position(q, k, v, g, beta, idx, mask, rec0, *, scale=None, use_qk_l2norm=False):
    """The gated delta rule (pallas_kernels/gated_delta/naive.py, same arithmetic) over each row's
    window, keeping every state. q/k [T, H, K], v [T, HV, V], g/beta f32[T, HV], idx/mask [N, W],
    rec0 f32[N, HV, K, V] -> (o [T, HV, V] in q.dtype, states f32[N, W, HV, K, V])."""
    t = q.shape[0]
    qf, kf = scaled_qk(q, k, v.shape[1], scale, use_qk_l2norm)  # f32[T, HV, K]
    xs = tuple(jnp.swapaxes(a[idx], 0, 1) for a in (qf, kf, v.astype(jnp.float32), g.astype(jnp.float32),
                                                     beta.astype(jnp.float32)))  # [W, N, ...]

    def step(st, x):
        q_t, k_t, v_t, g_t, b_t, m_t = x
        s = st * jnp.exp(g_t)[:, :, None, None]
        kv_mem = jnp.einsum("nhkv,nhk->nhv", s, k_t, precision="highest")
        delta = (v_t - kv_mem) * b_t[:, :, None]
        s = s + k_t[:, :, :, None] * delta[:, :, None, :]
        o = jnp.einsum("nhkv,nhk->nhv", s, q_t, precision="highest")
        s = jnp.where(m_t[:, None, None, None], s, st)
        return s, (o, s)

    _, (o, states) = jax.lax.scan(step, rec0.astype(jnp.float32), xs + (mask.T,))
    o = _scatter_tokens(jnp.swapaxes(o, 0, 1), idx, mask, t)
    return o.astype(q.dtype), jnp.swapaxes(states, 0, 1)


def ssd_per_position(x, dt, A, B, C, D, idx, mask, ssm0):
    """The Mamba-2 recurrence (layers/mamba2.ssd_varlen, same arithmetic) over each row's window,
    keeping every state. x [T, H, P], dt f32[T, H], A/D f32[H], B/C [T, G, N], idx/mask [N, W],
    ssm0 f32[N, H, P, N] -> (y f32[T, H, P], states f32[N, W, H, P, N])."""
    t, h, _ = x.shape
    rep = h // B.shape[1]
    Bh = jnp.repeat(B.astype(jnp.float32), rep, axis=1)
    Ch = jnp.repeat(C.astype(jnp.float32), rep, axis=1)
    xs = tuple(jnp.swapaxes(a[idx], 0, 1) for a in (x.astype(jnp.float32), dt.astype(jnp.float32), Bh, Ch))

    def step(st, xx):
        x_t, dt_t, b_t, c_t, m_t = xx
        s = st * jnp.exp(dt_t * A)[:, :, None, None] + (dt_t[:, :, None] * x_t)[:, :, :, None] * b_t[:, :, None, :]
        y = jnp.einsum("nhpk,nhk->nhp", s, c_t, precision="highest") + D[None, :, None] * x_t
        s = jnp.where(m_t[:, None, None, None], s, st)
        return s, (y, s)

    _, (y, states) = jax.lax.scan(step, ssm0.astype(jnp.float32), xs + (mask.T,))
    return _scatter_tokens(jnp.swapaxes(y, 0, 1), idx, mask, t), jnp.swapaxes(states, 0, 1)


def write_scratch(ssm: dict, kind: str, layer, values: dict) -> dict:
    """Store one layer's per-position states {name: f32[N, W, ...]} in the step's scratch."""
    sc = ssm[SCRATCH][kind]
    new = {name: sc[name].at[:, layer].set(v.reshape((-1,) + v.shape[2:]).astype(sc[name].dtype))
           for name, v in values.items()}
    return {**ssm, SCRATCH: {**ssm[SCRATCH], kind: {**sc, **new}}}


def add_scratch(ssm: dict, rows: int) -> dict:
    """The SSM dict plus a zeroed scratch of `rows` = N * W rows per pool array."""
    return {**ssm, SCRATCH: {kind: {name: jnp.zeros((rows,) + a.shape[1:], a.dtype) for name, a in arrays.items()}
                             for kind, arrays in ssm.items()}}


def commit(ssm: dict, slots, accepted, width: int) -> dict:
    """Write-on-accept: pool[slots[r]] <- scratch[r * width + accepted[r]] for every array; drop the
    scratch. slots i32[N] (-1 = pad row, writes nothing), accepted i32[N] in [0, width)."""
    sc = ssm[SCRATCH]
    src = jnp.arange(slots.shape[0], dtype=jnp.int32) * width + accepted
    out = {}
    for kind, arrays in ssm.items():
        if kind == SCRATCH:
            continue
        out[kind] = {}
        for name, a in arrays.items():
            dst = jnp.where(slots < 0, a.shape[0], slots)
            out[kind][name] = a.at[dst].set(sc[kind][name][src], mode="drop")
    return out
