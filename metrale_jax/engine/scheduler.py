"""Requests, sequences and the continuous-batching scheduler (host only, no JAX).

Each step gets a token budget (`max_num_batched_tokens`). The scheduler fills it in this order:
1. every running sequence that is decoding (one pending token) gets a decode row, oldest first;
2. running sequences in the middle of their prompt get their next prefill chunk;
1b. swapped-out sequences are resumed (swap mode; not in a step that had to preempt);
3. waiting sequences are admitted first-come-first-served while the budget, the prefill streams,
   `max_num_seqs`, free KV blocks (and SSM slots / penalty rows where needed) allow, and no
   swapped-out sequence is left to resume.
Chunked prefill thus rides the same step as the decode rows: a long prompt never stalls decoding.

When a running sequence needs a KV block and none is free, the newest running sequences are
preempted, in one of two ways (`preemption_mode`):
- recompute: their blocks and slots are freed and they go back to the waiting queue (at their
  original priority) with every token they had, to be prefilled again later. Nothing is lost; a
  preempted sequence's outputs so far are kept and re-read as part of its new prefill.
- swap (the default for models with SSM state, where a recompute would replay the whole
  recurrence): the step lists the sequence in `swap_out`, with the blocks and the SSM slot it
  held (`SwapRecord`), and the engine copies their contents to host memory before the step runs;
  the blocks and the slot are freed at once, the penalty row (if any) is kept, and `num_computed`
  stays. Swapped sequences resume before any new admission, oldest first (step 1b below), as soon
  as `max_num_seqs`, a free slot and the blocks of their cached tokens (plus the watermark while
  others run) allow: they get new blocks and a new slot, the step lists them in `swap_in`, the
  engine writes the saved state there, and they carry on decoding (or prefilling) where they
  stopped. A sequence swapped in and chosen as a victim in the same step goes back to the swapped
  list untouched. A sequence falls back to recompute when its host copy would exceed
  `swap_space_bytes`.

Parallel sampling (n > 1) shares the prompt: the first sequence (the leader) prefills it; the
others wait until the leader's cache holds the whole blocks before the last prompt token, take
references on those blocks (`BlockAllocator.share`) and compute only the remaining prompt tokens
themselves. Shared blocks are never written again. (Not for penalised requests, whose penalty rows
count the prompt, nor for models with SSM state, whose state would need a copy.)

Prefix caching (`prefix_caching=True`, metrale_jax/cache/prefix_cache.py): the block allocator
keeps the full blocks of freed sequences cached under their prefix hash (LRU); an admitted
sequence shares the longest cached chain (plus, with SSM state, the snapshot at its end, which the
step restores into its slot) and prefills only the rest. With SSM state, prefill chunks end on
block boundaries so that snapshots can be taken there.

A sequence whose one pending token is a generated one (`Sequence.decoding`) is a decode row: its
token is written to the cache at position `num_computed` and the next token is sampled from it.
Prompt tokens always go through prefill chunks, the last one too.

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
from metrale_jax.cache.prefix_cache import CachingBlockAllocator, PrefixCache
from metrale_jax.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its cached state lives in host memory
    FINISHED = "finished"


PREEMPTION_MODES = ("swap", "recompute")


@dataclass(eq=False)
class SwapRecord:
    """A swapped-out sequence's cached state.

    `blocks` (the first `ceil(num_computed / block_size)` blocks it held, in order) and `slot`
    (its SSM slot, -1 = none) are the device places the engine copies from before the step that
    preempted it runs; they are free in the allocators already. `data` is the engine's copy (its
    `metrale_jax.engine.swap.SwapData`), `nbytes` what the host copy takes.
    """

    blocks: list[int]
    slot: int
    nbytes: int
    data: Any = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


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
    prompt_logprobs_sent: bool = False  # RequestOutputKind.DELTA: returned already
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False
    lora_request: Any = None  # metrale_jax.lora.LoRARequest, or None for the base model
    # i32[ceil(V / 32)]: the tokens allowed_token_ids / logit_bias leave (`SamplingParams.token_mask`)
    token_mask: Any = None
    # bad_words of several tokens, as token sequences (`LLMEngine._bad_words`); one-token ones are in token_mask
    bad_words: tuple = ()
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached KV blocks
    priority: int = 0  # scheduling_policy "priority": lower first (then arrival)

    @property
    def finished(self) -> bool:
        return all(s.status == SeqStatus.FINISHED for s in self.seqs)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0 = the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def lora_key(self) -> tuple | None:
        """What identifies the adapter's effect on the KV cache (None = base model): the prefix
        cache's extra block key. The path is part of it, so an id reused for another adapter after
        `remove_lora` cannot hit the old adapter's blocks."""
        r = self.lora_request
        return None if r is None else (r.lora_int_id, r.lora_name, r.lora_path)

    @property
    def cache_extra(self) -> Any:
        """The prefix cache's extra block key: the adapter (`lora_key`), and the cache salt if any."""
        return self.lora_key if self.cache_salt is None else (self.lora_key, "salt", self.cache_salt)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int  # 0..n-1 within the request
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens the prefix cache (or its leader) gave it when first admitted
    blocks: list[int] = field(default_factory=list)
    pen_row: int = -1
    ssm_slot: int = -1
    num_preemptions: int = 0
    inflight: int = 0  # tokens sampled by dispatched steps whose output the host has not read yet
    inflight_row: int = -1  # the sampled row of the newest of them in its step
    leader: Sequence | None = None  # n > 1: the sequence whose prompt KV blocks this one shares
    swap: SwapRecord | None = None  # set while SWAPPED
    cache_state: Any = None  # prefix caching's record (metrale_jax.cache.prefix_cache.SeqCacheState)
    spec_len: int = 0  # drafts this step's decode row may carry (speculative decoding; 0 = plain)
    # drafts of its dispatched verify steps whose acceptance the host has not read yet (overlapped
    # verify steps, engine/spec_decode.py): its length is known up to these many tokens
    spec_inflight: int = 0
    mtp_drafts: tuple = (-1, ())  # (length of token_ids they follow, drafts): an MTP drafter's last output
    # outputs
    text: str = ""
    detok: Any = None  # IncrementalDetokenizer (None without a tokenizer)
    row_sampling: Any = None  # the engine's RowSampling of this sequence (cached across steps)
    grammar: Any = None  # structured output: the sequence's llguidance LLMatcher (None = free text)
    grammar_error: str | None = None  # why the matcher rejected a sampled token (the row then finishes)
    # speculative decoding: the grammar forced 2+ tokens after the last one fed to it, so a step
    # that reads this row's samples lets the next one draft the rest (jump-forward; a hint, set
    # by the thread that feeds the grammar, cleared by a verify step, whose successor drafts the
    # forced tokens itself; read by `spec_decode.sync_for_drafts`)
    grammar_forced: bool = False
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0  # summed when the request reports it (params.logprobs set)
    sent_tokens: int = 0  # RequestOutputKind.DELTA: output tokens (and their logprobs) already returned
    sent_text: int = 0  # ... and characters of `text`
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def priority(self) -> tuple[int, int, int]:
        """Scheduling order, first first: the request's priority (0 under "fcfs"), arrival, index."""
        return (self.request.priority, self.request.arrival, self.index)

    @property
    def lora_int_id(self) -> int:
        """Its request's LoRA adapter id (0 = base model)."""
        return self.request.lora_int_id

    @property
    def lora_key(self) -> tuple | None:
        """Its request's `lora_key` (None = base model)."""
        return self.request.lora_key

    @property
    def cache_extra(self) -> Any:
        """Its request's `cache_extra`: prefix caching keys KV blocks by it."""
        return self.request.cache_extra

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens known (or in flight) but not yet in the cache."""
        return len(self.token_ids) + self.inflight - self.num_computed

    @property
    def decoding(self) -> bool:
        """Its one pending token is a generated one: a decode row (a prompt's last token, even
        alone, goes through prefill: the prefill path is what a recurrent layer's reference runs
        over a prompt, and the token must not count as generated for the penalties)."""
        return self.pending == 1 and self.num_computed >= self.prompt_len

    def at_limit(self, max_model_len: int) -> bool:
        """Its in-flight tokens already reach max_tokens or max_model_len: schedule no more."""
        n = len(self.token_ids) + self.inflight + self.spec_inflight
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
    swap_out: list[Sequence] = field(default_factory=list)  # copy seq.swap's blocks/slot to host first
    swap_in: list[Sequence] = field(default_factory=list)  # then write seq.swap.data into seq.blocks/slot
    # prefix caching, SSM pool slot copies (source, destination): restores of cached snapshots into
    # admitted sequences' slots before the step runs, snapshots right after it
    ssm_restores: list[tuple[int, int]] = field(default_factory=list)
    ssm_snapshots: list[tuple[int, int]] = field(default_factory=list)
    # prefix cache's host tier: (key, block) evicted cached blocks to copy to host memory first, then
    # (block, host arrays) cached blocks to write back
    kv_offload: list[tuple[bytes, int]] = field(default_factory=list)
    kv_onload: list[tuple[int, Any]] = field(default_factory=list)

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
        max_model_len: int = 1 << 62, preemption_mode: str = "recompute", swap_bytes_per_block: int = 0,
        swap_bytes_per_slot: int = 0, swap_space_bytes: int = 1 << 62, max_loras: int = 0,
        prefix_caching: bool = False, snapshot_slots: tuple[int, ...] = (), cache_decoded: bool = True,
        kv_offloading_bytes: int = 0,
        num_spec_tokens: int = 0, max_prompt_lp_tokens: int = 1 << 62, num_lookahead_tokens: int = 0,
        spec_off_at: int | None = None,
    ):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={preemption_mode!r} must be one of {PREEMPTION_MODES}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_streams = max_prefill_streams
        self.max_prefill_tokens = max_prefill_tokens
        self.blocks = CachingBlockAllocator(num_blocks) if prefix_caching else BlockAllocator(num_blocks)
        # automatic prefix caching (metrale_jax/cache/prefix_cache.py); None = off
        self.prefix_cache = (PrefixCache(self.blocks, block_size, uses_ssm, snapshot_slots, cache_decoded,
                                         kv_offloading_bytes, swap_bytes_per_block) if prefix_caching else None)
        self.pen_rows = SlotAllocator(num_penalty_rows)
        self.ssm_slots = SlotAllocator(num_ssm_slots)
        self.uses_ssm = uses_ssm
        self.max_model_len = max_model_len
        self.watermark = max(1, num_blocks // 100) if watermark_blocks is None else watermark_blocks
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []  # sorted by priority
        self.swapped: list[Sequence] = []  # sorted by priority
        self.preemption_mode = preemption_mode
        self.swap_bytes_per_block = swap_bytes_per_block
        self.swap_bytes_per_slot = swap_bytes_per_slot
        self.swap_space_bytes = swap_space_bytes
        self.max_loras = max_loras  # distinct LoRA adapters among the running sequences; 0 = no limit
        self.swap_bytes = 0  # host bytes the swapped sequences hold now
        self.dropped_swaps: list[int] = []  # ids of swapped sequences finished while swapped (engine/lockstep.py)
        self.num_preemptions = 0
        self.num_swaps = 0  # swap-outs
        self.num_swap_ins = 0
        self.num_spec_tokens = num_spec_tokens  # k: a decode row may verify k drafts (blocks + budget)
        self.spec_off_at = spec_off_at  # no drafts while this many sequences run (None: always)
        # blocks past a decode row's window: an MTP drafter writes its k - 1 chained drafts' K/V there
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_prompt_lp_tokens = max_prompt_lp_tokens  # prompt-logprob positions per step (the step's rows)

    # ---- queue management ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _free_device(self, seq: Sequence, written: bool = True) -> None:
        """Free the blocks and the SSM slot (not the penalty row). `written`: the blocks hold the
        sequence's computed tokens (False for blocks of a swap-in that was cancelled)."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq, register=written)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        if seq.ssm_slot >= 0:
            self.ssm_slots.free(seq.ssm_slot)
            seq.ssm_slot = -1

    def _free_pen_row(self, seq: Sequence) -> None:
        if seq.pen_row >= 0:
            self.pen_rows.free(seq.pen_row)
            seq.pen_row = -1

    def _release(self, seq: Sequence) -> None:
        self._free_device(seq)
        self._free_pen_row(seq)
        seq.num_computed = 0

    def _drop_swap(self, seq: Sequence) -> None:
        if seq.swap is not None:
            self.swap_bytes -= seq.swap.nbytes
            seq.swap = None

    def finish(self, seq: Sequence) -> None:
        """Free everything `seq` holds and drop it from the queues."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self._free_pen_row(seq)
            self._drop_swap(seq)
            self.dropped_swaps.append(seq.seq_id)
            seq.num_computed = 0
        seq.status = SeqStatus.FINISHED

    def _swap_record(self, seq: Sequence) -> SwapRecord | None:
        """What swapping `seq` out would save, or None when it must be recomputed instead."""
        if self.preemption_mode != "swap" or seq.num_computed == 0:
            return None
        nb = -(-seq.num_computed // self.block_size)
        nbytes = nb * self.swap_bytes_per_block + (self.swap_bytes_per_slot if seq.ssm_slot >= 0 else 0)
        if self.swap_bytes + nbytes > self.swap_space_bytes:
            return None
        return SwapRecord(list(seq.blocks[:nb]), seq.ssm_slot, nbytes)

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        step.preempted.append(seq)
        seq.leader = None  # resumes (or recomputes) on its own
        if seq in step.swap_in:  # resumed in this very step: back to the swapped list, untouched
            step.swap_in.remove(seq)
            self.num_swap_ins -= 1
            self._free_device(seq, written=False)
            seq.status = SeqStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.priority)
            return
        seq.num_preemptions += 1
        self.num_preemptions += 1
        rec = self._swap_record(seq)
        if rec is None:
            self._release(seq)
            self.add(seq)
            return
        self._free_device(seq)
        seq.swap = rec
        self.swap_bytes += rec.nbytes
        self.num_swaps += 1
        seq.status = SeqStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=lambda s: s.priority)
        step.swap_out.append(seq)

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
                self._preempt(seq, step)
                return False
            if victim in step.decode:
                step.decode.remove(victim)
            step.chunks = [c for c in step.chunks if c.seq is not victim]
            self._preempt(victim, step)
        return True

    def _resume_swapped(self, step: ScheduledStep) -> None:
        """Swap in the swapped-out sequences, oldest first, while rows, slots and blocks allow.

        A resumed sequence gets the blocks of its cached tokens (the engine writes the saved state
        there) and, when it is decoding, its decode row in this step."""
        while self.swapped and not step.preempted:
            seq = self.swapped[0]
            if seq.inflight or len(self.running) >= self.max_num_seqs or self._lora_blocked(seq):
                break  # (an in-flight token: resume once the host has it)
            if self.uses_ssm and self.ssm_slots.num_free == 0:
                break
            rec = seq.swap
            upto = min(seq.num_computed + 1 + self.num_lookahead_tokens, self.max_model_len)
            need = -(-upto // self.block_size)
            if self.blocks.num_free - (self.watermark if self.running else 0) < need:
                break
            self.swapped.pop(0)
            seq.blocks = self.blocks.allocate(rec.num_blocks)
            if self.uses_ssm:
                seq.ssm_slot = self.ssm_slots.allocate()
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.priority)
            step.swap_in.append(seq)
            self.num_swap_ins += 1
            if seq.decoding and not seq.at_limit(self.max_model_len):
                seq.spec_len = 0
                seq.blocks += self.blocks.allocate(self._blocks_needed(seq, self._decode_upto(seq)))
                step.decode.append(seq)

    def _spec_len(self, seq: Sequence) -> int:
        """Drafts a decode row may verify: k, fewer near max_tokens / max_model_len (the row emits
        at most 1 + drafts tokens)."""
        if not self.num_spec_tokens or self.spec_paused():
            return 0
        n = len(seq.token_ids) + seq.inflight + seq.spec_inflight
        room = min((seq.request.params.max_tokens or 1 << 62) - (n - seq.prompt_len), self.max_model_len - n) - 1
        return max(0, min(self.num_spec_tokens, room))

    def spec_paused(self) -> bool:
        """Whether rows draft nothing now (`SpeculativeConfig.disable_by_batch_size`)."""
        return self.spec_off_at is not None and len(self.running) >= self.spec_off_at

    def _decode_upto(self, seq: Sequence) -> int:
        """Positions a decode row needs blocks for: its window (after the drafts a verify step in
        flight may still accept), then the lookahead (up to max_model_len)."""
        window = seq.num_computed + seq.spec_inflight + 1 + seq.spec_len
        return max(window, min(window + self.num_lookahead_tokens, self.max_model_len))

    def swapped_in(self, seq: Sequence) -> None:
        """The engine wrote `seq`'s saved state back: drop the host copy."""
        self._drop_swap(seq)

    @staticmethod
    def _prompt_lp_positions(seq: Sequence, start: int) -> int:
        """Positions from `start` on whose prompt logprob this sequence still needs (an upper
        bound: the first sequence of a request asking `prompt_logprobs`, up to its prompt's end)."""
        if seq.request.prompt_logprobs is None or seq.index != 0:
            return 0
        return max(0, seq.prompt_len - 1 - start)

    def _cap_prompt_lp(self, seq: Sequence, start: int, length: int, left: int) -> tuple[int, int]:
        """(`length` cut so that a chunk from `start` has at most `left` prompt-logprob positions,
        the sequence's prompt-logprob positions from `start`)."""
        plp = self._prompt_lp_positions(seq, start)
        return (min(length, left) if plp > left else length), plp

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep([], [], [])
        plp_left = self.max_prompt_lp_tokens
        # 1. decode rows, oldest first
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or not seq.decoding or seq.at_limit(self.max_model_len):
                continue
            seq.spec_len = self._spec_len(seq)
            need = self._blocks_needed(seq, self._decode_upto(seq))
            if need and not self._make_room(seq, need, step):
                continue
            seq.blocks += self.blocks.allocate(need)
            step.decode.append(seq)
        # 1b. swapped-out sequences come back before anything new is admitted
        self._resume_swapped(step)
        budget = self.budget - sum(1 + s.spec_len for s in step.decode)
        prefill = 0

        # 2. running sequences in the middle of a prefill
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or seq.pending < 1 or seq.decoding:
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
                budget = self.budget - sum(1 + s.spec_len for s in step.decode) - prefill
                length = min(length, budget, self.max_prefill_tokens - prefill)
                fit = (len(seq.blocks) + self.blocks.num_free) * self.block_size - seq.num_computed
            length, plp = self._cap_prompt_lp(seq, seq.num_computed, min(length, fit), plp_left)
            if length < 1:
                continue
            if self.prefix_cache is not None:
                length = self.prefix_cache.chunk_length(seq, seq.num_computed, length)
            plp_left -= min(length, plp)
            seq.blocks += self.blocks.allocate(self._blocks_needed(seq, seq.num_computed + length))
            step.chunks.append(Chunk(seq, seq.num_computed, length))
            budget -= length
            prefill += length

        # 3. admissions, first come first served (none in a step that had to preempt). A follower
        #    (n > 1) whose leader has not computed the shared prompt blocks yet is stepped over.
        i = 0
        while i < len(self.waiting) and not step.preempted and not self.swapped:
            seq = self.waiting[i]
            if seq.inflight:  # preempted with a token in flight: admit once the host has it
                break
            shared = self._shared_blocks(seq)
            if shared is None or self._lora_blocked(seq):  # wait for the leader / a LoRA slot
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
            hit = None
            if self.prefix_cache is not None and not shared:
                hit = self.prefix_cache.lookup(seq)
                shared = hit.blocks
            start = (len(shared) + (len(hit.onload) if hit else 0)) * self.block_size
            spare = self.blocks.num_free - self.watermark
            if hit is not None:  # cached blocks it takes count as free now; host-tier ones need new blocks
                spare -= self.blocks.num_reclaimed(shared) + len(hit.onload)
            length, plp = self._cap_prompt_lp(seq, start, min(seq.pending - start, room, spare * self.block_size),
                                              plp_left)
            if self.prefix_cache is not None and length >= 1:
                length = self.prefix_cache.chunk_length(seq, start, length)
            if length < 1:
                break
            plp_left -= min(length, plp)
            self.waiting.pop(i)
            self.blocks.share(shared)
            seq.blocks = list(shared)
            if hit is not None and hit.onload:
                seq.blocks += self.prefix_cache.onload(hit.onload, step)
            seq.num_computed = start
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = start
            seq.blocks += self.blocks.allocate(self._blocks_needed(seq, start + length))
            if wants_pen:
                seq.pen_row = self.pen_rows.allocate()
            if self.uses_ssm:
                seq.ssm_slot = self.ssm_slots.allocate()
            if hit is not None:
                self.prefix_cache.record(seq, hit)
                if hit.snapshot >= 0:
                    step.ssm_restores.append((hit.snapshot, seq.ssm_slot))
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.priority)
            step.chunks.append(Chunk(seq, start, length))
            budget -= length
            prefill += length
        if self.prefix_cache is not None:
            step.kv_offload = self.prefix_cache.take_evicted()
        return step

    def _lora_blocked(self, seq: Sequence) -> bool:
        """Running `seq` would make more than max_loras distinct adapters run at once."""
        lid = seq.request.lora_int_id
        if not lid or not self.max_loras:
            return False
        active = {s.request.lora_int_id for s in self.running} - {0}
        return lid not in active and len(active) >= self.max_loras

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
        if self.prefix_cache is not None:
            step.ssm_snapshots = self.prefix_cache.after_step(step)
