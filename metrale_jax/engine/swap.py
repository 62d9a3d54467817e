"""Preemption by swap: one sequence's whole cached state copied to host memory and back.

A sequence's state is its KV blocks in every attention layer plus its SSM slot row in every
recurrent layer. Which leaves of the model's state pytree are indexed by block and which by slot
(and along which axis) are its swap roles: `swap_roles(model, state)`. For the engine's
`EngineState` they are

    kv.k, kv.v   [L, num_blocks, block_size, Hkv, D]   block axis 1
    ssm leaves   [max_slots, ...]                      slot axis 0
    kv scales    (per layer, shared by all sequences)  not swapped

and a model with another state layout defines `model.swap_roles(state)` (one role or None per
leaf of `jax.tree.leaves(state)`), as `FakeModel` does.

Both directions are jitted with static shapes, one pair per block bucket M (`EngineConfig.swap_block_buckets`):
`gather` reads the blocks `i32[M]` (padding: block 0) and the slot `i32[]` of the state without
donating it, `scatter` writes them into new blocks `i32[M]` (padding: -1, dropped) and a new slot,
donating the state. The compilation manager compiles every pair at start-up with the step buckets,
so a swap never compiles while serving.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache import EngineState
from metrale_jax.step import replace_model_state

Role = tuple[str, int] | None  # ("block" | "slot", axis) or None (not part of a sequence's state)


def _engine_state_roles(state: EngineState) -> tuple[Role, ...]:
    roles = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if names[0] == "kv":
            roles.append(("block", 1) if names[1] in ("k", "v") else None)
        elif names[0] == "ssm":
            roles.append(("slot", 0))
        else:
            roles.append(None)
    return tuple(roles)


def swap_roles(model, state) -> tuple[Role, ...]:
    """One role per leaf of the model state `state` (see the module docstring)."""
    hook = getattr(model, "swap_roles", None)
    if hook is not None:
        roles = tuple(hook(state))
    elif isinstance(state, EngineState):
        roles = _engine_state_roles(state)
    else:
        raise TypeError(f"cannot swap a model state of type {type(state).__name__}: define "
                        "model.swap_roles(state)")
    if len(roles) != len(jax.tree.leaves(state)):
        raise ValueError(f"{len(roles)} swap roles for {len(jax.tree.leaves(state))} state leaves")
    for r in roles:
        if r is not None and (r[0] not in ("block", "slot") or r[1] < 0):
            raise ValueError(f"bad swap role {r}")
    return roles


def _index(ax: int, idx):
    return (slice(None),) * ax + (idx,)


def gather(state, blocks, slot, *, roles: tuple[Role, ...], placement=None) -> tuple[jax.Array, ...]:
    """A step state's (`StepState`) saved leaves of one sequence. blocks i32[M] (all in range),
    slot i32[] -> per role leaf in order: block leaves with axis `ax` of size M, slot leaves
    without their slot axis."""
    out = []
    for a, r in zip(jax.tree.leaves(state.model), roles):
        if r is None:
            continue
        kind, ax = r
        out.append(jnp.take(a, blocks if kind == "block" else jnp.maximum(slot, 0), axis=ax))
    return tuple(out) if placement is None else placement.replicate(tuple(out))


def scatter(state, blocks, slot, saved: tuple, *, roles: tuple[Role, ...], placement=None):
    """Write `saved` (as `gather` returns it) into blocks i32[M] (-1 = padding, not written) and
    slot i32[] (-1 = none) of the step state; returns the new state (laid out by `placement`
    under tensor parallelism, as the steps take it)."""
    leaves, treedef = jax.tree.flatten(state.model)
    it = iter(saved)
    new = []
    for a, r in zip(leaves, roles):
        if r is None:
            new.append(a)
            continue
        kind, ax = r
        v = next(it)
        idx = blocks if kind == "block" else slot
        idx = jnp.where(idx >= 0, idx, a.shape[ax])  # out of range: dropped
        new.append(a.at[_index(ax, idx)].set(v.astype(a.dtype), mode="drop"))
    state = replace_model_state(state, jax.tree.unflatten(treedef, new))
    return state if placement is None else placement.pin_state(state)


def copy_slots(state, src, dst, *, roles: tuple[Role, ...], placement=None):
    """Copy the SSM slot rows src i32[K] to dst i32[K] (dst -1 = padding, nothing written) in every
    slot leaf of the step state (prefix-caching snapshots and their restores); returns the new
    state. The destinations of one call are distinct; all rows are read before any is written."""
    leaves, treedef = jax.tree.flatten(state.model)
    new = []
    for a, r in zip(leaves, roles):
        if r is None or r[0] != "slot":
            new.append(a)
            continue
        ax = r[1]
        rows = jnp.take(a, jnp.maximum(src, 0), axis=ax)
        idx = jnp.where(dst >= 0, dst, a.shape[ax])  # out of range: dropped
        new.append(a.at[_index(ax, idx)].set(rows, mode="drop"))
    state = replace_model_state(state, jax.tree.unflatten(treedef, new))
    return state if placement is None else placement.pin_state(state)


@functools.cache
def jit_copy_slots():
    return jax.jit(copy_slots, static_argnames=("roles", "placement"), donate_argnums=(0,))


@functools.cache
def jit_gather():
    return jax.jit(gather, static_argnames=("roles", "placement"))


@functools.cache
def jit_scatter():
    return jax.jit(scatter, static_argnames=("roles", "placement"), donate_argnums=(0,))


def _raw(a: np.ndarray) -> np.ndarray:
    """`a` viewed as unsigned integers of its item size, for the host tier's copies: numpy copies
    ml_dtypes' bfloat16 element by element; integer arrays take its memcpy path."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def split_blocks(data: SwapData, roles: tuple[Role, ...]) -> list[tuple]:
    """A host `SwapData` of n blocks -> n tuples of the block leaves of one block each (the prefix
    cache's host tier keeps blocks one by one: copies, so that dropping one frees its memory)."""
    kinds = [r for r in roles if r is not None]
    leaves = [(_raw(a), a.dtype, ax) for a, (kind, ax) in zip(data.arrays, kinds) if kind == "block"]
    # basic slices, copied: `np.take` first copies a non-contiguous input whole (the leaves are cut
    # from the gather's bucket), once per block: 242 Llama-3-8B blocks took 37.9 s on the H200
    # machine (session 13; 31.8 s before the unsigned views, session 12)
    return [tuple(r[_index(ax, slice(i, i + 1))].copy().view(dt) for r, dt, ax in leaves)
            for i in range(data.num_blocks)]


