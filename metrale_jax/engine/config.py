"""`EngineConfig`: every engine choice in one frozen dataclass (no environment switches).

Fields left at None are resolved against the model and the device by `EngineConfig.resolve`,
which returns a config with every size filled in; the engine logs the resolved config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from metrale_jax.engine.spec_decode import SpeculativeConfig
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.loading.hub import DEFAULT_MODEL

log = logging.getLogger(__name__)

# JAX's persistent cache and our executables, beside the model cache (`$XDG_CACHE_HOME/metrale_jax`)
DEFAULT_CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "metrale_jax",
                                 "jax_cache")


def _pow2_upto(n: int, start: int = 1, factor: int = 2) -> tuple[int, ...]:
    out, b = [], start
    while b < n:
        out.append(b)
        b *= factor
    out.append(n)
    return tuple(sorted(set(out)))


def _swap_buckets(max_blocks: int, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Block counts of the swap copies: `buckets` below max_blocks plus max_blocks itself, or
    powers of 4 from 4 when empty."""
    out = [b for b in buckets if b < max_blocks] if buckets else list(_pow2_upto(max_blocks, 4, 4))
    return tuple(sorted(set(out + [max_blocks])))



def hopper() -> bool:
    """Whether the GPU has Hopper's wgmma (compute capability 9.x), which the Mosaic GPU kernels
    (prefill attention, the W8A8 linears) are written for; True when the first device is not a
    GPU (the GPU defaults asked for on the CPU, e.g. to lower the steps for an H200)."""
    import jax

    d = jax.devices()[0]
    cc = getattr(d, "compute_capability", None)
    return d.platform != "gpu" or cc is None or str(cc).split(".")[0] == "9"


def default_kernels(on_gpu: bool, uses_moe: bool = False, wgmma: bool | None = None,
                    lora: bool = False) -> AttentionConfig:
    """The kernel choices when none are given: on the GPU the Pallas kernels (attention, scans,
    FP8 decode linears), the Python layer loop and, for MoE models, tokamax's grouped GEMM when it
    imports (tried only then: the import takes seconds); on the CPU the XLA reference. The Mosaic
    GPU kernels only where the GPU has wgmma (`wgmma`, None = `hopper()`): other GPUs take the
    Triton prefill kernel and the W8A16 linears at every decode size. On the GPU, decode steps of
    fewer than 8 rows run the model on 8 (where the step finds that it pays: `min_decode_rows`),
    and the sampler skips what no row of the step needs (`sampler_skip`), in the forward half of
    steps without grammar rows (`sample_in_forward`: one launch a step). With LoRA (`lora`) on
    the GPU, XLA's rematerialization pass is off (`xla_remat`): it recomputed the base GEMMs whose
    output also feeds the folded shrinks (H200, Llama-3-8B, 8 slots: batch-1 steps 1.62x the
    base with it, 1.13x without; session 22)."""
    from metrale_jax.layers.moe import tokamax_available

    mosaic = on_gpu and (hopper() if wgmma is None else wgmma)
    if on_gpu and not mosaic:
        log.info("Mosaic GPU kernels off: the GPU has no wgmma (compute capability 9.x)")
    return AttentionConfig(use_pallas=on_gpu, unroll_layers=on_gpu,
                           tokamax_moe=on_gpu and uses_moe and tokamax_available(), fp8_kernel=on_gpu,
                           fp8_w8a8=mosaic, mosaic_prefill=mosaic, sampler_branches=not on_gpu,
                           sampler_skip=on_gpu, sample_in_forward=on_gpu, min_decode_rows=8 if on_gpu else 1,
                           xla_remat=not (on_gpu and lora))


