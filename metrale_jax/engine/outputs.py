"""Request outputs, shaped like vLLM's (`RequestOutput`, `CompletionOutput`, `Logprob`).

Outputs are cumulative: every `LLMEngine.step()` returns the whole text / token ids so far; a
streaming server diffs consecutive outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One entry of a logprobs dict. logprob: float32 log-softmax of the raw logits; rank from 1;
    decoded_token: None without a tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# position -> {token_id: Logprob}: the actual token plus the top k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (`n` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | None while running (or "abort")
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times (seconds)