def slot_leaves(data: SwapData, roles: tuple[Role, ...]) -> tuple:
    """The slot leaves of a host `SwapData` (`join_blocks` takes arrays of their shapes)."""
    kinds = [r for r in roles if r is not None]
    return tuple(a for a, (kind, _) in zip(data.arrays, kinds) if kind == "slot")


def join_blocks(blocks: list[tuple], roles: tuple[Role, ...], slot_leaves: tuple, bucket: int = 0) -> SwapData:
    """The inverse of `split_blocks` for a scatter into n new blocks; the slot leaves come from
    `slot_leaves` (any arrays of their shapes: they are written to slot -1, i.e. nowhere).
    bucket > 0: the block leaves come zero-padded to `bucket` blocks (what `SwapData.padded` of
    that bucket would make: one copy instead of two)."""
    kinds = [r for r in roles if r is not None]
    cols = iter(zip(*blocks))
    slots = iter(slot_leaves)
    return SwapData(0, len(blocks), tuple(_stack_blocks(next(cols), ax, max(bucket, len(blocks))) if kind == "block"
                                          else next(slots) for kind, ax in kinds), on_host=True)


def _stack_blocks(parts, ax: int, size: int) -> np.ndarray:
    """Host arrays of blocks along `ax` -> one array of `size` blocks: the parts one after the
    other, then zeros; copied through unsigned-integer views (`_raw`)."""
    shape = list(parts[0].shape)
    shape[ax] = size
    out = np.empty(shape, _raw(parts[0]).dtype)  # (np.zeros' pages cost a first touch on top of the copy)
    pos = 0
    for b in parts:
        out[_index(ax, slice(pos, pos + b.shape[ax]))] = _raw(b)
        pos += b.shape[ax]
    out[_index(ax, slice(pos, size))] = 0
    return out.view(parts[0].dtype)


@dataclass
class SwapData:
    """One swapped-out sequence's saved leaves: device arrays until `to_host`, then numpy with
    the block leaves cut to `num_blocks` (so host memory holds exactly the cached blocks)."""

    bucket: int  # M of the gather that made it
    num_blocks: int
    arrays: tuple  # per role leaf: jax.Array (bucket-padded) or np.ndarray (cut)
    on_host: bool = False

    def to_host(self, roles: tuple[Role, ...]) -> None:
        if self.on_host:
            return
        from metrale_jax.parallel import local

        host = jax.device_get([local(a) for a in self.arrays])
        kinds = [r for r in roles if r is not None]
        self.arrays = tuple(np.asarray(a)[_index(ax, slice(0, self.num_blocks))] if kind == "block" else np.asarray(a)
                            for a, (kind, ax) in zip(host, kinds))
        self.on_host = True

    def padded(self, roles: tuple[Role, ...], bucket: int) -> tuple:
        """The arrays for a scatter of block bucket `bucket` (host arrays padded with zeros)."""
        if not self.on_host:
            assert bucket == self.bucket
            return self.arrays
        kinds = [r for r in roles if r is not None]
        out = []
        for a, (kind, ax) in zip(self.arrays, kinds):
            if kind == "block" and a.shape[ax] != bucket:
                a = _stack_blocks([a], ax, bucket)
            out.append(a)
        return tuple(out)