@dataclass(frozen=True)
class EngineConfig:
    """Engine configuration. None = chosen from the model and device at start-up."""

    model: str = DEFAULT_MODEL  # path or alias (see metrale_jax.loading.hub)
    revision: str | None = None  # Hugging Face revision (branch, tag or commit) of a hub model id
    # the tokenizer from elsewhere (vLLM's `tokenizer`): a folder with tokenizer.json, a GGUF file,
    # an alias or a hub repo id; None = the model's own
    tokenizer: str | None = None
    # vLLM's `generation_config`: "auto" = the sampling fields of the model's generation_config.json
    # (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) are the defaults of
    # requests that do not set them; "vllm" = SamplingParams' own defaults; a folder = its
    # generation_config.json
    generation_config: str = "auto"
    dtype: str = "auto"  # parameters AND the KV cache: "auto" | "float32" | "bfloat16" | "float16" ("half", "float")
    # override the KV cache dtype (None = dtype): "float32" | "bfloat16" | "float16" | "float8_e4m3fn";
    # vLLM's kv_cache_dtype spellings too ("auto" = None, "fp8" / "fp8_e4m3" = float8_e4m3fn)
    kv_dtype: str | None = None
    # vLLM's `download_dir`: the Hugging Face cache a hub repo id downloads into (None: huggingface_hub's)
    download_dir: str | None = None
    # vLLM's `hf_overrides`: config.json keys replaced before the model is built, e.g.
    # '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
    # (Qwen3's long-context setting); a dict or its JSON text, kept as JSON (hashable)
    hf_overrides: str | None = None
    # quantize the decoder linears at load: "fp8" (128x128 blocks), "int4", "nvfp4"; or vLLM's name of
    # the checkpoint's own format ("gptq", "awq_marlin", ...: `model.checkpoint_quantization`)
    quantization: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from gpu_memory_utilization (GPU) / cpu_kv_tokens (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kv_tokens: int = 8192  # the CPU default pool, in tokens
    max_num_seqs: int | None = None  # running sequences (decode rows); None: 64 GPU / 16 CPU
    max_num_batched_tokens: int | None = None  # token budget per step; None: 2048 GPU / 256 CPU
    max_prefill_streams: int = 4  # B: prefill chunks per step
    decode_buckets: tuple[int, ...] = ()  # decode-step N buckets; () = powers of 2 to max_num_seqs
    # N buckets of mixed steps; () = max_num_seqs alone: a mixed step's cost is its prefill tokens
    # and the weights, so padding its decode rows costs little, and one N per T halves the start-up
    mixed_decode_buckets: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()  # T buckets of prefill / mixed steps; () = powers of 4
    max_logprobs: int = 20
    max_suppress_ids: int = 16  # per request: logit_bias entries + eos / stop_token_ids suppressed under min_tokens
    max_penalty_rows: int | None = None  # sequences with penalties at once; None = max_num_seqs
    max_ssm_slots: int | None = None  # None = max_num_seqs (only for models with SSM state)
    seed: int = 0  # draws the seeds of requests that give none
    attention: AttentionConfig | None = None  # None: the Pallas kernels on GPU, the XLA reference on CPU
    compilation_cache_dir: str | None = DEFAULT_CACHE_DIR  # JAX persistent cache; None = off
    compile_workers: int | None = None  # threads lowering/compiling buckets; None: min(8, CPU count), 1 on the CPU
    show_progress: bool = True
    # Run every compiled step once at start-up on padding inputs (which write nothing), so that
    # the first requests pay no first-execution costs (command-buffer capture, Mosaic GPU kernel
    # loading) and a step that cannot run fails at start-up. None: on for the GPU, off for the CPU.
    warm_up: bool | None = None
    # Prompt tokens per step whose logprobs can be computed (`prompt_logprobs`): on the GPU every
    # prefill / mixed step computes min(T, this) gathered rows in its LM-head matmul, asked or not
    # (no conditional, and the weights are read once; its GPU cost is not measured yet); a request asking
    # for prompt logprobs prefills at most this many tokens per step. Evaluation runs that score
    # long prompts may raise it (up to max_num_batched_tokens).
    max_prompt_logprobs_tokens: int = 128
    # Preemption when blocks run out: "swap" (copy the sequence's KV blocks and SSM slot to host
    # memory, write them back on resume), "recompute" (free them, prefill again), or "auto": swap
    # for models with SSM state (a recompute replays the whole recurrence), recompute otherwise.
    preemption_mode: str = "auto"
    # vLLM's: "fcfs" (arrival order) or "priority" (a request's `priority`, lower first, then
    # arrival): the order waiting requests are admitted in and running ones are preempted in
    scheduling_policy: str = "fcfs"
    swap_block_buckets: tuple[int, ...] = ()  # block counts of the swap copies; () = powers of 4 (+ the max)
    swap_space_gb: float = 4.0  # host memory for swapped sequences; beyond it, recompute
    # Automatic prefix caching (vLLM's name; on by default as in vLLM): freed full KV blocks stay
    # cached under a hash of their prefix and new sequences reuse them (metrale_jax/cache/prefix_cache.py)
    enable_prefix_caching: bool = True
    # SSM pool slots for prefix-cache snapshots of the recurrent state, on top of max_ssm_slots;
    # None: max_num_seqs with prefix caching on a model with SSM state, else 0
    max_ssm_snapshots: int | None = None
    # Host-memory tier of the prefix cache (vLLM's name), in GB: cached KV blocks evicted from the
    # device are copied there and copied back on a hit; 0 = off. Separate from swap_space_gb.
    kv_offloading_size: float = 0.0
    # Whether the host tier pays: None measures it at start-up (restoring the largest swap bucket of
    # blocks against recomputing them with the largest prefill bucket; when recomputing is cheaper
    # the tier stays off, with a log line); True / False decide without measuring.
    kv_offloading_restore: bool | None = None
    # Devices the steps span, on one mesh axis `tp` (metrale_jax/parallel.py): attention and MLP
    # heads, the KV and SSM pools and the vocabulary split over them, metadata replicated.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts split by expert (EP) instead of by their inner dimension
    # Multi-LoRA, vLLM's names (metrale_jax/lora): requests name a PEFT adapter (`lora_request=`);
    # at most max_loras distinct adapters run in one batch (device slots of rank max_lora_rank,
    # allocated at start-up); max_cpu_loras adapters stay in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # MoE models: LoRA slots for every routed expert too (max_loras * num_experts groups per layer:
    # gigabytes on a 128-expert model); False leaves them out and refuses adapters that train experts
    lora_experts: bool = True
    # Speculative decoding (vLLM's `speculative_config`): a `SpeculativeConfig` or its dict, e.g.
    # {"method": "ngram", "num_speculative_tokens": 4} (prompt lookup) or {"method": "mtp", ...} (the
    # checkpoint's multi-token-prediction head, Qwen3-Next); None = off. With it, verify steps of
    # N rows x (1 + k) tokens take the place of the decode steps (engine/spec_decode.py).
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        kd = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}.get(self.kv_dtype, self.kv_dtype)
        if kd not in (None, "float32", "bfloat16", "float16", "float8_e4m3fn"):
            raise ValueError(f"kv_dtype (kv_cache_dtype) {self.kv_dtype!r} is not supported: 'auto', 'float32', "
                             "'bfloat16', 'float16' or 'fp8' (float8_e4m3fn)")
        object.__setattr__(self, "kv_dtype", kd)
        from metrale_jax.config import DTYPE_ALIASES, DTYPE_NAMES, check_quantization_name

        dt = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dt != "auto" and dt not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is not supported: 'auto', 'bfloat16', 'float16' ('half') or "
                             "'float32' ('float')")
        object.__setattr__(self, "dtype", dt)

        check_quantization_name(self.quantization)
        if self.hf_overrides is not None:
            ov = self.hf_overrides
            try:
                ov = json.loads(ov) if isinstance(ov, str) else ov
            except ValueError as e:
                raise ValueError(f"hf_overrides is not JSON: {e}") from None
            if not isinstance(ov, dict):
                raise ValueError(f"hf_overrides must be a JSON object of config.json keys, got {self.hf_overrides!r}")
            object.__setattr__(self, "hf_overrides", json.dumps(ov, sort_keys=True) if ov else None)
        gc = self.generation_config
        if gc not in ("auto", "vllm") and not os.path.isfile(os.path.join(gc, "generation_config.json")):
            # here, not after the model has loaded (minutes for a large one)
            raise ValueError(f"generation_config={gc!r}: no generation_config.json in that folder "
                             "(or give 'auto' / 'vllm')")

    def replace(self, **kw) -> EngineConfig:
        return dataclasses.replace(self, **kw)

    def resolve(self, *, max_position_embeddings: int, on_gpu: bool, uses_ssm: bool = False,
                uses_moe: bool = False) -> EngineConfig:
        """Fill every None/() size and the "auto" preemption mode; raise ValueError for an
        inconsistent config."""
        mml = self.max_model_len
        if mml is None:
            mml = min(max_position_embeddings, 4096)
        if mml > max_position_embeddings:
            raise ValueError(f"max_model_len={mml} exceeds the model's context length {max_position_embeddings} "
                             "(max_position_embeddings, or what its RoPE scaling extends it to)")
        if mml < 2:
            raise ValueError(f"max_model_len={mml} must be >= 2")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        seqs = self.max_num_seqs or (64 if on_gpu else 16)
        budget = self.max_num_batched_tokens or (2048 if on_gpu else 256)
        if budget < seqs:
            raise ValueError(f"max_num_batched_tokens={budget} must be >= max_num_seqs={seqs}")
        dec = tuple(sorted(set(self.decode_buckets))) or _pow2_upto(seqs)
        mix = tuple(sorted(set(self.mixed_decode_buckets))) or (seqs,)
        pre = tuple(sorted(set(self.prefill_buckets))) or _pow2_upto(budget, 32, 4)
        if dec[-1] < seqs or mix[-1] < seqs:
            raise ValueError(f"decode buckets {dec} / mixed decode buckets {mix} must reach "
                             f"max_num_seqs={seqs}")
        if pre[-1] > budget:
            raise ValueError(f"prefill bucket {pre[-1]} exceeds max_num_batched_tokens={budget}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_prefill_streams < 1:
            raise ValueError(f"max_prefill_streams={self.max_prefill_streams} must be >= 1")
        if self.max_prompt_logprobs_tokens < 1:
            raise ValueError(f"max_prompt_logprobs_tokens={self.max_prompt_logprobs_tokens} must be >= 1")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be >= 0")
        mode = self.preemption_mode
        if mode == "auto":
            mode = "swap" if uses_ssm else "recompute"
        if mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be 'auto', 'swap' or 'recompute'")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be 'fcfs' or 'priority'")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb={self.swap_space_gb} must be >= 0")
        snaps = self.max_ssm_snapshots
        if snaps is not None and snaps < 0:
            raise ValueError(f"max_ssm_snapshots={snaps} must be >= 0")
        snaps = (seqs if snaps is None else snaps) if self.enable_prefix_caching and uses_ssm else 0
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size={self.kv_offloading_size} must be >= 0")
        offload = self.kv_offloading_size if self.enable_prefix_caching else 0.0
        if any(b < 1 for b in self.swap_block_buckets):
            raise ValueError(f"swap_block_buckets={self.swap_block_buckets} must be >= 1")
        cpu_loras = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1 or cpu_loras < self.max_loras):
            raise ValueError(f"max_loras={self.max_loras} and max_lora_rank={self.max_lora_rank} must be >= 1 and "
                             f"max_cpu_loras={cpu_loras} >= max_loras")
        return dataclasses.replace(
            self, max_model_len=mml, max_num_seqs=seqs, max_num_batched_tokens=budget,
            decode_buckets=dec, mixed_decode_buckets=mix, prefill_buckets=pre,
            max_penalty_rows=seqs if self.max_penalty_rows is None else self.max_penalty_rows,
            max_ssm_slots=seqs if self.max_ssm_slots is None else self.max_ssm_slots, max_ssm_snapshots=snaps,
            attention=self.attention or default_kernels(on_gpu, uses_moe, lora=self.enable_lora), preemption_mode=mode,
            warm_up=on_gpu if self.warm_up is None else self.warm_up,
            max_cpu_loras=cpu_loras,
            # one compile thread on the CPU: in jax 0.11.2 two XLA:CPU compiles at once can crash the process
            compile_workers=self.compile_workers or (max(1, min(8, os.cpu_count() or 1)) if on_gpu else 1),
            swap_block_buckets=_swap_buckets(-(-mml // self.block_size), self.swap_block_buckets)
            if mode == "swap" or offload else (), kv_offloading_size=offload,
        )

    @property
    def max_blocks_per_seq(self) -> int:
        assert self.max_model_len is not None, "resolve() the config first"
        return -(-self.max_model_len // self.block_size)
