"""Float32 references of the Mamba-2 SSD kernels (plain jnp, no Pallas).

Semantics follow transformers' `NemotronHMamba2Mixer` / `Mamba2Mixer` torch path (5.x):

* ``A = -exp(A_log)`` f32[H]; ``dt = softplus(dt_raw + dt_bias)`` (torch's softplus, threshold 20),
  then clamped to ``[dt_min, dt_max]``. transformers clamps in the chunked (prefill) path only, to
  ``time_step_limit`` = ``(time_step_min, inf)`` in NemotronH and ``config.time_step_limit`` in
  Mamba2; its single-step (decode) path does not clamp. Callers pass ``dt_min``/``dt_max``
  accordingly (``None`` = no bound).
* head ``h`` reads group ``h // (H // G)`` of B and C.
* ``y = C . state + D * x``; the gate by z and the gated RMSNorm stay outside (the model does them).
* states are f32 ``[..., H, P, N]`` (headdim before d_state), transformers' ``ssm_states`` layout.

`ssd_minimal` is the chunked "state space duality" form of mamba_ssm's ``ssd_minimal_discrete``,
re-derived here: intra-chunk outputs via a masked decay matrix, chunk states, the inter-chunk
recurrence as one more masked decay matrix over chunks, then state-to-output per chunk. It works
on equal-length batches; `ssd_chunk_scan_reference` runs it per stream of a varlen batch.
`selective_state_update_reference` is mamba_ssm's ``selective_state_update_ref`` (one step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def softplus_dt(dt_raw: Array, dt_bias: Array, dt_min: float | None, dt_max: float | None) -> Array:
    """f32 dt from raw dt [..., H] and dt_bias f32[H]: torch-style softplus, then the clamp."""
    v = dt_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    # torch.nn.functional.softplus(beta=1, threshold=20): identity above 20.
    dt = jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))
    if dt_min is not None and dt_min > -np.inf:
        dt = jnp.maximum(dt, dt_min)
    if dt_max is not None and dt_max < np.inf:
        dt = jnp.minimum(dt, dt_max)
    return dt


def segsum(a: Array) -> Array:
    """a f32[..., L] -> f32[..., L, L]: out[..., i, j] = sum(a[..., j+1 : i+1]) for i >= j, -inf above.

    Built as a masked cumulative sum (no difference of two large cumsums), so exp(out) is exact to
    rounding even when the sums are large and negative.
    """
    length = a.shape[-1]
    rep = jnp.broadcast_to(a[..., :, None], (*a.shape, length))  # rep[..., i, j] = a[i]
    strict = jnp.tril(jnp.ones((length, length), bool), k=-1)  # i > j
    out = jnp.cumsum(jnp.where(strict, rep, 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((length, length), bool)), out, -jnp.inf)


def ssd_minimal(
    x: Array,  # f32[b, l, h, p]
    dt: Array,  # f32[b, l, h] (already softplus'd and clamped)
    A: Array,  # f32[h] (negative)
    B: Array,  # f32[b, l, h, n] (groups already expanded to heads)
    C: Array,  # f32[b, l, h, n]
    chunk_size: int,
    initial_states: Array | None = None,  # f32[b, h, p, n]
) -> tuple[Array, Array]:
    """Chunked SSD over equal-length sequences -> (y f32[b, l, h, p] without the D skip, final f32[b, h, p, n])."""
    b, length, h, p = x.shape
    n = B.shape[-1]
    hp = jax.lax.Precision.HIGHEST
    pad = (-length) % chunk_size
    # Zero padding is neutral: dt = 0 means no decay (exp(0)) and no input.
    padt = lambda t: jnp.pad(t.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
    x, dt, B, C = padt(x), padt(dt), padt(B), padt(C)
    nc = (length + pad) // chunk_size
    X = (x * dt[..., None]).reshape(b, nc, chunk_size, h, p)  # discretized input
    Adt = (dt * A[None, None, :]).reshape(b, nc, chunk_size, h)
    Bc = B.reshape(b, nc, chunk_size, h, n)
    Cc = C.reshape(b, nc, chunk_size, h, n)
    Adt = jnp.moveaxis(Adt, -1, 1)  # [b, h, c, l]
    a_cum = jnp.cumsum(Adt, axis=-1)

    # 1. outputs inside each chunk: y[l] = sum_{s<=l} C[l].B[s] exp(a_cum[l]-a_cum[s]) X[s]
    decay = jnp.exp(segsum(Adt))  # [b, h, c, l, s]
    y_diag = jnp.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, decay, X, precision=hp)

    # 2. each chunk's own contribution to the state at its end
    decay_to_end = jnp.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, l]
    chunk_states = jnp.einsum("bclhn,bhcl,bclhp->bchpn", Bc, decay_to_end, X, precision=hp)

    # 3. recurrence over chunks: the state entering chunk c (and the final state)
    if initial_states is None:
        initial_states = jnp.zeros((b, h, p, n), jnp.float32)
    states = jnp.concatenate([initial_states.astype(jnp.float32)[:, None], chunk_states], axis=1)  # [b, c+1, h, p, n]
    chunk_decay = jnp.exp(segsum(jnp.pad(a_cum[..., -1], [(0, 0), (0, 0), (1, 0)])))  # [b, h, c+1, c+1]
    entering = jnp.einsum("bhzc,bchpn->bzhpn", chunk_decay, states, precision=hp)
    states, final = entering[:, :-1], entering[:, -1]

    # 4. the entering state's contribution to each position of the chunk
    y_off = jnp.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states, jnp.exp(a_cum), precision=hp)

    y = (y_diag + y_off).reshape(b, nc * chunk_size, h, p)[:, :length]
    return y, final


_ssd_minimal_jit = jax.jit(ssd_minimal, static_argnums=(5,))


def _expand_groups(t: Array, nheads: int) -> Array:
    """[..., G, N] -> [..., H, N]: head h uses group h // (H // G)."""
    return jnp.repeat(t, nheads // t.shape[-2], axis=-2)


def ssd_chunk_scan_reference(
    x: Array,  # [T, H, P]
    dt_raw: Array,  # [T, H]
    A_log: Array,  # f32[H]
    B: Array,  # [T, G, N]
    C: Array,  # [T, G, N]
    D: Array,  # f32[H]
    dt_bias: Array,  # f32[H]
    *,
    cu_seqlens,  # i32[S+1], concrete (host) values
    initial_states: Array,  # f32[S, H, P, N]
    dt_min: float | None = 0.0,
    dt_max: float | None = float("inf"),
    chunk_size: int = 64,
) -> tuple[Array, Array]:
    """Varlen reference: -> (y f32[T, H, P], final_states f32[S, H, P, N]); tokens past cu_seqlens[-1] give 0."""
    cu = np.asarray(cu_seqlens)
    num_tokens, nheads, _ = x.shape
    lens = np.diff(cu)
    lmax = max(int(lens.max(initial=0)), 1)
    # Gather the streams into a zero-padded batch [S, lmax]: trailing padding has dt = 0, which
    # leaves the state unchanged (no decay, no input), so the final states stay exact.
    pos = np.arange(lmax)[None, :]
    tok = np.where(pos < lens[:, None], cu[:-1, None] + pos, num_tokens)  # num_tokens -> padding row
    pad_row = lambda t: jnp.concatenate([t.astype(jnp.float32), jnp.zeros((1, *t.shape[1:]), jnp.float32)])
    A = -jnp.exp(A_log.astype(jnp.float32))
    dt = softplus_dt(dt_raw, dt_bias, dt_min, dt_max)
    xf = x.astype(jnp.float32)
    ys, finals = _ssd_minimal_jit(
        pad_row(xf)[tok],
        pad_row(dt)[tok],
        A,
        pad_row(_expand_groups(B, nheads))[tok],
        pad_row(_expand_groups(C, nheads))[tok],
        chunk_size,
        initial_states.astype(jnp.float32),
    )
    valid = pos < lens[:, None]
    y = jnp.zeros((num_tokens + 1, *x.shape[1:]), jnp.float32).at[tok[valid]].set(ys[valid])[:num_tokens]
    y = y + jnp.where(np.arange(num_tokens)[:, None, None] < cu[-1], D.astype(jnp.float32)[None, :, None] * xf, 0.0)
    return y, finals


def selective_state_update_reference(
    state: Array,  # f32[S, H, P, N] (S = N rows, or the pool when state_indices is given)
    x: Array,  # [R, H, P]
    dt_raw: Array,  # [R, H]
    A_log: Array,  # f32[H]
    B: Array,  # [R, G, N]
    C: Array,  # [R, G, N]
    D: Array,  # f32[H]
    dt_bias: Array,  # f32[H]
    *,
    state_indices: Array | None = None,  # i32[R]; -1 = padding row
    dt_min: float | None = None,
    dt_max: float | None = None,
) -> tuple[Array, Array]:
    """One recurrent step per row -> (y f32[R, H, P], new state f32 like `state`); padding rows give y = 0."""
    rows, nheads, _ = x.shape
    idx = jnp.arange(rows, dtype=jnp.int32) if state_indices is None else state_indices
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    s = state.astype(jnp.float32)[safe]  # [R, H, P, N]
    A = -jnp.exp(A_log.astype(jnp.float32))
    dt = softplus_dt(dt_raw, dt_bias, dt_min, dt_max)  # [R, H]
    Bh = _expand_groups(B.astype(jnp.float32), nheads)  # [R, H, N]
    Ch = _expand_groups(C.astype(jnp.float32), nheads)
    xf = x.astype(jnp.float32)
    dA = jnp.exp(dt * A[None, :])[..., None, None]  # [R, H, 1, 1]
    s_new = s * dA + (dt[..., None, None] * xf[..., None]) * Bh[:, :, None, :]
    y = jnp.einsum("rhpn,rhn->rhp", s_new, Ch, precision=jax.lax.Precision.HIGHEST)
    y = y + D.astype(jnp.float32)[None, :, None] * xf
    y = jnp.where(valid[:, None, None], y, 0.0)
    target = jnp.where(valid, idx, state.shape[0])  # out of range -> dropped
    new_state = state.astype(jnp.float32).at[target].set(s_new, mode="drop")
    return y, new_state
