"""`LoRAManager`: adapters on the host (an LRU of `max_cpu_loras`) and in the device slots (an
LRU of `max_loras`), and the one precompiled executable that writes a slot.

The slots are `params["layers"]["lora"]` (layout in `adapter.py`). Loading an adapter into a
slot runs `write_slot`, compiled once at start-up for these shapes and donating the old slot
arrays, so adapters come and go without a compile. The scheduler never runs more than
`max_loras` distinct adapters at once (`Scheduler.max_loras`); before each step the engine asks
`slots_for` for the step's adapters: those already in a slot stay, the others take a free slot
or evict the least recently used one that no running sequence needs.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.errors import LoRAAdapterNotFoundError, LoRAError
from metrale_jax.layers.stack import Unstacked
from metrale_jax.lora.adapter import HostAdapter, LoRASpec, load_peft_adapter
from metrale_jax.lora.request import LoRARequest

log = logging.getLogger(__name__)


# A leaves the engine folds into the base weight of the same input (and that weight's bias, padded
# with zeros): the base GEMM then also computes every slot's shrink x·A_s (`ops.add_delta`).
_FOLDABLE = {"qkv_a": ("wqkv", "bqkv"), "o_a": ("wo", "bo"), "gate_up_a": ("w_gate_up", None),
             "down_a": ("w_down", None)}


def _write(tree, slot, new, fold):
    """tree: {"lora": the slot leaves ([L, S*G(+1), ...] or `Unstacked` of [S*G(+1), ...]),
    "base": the folded base weights ([L, in, out + S*kR] or `Unstacked` of [in, out + S*kR])};
    new: one adapter, [L, G, ...] per leaf; slot: i32[]; fold: ((A leaf, base name, out), ...)
    -> tree with slot's rows of every slot leaf and its columns of every folded weight replaced."""

    def per_layer(leaf, fn):
        if isinstance(leaf, Unstacked):
            return Unstacked(fn(p, i) for i, p in enumerate(leaf.parts))
        return fn(leaf, slice(None))

    def rows(leaf, n):  # n [L, G, ...] at rows slot*G of the slot axis
        g = n.shape[1]
        return per_layer(leaf, lambda p, i: jax.lax.dynamic_update_slice_in_dim(
            p, n[i].astype(p.dtype), slot * g, axis=1 if isinstance(i, slice) else 0))

    def cols(leaf, a, out):  # a [L, 1, kR, in] as columns out + slot*kR ... of [in, out_ext]
        at = jnp.swapaxes(a[:, 0], -1, -2)  # [L, in, kR]
        return per_layer(leaf, lambda p, i: jax.lax.dynamic_update_slice_in_dim(
            p, at[i].astype(p.dtype), out + slot * at.shape[-1], axis=p.ndim - 1))

    base = dict(tree["base"])
    for a, name, out in fold:
        base[name] = cols(base[name], new[a], out)
    return {"lora": {k: rows(v, new[k]) for k, v in tree["lora"].items()}, "base": base}


def fold_targets(layers: dict, spec: LoRASpec) -> dict[str, str]:
    """{A leaf: base weight name} of the projections whose A the engine folds into the base
    weight: those whose weight is a plain array ([L, in, out] or per-layer [in, out]; FP8 and
    4-bit weights keep a separate shrink)."""
    shapes = spec.leaf_shapes()

    def plain(w) -> bool:
        parts = w.parts if isinstance(w, Unstacked) else (w,)
        return all(isinstance(p, jax.Array | np.ndarray) for p in parts)

    return {a: name for a, (name, _) in _FOLDABLE.items() if a in shapes and name in layers and plain(layers[name])}


def _fold_in(layers: dict, name: str, extra: int, owned: bool) -> None:
    """layers[name] with `extra` zero columns appended, layer by layer. owned: the engine owns the
    arrays (`LLMEngine.from_config`): the leaf is rewritten in place, so each layer's old array is
    freed once its successor exists; else the caller's arrays are left as they were (and stay
    in memory while the caller holds them)."""
    def pad(p):
        return jnp.concatenate([p, jnp.zeros(p.shape[:-1] + (extra,), p.dtype)], axis=-1)

    leaf = layers[name]
    if not isinstance(leaf, Unstacked):
        layers[name] = pad(leaf)
        return
    parts = list(leaf.parts)
    if owned:
        leaf.parts = ()
    else:
        leaf = layers[name] = Unstacked(())
    for i in range(len(parts)):
        parts[i] = pad(parts[i])
    leaf.parts = tuple(parts)


