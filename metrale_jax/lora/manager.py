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

import logging
from collections import OrderedDict
from collections.abc import Iterable

import jax
import numpy as np

from metrale_jax.errors import LoRAAdapterNotFoundError, LoRAError
from metrale_jax.layers.stack import Unstacked
from metrale_jax.lora.adapter import HostAdapter, LoRASpec, load_peft_adapter
from metrale_jax.lora.request import LoRARequest

log = logging.getLogger(__name__)


def _write(slots, slot, new):
    """slots: the lora tree (leaves [L, S*G(+1), ...] or `Unstacked` of [S*G(+1), ...]); new: the
    same keys, [L, G, ...]; slot: i32[] -> slots with slot's G rows of every leaf replaced."""

    def one(leaf, n):
        g = n.shape[1]
        if isinstance(leaf, Unstacked):
            return Unstacked(jax.lax.dynamic_update_slice_in_dim(p, n[i].astype(p.dtype), slot * g, axis=0)
                             for i, p in enumerate(leaf.parts))
        return jax.lax.dynamic_update_slice_in_dim(leaf, n.astype(leaf.dtype), slot * g, axis=1)

    return {k: one(slots[k], new[k]) for k in slots}


class LoRAManager:
    """Host cache, device slots and the slot writer of one engine."""

    def __init__(self, spec: LoRASpec, dtype, max_cpu_loras: int):
        self.spec = spec
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
        """The empty slots (host numpy) to put under params["layers"]["lora"]."""
        return self.spec.zeros(self.dtype)

    def compile(self, slots) -> None:
        """Compile the slot writer for the device slot tree `slots` (at start-up)."""

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        new = {k: jax.ShapeDtypeStruct(s, self.dtype) for k, s in self.spec.leaf_shapes(1).items()}
        self.writer = jax.jit(_write, donate_argnums=(0,)).lower(
            jax.tree.map(abstract, slots), jax.ShapeDtypeStruct((), np.int32), new).compile()

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
    def slots_for(self, slots_tree, ids: Iterable[int], pinned: set[int]) -> tuple[dict, dict[int, int]]:
        """Make every adapter of `ids` resident. pinned: adapters that may not be evicted (those of
        running sequences). Returns (the new slot tree, {lora_int_id: slot})."""
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
            slots_tree = self.writer(slots_tree, np.int32(slot), ad.weights)
            self.num_slot_loads += 1
            self.slot_of[i] = slot
        return slots_tree, {i: self.slot_of[i] for i in want}

    def assign_slots(self, engine, sched, rows: list, chunks: list) -> None:
        """Before a step: put its adapters into device slots (writing `engine.params`' slots as
        needed: no compile) and fill its DecodeRows' and PrefillChunks' `lora_slot` (and
        `moe_lora_slot` for adapters that train experts)."""
        ids = [s.lora_int_id for s in sched.decode] + [c.seq.lora_int_id for c in sched.chunks]
        if not any(ids):
            return
        pinned = {s.lora_int_id for s in engine.scheduler.running}
        layers = engine.params["layers"]
        tree, slot_of = self.slots_for(layers["lora"], ids, pinned)
        if tree is not layers["lora"]:
            engine.params = {**engine.params, "layers": {**layers, "lora": tree}}
        for item, i in zip(list(rows) + list(chunks), ids):
            if i:
                item.lora_slot = slot_of[i]
                item.moe_lora_slot = slot_of[i] if i in self.expert_ids else -1

    def has_experts(self, lora_int_id: int) -> bool:
        """Whether the adapter trains MoE experts (its rows get moe_row_adapter = their slot)."""
        return lora_int_id in self.expert_ids


def attach_lora(engine) -> LoRAManager:
    """An engine's LoRA manager (enable_lora), with empty slots added under
    `engine.params["layers"]["lora"]` (in a new top-level dict: the caller's tree is left alone;
    per-layer arrays when the engine walks the layers in Python)."""
    from metrale_jax.layers.stack import device_put_layers
    from metrale_jax.lora.adapter import LORA_FAMILIES

    c = engine.config
    fam = getattr(engine.model, "family_name", "")
    if fam not in LORA_FAMILIES:
        raise LoRAError(f"enable_lora: LoRA is served for the {', '.join(LORA_FAMILIES)} families, not {fam!r}")
    spec = LoRASpec.for_model(engine.model, c.max_loras, c.max_lora_rank, experts=c.lora_experts)
    dtype = np.dtype(engine.params["embed"].dtype)
    mgr = LoRAManager(spec, dtype, c.max_cpu_loras)
    mgr.in_use = lambda: {r.lora_int_id for r in engine.requests.values()}
    zeros = {"layers": mgr.init_slots()}
    slots = (device_put_layers(zeros) if c.attention.unroll_layers else jax.device_put(zeros))["layers"]
    engine.params = {**engine.params, "layers": {**engine.params["layers"], "lora": slots}}
    log.info("LoRA: %d slots of rank %d (%.1f MB), %d adapters in host memory", c.max_loras, c.max_lora_rank,
             c.max_loras * spec.slot_bytes(dtype.itemsize) / 1e6, c.max_cpu_loras)
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
