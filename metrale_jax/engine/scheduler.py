"""Requests, sequences and the continuous-batching scheduler (host only, no JAX).

Each step gets a token budget (`max_num_batched_tokens`). The scheduler fills it in this order:
1. every running sequence that is decoding (one pending token) gets a decode row, oldest first;
2. running sequences in the middle of their prompt get their next prefill chunk;
3. waiting sequences are admitted first-come-first-served while the budget, the prefill streams,
   `max_num_seqs`, free KV blocks (and SSM slots / penalty rows where needed) allow.
Chunked prefill thus rides the same step as the decode rows: a long prompt never stalls decoding.

When a running sequence needs a KV block and none is free, the newest running sequences are
preempted by recompute: their blocks and slots are freed and they go back to the waiting queue
(at their original priority) with every token they had, to be prefilled again later. Nothing is
lost; a preempted sequence's outputs so far are kept and re-read as part of its new prefill.

Parallel sampling (n > 1) shares the prompt: the first sequence (the leader) prefills it; the
others wait until the leader's cache holds the whole blocks before the last prompt token, take
references on those blocks (`BlockAllocator.share`) and compute only the remaining prompt tokens
themselves. Shared blocks are never written again. (Not for penalised requests, whose penalty rows
count the prompt, nor for models with SSM state, whose state would need a copy.)

A sequence with exactly one pending token is a decode row: its token is written to the cache at
position `num_computed` and the next token is sampled from it.

Overlapped stepping: the engine dispatches step k+1 before it reads step k's samples, so a
sequence may have one token "in flight" (`Sequence.inflight`) when it is scheduled; that token
counts as known (the step reads it from the previous step's output on the device). A sequence
whose in-flight tokens already reach max_tokens / max_model_len is not scheduled again.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Any

from metrale_jax.cache.allocator import BlockAllocator, SlotAllocator
from metrale_jax.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order (priority: lower first)
    seed: int  # the request's seed (drawn from the engine RNG when params.seed is None)
    stop_ids: frozenset[int] = frozenset()  # eos (unless ignore_eos) + stop_token_ids
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None  # filled as prefill chunks compute them
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status == SeqStatus.FINISHED for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int  # 0..n-1 within the request
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    pen_row: int = -1
    ssm_slot: int = -1
    num_preemptions: int = 0
    inflight: int = 0  # tokens sampled by dispatched steps whose output the host has not read yet
    inflight_row: int = -1  # the sampled row of the newest of them in its step
    leader: Sequence | None = None  # n > 1: the sequence whose prompt KV blocks this one shares
    # outputs
    text: str = ""
    detok: Any = None  # IncrementalDetokenizer (None without a tokenizer)
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def priority(self) -> tuple[int, int]:
        return (self.request.arrival, self.index)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens known (or in flight) but not yet in the cache (1 = decoding)."""
        return len(self.token_ids) + self.inflight - self.num_computed

    def at_limit(self, max_model_len: int) -> bool:
        """Its in-flight tokens already reach max_tokens or max_model_len: schedule no more."""
        n = len(self.token_ids) + self.inflight
        return n - self.prompt_len >= (self.request.params.max_tokens or 1 << 62) or n >= max_model_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


