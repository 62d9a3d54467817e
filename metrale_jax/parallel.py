"""Tensor and expert parallelism: one `tp` mesh axis, placements from a table of rules.

The steps stay single-device code: the parameters and the engine state are laid out on a
`jax.sharding.Mesh` with one axis `tp` (`NamedSharding`), the step metadata is replicated, and
XLA's SPMD partitioner turns each compiled step into per-device code with its collectives
(GSPMD). Every feature of the step (sampling, penalties, logprobs, chunked prefill, swap) is
therefore the same program at any `tensor_parallel_size`; only where the arrays live changes.

Rules (Megatron's layout), by the last name of a parameter's path, counted from its end so that
the same rule holds for layer-stacked `[L, ...]` and per-layer arrays:

    column-parallel (output features)  wqkv wq wkv w_gate_up w_qkvz w_ba in_proj up
                                       shared_gate_up shared_up              dim -1
    row-parallel (input features)      wo w_down down out shared_down       dim -2
    per-head vectors                   A_log dt_bias D conv_b               dim -1
    conv filters                       conv_w [C, K]                        dim -2
    experts [E, in, out]               by expert (EP) dim -3, else like their dense twins
    4-bit linears (`W4Linear`, [N, K]-major codes, scales, zeros): along N when column-parallel,
                                       along K when row-parallel (act-order `perm` with K);
                                       4-bit experts under EP by expert (row_scale, perm dim -2)
    vocabulary                         embed [V, H] dim -2, lm_head [H, V] dim -1
    everything else (norms, routers, q/k norms, biases of the router)      replicated

The KV pool `[L, blocks, block_size, Hkv, D]` is sharded by KV head, the SSM pool
`[slots, L, heads or channels, ...]` by its third axis; block tables and slots are replicated.
A dimension the device count does not divide is replicated, with one log line per rule (Qwen3-
Next has 2 KV heads: at TP=4 its KV pool is replicated).

What this does not do yet: fused projections (`wqkv` = [q | k | v]) are split at the column
where the device boundary falls, not per head group, so XLA moves some activations between
devices where a hand-placed layout would not; the Pallas kernels are custom calls the
partitioner cannot split, so on the GPU their operands are gathered (the kernels need
`shard_map` to run per shard). Both cost speed, not correctness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

AXIS = "tp"

_COLUMN = frozenset({"wqkv", "wq", "wkv", "w_gate_up", "w_qkvz", "w_ba", "in_proj", "up", "shared_gate_up",
                     "shared_up", "lm_head", "A_log", "dt_bias", "D", "conv_b"})
_ROW = frozenset({"wo", "w_down", "down", "out", "shared_down", "conv_w", "embed"})
_EXPERT_COLUMN = frozenset({"experts_gate_up", "experts_up"})
_EXPERT_ROW = frozenset({"experts_down"})
# a `W4Linear`'s arrays, stored [..., N, K]-major: the axis each shards when the linear is
# column-parallel (N) and when it is row-parallel (K)
_W4_AXES = {"packed": (-2, -1), "scales": (-2, -1), "zeros": (-2, -1), "row_scale": (-1, None),
            "perm": (None, -1), "kernel_scales": (-1, -2)}


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D mesh `tp` over the first `tensor_parallel_size` devices (all processes' devices
    under `jax.distributed`)."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                         f"{len(devices)} are visible ({devices[0].platform})")
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (AXIS,))


def _spec(ndim: int, dim: int | None) -> P:
    if dim is None:
        return P()
    parts = [None] * ndim
    parts[dim % ndim] = AXIS
    return P(*parts)


def param_dim(name: str, ndim: int, expert_parallel: bool) -> int | None:
    """The axis of a parameter named `name` (its path's last key) with `ndim` dims that the
    rules shard, or None (replicated)."""
    if name in _EXPERT_COLUMN or name in _EXPERT_ROW:
        if expert_parallel:
            return -3
        return -1 if name in _EXPERT_COLUMN else -2
    if name in _COLUMN:
        return -1
    if name in _ROW:
        return -2 if ndim >= 2 else None
    return None


@dataclass(frozen=True)
class Placement:
    """Where a step's state and outputs live on the mesh: a static argument of the steps, which
    pin their returned state to the layout it came in with (donation needs the same layout, and
    the compiled steps accept no other) and return samples replicated."""

    state: tuple[NamedSharding, ...]  # one per leaf of the StepState, in tree order
    replicated: NamedSharding

    def pin_state(self, state):
        leaves, treedef = jax.tree.flatten(state)
        if len(leaves) != len(self.state):
            raise ValueError(f"{len(leaves)} state leaves for {len(self.state)} placements")
        return treedef.unflatten([jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, self.state)])

    def replicate(self, tree):
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.replicated), tree)


class Sharder:
    """Places parameters and engine state on a `tp` mesh by the module's rules."""

    def __init__(self, mesh: Mesh, expert_parallel: bool = False):
        self.mesh = mesh
        self.size = mesh.shape[AXIS]
        self.expert_parallel = expert_parallel
        self.replicated = NamedSharding(mesh, P())
        self._said: set[str] = set()

    def _sharding(self, what: str, shape: tuple[int, ...], dim: int | None) -> NamedSharding:
        if dim is None or not shape:
            return self.replicated
        n = shape[dim % len(shape)]
        if n % self.size:
            if what not in self._said:
                self._said.add(what)
                log.info("tensor parallel: %s (axis of size %d) is not divisible by %d devices: replicated",
                         what, n, self.size)
            return self.replicated
        return NamedSharding(self.mesh, _spec(len(shape), dim))

    def param_sharding(self, path, x) -> NamedSharding:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path]
        return self.sharding_for(names, x.shape)

    def sharding_for(self, names, shape: tuple[int, ...]) -> NamedSharding:
        """The placement of a parameter of `shape` (layer-stacked or one layer's) whose tree path
        has the keys `names` (the loader streams per-layer arrays through this)."""
        names = [n for n in names if n and not n.isdigit() and n != "parts"]
        name = names[-1] if names else ""
        if name in ("w8", "scale_inv"):  # an `Fp8Linear`: [..., N, K] weight and block scales
            name = names[-2] if len(names) > 1 else name
            dim = param_dim(name, len(shape), self.expert_parallel)
            dim = {-1: -2, -2: -1}.get(dim, dim)  # stored transposed
            return self._sharding(name, shape, dim)
        if name in _W4_AXES and len(names) > 1:  # a `W4Linear` (4-bit weights)
            name = names[-2]
            column, row = _W4_AXES[names[-1]]
            dim = {-1: column, -2: row}.get(param_dim(name, 2, False))
            if self.expert_parallel and param_dim(name, 2, True) == -3:  # experts [..., E, N, ...] by expert
                dim = -2 if names[-1] in ("row_scale", "perm") else -3
            return self._sharding(f"{name}.{names[-1]}", shape, dim)
        return self._sharding(name, shape, param_dim(name, len(shape), self.expert_parallel))

    def put(self, names, x) -> jax.Array:
        """Host array `x` placed by the rules, each device receiving only its own slice (no
        cross-process check, unlike `jax.device_put`: every process passes the same `x`)."""
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, self.sharding_for(names, x.shape), lambda idx: x[idx])

    def state_sharding(self, path, x) -> NamedSharding:
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        if "kv" in names and names[-1] in ("k", "v") and x.ndim == 5:
            return self._sharding("the KV pool's KV heads", x.shape, 3)
        if "ssm" in names and x.ndim >= 3:
            return self._sharding(f"the SSM pool's {names[-2]}.{names[-1]} heads", x.shape, 2)
        return self.replicated

    def shard_params(self, params):
        """`params` placed by the rules (a new tree; the old arrays are freed when unreferenced)."""
        shardings = jax.tree_util.tree_map_with_path(self.param_sharding, params)
        return jax.device_put(params, shardings)

    def placement(self, state) -> Placement:
        s = jax.tree_util.tree_map_with_path(self.state_sharding, state)
        return Placement(tuple(jax.tree.leaves(s)), self.replicated)

    def shard_state(self, state, placement: Placement):
        leaves, treedef = jax.tree.flatten(state)
        return treedef.unflatten([jax.device_put(x, s) for x, s in zip(leaves, placement.state)])


