"""`LLM`: the offline API, shaped like vLLM's.

    from metrale_jax import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", dtype="float32", max_model_len=1024)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import EngineStats, LLMEngine
from metrale_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from metrale_jax.errors import InvalidRequestError
from metrale_jax.loading.hub import DEFAULT_MODEL
from metrale_jax.sampling import SamplingParams

PromptType = str | dict | list[int]


class LLM:
    """Load a model, compile its steps, generate.

    `dtype` sets the parameters' and the KV cache's dtype ("auto" = the checkpoint's). The KV pool
    has `num_kv_blocks` blocks of `block_size` tokens when given; otherwise, on a GPU, a
    `gpu_memory_utilization` share of the device memory left after the weights, and on CPU a small
    fixed pool. `max_model_len` above the model's max_position_embeddings raises ValueError; an
    unknown model path or alias raises ModelNotFoundError. Other `EngineConfig` fields can be
    passed as keyword arguments.
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
        **engine_kwargs: Any,
    ):
        config = EngineConfig(
            model=str(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs,
        )
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

    def stats(self) -> EngineStats:
        return self.llm_engine.stats()

    # ---- generation ------------------------------------------------------------------------------
    def _run(self, prompts: Sequence[PromptType], params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        for p, sp in zip(prompts, plist):  # reject a bad batch before queuing any of it
            eng.validate(p, sp)
        rids = []
        for p, sp in zip(prompts, plist):
            rid = str(next(self._ids))
            eng.add_request(rid, p, sp)
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
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or {"prompt_token_ids": [...]}); outputs in order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of conversations, rendered with the tokenizer's chat template."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                                           chat_template=chat_template, **template_kwargs)
            ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          chat_template=chat_template, **template_kwargs)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self._run(prompts, sampling_params, use_tqdm)

    def abort(self, request_id: str) -> None:
        self.llm_engine.abort(request_id)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig", "LLMEngine"]
