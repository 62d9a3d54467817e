"""Host-side allocators: KV blocks with reference counts, and plain slots (SSM pool rows,
penalty-table rows). The device pools never see these objects; the metadata builder turns the
ids they hand out into block tables and slot indices."""

from __future__ import annotations

from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation (the scheduler checks first; this is a bug guard)."""


class BlockAllocator:
    """`num_blocks` KV blocks, ids 0..num_blocks-1, with reference counts for sharing.

    `allocate` hands out blocks with ref count 1, `share` adds a reference (prefix sharing, fork),
    `free` drops one reference and returns a block to the pool when it reaches 0.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"{num_blocks=} must be >= 1")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # LIFO free list: recently freed (likely cache-warm) blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class SlotAllocator:
    """`num_slots` slots (ids 0..num_slots-1), one owner each: SSM pool rows, penalty rows."""

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"{num_slots=} must be >= 0")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_slots} slots are in use")
        s = self._free.pop()
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
