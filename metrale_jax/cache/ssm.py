"""The generic SSM state pool: per-sequence recurrent state rows, separate from the KV pages.

Per recurrent layer, any set of named arrays `[max_slots, ...]` (a Mamba-2 layer has a conv state
and an SSD state, a GDN layer a conv state and a delta-rule state, ...). A sequence owns one slot
(the same index in every layer), handed out by the host `SlotAllocator`; steps read and write the
rows of their sequences through `read_slots` / `write_slots`, where slot -1 (padding) reads zeros
and writes nothing. `snapshot` copies one slot of every layer to host memory and `restore` puts it
back (into any slot): preemption by swap, prefix caching and speculative rollback for hybrids.

The pool is a plain pytree `{layer name: {array name: Array[max_slots, ...]}}`, the `ssm` field
of `metrale_jax.cache.EngineState`, donated with the rest of the state.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache.allocator import SlotAllocator

Array = jax.Array
SSMPool = dict  # {layer name: {array name: Array[max_slots, ...]}}
SSMSnapshot = dict  # {layer name: {array name: np.ndarray[...]}} (one slot, host memory)


@dataclass(frozen=True)
class SSMArraySpec:
    """One named state array of a layer: per-slot `shape` and `dtype` (a numpy dtype name)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


SSMSpec = Mapping[str, Mapping[str, SSMArraySpec]]  # layer name -> array name -> spec


def init_ssm_pool(spec: SSMSpec, max_slots: int) -> SSMPool:
    """Zeroed pool of `max_slots` rows for every layer and array of `spec`."""
    return {
        layer: {name: jnp.zeros((max_slots, *a.shape), a.dtype) for name, a in arrays.items()}
        for layer, arrays in spec.items()
    }


def ssm_bytes_per_slot(spec: SSMSpec) -> int:
    """Bytes one sequence's state takes over all layers (exact, from shapes: size pools with it)."""
    return sum(a.bytes for arrays in spec.values() for a in arrays.values())


def pool_max_slots(pool: SSMPool) -> int:
    for arrays in pool.values():
        for a in arrays.values():
            return int(a.shape[0])
    return 0


def _oob(slots: Array, size: int) -> Array:
    return jnp.where(slots < 0, size, slots)


def read_slots(layer_pool: Mapping[str, Array], slots: Array) -> dict[str, Array]:
    """Rows `slots` i32[N] of each array -> {name: [N, ...]}; slot -1 reads zeros."""
    return {
        name: jnp.take(a, _oob(slots, a.shape[0]), axis=0, mode="fill", fill_value=0)
        for name, a in layer_pool.items()
    }


def write_slots(layer_pool: Mapping[str, Array], slots: Array, values: Mapping[str, Array]) -> dict[str, Array]:
    """Write `values[name]` [N, ...] into rows `slots` i32[N]; slot -1 writes nothing.

    Arrays missing from `values` are kept. Two rows with the same valid slot is a caller bug.
    """
    out = dict(layer_pool)
    for name, v in values.items():
        a = layer_pool[name]
        out[name] = a.at[_oob(slots, a.shape[0])].set(v.astype(a.dtype), mode="drop")
    return out


def reset_slots(pool: SSMPool, slots: Array) -> SSMPool:
    """Zero rows `slots` i32[N] of every layer (a sequence starting from position 0); -1 = none."""
    return {
        layer: {name: a.at[_oob(slots, a.shape[0])].set(0, mode="drop") for name, a in arrays.items()}
        for layer, arrays in pool.items()
    }


@functools.partial(jax.jit, donate_argnums=0)
def _restore(pool: SSMPool, slot: Array, snap: SSMSnapshot) -> SSMPool:
    return {
        layer: {name: a.at[slot].set(snap[layer][name].astype(a.dtype)) for name, a in arrays.items()}
        for layer, arrays in pool.items()
    }


@jax.jit
def _gather(pool: SSMPool, slot: Array) -> SSMSnapshot:
    return jax.tree.map(lambda a: a[slot], pool)


def snapshot(pool: SSMPool, slot: int) -> SSMSnapshot:
    """Copy slot `slot` of every layer to host memory."""
    return jax.device_get(_gather(pool, jnp.int32(slot)))


def restore(pool: SSMPool, slot: int, snap: SSMSnapshot) -> SSMPool:
    """Write a snapshot back into slot `slot` (any slot). The pool is donated: use the result."""
    return _restore(pool, jnp.int32(slot), snap)


class SSMSlotPool:
    """Host side of the pool: the slot allocator plus host snapshots keyed by owner."""

    def __init__(self, max_slots: int):
        self.allocator = SlotAllocator(max_slots)
        self.snapshots: dict[object, SSMSnapshot] = {}

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def allocate(self) -> int:
        return self.allocator.allocate()

    def free(self, slot: int) -> None:
        self.allocator.free(slot)
