"""Reading and writing one recurrent layer's rows of the SSM pool inside a layer scan.

Hybrid models keep, per kind of recurrent layer, arrays `[max_slots, num_layers_of_kind, ...]`
in the engine's SSM pool (slot first, so snapshot/restore of a slot is one row). Slot -1 is
padding: it reads zeros and writes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def read_layer(pool_array: jax.Array, slots: jax.Array, layer: jax.Array, fresh: jax.Array | None = None):
    """pool_array [S, L, ...], slots i32[N], layer i32[] -> f32[N, ...].

    Rows with slot -1, or with `fresh` True (a sequence starting at position 0), read zeros.
    """
    size = pool_array.shape[0]
    idx = jnp.where(slots < 0, size, slots)
    # Gather (slot, layer) pairs directly so no [N, L, ...] intermediate is built.
    rows = pool_array.at[idx, layer].get(mode="fill", fill_value=0).astype(jnp.float32)
    if fresh is not None:
        rows = jnp.where(fresh.reshape((-1,) + (1,) * (rows.ndim - 1)), 0.0, rows)
    return rows


def write_layer(pool_array: jax.Array, slots: jax.Array, layer: jax.Array, values: jax.Array) -> jax.Array:
    """Write values [N, ...] into pool_array[slots, layer]; slot -1 writes nothing."""
    size = pool_array.shape[0]
    idx = jnp.where(slots < 0, size, slots)
    return pool_array.at[idx, layer].set(values.astype(pool_array.dtype), mode="drop")


def recurrent_streams(dmd, pmd):
    """The streams a recurrent layer sees in a step: each decode row is a stream of one token,
    then each prefill chunk a stream of its tokens.

    -> (cu_seqlens i32[N + B + 1], ssm_slots i32[N + B], fresh bool[N + B]); `fresh` marks a
    stream starting at position 0, whose state must start from zeros, not from its pool row.
    """
    cu, slots, fresh = [jnp.zeros((1,), jnp.int32)], [], []
    n = dmd.num_seqs if dmd is not None else 0
    if dmd is not None:
        cu.append(jnp.arange(1, n + 1, dtype=jnp.int32))
        slots.append(dmd.ssm_slots)
        fresh.append(dmd.seq_lens <= 1)
    if pmd is not None:
        new = pmd.cu_seqlens[1:] - pmd.cu_seqlens[:-1]
        cu.append(n + pmd.cu_seqlens[1:])
        slots.append(pmd.ssm_slots)
        fresh.append(pmd.kv_lens - new <= 0)
    return jnp.concatenate(cu), jnp.concatenate(slots), jnp.concatenate(fresh)