class LoRAManager:
    """Host cache, device slots and the slot writer of one engine."""

    def __init__(self, spec: LoRASpec, dtype, max_cpu_loras: int, folded: dict[str, str] | None = None):
        self.spec = spec
        self.folded = folded or {}  # A leaf -> the base weight it is folded into (`fold_targets`)
        self.dtype = np.dtype(dtype)
        self.max_cpu_loras = max_cpu_loras
        self.registered: dict[int, LoRARequest] = {}  # lora_int_id -> request (add_lora / first use)
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()  # LRU, most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot (LRU order)
        self.writer = None  # compiled `_write`
        self.num_slot_loads = 0  # adapters written into a slot so far
        self.num_host_loads = 0  # adapters read from disk so far
        self.expert_ids: set[int] = set()  # adapters that train MoE experts
        self.in_use = set  # () -> ids of adapters that queued requests name (set by the engine)

    # ---- start-up --------------------------------------------------------------------------------
    def init_slots(self) -> dict[str, np.ndarray]:
        """The empty slots (host numpy) to put under params["layers"]["lora"] (folded A leaves
        live in the base weights instead)."""
        return {k: v for k, v in self.spec.zeros(self.dtype).items() if k not in self.folded}

    def _tree(self, params) -> dict:
        """What the slot writer rewrites: the slot leaves and the folded base weights."""
        layers = params["layers"]
        return {"lora": layers["lora"], "base": {name: layers[name] for name in self.folded.values()}}

    def _with_tree(self, params, tree) -> dict:
        return {**params, "layers": {**params["layers"], "lora": tree["lora"], **tree["base"]}}

    def compile(self, params) -> None:
        """Compile the slot writer for the engine's `params` (at start-up)."""
        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        shapes = self.spec.leaf_shapes()
        fold = tuple((a, name, shapes[a.replace("_a", "_b")][-1]) for a, name in self.folded.items())
        new = {k: jax.ShapeDtypeStruct(s, self.dtype) for k, s in self.spec.leaf_shapes(1).items()}
        self.writer = jax.jit(functools.partial(_write, fold=fold), donate_argnums=(0,)).lower(
            jax.tree.map(abstract, self._tree(params)), jax.ShapeDtypeStruct((), np.int32), new).compile()

    # ---- adapters on the host --------------------------------------------------------------------
    def resolve(self, req: LoRARequest) -> HostAdapter:
        """Validate `req` and return its host weights (read from disk on a cache miss). Raises a
        LoRAError subclass when the adapter cannot be served."""
        if not isinstance(req, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        known = self.registered.get(req.lora_int_id)
        if known is not None and (known.lora_name != req.lora_name or known.lora_path != req.lora_path):
            raise LoRAError(f"lora_int_id {req.lora_int_id} is already adapter {known.lora_name!r} "
                            f"({known.lora_path}); use another id for {req.lora_name!r} ({req.lora_path})")
        ad = self.host.get(req.lora_int_id)
        if ad is None:
            if not req.lora_path:
                raise LoRAAdapterNotFoundError(f"LoRA adapter {req.lora_name!r} has no lora_path")
            ad = load_peft_adapter(req.lora_path, self.spec, self.dtype, req.lora_int_id, req.lora_name)
            self.num_host_loads += 1
            self.host[req.lora_int_id] = ad
            while len(self.host) > self.max_cpu_loras:
                # the least recently used adapter that no queued request names, else the least
                # recently used (it is read again when its requests run)
                busy = self.in_use() | {req.lora_int_id}
                old = next((i for i in self.host if i not in busy), next(iter(self.host)))
                del self.host[old]
                log.info("LoRA host cache: dropped adapter %d (max_cpu_loras=%d)", old, self.max_cpu_loras)
            log.info("LoRA adapter %r (id %d, rank %d, %s%s) read from %s", req.lora_name, req.lora_int_id, ad.rank,
                     ",".join(ad.targets), ", experts" if ad.has_experts else "", req.lora_path)
        else:
            self.host.move_to_end(req.lora_int_id)
        self.registered[req.lora_int_id] = req
        if ad.has_experts:
            self.expert_ids.add(req.lora_int_id)
        return ad

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy and slot; the slot's stale weights are never read again).
        Raises LoRAError while a queued request uses it; False when unknown."""
        if lora_int_id in self.in_use():
            raise LoRAError(f"LoRA adapter {lora_int_id} is in use by a running request")
        known = self.registered.pop(lora_int_id, None)
        self.host.pop(lora_int_id, None)
        self.slot_of.pop(lora_int_id, None)
        self.expert_ids.discard(lora_int_id)
        return known is not None

    # ---- adapters in the device slots ------------------------------------------------------------
    def slots_for(self, params, ids: Iterable[int], pinned: set[int]) -> tuple[dict, dict[int, int]]:
        """Make every adapter of `ids` resident in the engine's `params`. pinned: adapters that may
        not be evicted (those of running sequences). Returns (the new params, {lora_int_id: slot})."""
        tree = None
        want = [i for i in dict.fromkeys(ids) if i]
        for i in want:
            if i in self.slot_of:
                self.slot_of.move_to_end(i)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.spec.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((v for v in self.slot_of if v not in pinned and v not in want), None)
                if victim is None:
                    raise RuntimeError(f"no LoRA slot free for adapter {i}: {len(self.slot_of)} slots pinned "
                                       f"(the scheduler admits at most max_loras adapters; a bug)")
                slot = self.slot_of.pop(victim)
                log.debug("LoRA slot %d: adapter %d evicted for %d", slot, victim, i)
            req = self.registered.get(i)
            ad = self.host.get(i)
            if ad is None:  # dropped from the host cache since: read it again
                if req is None:
                    raise LoRAAdapterNotFoundError(f"LoRA adapter {i} was removed")
                ad = self.resolve(req)
            tree = self.writer(self._tree(params) if tree is None else tree, np.int32(slot), ad.weights)
            self.num_slot_loads += 1
            self.slot_of[i] = slot
        return (params if tree is None else self._with_tree(params, tree)), {i: self.slot_of[i] for i in want}

    def assign_slots(self, engine, sched, rows: list, chunks: list) -> None:
        """Before a step: put its adapters into device slots (writing `engine.params`' slots as
        needed: no compile) and fill its DecodeRows' and PrefillChunks' `lora_slot` (and
        `moe_lora_slot` for adapters that train experts)."""
        ids = [s.lora_int_id for s in sched.decode] + [c.seq.lora_int_id for c in sched.chunks]
        if not any(ids):
            return
        pinned = {s.lora_int_id for s in engine.scheduler.running}
        engine.params, slot_of = self.slots_for(engine.params, ids, pinned)
        for item, i in zip(list(rows) + list(chunks), ids):
            if i:
                item.lora_slot = slot_of[i]
                item.moe_lora_slot = slot_of[i] if i in self.expert_ids else -1

    def has_experts(self, lora_int_id: int) -> bool:
        """Whether the adapter trains MoE experts (its rows get moe_row_adapter = their slot)."""
        return lora_int_id in self.expert_ids


def attach_lora(engine, owns_params: bool = False) -> LoRAManager:
    """An engine's LoRA manager (enable_lora): empty slots added under
    `engine.params["layers"]["lora"]` (per-layer arrays when the engine walks the layers in
    Python) and the foldable A leaves' columns appended to their base weights (`fold_targets`), in
    a new tree: the caller's stays as it was unless the engine owns it (`owns_params`)."""
    from metrale_jax.layers.stack import device_put_layers
    from metrale_jax.lora.adapter import LORA_FAMILIES

    c = engine.config
    fam = getattr(engine.model, "family_name", "")
    if fam not in LORA_FAMILIES:
        raise LoRAError(f"enable_lora: LoRA is served for the {', '.join(LORA_FAMILIES)} families, not {fam!r}")
    spec = LoRASpec.for_model(engine.model, c.max_loras, c.max_lora_rank, experts=c.lora_experts)
    dtype = np.dtype(engine.params["embed"].dtype)
    layers = engine.params["layers"] if owns_params else dict(engine.params["layers"])
    mgr = LoRAManager(spec, dtype, c.max_cpu_loras, fold_targets(layers, spec))
    mgr.in_use = lambda: {r.lora_int_id for r in engine.requests.values()}
    zeros = {"layers": mgr.init_slots()}
    layers["lora"] = (device_put_layers(zeros) if c.attention.unroll_layers else jax.device_put(zeros))["layers"]
    shapes = spec.leaf_shapes()
    for a, name in mgr.folded.items():
        extra = spec.max_loras * shapes[a][-2]  # S * kR columns
        _fold_in(layers, name, extra, owns_params)
        bias = _FOLDABLE[a][1]
        if bias in layers:
            _fold_in(layers, bias, extra, owns_params)
    engine.params = {**engine.params, "layers": layers}
    log.info("LoRA: %d slots of rank %d (%.1f MB; A of %s in the base weights), %d adapters in host memory",
             c.max_loras, c.max_lora_rank, c.max_loras * spec.slot_bytes(dtype.itemsize) / 1e6,
             ", ".join(mgr.folded.values()) or "none", c.max_cpu_loras)
    return mgr


def resolve_for(mgr: LoRAManager | None, lora_request) -> None:
    """Check that `lora_request` (None = base model) can be served by an engine whose manager is
    `mgr` (None: built without enable_lora): raises a LoRAError subclass otherwise."""
    from metrale_jax.errors import LoRANotEnabledError

    if lora_request is None:
        return
    if mgr is None:
        raise LoRANotEnabledError("this request names a LoRA adapter, but the engine was built without "
                                  "enable_lora=True")
    mgr.resolve(lora_request)
