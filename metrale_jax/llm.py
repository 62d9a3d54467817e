"""`LLM`: the offline API, shaped like vLLM's.

    from metrale_jax import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", dtype="float32", max_model_len=1024)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from metrale_jax.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import EngineStats, LLMEngine
from metrale_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from metrale_jax.errors import ChatTemplateError, InvalidMessagesError, InvalidPromptError, InvalidRequestError
from metrale_jax.loading.hub import DEFAULT_MODEL
from metrale_jax.sampling import RequestOutputKind, SamplingParams

PromptType = str | dict | list[int]
log = logging.getLogger(__name__)


def engine_config(model: str = DEFAULT_MODEL, *, tokenizer: str | None = None, swap_space: float | None = None,
                  trust_remote_code: bool = False, enforce_eager: bool = False, kv_cache_dtype: str | None = None,
                  tokenizer_mode: str = "auto", enable_chunked_prefill: bool | None = None,
                  disable_log_stats: bool = True, max_seq_len_to_capture: int | None = None,
                  distributed_executor_backend: str | None = None, **engine_kwargs: Any) -> EngineConfig:
    """The EngineConfig of vLLM's engine arguments: what `LLM(...)` and `EngineArgs(...)` take
    (`LLM`'s docstring: vLLM's names mapped onto EngineConfig's, the rest passed through)."""
    del trust_remote_code, disable_log_stats, max_seq_len_to_capture, distributed_executor_backend  # (nothing to set)
    if tokenizer_mode not in ("auto", "slow", "hf"):
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r} is not supported ('auto'; the tokenizer is always "
                         "the `tokenizers` one of tokenizer.json or the GGUF)")
    if enable_chunked_prefill is False:
        log.info("enable_chunked_prefill=False: metrale-jax always prefills long prompts in chunks")
    if kv_cache_dtype is not None:
        engine_kwargs["kv_dtype"] = kv_cache_dtype
    if enforce_eager:
        log.info("enforce_eager=True: metrale-jax has no eager mode; its steps are compiled ahead of time")
    if swap_space is not None:
        engine_kwargs["swap_space_gb"] = float(swap_space)
    return EngineConfig(model=str(model), tokenizer=tokenizer, **engine_kwargs)


