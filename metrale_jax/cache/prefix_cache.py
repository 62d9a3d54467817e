"""Automatic prefix caching (host only, no JAX): KV blocks keyed by a chained hash, plus SSM-state
snapshots for models with recurrent layers.

Blocks. A *full* block i of a sequence is keyed by `block_hash(key of block i-1, its block_size
token ids, extra key)` (sha256, first 16 bytes): the key names the whole prefix up to the block's
end. The extra key is whatever else changes the block's K/V: the request's LoRA adapter
(`Sequence.lora_key`; None for the base model). A block is registered under its key once the
step that writes its last token has been dispatched (`PrefixCache.after_step`), or when its
sequence frees it (`PrefixCache.release`); a key already held by another block is not registered
twice (the duplicate stays an ordinary block). A registered block is never written again: its
tokens are all below its sequence's `num_computed`.

`CachingBlockAllocator` keeps registered blocks whose reference count drops to 0 in an LRU list
instead of the free list; they still count as free (`num_free`), and `allocate` takes never-cached
blocks first, then evicts the least recently freed cached block (a finished sequence frees its
blocks tail first, so its last blocks go first). A hit (`share`) takes a cached block out of the
LRU list, or adds a reference to one a running sequence holds.

Lookup (`PrefixCache.lookup`). A new sequence (or one preempted by recompute) reuses the longest
chain of registered blocks over its known tokens, at most `(len(tokens) - 1) // block_size`
blocks: at least one token is always computed, for the logits. Requests with penalties (their
penalty rows count the whole prompt) do not look up; a request that wants prompt logprobs looks
up only the blocks before the first prompt position whose logprob it still needs.

SSM snapshots (models with recurrent state). A recurrent state is valid only at the exact position
where it was taken, so a hit needs a snapshot at the end of the reused chain. Snapshots live in
`max_ssm_snapshots` extra slots of the SSM pool (ids `snapshot_slots`, after the sequences' own
slots), filled by device slot-to-slot copies that the engine runs between steps:
- after a prefill chunk that ends on a block boundary (the scheduler ends chunks there:
  `chunk_length`; the last chunk of a prefill is cut at its last block boundary, so every prefill
  leaves one), keyed by the hash of the block that ends there;
- after each decode step that completes a block, into the sequence's own rolling snapshot slot
  (overwritten at the next boundary); when the sequence finishes or is preempted, that snapshot is
  keyed and cached, so the next turn of a conversation (which resends the reply) hits.
Keyed snapshots are evicted least recently used (taken or hit) first when a new one needs a slot;
rolling ones belong to their running sequence and are not evicted. A snapshot is only ever read
by copies dispatched before any later copy that overwrites its slot, so evicting one needs no
reference count. Lookup walks back from the end of the KV chain to the last block that has a
snapshot; that block's end is the hit.

Host tier (`host_bytes` > 0, `EngineConfig.kv_offloading_size`): the allocator records the cached
blocks it evicts; the engine copies them to host memory (the swap gather) before the step that
may reuse them runs and hands them over block by block (`host_put`; least recently used dropped
past the capacity). A lookup whose device chain ends goes on through host keys; those blocks get
new device blocks, registered at once, which the engine writes (the swap scatter) before the step
(`onload`). Snapshots have no host tier.

A model whose decode path differs numerically from its prefill path (`Model.decode_matches_prefill`
False: Nemotron-H with a dt floor) caches only what prefill chunks computed (`cache_decoded=False`):
blocks up to the end of a sequence's prefill and no decode snapshots, so that a hit gives exactly
what recomputing the prefix would.

Speculative decoding (hook): `after_step` registers blocks up to `min(num_computed, len(token_ids))`
and takes a decode row's snapshot when `num_computed` lands on a block boundary. A speculative
step must therefore count in `num_computed` only positions whose K/V and recurrent state are final
(verified tokens, not a rejected draft's K/V awaiting its rewrite), and a state that has seen
unverified drafts must never be snapshotted: skip those rows in `after_step`'s decode loop.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrale_jax.cache.allocator import BlockAllocator, NoFreeBlocksError


def block_hash(parent: bytes | None, tokens: Iterable[int], extra: Any = None) -> bytes:
    """The key of a full block: sha256 over (parent key, token ids as int64, repr(extra)), 16 bytes."""
    h = hashlib.sha256(parent or b"\0" * 16)
    h.update(np.asarray(list(tokens), np.int64).tobytes())
    if extra is not None:
        h.update(repr(extra).encode())
    return h.digest()[:16]


class CachingBlockAllocator(BlockAllocator):
    """A `BlockAllocator` whose freed registered blocks stay cached (LRU) until allocation needs
    them (module docstring)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._table: dict[bytes, int] = {}  # key -> block
        self._key: dict[int, bytes] = {}  # block -> key (registered blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered blocks with ref count 0, oldest first
        self.num_evictions = 0
        self.evicted: list[tuple[bytes, int]] | None = None  # (key, block) of evictions, when recorded

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered blocks (in use or not)."""
        return len(self._key)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                key = self._key.pop(b)
                del self._table[key]
                self.num_evictions += 1
                if self.evicted is not None:
                    self.evicted.append((key, b))
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0 and b in self._lru:
                del self._lru[b]
                self._refs[b] = 1
            else:
                super().share([b])

    def free(self, blocks: Iterable[int]) -> None:
        for b in reversed(list(blocks)):  # tail first: the deepest blocks are evicted first
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def num_reclaimed(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` a `share` would take out of the free count (cached, ref 0)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def register(self, block: int, key: bytes) -> bool:
        """Key an allocated block; False when the key or the block is registered already."""
        if key in self._table or block in self._key:
            return False
        self._table[key] = block
        self._key[block] = key
        return True

    def cached(self, key: bytes) -> int | None:
        return self._table.get(key)

    def key_of(self, block: int) -> bytes | None:
        return self._key.get(block)


@dataclass(eq=False)
class SeqCacheState:
    """A sequence's prefix-caching record (`Sequence.cache_state`)."""

    keys: list[bytes] = field(default_factory=list)  # keys of its full known blocks, in order
    registered: int = 0  # leading blocks of seq.blocks already offered to the table
    prefill_end: int = 0  # the furthest position its prefill chunks computed
    rolling_slot: int = -1  # its rolling snapshot slot (-1 = none)
    rolling_pos: int = 0  # the position that snapshot holds the state at


