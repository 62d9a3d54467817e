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
