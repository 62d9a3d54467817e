"""Request outputs, shaped like vLLM's (`RequestOutput`, `CompletionOutput`, `Logprob`).

`SamplingParams.output_kind` picks what `LLMEngine.step()` returns: the whole text / token ids so
far (CUMULATIVE), only what is new (DELTA: the server streams these; `RequestOutput.add` joins
deltas), or one final output (FINAL_ONLY).
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

    def add(self, later: RequestOutput) -> None:
        """Append a later DELTA output of the same request to this one (in place): token ids, text
        and logprobs concatenate; finish state, cumulative logprob and metrics are the later's."""
        mine = {o.index: o for o in self.outputs}
        for o in later.outputs:
            a = mine.get(o.index)
            if a is None:
                self.outputs.append(o)
                continue
            a.text += o.text
            a.token_ids = a.token_ids + o.token_ids
            if o.logprobs is not None:
                a.logprobs = (a.logprobs or []) + o.logprobs
            a.cumulative_logprob, a.finish_reason, a.stop_reason = o.cumulative_logprob, o.finish_reason, o.stop_reason
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.metrics = later.finished, later.metrics