class EngineArgs:
    """vLLM's `EngineArgs`: `LLM`'s keyword arguments kept for `LLMEngine.from_engine_args`
    (`EngineArgs(model=..., max_model_len=...)`; `create_engine_config()` checks them)."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any):
        self.model = model
        self.kwargs = kwargs

    def create_engine_config(self) -> EngineConfig:
        return engine_config(self.model, **self.kwargs)


class LLM:
    """Load a model, compile its steps, generate.

    `dtype` sets the parameters' and the KV cache's dtype ("auto" = the checkpoint's). The KV pool
    has `num_kv_blocks` blocks of `block_size` tokens when given; otherwise, on a GPU, a
    `gpu_memory_utilization` share of the device memory left after the weights, and on CPU a small
    fixed pool. `max_model_len` above the model's context length (max_position_embeddings, or what
    yarn / linear RoPE scaling extends it to: `ModelConfig.max_positions`) raises ValueError; an
    unknown model path or alias raises ModelNotFoundError. Other `EngineConfig` fields can be
    passed as keyword arguments.

    vLLM's arguments that ported scripts pass: `tokenizer` (another tokenizer: a folder, a GGUF
    file, an alias or a hub id), `swap_space` (GiB of host memory for preempted sequences,
    `EngineConfig.swap_space_gb`), `trust_remote_code` (accepted; nothing from a checkpoint is ever
    run: every architecture is this package's own code), `enforce_eager` (accepted; the steps
    are always compiled ahead of time, there is no eager mode: True is logged once),
    `kv_cache_dtype` (`EngineConfig.kv_dtype`: "auto", "fp8", ...), `download_dir`,
    `tokenizer_mode` ("auto", or "slow" / "hf": the `tokenizers` one either way; "mistral" is
    refused), `enable_chunked_prefill` (prefill is always chunked), and `disable_log_stats`,
    `max_seq_len_to_capture`, `distributed_executor_backend` (accepted, nothing to set here).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int = 16,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        tokenizer: str | None = None,
        swap_space: float | None = None,
        trust_remote_code: bool = False,
        enforce_eager: bool = False,
        kv_cache_dtype: str | None = None,
        tokenizer_mode: str = "auto",
        enable_chunked_prefill: bool | None = None,
        disable_log_stats: bool = True,
        max_seq_len_to_capture: int | None = None,
        distributed_executor_backend: str | None = None,
        **engine_kwargs: Any,
    ):
        config = engine_config(
            model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, seed=seed, tokenizer=tokenizer, swap_space=swap_space,
            trust_remote_code=trust_remote_code, enforce_eager=enforce_eager, kv_cache_dtype=kv_cache_dtype,
            tokenizer_mode=tokenizer_mode, enable_chunked_prefill=enable_chunked_prefill,
            disable_log_stats=disable_log_stats, max_seq_len_to_capture=max_seq_len_to_capture,
            distributed_executor_backend=distributed_executor_backend, **engine_kwargs)
        self.llm_engine = LLMEngine.from_config(config)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built with `LLMEngine(model, params, config)`)."""
        self = cls.__new__(cls)
        self.llm_engine = engine
        self._ids = itertools.count()
        return self

    # ---- properties ------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams `generate` / `chat` use when given none: SamplingParams'
        defaults with the sampling fields of the model's generation_config.json over them
        (`EngineConfig.generation_config`: "auto"; "vllm" leaves SamplingParams' own)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def stats(self) -> EngineStats:
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM's name); False while requests run or caching is off."""
        return self.llm_engine.reset_prefix_cache()

    # ---- generation ------------------------------------------------------------------------------
    def _run(self, prompts: Sequence[PromptType], params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, lora_request: Any = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        eng = self.llm_engine
        params = params if params is not None else self.get_default_sampling_params()
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        llist = list(lora_request) if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        if len(llist) != len(prompts):
            raise InvalidRequestError(f"{len(llist)} LoRA requests for {len(prompts)} prompts")
        prio = [0] * len(prompts) if priority is None else list(priority)
        if len(prio) != len(prompts):
            raise InvalidRequestError(f"{len(prio)} priorities for {len(prompts)} prompts")
        for p, sp, lr, pr in zip(prompts, plist, llist, prio):  # reject a bad batch before queuing any of it
            eng.validate(p, sp)
            eng._resolve_lora(lr)
            eng._check_priority(pr)
        # only final outputs are read here (as vLLM's LLM does): no per-step output copies
        plist = [sp.clone(output_kind=RequestOutputKind.FINAL_ONLY) for sp in plist]
        rids = []
        for p, sp, lr, pr in zip(prompts, plist, llist, prio):
            rid = str(next(self._ids))
            eng.add_request(rid, p, sp, lora_request=lr, priority=pr)
            rids.append(rid)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(rids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        final[o.request_id] = o
                        bar.update(1)
        except BaseException:
            for r in rids:
                eng.abort(r)
            raise
        finally:
            bar.close()
        return [final[r] for r in rids]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or {"prompt_token_ids": [...]}); outputs in order.
        lora_request: a `LoRARequest` for every prompt, or a list with one (or None) per prompt
        (needs `enable_lora=True`). priority: one per prompt, lower first (needs
        scheduling_policy="priority")."""
        if isinstance(prompts, str | dict) or not isinstance(prompts, Iterable):
            prompts = [prompts]  # (one prompt; one of a wrong type is refused by `validate`)
        return self._run(list(prompts), sampling_params, use_tqdm, lora_request, priority)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: Any = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of conversations, rendered with the tokenizer's chat template. `tools`,
        `continue_final_message` (with add_generation_prompt=False), `chat_template_kwargs` (vLLM's
        dict) and other keyword arguments reach the template."""
        template_kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template")
        if not isinstance(messages, list | tuple) or not messages:
            raise InvalidMessagesError("messages must be a non-empty list of {'role', 'content'} dicts "
                                       "(or a list of such lists)")
        single = isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        convs = [_check_messages(conv, "messages" if single else f"messages[{i}]") for i, conv in enumerate(convs)]
        prompts = []
        for conv in convs:
            try:
                text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               chat_template=chat_template, **template_kwargs)
            except InvalidRequestError:
                raise
            except Exception as e:  # noqa: BLE001 - jinja2 errors, the template's raise_exception, its ops' TypeErrors
                raise ChatTemplateError(chat_template_error_message(e)) from e
            try:
                text.encode("utf-8")
                # as apply_chat_template(tokenize=True): the template writes its own special tokens
                ids = tok.encode(text, add_special_tokens=False)
            except Exception as e:  # noqa: BLE001 - lone surrogates, or what else the tokenizer refuses
                raise InvalidPromptError(f"the rendered chat prompt cannot be tokenized (text that is not valid "
                                         f"UTF-8?): {type(e).__name__}: {e}") from e
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (`metrale_jax.beam_search`): the `params.beam_width` best beams of
        each prompt (a string, {"prompt": ...} or {"prompt_token_ids": [...]}), best first."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        return beam_search(self, list(prompts), params, lora_request, use_tqdm)

    def abort(self, request_id: str) -> None:
        self.llm_engine.abort(request_id)


def chat_template_error_message(e: BaseException) -> str:
    """What a chat template's failure says: the jinja2 error (with its template line) or the
    template's own raise_exception message."""
    line = getattr(e, "lineno", None)
    where = f" (template line {line})" if line else ""
    return f"the chat template cannot render these messages{where}: {type(e).__name__}: {e}"


def _check_messages(conv: Any, where: str) -> list[dict]:
    """One conversation as the chat template takes it: a non-empty list of dicts with a string
    `role` and a `content` that is a string (None: "") or a list of OpenAI text content parts
    ({"type": "text", "text": str}, joined with newlines as the server joins them). Other keys
    (name, tool_calls, ...) pass through. Raises InvalidMessagesError naming the bad message."""
    if not isinstance(conv, list | tuple) or not conv:
        raise InvalidMessagesError(f"{where} must be a non-empty list of message dicts, got {type(conv).__name__}")
    out = []
    for i, m in enumerate(conv):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise InvalidMessagesError(f"{at} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidMessagesError(f"{at} needs a string 'role' (e.g. 'user'), got {m.get('role')!r}")
        if "content" not in m:
            raise InvalidMessagesError(f"{at} (role {m['role']!r}) has no 'content'")
        content = m["content"]
        if content is None:
            content = ""
        elif isinstance(content, list | tuple):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise InvalidMessagesError(f"{at}.content[{j}]: only {{'type': 'text', 'text': str}} content "
                                               f"parts are supported, got {kind!r}")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise InvalidMessagesError(f"{at}.content must be a string or a list of content parts, got "
                                       f"{type(content).__name__}")
        out.append({**m, "content": content})
    return out


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig", "LLMEngine"]
