"""`LLMEngine`: requests in, cumulative `RequestOutput`s out, one `step()` at a time.

Single-threaded: a server calls it from one background thread. Per step the engine asks the
scheduler for a batch, builds the step inputs in numpy (`metadata_builder`, one host->device
transfer), runs the bucket's precompiled executable (state donated), fetches the sampled ids (and
logprobs only when some row asked for them), and updates the sequences: detokenize
incrementally, check stop conditions, free what finished sequences held.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import threading
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from metrale_jax.engine.compile import CompilationManager, setup_compilation_cache
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.lockstep import Lockstep, follow
from metrale_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from metrale_jax.engine.scheduler import Chunk, Request, Scheduler, SeqStatus, Sequence
from metrale_jax.errors import (
    EmptyPromptError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    InvalidStructuredOutputsError,
    MaxTokensTooLargeError,
    PromptTooLongError,
)
from metrale_jax.layers.linear import use_fp8_kernel
from metrale_jax.layers.stack import split_layers
from metrale_jax.metadata_builder import (
    BuilderConfig,
    DecodeRow,
    PrefillChunk,
    RowSampling,
    StepInputs,
    build_step,
    pack,
)
from metrale_jax.parallel import Sharder, local, make_mesh
from metrale_jax.sampling import (
    F_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    and_token_masks,
    bad_word_bans,
    bad_words_token_ids,
    ban_tokens,
    sampling_defaults,
)
from metrale_jax.step import StepState, init_step_state

log = logging.getLogger(__name__)

_DTYPES = {"float32", "bfloat16", "float16"}
# vLLM's prompt-dict keys for images, audio and precomputed embeddings
_MULTIMODAL_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    ssm_slots_total: int
    ssm_slots_used: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    num_steps: int = 0
    num_swapped: int = 0  # requests with a sequence swapped out to host memory now
    num_swaps: int = 0  # preemptions by swap (swap-outs) so far
    num_swap_ins: int = 0
    swap_bytes: int = 0  # host memory the swapped-out sequences hold now
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed again)
    spec_num_drafts: int = 0  # verify rows that carried drafts (speculative decoding)
    spec_draft_tokens: int = 0  # drafts verified
    spec_accepted_tokens: int = 0  # drafts accepted (the bonus token excluded)


@dataclass
class _InFlight:
    """A dispatched step: what the host needs to apply its samples once they arrive."""

    sched: Any  # ScheduledStep
    inputs: StepInputs
    sampled: list  # (row, Sequence) per sampled row
    names: list[str]  # SampleOutput fields being fetched
    arrays: list  # their device arrays (host copies started)
    want_lp: bool
    want_plp: bool
    constrained: bool = False  # a sampled row follows a grammar (structured output)
    advanced: bool = False  # its samples were fed to those grammars, or are being fed (`_advance_grammars`)
    fed: threading.Event | None = None  # set once the mask thread has fed them (`_dispatch`)
    # a constrained split step's sampling half, not launched yet (see `LLMEngine._dispatch`): it
    # fills `arrays`; None once launched
    launch: Any = None
    # an overlapped verify step (engine/spec_decode.py): its t0s were counted at dispatch, so the
    # next step could be scheduled before its acceptance is read; each row's drafts by seq_id
    overlapped: bool = False
    row_drafts: dict | None = None

    def read(self) -> dict:
        """The fetched samples on the host, by name: waits for each array's copy, started at dispatch
        (`jax.device_get` would start each copy again first, ~20 us of host time an array)."""
        return dict(zip(self.names, [np.asarray(a) for a in self.arrays]))

    def launched(self) -> _InFlight:
        """This step with its sampling half launched (its `arrays` filled)."""
        if self.launch is not None:
            launch, self.launch = self.launch, None
            launch()
        return self


def _on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What scripts written for vLLM read off `llm.llm_engine.model_config` (`LLMEngine.model_config`)."""

    model: str
    dtype: str  # the parameters' dtype, resolved ("bfloat16", ...)
    quantization: str | None  # how the weights are stored (`model.Model.quantization`)
    max_model_len: int
    vocab_size: int
    hidden_size: int

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return self.hidden_size


