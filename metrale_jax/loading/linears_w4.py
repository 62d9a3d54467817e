"""`WeightReader.linears` for 4-bit checkpoints and 4-bit quantize-on-load: -> a stacked `W4Linear`.

Each part of a (possibly fused) linear is read into `quant.w4.W4Weight` by its format's reader,
the parts are stacked along N (no padding: every row has its own group scales) and the layers on
a leading axis (the codes two per byte, as `quant.w4.W4Weight` holds them). A module the
checkpoint left unquantized (no `qweight` / `weight_packed` / `weight_scale_2`, e.g. an `ignore`d
one) returns None and loads dense; so does one that is 4-bit in some layers or parts only, or in
formats / group sizes / act-orders that differ between them (`WeightReader.get` then dequantizes
its 4-bit weights: it runs dense, with a warning, rather than not at all).
"""

from __future__ import annotations

import logging

import numpy as np

from metrale_jax.errors import LoadError
from metrale_jax.layers.linear import W4Linear
from metrale_jax.quant import w4 as q4

log = logging.getLogger(__name__)


class TensorLoader:
    """load(name) -> array (marked used); .has(name)."""

    def __init__(self, reader):
        self.reader = reader

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def __call__(self, name: str) -> np.ndarray:
        if not self.reader.has(name):
            from metrale_jax.errors import MissingTensorError

            raise MissingTensorError(f"tensor {name!r} is missing from checkpoint {self.reader.origin}")
        self.reader.used.add(name)
        return np.asarray(self.reader.source.load(name))


def _check_not_packed(reader, name: str, marker: str) -> None:
    """A linear without its format's marker tensor is read dense, unless its weight holds packed
    4-bit codes (u8, NVFP4's layout): then the marker is what is missing."""
    from metrale_jax.errors import MissingTensorError

    prefix = _prefix(name)
    if not reader.has(prefix + marker) and reader.has(name) and np.dtype(reader.source.dtype(name)) == np.uint8:
        raise MissingTensorError(f"tensor {prefix + marker!r} is missing from checkpoint {reader.origin}: "
                                 f"{name!r} holds packed 4-bit codes (uint8)")


def _prefix(name: str) -> str:
    if not name.endswith(".weight"):
        raise LoadError(f"linear weight name {name!r} does not end in '.weight'")
    return name[: -len("weight")]


def _read_part(reader, name: str, n: int, k: int) -> q4.W4Weight | None:
    if reader.quantize_w4:
        return reader.w4_quantized(name, (n, k))
    marker, read = q4.READERS[reader.w4_scheme.method]
    prefix = _prefix(name)
    if not reader.has(prefix + marker):
        return None
    return read(TensorLoader(reader), prefix, n, k, reader.w4_scheme)


def _dense(reader, names, why: str) -> None:
    log.warning("%s: %s %s; %s", reader.origin, names, why, "left in the model dtype" if reader.quantize_w4 else
                f"loading {'it' if len(names) == 1 else 'them'} dense (dequantized, the model dtype)")


def read_w4_linears(reader, num_layers: int, k: int, parts, desc: str = "") -> W4Linear | None:
    """parts(i) -> [(HF weight name, N_j)] of layer i (as `WeightReader.linears`); None: load it dense."""
    names = [name for name, _ in parts(0)]
    if reader.quantize_w4 == "nvfp4" and k % q4.FP4_GROUP:
        _dense(reader, names, f"have K={k}, not a multiple of NVFP4's groups of {q4.FP4_GROUP}")
        return None
    if not reader.quantize_w4:
        marker = q4.READERS[reader.w4_scheme.method][0]
        every = [name for i in range(num_layers) for name, _ in parts(i)]
        dense = [name for name in every if not reader.has(_prefix(name) + marker)]
        if dense:
            if len(dense) < len(every):
                for name in every:
                    _check_not_packed(reader, name, marker)
                _dense(reader, names, f"are 4-bit in some layers or parts only ({len(dense)} of {len(every)} "
                       f"weights not, e.g. {dense[0]!r})")
            return None
    layers = [[_read_part(reader, name, n, k) for name, n in parts(i)]
              for i in reader.progress(range(num_layers), desc)]
    flat = [w for ws in layers for w in ws]
    kinds = {w.kind for w in flat}
    groups = {w.group_size for w in flat}
    if len(kinds) > 1 or len(groups) > 1:
        _dense(reader, names, f"mix 4-bit formats or group sizes ({sorted(kinds)}, {sorted(groups)})")
        return None
    kind, group = kinds.pop(), groups.pop()
    sdt = {w.scales.dtype for w in flat}
    sdt = sdt.pop() if len(sdt) == 1 else np.dtype(np.float32)
    perms = []
    for ws in layers:
        ps = [w.perm for w in ws]
        if any(p is not None for p in ps) and not all(p is not None and np.array_equal(p, ps[0]) for p in ps):
            _dense(reader, names, "have different act-order g_idx (fused parts must share one: they read the "
                   "same input)")
            return None
        perms.append(ps[0])
    packed = np.stack([np.concatenate([w.packed for w in ws]) for ws in layers])  # u8[L, N, K/2]
    scales = np.stack([np.concatenate([w.scales.astype(sdt) for w in ws]) for ws in layers])  # [L, N, NG]
    zeros = row_scale = perm = None
    if kind == "int4":
        zeros = np.stack([np.concatenate([w.zeros for w in ws]) for ws in layers]).astype(np.uint8)
    else:
        row_scale = np.stack([np.concatenate([np.full(w.shape[0], w.row_scale, np.float32) for w in ws])
                              for ws in layers])  # f32[L, N]
    if any(p is not None for p in perms):
        perm = np.stack([np.arange(k, dtype=np.int32) if p is None else p.astype(np.int32) for p in perms])
    return W4Linear(packed, scales, zeros, row_scale, perm, k=k, group_size=group, kind=kind)