def local(a: jax.Array) -> jax.Array:
    """A replicated array's copy on this process's first device (the array itself when every
    device is this process's): what the host reads under `jax.distributed`."""
    return a if a.is_fully_addressable else a.addressable_data(0)


def shard_heads(mesh: Mesh, fn, q, k, v, rest):
    """`fn(q, k, v, *rest)` run per device on its heads (`shard_map`): q [T, Hq, D] split along
    its heads, the pools k, v [..., Hkv, D] along their KV heads, `rest` (a tuple pytree:
    metadata, the layer index) replicated; -> [T, Hq, D] split like q. For custom calls (the
    Pallas kernels) that the partitioner cannot split. Unsplit (one call over the gathered
    operands) when the heads do not divide over the mesh."""
    n = mesh.shape[AXIS]
    if q.shape[1] % n or k.shape[-2] % n:
        return fn(q, k, v, *rest)
    leaves, treedef = jax.tree.flatten(rest)
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]  # static ones stay closed over

    def per_device(q, k, v, values):
        vals = list(leaves)
        for i, x in zip(dyn, values):
            vals[i] = x
        return fn(q, k, v, *treedef.unflatten(vals))

    heads, pool = P(None, AXIS), P(*([None] * (k.ndim - 2)), AXIS)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(heads, pool, pool, P()), out_specs=heads,
                         check_vma=False)(q, k, v, [leaves[i] for i in dyn])