@dataclass
class Chunk:
    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the next token is sampled from it."""
        return self.start + self.length == len(self.seq.token_ids)


@dataclass
class ScheduledStep:
    decode: list[Sequence]
    chunks: list[Chunk]
    preempted: list[Sequence]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    def empty(self) -> bool:
        return not self.decode and not self.chunks


class Scheduler:
    """Continuous batching over KV blocks (ref-counted), penalty rows and SSM slots."""

    def __init__(
        self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        max_prefill_streams: int, max_prefill_tokens: int, num_penalty_rows: int = 0,
        num_ssm_slots: int = 0, uses_ssm: bool = False, watermark_blocks: int | None = None,
        max_model_len: int = 1 << 62,
    ):
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_streams = max_prefill_streams
        self.max_prefill_tokens = max_prefill_tokens
        self.blocks = BlockAllocator(num_blocks)
        self.pen_rows = SlotAllocator(num_penalty_rows)
        self.ssm_slots = SlotAllocator(num_ssm_slots)
        self.uses_ssm = uses_ssm
        self.max_model_len = max_model_len
        self.watermark = max(1, num_blocks // 100) if watermark_blocks is None else watermark_blocks
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []  # sorted by priority
        self.num_preemptions = 0

    # ---- queue management ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.blocks)
        seq.blocks = []
        if seq.pen_row >= 0:
            self.pen_rows.free(seq.pen_row)
            seq.pen_row = -1
        if seq.ssm_slot >= 0:
            self.ssm_slots.free(seq.ssm_slot)
            seq.ssm_slot = -1
        seq.num_computed = 0

    def finish(self, seq: Sequence) -> None:
        """Free everything `seq` holds and drop it from the queues."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.leader = None  # recompute on its own
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # ---- one step --------------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, upto: int) -> int:
        """Blocks to add so that positions < upto have a block."""
        return max(0, -(-upto // self.block_size) - len(seq.blocks))

    def _make_room(self, seq: Sequence, need: int, step: ScheduledStep) -> bool:
        """Preempt the newest running sequences until `need` blocks are free. False when `seq`
        itself had to go (it was the newest)."""
        while self.blocks.num_free < need:
            victim = self.running[-1]
            if victim is seq:
                self._preempt(seq)
                step.preempted.append(seq)
                return False
            if victim in step.decode:
                step.decode.remove(victim)
            step.chunks = [c for c in step.chunks if c.seq is not victim]
            self._preempt(victim)
            step.preempted.append(victim)
        return True

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep([], [], [])
        # 1. decode rows, oldest first
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or seq.pending != 1 or seq.at_limit(self.max_model_len):
                continue
            need = self._blocks_needed(seq, seq.num_computed + 1)
            if need and not self._make_room(seq, need, step):
                continue
            seq.blocks += self.blocks.allocate(need)
            step.decode.append(seq)
        budget = self.budget - len(step.decode)
        prefill = 0

        # 2. running sequences in the middle of a prefill
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or seq.pending <= 1:
                continue
            room = min(budget, self.max_prefill_tokens - prefill)
            if len(step.chunks) >= self.max_streams or room <= 0:
                break
            length = min(seq.pending, room)
            fit = (len(seq.blocks) + self.blocks.num_free) * self.block_size - seq.num_computed
            if fit < 1:
                if not self._make_room(seq, 1, step):
                    continue
                prefill = step.num_prefill_tokens
                budget = self.budget - len(step.decode) - prefill
                length = min(length, budget, self.max_prefill_tokens - prefill)
                fit = (len(seq.blocks) + self.blocks.num_free) * self.block_size - seq.num_computed
            length = min(length, fit)
            seq.blocks += self.blocks.allocate(self._blocks_needed(seq, seq.num_computed + length))
            step.chunks.append(Chunk(seq, seq.num_computed, length))
            budget -= length
            prefill += length

        # 3. admissions, first come first served (none in a step that had to preempt). A follower
        #    (n > 1) whose leader has not computed the shared prompt blocks yet is stepped over.
        i = 0
        while i < len(self.waiting) and not step.preempted:
            seq = self.waiting[i]
            if seq.inflight:  # preempted with a token in flight: admit once the host has it
                break
            shared = self._shared_blocks(seq)
            if shared is None:  # wait for the leader
                i += 1
                continue
            room = min(budget, self.max_prefill_tokens - prefill)
            if (len(step.chunks) >= self.max_streams or room <= 0
                    or len(self.running) >= self.max_num_seqs):
                break
            wants_pen = seq.request.params.has_penalties and self.pen_rows.num_slots > 0
            if wants_pen and self.pen_rows.num_free == 0:
                break
            if self.uses_ssm and self.ssm_slots.num_free == 0:
                break
            start = len(shared) * self.block_size
            spare = self.blocks.num_free - self.watermark
            length = min(seq.pending - start, room, spare * self.block_size)
            if length < 1:
                break
            self.waiting.pop(i)
            self.blocks.share(shared)
            seq.blocks = list(shared)
            seq.num_computed = start
            seq.blocks += self.blocks.allocate(self._blocks_needed(seq, start + length))
            if wants_pen:
                seq.pen_row = self.pen_rows.allocate()
            if self.uses_ssm:
                seq.ssm_slot = self.ssm_slots.allocate()
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.priority)
            step.chunks.append(Chunk(seq, start, length))
            budget -= length
            prefill += length
        return step

    def _shared_blocks(self, seq: Sequence) -> list[int] | None:
        """The leader's prompt blocks a follower can share ([] = none), or None = wait for them.

        Only whole blocks before the last prompt token are shared (the follower computes the rest
        itself, so nobody ever writes into a shared block)."""
        lead = seq.leader
        if lead is None:
            return []
        k = (seq.prompt_len - 1) // self.block_size
        if lead.status == SeqStatus.FINISHED or k == 0:
            seq.leader = None
            return []
        if lead.status == SeqStatus.RUNNING and lead.num_computed >= k * self.block_size:
            return lead.blocks[:k]
        return None

    def complete(self, step: ScheduledStep) -> None:
        """Mark the step's tokens as cached (call after the step ran, before appending samples)."""
        for seq in step.decode:
            seq.num_computed += 1
        for c in step.chunks:
            c.seq.num_computed += c.length