@dataclass
class PrefixHit:
    blocks: list[int]  # cached device blocks to share, in order
    snapshot: int = -1  # SSM snapshot slot holding the state at the hit's end (-1 = none)
    onload: list[bytes] = field(default_factory=list)  # keys of the host-tier blocks that follow `blocks`

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.onload)


class PrefixCache:
    """The scheduler's prefix cache over a `CachingBlockAllocator` (module docstring).

    `snapshot_slots` are the SSM pool slots reserved for snapshots (empty without SSM state);
    `cache_decoded` False caches only what prefill chunks computed. `host_bytes` > 0 turns on the
    host tier of `bytes_per_block` blocks (module docstring)."""

    def __init__(self, blocks: CachingBlockAllocator, block_size: int, uses_ssm: bool = False,
                 snapshot_slots: Iterable[int] = (), cache_decoded: bool = True, host_bytes: int = 0,
                 bytes_per_block: int = 0):
        self.blocks = blocks
        self.cache_decoded = cache_decoded
        self.host_capacity = host_bytes // bytes_per_block if bytes_per_block > 0 else 0  # in blocks
        self._host: OrderedDict[bytes, Any] = OrderedDict()  # key -> one block's host arrays, LRU first
        if self.host_capacity:
            blocks.evicted = []
        self.num_offloaded = 0  # blocks copied to the host tier
        self.num_onloaded = 0  # blocks copied back from it
        self.block_size = block_size
        self.uses_ssm = uses_ssm
        self.snapshot_slots = tuple(snapshot_slots)
        self._snaps: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free_snaps = list(reversed(self.snapshot_slots))
        self.queries = 0  # tokens looked up (cumulative)
        self.hits = 0  # tokens found
        self.num_snapshots_taken = 0
        self.num_snapshot_evictions = 0

    # ---- keys ------------------------------------------------------------------------------------
    def _state(self, seq) -> SeqCacheState:
        if seq.cache_state is None:
            seq.cache_state = SeqCacheState()
        return seq.cache_state

    def keys(self, seq, upto_blocks: int | None = None) -> list[bytes]:
        """Keys of seq's full known blocks (extended lazily; tokens only ever get appended)."""
        st = self._state(seq)
        bs = self.block_size
        n = len(seq.token_ids) // bs if upto_blocks is None else min(upto_blocks, len(seq.token_ids) // bs)
        extra = getattr(seq, "cache_extra", None)  # the LoRA adapter and the cache salt (None: neither)
        while len(st.keys) < n:
            i = len(st.keys)
            st.keys.append(block_hash(st.keys[-1] if i else None, seq.token_ids[i * bs:(i + 1) * bs], extra))
        return st.keys[:n]

    # ---- lookup ----------------------------------------------------------------------------------
    def lookup(self, seq) -> PrefixHit:
        """The longest reusable cached prefix of `seq` (module docstring); read-only."""
        req = seq.request
        if req.params.has_penalties:
            return PrefixHit([])
        limit = len(seq.token_ids) - 1
        plp = req.prompt_logprobs
        if plp is not None and seq.index == 0:  # stop before the first prompt logprob still needed
            first = next((p for p in range(seq.prompt_len - 1) if plp[p + 1] is None), seq.prompt_len)
            limit = min(limit, first)
        keys = self.keys(seq, limit // self.block_size)
        blocks = []
        for k in keys:
            b = self.blocks.cached(k)
            if b is None:
                break
            blocks.append(b)
        onload = []
        for k in keys[len(blocks):]:  # the chain goes on in the host tier
            if k not in self._host:
                break
            onload.append(k)
        if not self.uses_ssm:
            return PrefixHit(blocks, onload=onload)
        j = len(blocks) + len(onload)
        while j > 0 and keys[j - 1] not in self._snaps:
            j -= 1
        return PrefixHit(blocks[:j], self._snaps[keys[j - 1]] if j else -1, onload[:max(0, j - len(blocks))])

    def record(self, seq, hit: PrefixHit) -> None:
        """Count an admission's lookup in the stats and refresh the snapshot it uses."""
        self.queries += len(seq.token_ids)
        self.hits += hit.num_blocks * self.block_size
        if hit.snapshot >= 0:
            self._snaps.move_to_end(self.keys(seq, hit.num_blocks)[-1])

    # ---- host tier -------------------------------------------------------------------------------
    def take_evicted(self) -> list[tuple[bytes, int]]:
        """(key, block) of the cached blocks evicted since the last call: the engine copies them to
        the host before the step that may reuse them runs (empty without the host tier)."""
        if self.blocks.evicted is None or not self.blocks.evicted:
            return []
        out, self.blocks.evicted = self.blocks.evicted, []
        return out

    def host_put(self, key: bytes, arrays: Any) -> None:
        """The engine's host copy of an evicted block (least recently used ones dropped past the
        capacity)."""
        self._host[key] = arrays
        self._host.move_to_end(key)
        self.num_offloaded += 1
        while len(self._host) > self.host_capacity:
            self._host.popitem(last=False)

    def onload(self, keys: list[bytes], step) -> list[int]:
        """New device blocks for the host-tier blocks `keys` of a hit, registered under their keys;
        `step.kv_onload` gets (block, host arrays) for the engine to write before the step."""
        new = self.blocks.allocate(len(keys))
        for b, k in zip(new, keys):
            self.blocks.register(b, k)
            self._host.move_to_end(k)
            step.kv_onload.append((b, self._host[k]))
        self.num_onloaded += len(keys)
        return new

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    # ---- registration ----------------------------------------------------------------------------
    def register(self, seq) -> None:
        """Offer seq's full, computed, known blocks to the table."""
        st = self._state(seq)
        n = min(seq.num_computed, len(seq.token_ids))
        if not self.cache_decoded:
            n = min(n, st.prefill_end)
        n //= self.block_size
        n = min(n, len(seq.blocks))
        if n <= st.registered:
            return
        keys = self.keys(seq, n)
        for i in range(st.registered, n):
            self.blocks.register(seq.blocks[i], keys[i])
        st.registered = n

    def release(self, seq, register: bool = True) -> None:
        """`seq` is about to free its blocks (finished or preempted): register what it computed
        (unless `register` is False: blocks whose contents were never written) and key its
        rolling snapshot."""
        if register:
            self.register(seq)
        st = self._state(seq)
        st.registered = 0  # its next blocks (after a re-admission or swap-in) are new ones
        if st.rolling_slot >= 0:
            slot, pos = st.rolling_slot, st.rolling_pos
            st.rolling_slot = -1
            keys = self.keys(seq, pos // self.block_size)
            if pos > 0 and len(keys) == pos // self.block_size and keys[-1] not in self._snaps:
                self._snaps[keys[-1]] = slot
            else:
                self._free_snaps.append(slot)

    # ---- snapshots -------------------------------------------------------------------------------
    def _take_slot(self) -> int:
        if self._free_snaps:
            return self._free_snaps.pop()
        if self._snaps:
            _, slot = self._snaps.popitem(last=False)
            self.num_snapshot_evictions += 1
            return slot
        return -1

    def chunk_length(self, seq, start: int, length: int) -> int:
        """With SSM state, end a prefill chunk [start, start + length) on a block boundary so that
        a snapshot can be taken there: a chunk that stops before the known tokens end is cut back
        to its last boundary, the last chunk at the last boundary before its end (its remainder
        runs in the next step). Unchanged when no boundary lies inside it."""
        if not self.uses_ssm or not self.snapshot_slots:
            return length
        end = start + length
        last = end == len(seq.token_ids) + seq.inflight
        cut = ((end - 1) if last else end) // self.block_size * self.block_size
        return cut - start if cut > start else length

    def after_step(self, step) -> list[tuple[int, int]]:
        """After a step is dispatched and `Scheduler.complete` counted its tokens: register the
        blocks it filled; return the SSM snapshot copies (source slot, snapshot slot) to run right
        after it."""
        copies = []
        bs = self.block_size
        for c in step.chunks:
            st = self._state(c.seq)
            st.prefill_end = max(st.prefill_end, c.start + c.length)
            self.register(c.seq)
        for seq in step.decode:
            self.register(seq)
        if not self.uses_ssm or not self.snapshot_slots:
            return copies
        for c in step.chunks:
            seq = c.seq
            end = c.start + c.length
            if end % bs or end > len(seq.token_ids):
                continue
            key = self.keys(seq, end // bs)[-1]
            if key in self._snaps:
                self._snaps.move_to_end(key)
                continue
            slot = self._take_slot()
            if slot >= 0:
                self._snaps[key] = slot
                copies.append((seq.ssm_slot, slot))
                self.num_snapshots_taken += 1
        # hook for speculative decoding: only rows whose num_computed counts verified tokens
        for seq in step.decode:
            if seq.num_computed % bs or not self.cache_decoded:
                continue
            st = self._state(seq)
            if st.rolling_slot < 0:
                st.rolling_slot = self._take_slot()
                if st.rolling_slot < 0:
                    continue
            st.rolling_pos = seq.num_computed
            copies.append((seq.ssm_slot, st.rolling_slot))
            self.num_snapshots_taken += 1
        return copies

    def reset(self) -> bool:
        """Forget every cached block, snapshot and host-tier block (vLLM's `reset_prefix_cache`).
        False (and nothing done) while some sequence holds blocks or a rolling snapshot."""
        a = self.blocks
        if a.num_used or len(self._free_snaps) + len(self._snaps) < len(self.snapshot_slots):
            return False
        a._free.extend(a._lru)
        a._lru.clear()
        a._table.clear()
        a._key.clear()
        self._free_snaps.extend(self._snaps.values())
        self._snaps.clear()
        self._host.clear()
        return True

    @property
    def num_snapshots(self) -> int:
        """Keyed snapshots held now."""
        return len(self._snaps)