class LLMEngine:
    """The serving engine. `LLMEngine(model, params, config)` or `LLMEngine.from_config(config)`.

    With `AttentionConfig.unroll_layers` (the GPU default) the engine splits the layer-stacked
    arrays of `params` into per-layer arrays IN PLACE (`layers.stack.split_layers`); the split
    tree still works everywhere a stacked one does (`model.forward`, other engines).
    `owns_params` (`from_config`): nobody else uses `params`, and the engine may rewrite them in
    place (enable_lora appends the adapters' A matrices to the base weights, freeing each layer's
    old array as it goes; otherwise it copies, and the caller's arrays stay in memory too).
    """

    def __init__(self, model, params, config: EngineConfig | None = None, *, owns_params: bool = False):
        t0 = time.perf_counter()
        gc.unfreeze()  # (an earlier engine froze the heap, below: what was dropped since is garbage again)
        config = config or EngineConfig()
        self.model = model
        self.params = params
        self.uses_ssm = model.ssm_bytes_per_slot() > 0
        self.config = config.resolve(max_position_embeddings=model.cfg.max_positions,
                                     on_gpu=_on_gpu(), uses_ssm=self.uses_ssm,
                                     uses_moe=getattr(model, "has_experts", False))
        why_not = model.pallas_unsupported() if hasattr(model, "pallas_unsupported") else None
        if self.config.attention.use_pallas and why_not:
            log.warning("Pallas kernels off for this model (%s): using the XLA reference path", why_not)
            self.config = self.config.replace(attention=dataclasses.replace(self.config.attention, use_pallas=False))
        c = self.config
        log.info("kernels: %s; layers: %s", "Pallas" if c.attention.use_pallas else "XLA reference",
                 "Python loop over per-layer arrays" if c.attention.unroll_layers else "lax.scan")
        phases = {}  # start-up phase -> seconds (logged; `startup_phases`)
        t = time.perf_counter()
        if c.attention.unroll_layers:
            # in place, so that the layer-stacked arrays are freed before the KV pool is sized
            # (unless the caller keeps other references to them); see layers/stack.py
            self.params = split_layers(params)
        if c.attention.fp8_kernel:
            self.params = use_fp8_kernel(self.params, interpret=c.attention.interpret, w8a8=c.attention.fp8_w8a8,
                                         fp4_tensor_cores=c.attention.fp4_tensor_cores,
                                         w4_fused_decode=c.attention.w4_fused_decode, pdl=c.attention.kernel_pdl,
                                         w4_promote=c.attention.w4_promote)
        phases["split_layers"] = time.perf_counter() - t
        self.lora = None  # LoRAManager (enable_lora): slots under params["layers"]["lora"]
        if c.enable_lora:
            from metrale_jax.lora.manager import attach_lora

            self.lora = attach_lora(self, owns_params)
        self.sharder = None  # tensor parallelism (metrale_jax/parallel.py)
        # several processes (jax.distributed): process 0 schedules, the others follow (engine/lockstep.py)
        self.lockstep = Lockstep() if jax.process_count() > 1 else None
        if self.lockstep is not None and c.tensor_parallel_size != jax.device_count():
            raise ValueError(f"under jax.distributed the steps span every device: tensor_parallel_size must be "
                             f"{jax.device_count()} ({jax.process_count()} processes), not {c.tensor_parallel_size}")
        if self.lockstep is not None and c.enable_lora:
            raise ValueError("LoRA adapters under jax.distributed (several processes) are not supported yet")
        if self.lockstep is not None and c.kv_offloading_size:
            raise ValueError("the prefix cache's host tier (kv_offloading_size) under jax.distributed (several "
                             "processes) is not supported yet")
        if c.tensor_parallel_size > 1:
            t = time.perf_counter()
            self.sharder = Sharder(make_mesh(c.tensor_parallel_size), expert_parallel=c.enable_expert_parallel)
            self.params = self.sharder.shard_params(self.params)
            self.config = c = c.replace(attention=dataclasses.replace(c.attention, mesh=self.sharder.mesh))
            phases["shard"] = time.perf_counter() - t
            log.info("tensor parallel over %d %s devices (mesh axis %r%s)", c.tensor_parallel_size,
                     jax.devices()[0].platform, "tp", ", experts by expert" if c.enable_expert_parallel else "")
        self.num_drafts = self._check_mtp()  # k of an MTP drafter (speculative_config method "mtp"), else 0
        self.tokenizer = getattr(model, "tokenizer", None)
        self.model_name = getattr(model, "name", "") or c.model
        self.eos_token_ids: tuple[int, ...] = tuple(getattr(model, "eos_token_ids", ()) or ())
        self.sampling_defaults = sampling_defaults(c.generation_config, getattr(model, "generation_config", None))
        if self.sampling_defaults:  # (said once, here: the CLI reads the same defaults before the engine exists)
            log.warning("request defaults from the model's generation config: %s (EngineConfig(generation_config="
                        "'vllm') keeps SamplingParams' own)",
                        ", ".join(f"{k}={v}" for k, v in sorted(self.sampling_defaults.items())))
        self.vocab_size = int(model.cfg.vocab_size)
        self.cache_dir = setup_compilation_cache(c.compilation_cache_dir)

        t = time.perf_counter()
        kv_dtype = c.kv_dtype or (c.dtype if c.dtype in _DTYPES else getattr(model, "dtype", None))
        self.kv_dtype = kv_dtype
        self.num_blocks = self._kv_pool_size(kv_dtype)
        if self.num_blocks < c.max_blocks_per_seq:
            raise ValueError(
                f"the KV pool ({self.num_blocks} blocks of {c.block_size}) cannot hold one sequence of "
                f"max_model_len={c.max_model_len}; lower max_model_len or raise num_kv_blocks")
        pen_rows = c.max_penalty_rows or 0
        ssm_slots = c.max_ssm_slots if self.uses_ssm else 0
        # the sequences' slots, then the prefix cache's snapshot slots
        self.state: StepState = init_step_state(model, self.num_blocks, c.block_size, kv_dtype,
                                                max_ssm_slots=ssm_slots + c.max_ssm_snapshots, penalty_rows=pen_rows,
                                                extra_kv_layers=self.extra_kv_layers)
        placement = None
        if self.sharder is not None:
            placement = self.sharder.placement(self.state)
            self.state = self.sharder.shard_state(self.state, placement)
        log.info(
            "KV pool: %d blocks x %d tokens (%d tokens, %.1f MB, %s); max_model_len=%d, max_num_seqs=%d, "
            "token budget %d", self.num_blocks, c.block_size, self.num_blocks * c.block_size,
            self.num_blocks * self.kv_bytes_per_block / 1e6, kv_dtype,
            c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens)
        if self.uses_ssm:
            log.info("SSM pool: %d slots + %d prefix-cache snapshots x %.3f MB (%.1f MB)", ssm_slots,
                     c.max_ssm_snapshots, model.ssm_bytes_per_slot() / 1e6,
                     (ssm_slots + c.max_ssm_snapshots) * model.ssm_bytes_per_slot() / 1e6)
        log.info("preemption: %s%s", c.preemption_mode, f" (block buckets {c.swap_block_buckets}, host space "
                 f"{c.swap_space_gb:g} GB)" if c.preemption_mode == "swap" else "")
        self.builder = BuilderConfig(block_size=c.block_size, max_blocks_per_seq=c.max_blocks_per_seq,
                                     vocab_size=self.vocab_size, max_suppress_ids=c.max_suppress_ids,
                                     max_prompt_lp_tokens=c.max_prompt_logprobs_tokens, mtp=bool(self.num_drafts))
        jax.block_until_ready(self.state)
        phases["kv_pool"] = time.perf_counter() - t
        self.compiler = CompilationManager(model, c, self.builder, placement, num_drafts=self.num_drafts)
        phases["compile"] = self.compiler.compile_all(self.params, self.state)
        if self.lora is not None:
            t = time.perf_counter()
            self.lora.compile(self.params)
            phases["compile"] += time.perf_counter() - t
        if c.warm_up:
            self.state = self.compiler.warm_up(self.params, self.state)
            phases["warm_up"] = self.compiler.warmup_seconds
        reserve = getattr(self, "_scratch_reserve", None)
        if reserve is not None and self.compiler.temp_bytes > reserve:
            log.warning("the largest step needs %.2f GB of scratch but %.2f GB were reserved when sizing the KV "
                        "pool: lower gpu_memory_utilization or set num_kv_blocks if steps run out of memory",
                        self.compiler.temp_bytes / 1e9, reserve / 1e9)
        self.spec_stats = dict.fromkeys(("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens"), 0)
        # the prefix cache's host tier, when restoring a block beats recomputing it (measured here)
        self.host_tier_costs: dict[str, float] = {}
        self.host_tier_on = c.kv_offloading_size > 0 and c.kv_offloading_restore is not False
        if self.host_tier_on and c.kv_offloading_restore is None:
            t = time.perf_counter()
            self.host_tier_on = self._host_tier_pays()
            phases["host_tier_check"] = time.perf_counter() - t
        self.scheduler = self._new_scheduler()
        self.requests: dict[str, Request] = {}
        self._rng = np.random.default_rng(c.seed)
        self._arrivals = 0
        self._seq_ids = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._steps = 0
        self._inflight: _InFlight | None = None  # the dispatched step whose samples are not read yet
        self._next_tokens = self.compiler.zero_tokens()  # its samples, on the device
        from metrale_jax.engine.spec_decode import overlaps

        self._spec_overlap = overlaps(self)  # verify steps dispatched before the last one is read
        self._swap_pending: list = []  # (Sequence, SwapData) copied out by the last step, not on the host yet
        self._offload_pending: list = []  # prefix cache's host tier: (keys, SwapData) copied out, not on the host yet
        self._slot_leaves: tuple | None = None  # host arrays of the SSM slot leaves' shapes (host-tier writes)
        self._grammars = None  # structured output's GrammarCompiler, made by the first constrained request
        # the start-up heap (~0.5M objects: traces, compiled executables' records) left out of the
        # garbage collector's full passes, as vLLM's engine does: while decoding, those passes took
        # ~0.25 s every ~9 s (2-core CPU, structured-output bench, session 18), a stall per pass.
        # The collection first frees what was dropped before (an earlier engine, unfrozen above).
        gc.collect()
        gc.freeze()
        self.startup_seconds = time.perf_counter() - t0
        self.startup_phases = phases
        log.info("engine ready in %.1fs (%s; %d executables, %d from the cache at %s)", self.startup_seconds,
                 ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()), self.compiler.num_executables,
                 self.compiler.cache_hits, self.cache_dir)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from metrale_jax.model import load_model

        mesh = make_mesh(config.tensor_parallel_size)  # enough devices? (before the model loads)
        # per-layer arrays straight from the loader when the steps will walk the layers in Python;
        # with tensor parallelism, each device receives only its shards, a layer at a time
        split = config.attention.unroll_layers if config.attention is not None else _on_gpu()
        sharder = Sharder(mesh, expert_parallel=config.enable_expert_parallel) \
            if config.tensor_parallel_size > 1 else None
        spec = config.speculative_config
        model, params = load_model(config.model, dtype=config.dtype, show_progress=config.show_progress,
                                   revision=config.revision, quantization=config.quantization, split_layers=split,
                                   sharder=sharder, mtp=spec is not None and spec.method == "mtp",
                                   download_dir=config.download_dir,
                                   hf_overrides=json.loads(config.hf_overrides) if config.hf_overrides else None)
        if config.tokenizer is not None:
            from metrale_jax.loading.checkpoint import load_tokenizer

            tok = load_tokenizer(config.tokenizer, show_progress=config.show_progress)
            model = dataclasses.replace(model, tokenizer=tok)
        return cls(model, params, config, owns_params=True)

    @classmethod
    def from_engine_args(cls, engine_args) -> LLMEngine:
        """vLLM's: the engine of an `EngineArgs` (`metrale_jax.EngineArgs`: `LLM`'s keyword arguments)."""
        return cls.from_config(engine_args.create_engine_config())

    @property
    def model_config(self) -> ModelInfo:
        """vLLM's `llm_engine.model_config`: the model, its resolved dtype and quantization, the context length."""
        cfg = self.model.cfg
        return ModelInfo(model=self.model.name or self.config.model, dtype=self.model.dtype,
                         quantization=self.model.quantization,
                         max_model_len=self.config.max_model_len, vocab_size=cfg.vocab_size,
                         hidden_size=cfg.hidden_size)

    def get_model_config(self) -> ModelInfo:
        return self.model_config

    @property
    def extra_kv_layers(self) -> int:
        """KV-pool layers after the model's own: the MTP drafter's one."""
        return 1 if self.num_drafts else 0

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.config.block_size, self.kv_dtype, self.extra_kv_layers)

    def _check_mtp(self) -> int:
        """k when the speculative config drafts with the model's MTP head, else 0; a clear error
        when the model cannot (no params["mtp"]: `load_model(..., mtp=True)` reads it)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "mtp":
            return 0
        head = self.params.get("mtp") if isinstance(self.params, dict) else None
        if head is None or not hasattr(self.model.family, "mtp_forward_paged"):
            raise ValueError(f"speculative_config method='mtp' needs the model's multi-token-prediction head "
                             f"({getattr(self.model.cfg, 'architecture', '?')} has none loaded): load a "
                             f"checkpoint with mtp.* weights (Qwen3-Next) with load_model(..., mtp=True), or "
                             f"use method='ngram'")
        from metrale_jax.layers.stack import num_layers

        if num_layers(head["layers"]) != 1:
            raise ValueError(f"an MTP head of {num_layers(head['layers'])} layers is not supported yet (1 layer)")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("speculative_config method='mtp' with tensor parallelism is not supported yet")
        return spec.num_speculative_tokens

    # ---- LoRA adapters (vLLM's LLMEngine names; the logic lives in metrale_jax/lora) ---------------
    def add_lora(self, lora_request) -> bool:
        """Read and check an adapter now (into the host cache); raises a LoRAError if it cannot be
        served. Requests may also name adapters never added: they are read on first use."""
        self._resolve_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter. Raises LoRAError while a request uses it; False when unknown."""
        return self.lora.remove(lora_int_id) if self.lora is not None else False

    def list_loras(self) -> set[int]:
        return set(self.lora.registered) if self.lora is not None else set()

    def _resolve_lora(self, lora_request) -> None:
        """Check that `lora_request` (None = base model) can be served, before anything is queued."""
        from metrale_jax.lora.manager import resolve_for

        resolve_for(self.lora, lora_request)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @scheduler.setter
    def scheduler(self, s: Scheduler) -> None:
        """Install a scheduler over the device pools. The pools hold what the previous scheduler
        wrote, so a scheduler installed again (tests and benches swap them) forgets its cached
        prefixes: their blocks may have been overwritten meanwhile."""
        if getattr(self, "_scheduler", None) is not None and s.prefix_cache is not None:
            s.prefix_cache.reset()
        self._scheduler = s

    def _new_scheduler(self, **limits: int) -> Scheduler:
        """A fresh scheduler. `limits` may lower (never raise) num_blocks, max_num_seqs,
        max_num_batched_tokens, max_prefill_streams, max_prefill_tokens, num_ssm_slots,
        swap_space_bytes, prefix_caching and max_prompt_lp_tokens (tests use this)."""
        c = self.config
        caps = dict(num_blocks=self.num_blocks, max_num_seqs=c.max_num_seqs,
                    max_num_batched_tokens=c.max_num_batched_tokens, max_prefill_streams=c.max_prefill_streams,
                    max_prefill_tokens=c.prefill_buckets[-1], num_ssm_slots=c.max_ssm_slots if self.uses_ssm else 0,
                    swap_space_bytes=int(c.swap_space_gb * 1e9), prefix_caching=c.enable_prefix_caching,
                    max_prompt_lp_tokens=c.max_prompt_logprobs_tokens)
        for k, v in limits.items():
            if k not in caps or v > caps[k]:
                raise ValueError(f"scheduler limit {k}={v} is unknown or above the compiled {caps.get(k)}")
            caps[k] = v
        if self.uses_ssm and caps["num_ssm_slots"] < 1:
            raise ValueError("a model with SSM state needs num_ssm_slots >= 1")
        return Scheduler(
            block_size=c.block_size, num_penalty_rows=c.max_penalty_rows or 0, uses_ssm=self.uses_ssm,
            max_model_len=c.max_model_len, preemption_mode=c.preemption_mode,
            swap_bytes_per_block=self.kv_bytes_per_block,
            swap_bytes_per_slot=self.model.ssm_bytes_per_slot(),
            max_loras=c.max_loras if c.enable_lora else 0,
            snapshot_slots=tuple(range(c.max_ssm_slots, c.max_ssm_slots + c.max_ssm_snapshots)),
            cache_decoded=getattr(self.model, "decode_matches_prefill", True),
            kv_offloading_bytes=int(c.kv_offloading_size * 1e9) if self.host_tier_on else 0, **caps,
            num_spec_tokens=c.speculative_config.num_speculative_tokens if c.speculative_config else 0,
            num_lookahead_tokens=max(0, self.num_drafts - 1),
            spec_off_at=c.speculative_config.disable_by_batch_size if c.speculative_config else None,
        )

    def _host_tier_pays(self) -> bool:
        """Whether restoring cached blocks from the host tier is cheaper than recomputing them, timed
        once at start-up (best of 3, synchronously): the host-tier path (per-block host arrays
        joined into the largest swap bucket, its scatter) into free blocks, against the largest
        prefill bucket on padding inputs, per block of tokens. The padding prefill has no attention
        context, so it is a lower bound of recomputing a cached prefix: a restore that beats it
        pays at any depth; one that does not may still pay deep in a long context (then the tier
        stays off: a documented, conservative choice)."""
        from metrale_jax.engine.swap import join_blocks, slot_leaves, split_blocks

        c, comp = self.config, self.compiler
        m = c.swap_block_buckets[-1]
        blocks = list(range(m))  # every block is free at start-up: their contents do not matter
        data = comp.swap_out(self.state, blocks, -1)
        data.to_host(comp.swap_roles)
        slots = slot_leaves(data, comp.swap_roles)
        parts = split_blocks(data, comp.swap_roles)
        bucket = comp.bucket_for(0, c.prefill_buckets[-1], 1)
        dev = comp.transfer(build_step(self.builder, bucket, [], []))

        def restore():
            self.state = comp.swap_in(self.state, join_blocks(parts, comp.swap_roles, slots, m), blocks, -1)
            jax.block_until_ready(self.state)

        def recompute():
            self.state, out, _ = comp.run(bucket, self.params, self.state, dev)
            jax.block_until_ready(out.token_ids)

        def best(fn):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        restore_ms, recompute_ms = 1e3 * best(restore) / m, 1e3 * best(recompute) * c.block_size / bucket.num_tokens
        self.host_tier_costs = {"restore_ms_per_block": restore_ms, "recompute_ms_per_block": recompute_ms}
        pays = restore_ms < recompute_ms
        (log.info if pays else log.warning)(
            "prefix cache host tier %s: restoring a block of %d tokens takes %.3f ms, recomputing it at least %.3f ms",
            "on" if pays else "off (recomputing is cheaper; kv_offloading_restore=True forces it)", c.block_size,
            restore_ms, recompute_ms)
        return pays

    def _kv_pool_size(self, kv_dtype) -> int:
        c = self.config
        per_block = self.kv_bytes_per_block
        if c.num_kv_blocks is not None:
            return int(c.num_kv_blocks)
        if per_block == 0:  # no attention layer: blocks cost nothing, so they never bind
            return c.max_num_seqs * c.max_blocks_per_seq
        if not _on_gpu():
            return max(-(-c.cpu_kv_tokens // c.block_size), c.max_blocks_per_seq)
        tp = c.tensor_parallel_size
        if tp > 1 and self.model.cfg.num_kv_heads % tp == 0:
            per_block //= tp  # each device holds its KV heads of every block (metrale_jax/parallel.py)
        gc.collect()  # a dropped engine (in a reference cycle, say) returns its device memory first
        stats = jax.devices()[0].memory_stats() or {}
        limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
        # scratch of the steps: activations of the largest batch plus sampling rows (an estimate;
        # the compiled executables' real scratch is logged after compilation)
        mc = self.model.cfg
        t = c.max_num_batched_tokens
        act = 4 * t * (8 * mc.hidden_size + 3 * mc.intermediate_size) + 16 * 4 * (c.max_num_seqs + 64) * mc.vocab_size
        if not c.attention.use_pallas:  # the XLA reference gathers every row's pages in f32
            rows = c.max_num_seqs + c.max_prefill_streams
            act += 2 * 4 * rows * c.max_model_len * mc.num_kv_heads * mc.head_dim
        from metrale_jax.layers.moe_w4 import dequantized_scratch_bytes

        # (quantized experts' grouped GEMM over a dense copy of one layer's experts)
        act += dequantized_scratch_bytes(self.params, self.model.dtype, tokamax=c.attention.tokamax_moe)
        other = (c.max_penalty_rows or 0) * mc.vocab_size * 5
        if self.uses_ssm:
            other += (c.max_ssm_slots + c.max_ssm_snapshots) * self.model.ssm_bytes_per_slot()
            if c.speculative_config:  # a verify step's per-position states (layers/spec_states.py)
                other += c.max_num_seqs * (1 + c.speculative_config.num_speculative_tokens) * \
                    self.model.ssm_bytes_per_slot()
        free = limit * c.gpu_memory_utilization - used - act - other
        blocks = int(free // per_block)
        self._scratch_reserve = act
        log.info("KV sizing: device limit %.2f GB, in use %.2f GB, reserved for activations %.2f GB -> %d blocks",
                 limit / 1e9, used / 1e9, act / 1e9, blocks)
        return blocks

    # ---- requests --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            other = sorted(k for k in prompt if k in _MULTIMODAL_PROMPT_KEYS and prompt[k] is not None)
            if other:  # (vLLM's multimodal inputs: refused, not dropped)
                raise InvalidPromptError(f"{', '.join(other)}: this engine serves text-only models")
            salt = prompt.get("cache_salt")  # (vLLM's prompt key; `Request.cache_salt`)
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise InvalidPromptError(f"cache_salt must be a non-empty string, got {salt!r}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt_token_ids' (or 'prompt')")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send {'prompt_token_ids': [...]}")
            text = prompt
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                # A str with lone surrogates: bytes that were not UTF-8, decoded with surrogateescape
                # (how Python hands over a command-line argument such as $'bad \xff byte').
                raise InvalidPromptError(
                    f"the prompt is not valid UTF-8 text: {prompt[e.start:e.end]!r} at character {e.start} is a "
                    f"lone surrogate (a byte that is not UTF-8, decoded with surrogateescape?)") from None
            try:
                ids = self.tokenizer.encode(prompt) if prompt else []
            except Exception as e:  # noqa: BLE001 - the Rust tokenizer raises bare TypeError / Exception
                raise InvalidPromptError(f"the tokenizer cannot encode the prompt: {type(e).__name__}: {e}") from e
        elif isinstance(prompt, list | tuple | np.ndarray):
            ids = prompt
        else:
            raise InvalidPromptError(f"unsupported prompt type {type(prompt).__name__}")
        if isinstance(ids, str | bytes):
            raise InvalidPromptError("prompt_token_ids must be a list of integers, got a string")
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidPromptError(f"prompt_token_ids must be integers: {e}") from e
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidPromptError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return text, ids

    def validate(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Check a request without queuing it; raises an InvalidRequestError subclass."""
        return self._checked(prompt, params)[:2]

    def _checked(self, prompt: Any, params: SamplingParams
                 ) -> tuple[str | None, list[int], np.ndarray | None, tuple[tuple[int, ...], ...]]:
        """`validate`'s (text, prompt ids), the request's token mask (`SamplingParams.token_mask`, with
        the one-token bad words banned) and its bad words of several tokens (`_bad_words`)."""
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        text, ids = self._prompt_ids(prompt)
        if params.truncate_prompt_tokens is not None:  # vLLM's left truncation
            keep = params.truncate_prompt_tokens
            ids = ids[-(self.config.max_model_len - 1 if keep == -1 else keep):]
        if not ids:
            raise EmptyPromptError("the prompt is empty (no tokens)")
        mml = self.config.max_model_len
        if len(ids) >= mml:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; max_model_len={mml} leaves room for at most "
                f"{mml - 1} prompt tokens plus one generated token")
        if params.max_tokens is not None and len(ids) + params.max_tokens > mml:
            # vLLM's check and message (None means "up to max_model_len", never an error)
            raise MaxTokensTooLargeError(
                f"This model's maximum context length is {mml} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                f"completion). Please reduce the length of the prompt or completion (max_tokens <= "
                f"{mml - len(ids)}, or None for up to the context).")
        k = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > k:
                raise InvalidSamplingParamsError(f"{name}={v} exceeds the engine's max_logprobs={k}")
        n_bias = len(params.additive_bias)
        n_sup = len(self._stop_ids(params)) if params.min_tokens > 0 else 0
        if n_bias + n_sup > self.config.max_suppress_ids:
            raise InvalidSamplingParamsError(
                f"{n_bias} logit_bias entries (other than -100, 0, 100) and {n_sup} stop ids under min_tokens exceed "
                f"the engine's max_suppress_ids={self.config.max_suppress_ids} (EngineConfig)")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidSamplingParamsError(f"stop_token_ids must be < vocab size {self.vocab_size}")
        if params.has_penalties and not self.config.max_penalty_rows:
            raise InvalidSamplingParamsError("penalties are disabled in this engine (max_penalty_rows=0)")
        if params.structured_outputs is not None:
            self.grammar_compiler().compile(params.structured_outputs)  # cached; raises if invalid
        mask = params.token_mask(self.vocab_size)  # (raises for ids outside the vocabulary, an empty mask)
        single, bad_words = self._bad_words(params)
        if single:
            mask = ban_tokens(mask, single, self.vocab_size)
            if not mask.any():
                raise InvalidSamplingParamsError("bad_words leave no token to sample")
        if mask is not None and params.min_tokens > 0:
            stop = np.zeros(mask.size * 32, bool)
            stop[list(self._stop_ids(params))] = True
            if not np.any(np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool) & ~stop):
                raise InvalidSamplingParamsError("with min_tokens > 0, allowed_token_ids / logit_bias leave only "
                                                 "stop tokens, which min_tokens bans")
        return text, ids, mask, bad_words

    def _bad_words(self, params: SamplingParams) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """`bad_words` as (one-token words' ids, banned everywhere; the token sequences of the others,
        whose last token `_bad_word_masks` bans where the output ends with the rest)."""
        if not params.bad_words:
            return [], ()
        if self.tokenizer is None:
            raise InvalidSamplingParamsError("bad_words needs a tokenizer; this model has none")
        words = bad_words_token_ids(list(params.bad_words), self.tokenizer)
        if any(t >= self.vocab_size for w in words for t in w):
            raise InvalidSamplingParamsError(f"bad_words tokenize to ids outside the vocabulary [0, {self.vocab_size})")
        return [w[0] for w in words if len(w) == 1], tuple(w for w in words if len(w) > 1)

    def _check_priority(self, priority: Any) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority={priority} needs scheduling_policy='priority' (this engine "
                                      f"schedules {self.config.scheduling_policy!r})")

    def grammar_compiler(self):
        """The structured-output `GrammarCompiler` over this model's tokenizer (built on first use)."""
        if self._grammars is None:
            from metrale_jax.structured_output import GrammarCompiler

            if self.tokenizer is None:
                raise InvalidStructuredOutputsError("structured output needs a tokenizer; this model has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(self.eos_token_ids)
        return frozenset(ids)

    def add_request(self, request_id: str, prompt: str | dict | list[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, lora_request=None, priority: int = 0) -> None:
        """Validate and queue a request. Raises InvalidRequestError (subclasses) before queuing.
        lora_request: a `metrale_jax.lora.LoRARequest` (needs enable_lora), None = base model.
        priority: with scheduling_policy "priority", lower runs first (vLLM's); else it must be 0."""
        params = params if params is not None else SamplingParams()
        request_id = str(request_id)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids, mask, bad_words = self._checked(prompt, params)
        self._resolve_lora(lora_request)
        self._check_priority(priority)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.config.max_model_len - len(ids))
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        req = Request(request_id, text, ids, params, arrival=self._arrivals, seed=seed,
                      stop_ids=frozenset(params.stop_token_ids), arrival_time=arrival_time or time.time(),
                      lora_request=lora_request, token_mask=mask, bad_words=bad_words,
                      cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
                      priority=int(priority))
        self._arrivals += 1
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        grammar = (self.grammar_compiler().compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        for i in range(params.n):
            seq = Sequence(self._seq_ids, req, i, list(ids), len(ids))
            self._seq_ids += 1
            if grammar is not None:
                seq.grammar = self._grammars.matcher(grammar)
            if params.logprobs is not None:
                seq.logprobs = []
            if i > 0 and not params.has_penalties and not self.uses_ssm:
                seq.leader = req.seqs[0]  # share the prompt's KV blocks with sequence 0
            if self.tokenizer is not None and params.detokenize:
                from metrale_jax.loading.tokenizer import IncrementalDetokenizer

                seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """vLLM's name: `abort` each of `request_ids` (one id or several)."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Drop a request and free everything it holds (now). Unknown ids are ignored."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return
        req.aborted = True
        for seq in req.seqs:
            if seq.status != SeqStatus.FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished_requests(self) -> bool:
        """True while a request runs, or a dispatched step has not been read back yet (stepping
        until False drains the device, so nothing is left in flight at exit)."""
        return bool(self.requests) or self._inflight is not None

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_waiting=len({q.request.request_id for q in s.waiting}),
            num_running=len({q.request.request_id for q in s.running}),
            kv_blocks_total=s.blocks.num_blocks, kv_blocks_used=s.blocks.num_used,
            kv_blocks_free=s.blocks.num_free, ssm_slots_total=s.ssm_slots.num_slots,
            ssm_slots_used=s.ssm_slots.num_used, prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._gen_tokens, num_preemptions=s.num_preemptions,
            num_steps=self._steps, num_swapped=len({q.request.request_id for q in s.swapped}),
            num_swaps=s.num_swaps, num_swap_ins=s.num_swap_ins, swap_bytes=s.swap_bytes,
            prefix_cache_queries=s.prefix_cache.queries if s.prefix_cache else 0,
            prefix_cache_hits=s.prefix_cache.hits if s.prefix_cache else 0, **self.spec_stats,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM's name); False while requests run (or caching is off)."""
        pc = self.scheduler.prefix_cache
        return pc is not None and not self.has_unfinished_requests() and pc.reset()

    # ---- one step --------------------------------------------------------------------------------
    def _row_sampling(self, seq: Sequence) -> RowSampling:
        """The row's sampling, built once per sequence (and penalty row); only the output index
        and the min_tokens suppression change from step to step (the host loop's hot path)."""
        p = seq.request.params
        n_out = seq.num_outputs + seq.inflight  # index of the token this row samples
        rs = seq.row_sampling
        if rs is None or rs.pen_row != (seq.pen_row if p.has_penalties else -1):
            rs = seq.row_sampling = RowSampling.from_params(p, seed=seq.request.seed, seq_index=seq.index,
                                                            out_index=n_out, pen_row=seq.pen_row)
        rs.out_index = n_out
        rs.suppress_ids = tuple(sorted(self._stop_ids(p))) if n_out < p.min_tokens else ()
        return rs

    def _chunk(self, c: Chunk) -> PrefillChunk:
        seq = c.seq
        end = c.start + c.length
        req = seq.request
        targets = None
        if req.prompt_logprobs is not None and seq.index == 0:
            targets = [seq.token_ids[p + 1] if p + 1 < seq.prompt_len and req.prompt_logprobs[p + 1] is None
                       else -1 for p in range(c.start, end)]
        return PrefillChunk(
            tokens=seq.token_ids[c.start:end], start=c.start, block_table=seq.blocks,
            sampling=self._row_sampling(seq) if c.samples else None, pen_row=seq.pen_row,
            ssm_slot=seq.ssm_slot, prompt_lp_targets=targets,
            num_output_tokens=max(0, end - max(c.start, seq.prompt_len)),
            reset_penalty_row=c.start == 0 and seq.pen_row >= 0,
            next_token=seq.token_ids[end] if end < len(seq.token_ids) else -1,
        )

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that progressed (cumulative outputs).

        Overlapped: this dispatches the next step to the device first, then reads and applies
        the previous step's samples while the device works, so each call returns the progress
        of the step dispatched by the previous call (the first call returns []).

        Structured output: the mask of a constrained row depends on the token the previous step
        sampled for it, so `_dispatch` launches the step's forward and leaves to a helper thread
        the wait for the previous step's sampled ids, feeding them to the grammars and filling the
        masks; the step's sampling half is launched by the next call once its step's inputs are
        sent (`_InFlight.launch`), so the host's work overlaps the forward.
        """
        outputs = []
        if self._inflight is not None and self._inflight.overlapped:  # a verify step in flight
            from metrale_jax.engine.spec_decode import can_overlap

            if not can_overlap(self):  # (new requests, swaps: the next step needs exact lengths)
                outputs, self._inflight = self._finish_step(self._inflight), None
        sched = self.scheduler.schedule()
        if sched.empty() or sched.swap_out or sched.swap_in or sched.kv_offload or sched.kv_onload \
                or sched.ssm_restores:
            self._launch_sample()  # (what follows donates the state the pending sample reads)
        while self.scheduler.dropped_swaps:  # the other processes drop their saved copies too
            self._announce("drop", self.scheduler.dropped_swaps.pop())
        self._swap(sched)
        new = None if sched.empty() else self._dispatch(sched)
        prev, self._inflight = self._inflight, new
        outputs += self._finish_step(prev) if prev is not None else []
        if self.config.speculative_config is not None and self._inflight is not None:
            from metrale_jax.engine.spec_decode import sync_for_drafts

            if sync_for_drafts(self, self._inflight):
                # the next step's rows depend on this one's accepted drafts (lengths, drafts): read
                # it before scheduling again
                outputs += self._finish_step(self._inflight)
                self._inflight = None
        for seq, d in self._swap_pending:  # copies started before the last step: bring them home
            if seq.swap is not None and seq.swap.data is d:  # (not swapped back in or finished since)
                d.to_host(self.compiler.swap_roles)
        self._swap_pending = [(seq, seq.swap.data) for seq in sched.swap_out if seq.swap is not None]
        self._offload_to_host()
        return outputs

    def _offload(self, sched) -> None:
        """Prefix cache's host tier: start copying the evicted cached blocks out (before anything
        writes them); `_offload_to_host` hands them to the cache at the end of `step()`."""
        big = self.config.swap_block_buckets[-1]
        ev = sched.kv_offload
        for i in range(0, len(ev), big):
            part = ev[i:i + big]
            data = self.compiler.swap_out(self.state, [b for _, b in part], -1)
            self._offload_pending.append(([k for k, _ in part], data))

    def _offload_to_host(self) -> None:
        """The copies `_offload` started, into the host tier. They ran right after the previous
        step, whose samples `step()` has just read, so this barely waits."""
        from metrale_jax.engine.swap import slot_leaves, split_blocks

        roles = self.compiler.swap_roles
        for keys, data in self._offload_pending:
            data.to_host(roles)
            if self._slot_leaves is None:
                self._slot_leaves = slot_leaves(data, roles)
            for k, arrays in zip(keys, split_blocks(data, roles)):
                self.scheduler.prefix_cache.host_put(k, arrays)
        self._offload_pending = []

    def _onload(self, sched) -> None:
        """Prefix cache's host tier: write the hit blocks back into their new device blocks."""
        from metrale_jax.engine.swap import join_blocks

        big = self.config.swap_block_buckets[-1]
        on = sched.kv_onload
        for i in range(0, len(on), big):
            part = on[i:i + big]
            data = join_blocks([a for _, a in part], self.compiler.swap_roles, self._slot_leaves,
                               self.compiler.swap_bucket(len(part)))
            self.state = self.compiler.swap_in(self.state, data, [b for b, _ in part], -1)

    # ---- several processes (engine/lockstep.py) -------------------------------------------------
    def _announce(self, op: str, *args) -> None:
        if self.lockstep is not None:
            self.lockstep.send(op, *args)

    def follow_leader(self) -> None:
        """Processes other than 0 under `jax.distributed`: run the steps process 0 schedules, until
        it calls `release_followers`. A no-op in a single process."""
        if self.lockstep is not None and not self.lockstep.leader:
            follow(self)

    def release_followers(self) -> None:
        """Process 0: let the other processes' `follow_leader` return (call once, when done)."""
        if self.lockstep is not None and self.lockstep.leader:
            self.lockstep.send("stop")

    def _swap(self, sched) -> None:
        """Copy the swapped-out sequences' blocks and slots to the host, then write the resumed
        ones' saved state into their new blocks and slots, before the step runs (the freed blocks
        may be reused by this very step). Evicted cached blocks go to the host tier first."""
        if sched.kv_offload:
            self._offload(sched)
        for seq in sched.swap_out:
            rec = seq.swap
            self._announce("swap_out", seq.seq_id, rec.blocks, rec.slot)
            rec.data = self.compiler.swap_out(self.state, rec.blocks, rec.slot)
        for seq in sched.swap_in:
            rec = seq.swap
            self._announce("swap_in", seq.seq_id, seq.blocks[: rec.num_blocks], seq.ssm_slot)
            self.state = self.compiler.swap_in(self.state, rec.data, seq.blocks[: rec.num_blocks], seq.ssm_slot)
            self.scheduler.swapped_in(seq)
        if sched.kv_onload:
            self._onload(sched)
        if sched.ssm_restores:  # prefix-cache hits: the cached SSM snapshots into the new sequences' slots
            self._announce("ssm_copy", sched.ssm_restores)
            self.state = self.compiler.copy_ssm_slots(self.state, sched.ssm_restores)

    def _launch_sample(self) -> None:
        """Launch the in-flight step's sampling half if it waits (a constrained step's, see
        `_dispatch`)."""
        if self._inflight is not None:
            self._inflight.launched()

    def _dispatch(self, sched) -> _InFlight:
        self._steps += 1
        if self.config.speculative_config is not None:
            self._launch_sample()  # (a verify step reads the previous step's samples)
        if self.config.speculative_config is not None and sched.decode and not sched.chunks:
            from metrale_jax.engine.spec_decode import dispatch_verify

            f = dispatch_verify(self, sched)  # None when no row has drafts: a plain decode step
            if f is not None:
                return f
        rows = []
        for s in sched.decode:
            if s.inflight:  # its last token is the previous step's sample, still on the device
                rows.append(DecodeRow(token=0, position=s.num_computed, block_table=s.blocks,
                                      sampling=self._row_sampling(s), ssm_slot=s.ssm_slot, src_row=s.inflight_row))
            else:
                rows.append(DecodeRow(token=s.token_ids[-1], position=s.num_computed, block_table=s.blocks,
                                      sampling=self._row_sampling(s), ssm_slot=s.ssm_slot))
        chunks = [self._chunk(c) for c in sched.chunks]
        if self.lora is not None:
            self.lora.assign_slots(self, sched, rows, chunks)
        bucket = self.compiler.bucket_for(len(rows), sched.num_prefill_tokens, len(chunks))
        inputs = build_step(self.builder, bucket, rows, chunks)
        _, ibuf, fbuf = pack(self.builder, inputs)
        dev = self.compiler.put(ibuf, fbuf)
        self._launch_sample()  # the previous step's sampling half, if it waits: the inputs are sent
        # sampled rows: decode rows 0..n-1, then stream j at row N + j when its chunk samples
        n_bucket = bucket.num_seqs
        sampled = [(i, s) for i, s in enumerate(sched.decode)]
        sampled += [(n_bucket + j, c.seq) for j, c in enumerate(sched.chunks) if c.samples]
        masked = [(s.grammar, row) for row, s in sampled if s.grammar is not None and s.status != SeqStatus.FINISHED]
        # allowed_token_ids / logit_bias: a fixed mask per row, ANDed into the grammars' (or alone)
        fixed = [(row, s.request.token_mask) for row, s in sampled
                 if s.request.token_mask is not None and s.status != SeqStatus.FINISHED]
        worded = [(row, s) for row, s in sampled if s.request.bad_words and s.status != SeqStatus.FINISHED]
        if worded:
            fixed = self._bad_word_masks(worded, fixed)
        bitmask = None  # no constrained row: the compiler's constant all-allowed mask (nothing sent)
        split = bool(masked) and self.compiler.has_split(bucket) and self.lockstep is None
        if split:  # the forward first: it runs while the host fills the masks below
            self.state, logits, plp = self.compiler.run_forward(bucket, self.params, self.state, dev,
                                                                self._next_tokens)
        defer = split and not sched.ssm_snapshots  # the sample launched by the next step (below)
        if masked:
            prev = self._inflight if self._inflight is not None and self._inflight.constrained else None
            if defer:  # (so no other processes to announce the step to: `split`)
                # the previous step's samples fed to the grammars and the masks filled on a helper
                # thread (llguidance drops the GIL) while this thread reads the previous step and
                # schedules, builds and sends the next one; the sample's launch, after all that,
                # waits for the masks. (The fill inline here, before that work: +4% to +17% per step
                # over free rows at batch 64 on the H200, sessions 26-27; on a helper thread beside
                # the forward's launch instead: that launch got slower, s26. The samples fed here
                # before the helper's fill: session 31's `feedmain`.)
                feed = None
                if prev is not None and not prev.advanced:
                    prev.advanced, prev.fed = True, threading.Event()
                    feed = functools.partial(self._feed_grammars, prev)
                bitmask = self._grammars.fill_async(masked, bucket.num_sample_rows, before=feed)
                if fixed:
                    bitmask = functools.partial(lambda fill: and_token_masks(fill(), fixed), bitmask)
            else:
                if prev is not None:
                    self._advance_grammars(prev)  # waits for the previous step's samples
                bitmask = and_token_masks(self._grammars.fill(masked, bucket.num_sample_rows), fixed)
                self._announce("step", inputs.bucket, ibuf, fbuf, bitmask)
                bitmask = self.compiler.put(bitmask)
        elif fixed:
            bitmask = and_token_masks(np.full((bucket.num_sample_rows, fixed[0][1].size), -1, np.int32), fixed)
            self._announce("step", inputs.bucket, ibuf, fbuf, bitmask)
            bitmask = self.compiler.put(bitmask)
        else:
            self._announce("step", inputs.bucket, ibuf, fbuf, None)
        want_lp = bool(inputs.smd.flags[F_LOGPROBS])
        want_plp = bool(np.any(inputs.smd.prompt_lp_targets >= 0))
        names = ["token_ids"]
        if want_lp:  # some row reports logprobs (logprobs=0 included: its cumulative logprob); else
            # not even the sampled tokens' are read: one device-to-host copy fewer per step
            names += ["logprobs", "ranks", "top_ids", "top_logprobs"]
        if want_plp:
            names += ["prompt_logprobs", "prompt_ranks", "prompt_top_ids", "prompt_top_logprobs"]
        f = _InFlight(sched, inputs, sampled, names, [], want_lp, want_plp, constrained=bool(masked))

        def fetch(out):
            if out.drafts is not None and sampled:  # decode rows' drafts, and a sampled stream's first one
                names.append("drafts")
            f.arrays = [local(getattr(out, n)) for n in names]
            for a in f.arrays:
                a.copy_to_host_async()

        if split:
            def launch_sample(penalties=self.state.penalties, mask=bitmask):
                if callable(mask):  # (fill_async's: wait for the masks, then send them)
                    mask = self.compiler.put(mask())
                out, self._next_tokens = self.compiler.run_sample(bucket, logits, penalties, dev, plp, mask,
                                                                  self._next_tokens)
                fetch(out)

            if not defer:  # (the SSM copy below donates the state the sample reads)
                launch_sample()
            else:
                # launched by the next step once its inputs are sent (or before anything touches the
                # state): a launch with a fresh input (the mask) returns only when the device is
                # free, so the host's work for the next step (reading this one's predecessor,
                # scheduling, building) runs while the forward does, not after the sample
                f.launch = launch_sample
        else:
            self.state, out, self._next_tokens = self.compiler.run(inputs.bucket, self.params,
                                                                   self.state, dev, self._next_tokens, bitmask)
            fetch(out)
        self.scheduler.complete(sched)
        if sched.ssm_snapshots:  # prefix caching: SSM snapshots at the block boundaries this step reached
            self._announce("ssm_copy", sched.ssm_snapshots)
            self.state = self.compiler.copy_ssm_slots(self.state, sched.ssm_snapshots)
        self._prompt_tokens += sum(c.length for c in sched.chunks if c.start < c.seq.prompt_len)
        for row, seq in sampled:
            seq.inflight += 1
            seq.inflight_row = row
        return f

    def _bad_word_masks(self, rows: list[tuple[int, Sequence]], fixed: list[tuple[int, np.ndarray]]
                        ) -> list[tuple[int, np.ndarray]]:
        """`fixed`'s (row, mask) pairs with this step's bad-word bans of `rows` (sample row, sequence)
        ANDed in: the last token of each bad word whose other tokens end the row's output. A row
        whose last token is still on the device waits for the previous step's samples."""
        masks = dict(fixed)
        prev = None
        for row, seq in rows:
            out = seq.token_ids[seq.prompt_len:]
            if seq.inflight:  # (one at most: a bad-words row never overlaps a verify step, `_needs_host`)
                if prev is None:
                    f = self._inflight.launched()
                    prev = np.asarray(f.arrays[f.names.index("token_ids")])
                out = [*out, int(prev[seq.inflight_row])]
            ban = bad_word_bans(seq.request.bad_words, out)
            if ban:
                masks[row] = ban_tokens(masks.get(row), ban, self.vocab_size)
        return list(masks.items())

    def _advance_grammars(self, f: _InFlight) -> None:
        """Feed a dispatched step's samples to its constrained rows' grammars, once, or wait until
        the mask thread has (`_dispatch`)."""
        if f.advanced:
            if f.fed is not None:
                f.fed.wait()
            return
        f.advanced = True
        self._feed_grammars(f.launched())

    def _feed_grammars(self, f: _InFlight) -> None:
        """Feed `f`'s samples (its sampling half launched) to its constrained rows' grammars (EOS
        is not fed: it ends the sequence); sets `f.fed` when done. A token the grammar rejects
        leaves its matcher in an error state, which `_append_token` turns into finish_reason "abort"."""
        try:
            toks = np.asarray(f.arrays[f.names.index("token_ids")])  # waits for the step
            fed = [(seq, int(toks[row])) for row, seq in f.sampled
                   if seq.grammar is not None and seq.status != SeqStatus.FINISHED and not seq.request.aborted]
            fed = [(seq, t) for seq, t in fed if t not in self.eos_token_ids]
            for (seq, _), ok in zip(fed, self._grammars.consume([(seq.grammar, t) for seq, t in fed])):
                if not ok:  # (`_append_token` finishes the row on this record)
                    seq.grammar_error = seq.grammar.get_error() or "token rejected"
                elif self.config.speculative_config is not None:
                    seq.grammar_forced = len(seq.grammar.compute_ff_tokens()) > 1
        finally:
            if f.fed is not None:
                f.fed.set()

    def _finish_step(self, f: _InFlight) -> list[RequestOutput]:
        """Read a dispatched step's samples and apply them (stop checks, text, logprobs)."""
        f.launched()  # (the last step's sample: no next step launched it)
        if f.inputs.bucket.kind == "verify":
            from metrale_jax.engine.spec_decode import finish_verify

            return finish_verify(self, f)
        if f.constrained:
            self._advance_grammars(f)
        out = f.read()
        now = time.time()
        touched: dict[str, Request] = {}
        if f.want_plp:
            self._record_prompt_logprobs(f.sched.chunks, f.inputs, out)
        for row, seq in f.sampled:
            seq.inflight -= 1
            req = seq.request
            if req.aborted or seq.status == SeqStatus.FINISHED:
                continue  # finished (or aborted) while this sample was in flight: drop it
            self._append_token(seq, row, out, f.want_lp)
            if "drafts" in out and row < len(out["drafts"]):
                seq.mtp_drafts = (len(seq.token_ids), out["drafts"][row])
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req
        for c in f.sched.chunks:  # prompt logprobs progress without sampling
            if c.seq.request.prompt_logprobs is not None and not c.seq.request.aborted:
                touched.setdefault(c.seq.request.request_id, c.seq.request)
        return self._outputs(touched.values(), now)

    def _outputs(self, touched, now: float) -> list[RequestOutput]:
        """The outputs of the requests a step advanced (finished ones leave `requests`)."""
        outputs = []
        for req in touched:
            if req.finished:
                req.finish_time = now
                self.requests.pop(req.request_id, None)
            elif req.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            out = self._request_output(req)
            if (req.params.output_kind == RequestOutputKind.DELTA and not req.finished
                    and out.prompt_logprobs is None and not any(o.token_ids or o.text for o in out.outputs)):
                continue  # nothing new
            outputs.append(out)
        return outputs

    # ---- outputs ---------------------------------------------------------------------------------
    def _decode_token(self, t: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _lp_dict(self, token: int, lp: float, rank: int, top_ids, top_lps, k: int,
                 detokenize: bool = True) -> dict[int, Logprob]:
        """{token id: Logprob} of the chosen token and the top k; decoded_token None under
        `detokenize=False` (vLLM's)."""
        name = self._decode_token if detokenize else (lambda t: None)
        d = {int(token): Logprob(float(lp), int(rank), name(int(token)))}
        for j in range(k):
            t = int(top_ids[j])
            if t not in d:
                d[t] = Logprob(float(top_lps[j]), j + 1, name(t))
        return d

    def _record_prompt_logprobs(self, chunks: list[Chunk], inputs: StepInputs, out: dict) -> None:
        """Row j of the step's prompt logprobs is prefill token `prompt_lp_rows[j]` (the builder
        compacts the chunks' targets in order): its chunk and position."""
        rows, tgt = inputs.smd.prompt_lp_rows, inputs.smd.prompt_lp_targets
        ends = np.cumsum([c.length for c in chunks])
        for j in np.flatnonzero(tgt >= 0):
            ci = int(np.searchsorted(ends, rows[j], side="right"))
            c = chunks[ci]
            req = c.seq.request
            if req.prompt_logprobs is None:
                continue
            i = int(rows[j]) - int(ends[ci] - c.length)
            req.prompt_logprobs[c.start + i + 1] = self._lp_dict(
                int(tgt[j]), out["prompt_logprobs"][j], out["prompt_ranks"][j], out["prompt_top_ids"][j],
                out["prompt_top_logprobs"][j], req.params.prompt_logprobs, req.params.detokenize)

    def _append_token(self, seq: Sequence, row: int, out: dict, want_lp: bool) -> None:
        p = seq.request.params
        t = int(out["token_ids"][row])
        seq.token_ids.append(t)
        self._gen_tokens += 1
        lp = float(out["logprobs"][row]) if "logprobs" in out else 0.0  # (fetched when a row reports it)
        seq.cumulative_logprob += lp
        if seq.logprobs is not None and want_lp:
            seq.logprobs.append(self._lp_dict(t, lp, out["ranks"][row], out["top_ids"][row],
                                              out["top_logprobs"][row], p.logprobs, p.detokenize))
        n_out = seq.num_outputs
        finish, reason = None, None
        if seq.grammar_error is not None:
            # the mask allowed nothing but what the grammar rejects (e.g. min_tokens banned the EOS of
            # a finished grammar): stop rather than go on unconstrained
            why = (seq.grammar_error.strip().splitlines() or ["rejected"])[0][:200]
            log.warning("request %s: token %d breaks its structured-output grammar (%s); finishing it",
                        seq.request.request_id, t, why)  # (one line: llguidance's errors carry the grammar)
            finish = "abort"
            # the token is not part of the output: the grammar rejected it
            seq.token_ids.pop()
            self._gen_tokens -= 1
            seq.cumulative_logprob -= lp
            if seq.logprobs is not None and want_lp:
                seq.logprobs.pop()
        stop_token = False
        if finish is None and n_out >= p.min_tokens:
            if not p.ignore_eos and t in self.eos_token_ids:
                finish, stop_token = "stop", True
            elif t in seq.request.stop_ids:
                finish, reason, stop_token = "stop", t, True
        if seq.detok is not None and stop_token and p.include_stop_str_in_output:
            seq.detok.add(t)  # vLLM's: the stop token's text too (none for a special token skipped)
            seq.text = seq.detok.text
        if seq.detok is not None and finish is None:
            delta = seq.detok.add(t)
            seq.text = seq.detok.text
            if delta and p.stop and n_out > p.min_tokens:
                hit = _find_stop(seq.text, len(delta), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    finish, reason = "stop", hit[0]
                    seq.text = seq.text[: hit[1]] if hit[1] >= 0 else seq.text
        if finish is None and (n_out >= p.max_tokens or len(seq.token_ids) >= self.config.max_model_len):
            finish = "length"
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish, reason
            self.scheduler.finish(seq)

    def _request_output(self, req: Request) -> RequestOutput:
        """The request's output: whole (CUMULATIVE, FINAL_ONLY) or what is new since its last
        output (DELTA: slices of the new part only, so a long stream costs nothing per token that
        grows with the output). Text that could still become a stop string is held back."""
        delta = req.params.output_kind == RequestOutputKind.DELTA
        outs = []
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        for seq in req.seqs:
            end = len(seq.text) if seq.finish_reason is not None else max(0, len(seq.text) - hold)
            first = seq.prompt_len + seq.sent_tokens if delta else seq.prompt_len
            lps = None
            if seq.logprobs is not None:
                lps = seq.logprobs[seq.sent_tokens:] if delta else list(seq.logprobs)
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text[seq.sent_text:end] if delta else seq.text[:end],
                token_ids=seq.token_ids[first:],  # a new list (a slice)
                cumulative_logprob=seq.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
            if delta:
                seq.sent_tokens, seq.sent_text = seq.num_outputs, max(seq.sent_text, end)
        plp = None
        if req.prompt_logprobs is not None and not (delta and req.prompt_logprobs_sent):
            plp = list(req.prompt_logprobs)
            plp[0] = None
            # DELTA: sent once, complete: with the first output after every prompt position has its
            # logprobs (not when the sequences' computed counts pass the prompt: those move when a step
            # is dispatched, its logprobs arrive when it is read), or with the last output
            req.prompt_logprobs_sent = delta and (req.finished or all(d is not None for d in plp[1:]))
            if delta and not req.prompt_logprobs_sent:
                plp = None
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, plp, outs, req.finished,
                             num_cached_tokens=max(0, req.seqs[0].num_cached_tokens), metrics=metrics)

    # ---- convenience -----------------------------------------------------------------------------
    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every queued request finished; the final output of each request."""
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return final

    def generate(self, prompts: Seq[Any], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Queue `prompts` (one prompt, a str or dict, or a list) and run them to completion (offline
        use); outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str | dict) else prompts
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        for p, sp in zip(prompts, plist):
            self.validate(p, sp)
        plist = [sp.clone(output_kind=RequestOutputKind.FINAL_ONLY) for sp in plist]  # only final ones are read
        ids = []
        for p, sp in zip(prompts, plist):
            rid = f"gen-{self._arrivals}"
            self.add_request(rid, p, sp)
            ids.append(rid)
        final = self.run_to_completion()
        return [final[r] for r in ids]


def _find_stop(text: str, new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """vLLM's stop-string check on the text tail: (stop string, cut index or -1 to keep all)."""
    for s in stops:
        start = max(0, len(text) - new_chars - len(s) + 1)
        i = text.find(s, start)
        if i == -1:
            continue
        if include:
            i += len(s)
            if i >= len(text):
                return s, -1
        return s, i
    return None


__all__ = ["LLMEngine", "EngineStats", "EngineConfig"]
