"""Walking the layer stack: `lax.scan`, or a Python loop over static layer slices.

Parameters are stacked on a leading layer axis. `lax.scan` compiles one layer body, but on the
GPU XLA copies each iteration's weight slices out of the stacked arrays before the dots: on the
H200 a Llama-3-8B decode step spent 6.7 of its 13 ms in those copies, and the same weight stream
ran 10.9 ms scanned against 3.9 ms with constant slices, which XLA folds into the dots
(bench/kernels/layer_loop.py, bench/results/layer_loop.md). `unroll=True` walks the layers in
Python with constant indices instead: the engine's GPU default. Compile time grows with depth
(the probe: 3.0 s against 1.7 s for 32 layers), so the CPU default stays the scan.

Give per-layer scalars (layer kinds, counters) as numpy: under the Python loop they stay numpy
(static: `switch` becomes a Python call and `take_layer` a constant slice), under the scan
`lax.scan` traces them. The same body serves both.

Static slices of stacked arrays are not free everywhere, though: where a slice feeds a cuBLAS
GEMM or a Pallas custom call (prefill-sized dots, the FP8 kernels), XLA materializes it, and on
the H200 XLA hoisted all 32 layers' copies of a Llama-3-8B prefill step into 17.7 GB of scratch
(out of memory). So the engine, when it walks layers in Python, first splits every layer-stacked
leaf into per-layer arrays (`split_layers`, in place): an `Unstacked` leaf holds them, layer i is
then a plain buffer, and nothing is sliced. Every function here also takes split trees under
`lax.scan` (the parts are re-stacked inside the trace: a copy, correct but not fast).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# top-level parameter subtrees that are NOT stacked over layers (every family's names)
GLOBAL_KEYS = frozenset({"embed", "norm", "norm_f", "lm_head"})
MTP_STACKED_KEYS = ("layers", "attn")  # the layer-stacked subtrees of params["mtp"]


@jax.tree_util.register_pytree_node_class
class Unstacked:
    """One layer-stacked parameter kept as per-layer arrays: parts[i] is layer i's [...] array."""

    def __init__(self, parts):
        self.parts = tuple(parts)

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, aux, parts):
        return cls(parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        p = self.parts[0] if self.parts else None
        return f"Unstacked({len(self.parts)} x {getattr(p, 'shape', '?')} {getattr(p, 'dtype', '')})"


def _is_unstacked(x) -> bool:
    return isinstance(x, Unstacked)


def split_layers(params: dict) -> dict:
    """Replace, in place, every layer-stacked leaf of `params` (all top-level subtrees but
    `GLOBAL_KEYS`) by an `Unstacked` of its per-layer arrays; returns `params`.

    Leaf by leaf through host memory: a stacked device array is copied out, freed (when nothing
    else holds it), and its parts put back into the hole it left. Splitting on the device instead
    left the freed stacked arrays as holes below the parts, and on the H200 the KV pool, sized to
    fill the rest of memory, then found no contiguous room (out of memory at 38.9 GiB).
    Already split leaves are left alone; nested dicts are updated in place.
    """
    for key in list(params):
        if key == "mtp":  # an MTP head (models/mtp.py): its fc and norms are not layer-stacked
            for k in MTP_STACKED_KEYS:
                _split_in(params[key], k)
        elif key not in GLOBAL_KEYS:
            _split_in(params, key)
    return params


def _split_in(parent, key) -> None:
    """Split parent[key] (a dict, a dataclass of arrays such as `Fp8Linear`, or an array)."""
    node = parent[key]
    if isinstance(node, dict):
        del node
        for k in list(parent[key]):
            _split_in(parent[key], k)
    elif dataclasses.is_dataclass(node):  # frozen: rebuild it from its fields, split one by one
        fields = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
        cls = type(node)
        parent[key] = node = None
        for name in list(fields):
            if isinstance(fields[name], (jax.Array, np.ndarray, dict)) or dataclasses.is_dataclass(fields[name]):
                _split_in(fields, name)
        parent[key] = cls(**fields)
    elif isinstance(node, (jax.Array, np.ndarray)):
        sharding = getattr(node, "sharding", None)
        parent[key] = None
        host = np.asarray(node)
        del node  # the device copy goes here, before its parts are allocated
        parent[key] = Unstacked(jax.device_put(host[i], sharding) for i in range(host.shape[0]))


def device_put_layers(tree: dict) -> dict:
    """Put a host parameter tree (numpy, layer-stacked) on the device with every layer-stacked
    leaf already split (`Unstacked` of per-layer device arrays), as `split_layers` would leave
    it, without the stacked device copy: loading straight into the engine's GPU layout skips
    `split_layers`' round trip through host memory (11-12 s for a Llama-3-8B shape on the H200,
    bench/results/startup_llama3_8b_2026-12-01.json)."""
    return {k: jax.tree.map(jax.device_put, v) if k in GLOBAL_KEYS else
            jax.tree.map(lambda a: Unstacked(jax.device_put(a[i]) for i in range(a.shape[0])), v)
            for k, v in tree.items()}


def host_stacked(tree):
    """`tree` on the host (numpy) with every `Unstacked` leaf stacked back (for saving)."""
    return jax.tree.map(lambda a: np.stack([np.asarray(p) for p in a.parts]) if _is_unstacked(a) else np.asarray(a),
                        tree, is_leaf=_is_unstacked)


def restack(tree):
    """`tree` with every `Unstacked` leaf stacked back into one array (inside a trace: a copy)."""
    return jax.tree.map(lambda a: jnp.stack(a.parts) if _is_unstacked(a) else a, tree, is_leaf=_is_unstacked)


def num_layers(tree) -> int:
    first = jax.tree.leaves(tree, is_leaf=_is_unstacked)[0]
    return len(first) if _is_unstacked(first) else first.shape[0]


def scan_layers(body, carry, xs, unroll: bool):
    """carry after `body(carry, xs[i]) -> (carry, None)` for each layer i.

    xs: a pytree of arrays stacked on axis 0 (jax or numpy) or `Unstacked`. unroll: Python loop
    with static layer indices (numpy leaves stay numpy) instead of `lax.scan`.
    """
    if not unroll:
        return jax.lax.scan(body, carry, restack(xs))[0]
    for i in range(num_layers(xs)):
        carry, _ = body(carry, take_layer(xs, i))
    return carry


def take_layer(tree, i):
    """Layer i of a tree of layer-stacked (or `Unstacked`) arrays: a plain per-layer array or a
    constant slice when i is static, a dynamic slice when it is traced."""
    static = isinstance(i, (int, np.integer))

    def one(a):
        if _is_unstacked(a):
            return a.parts[int(i)] if static else jnp.stack(a.parts)[i]
        return a[i]

    return jax.tree.map(one, tree, is_leaf=_is_unstacked)


def switch(index, branches, *args):
    """`branches[index](*args)`: a Python call when index is static, else `lax.switch`."""
    if isinstance(index, (int, np.integer)):
        return branches[int(index)](*args)
    return jax.lax.switch(index, branches, *args)
