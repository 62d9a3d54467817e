"""Beam search over the engine, as vLLM's `LLM.beam_search` does it: a search at the request level.

Each round sends every live beam as a prompt of its own with `max_tokens=1` and the top
2 x beam_width logprobs (raw log-softmax, so `temperature` changes nothing), extends each beam
by each of those tokens, and keeps the beam_width best extensions per prompt by
cumulative logprob / length ** length_penalty (the length counts the prompt and not a final EOS,
as vLLM's `get_beam_search_score`). An extension ending in EOS is finished (unless `ignore_eos`);
after `max_tokens` rounds, or when no live beam is left, the finished and the live beams are
ranked together and the best beam_width returned. The prefix cache (on by default) keeps the
rounds from recomputing the beams' shared prefixes: each round prefills at most the tokens past
a beam's last full cached block.

    from metrale_jax import LLM, BeamSearchParams
    out = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=4, max_tokens=16))
    best = out[0].sequences[0]  # .tokens (prompt + output), .text, .cum_logprob, .finish_reason
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from metrale_jax.engine.outputs import PositionLogprobs
from metrale_jax.errors import InvalidSamplingParamsError
from metrale_jax.sampling import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's fields. beam_width >= 1 beams per prompt, up to max_tokens >= 1 new tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # (kept for vLLM's signature: the beams rank by raw logprobs)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # (vLLM's field; beams end at EOS only)

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidSamplingParamsError(f"{name} must be an integer >= 1, got {v!r}")
        if not math.isfinite(self.length_penalty):
            raise InvalidSamplingParamsError(f"length_penalty must be finite, got {self.length_penalty!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidSamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's ids and then the beam's; `logprobs` one dict per new
    token (the candidates of that round); `text` the decoded tokens, prompt and special tokens
    included (vLLM's offline API); finish_reason "stop" (EOS) or "length"."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, the length without a final EOS."""
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """One search's state between rounds, so that the offline API and the server can drive it:
    `round()` gives the live beams' token lists to run as one-token requests (`step_params`; []
    when the search is over), `advance(...)` takes each one's logprob dict, `results()` ranks."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: tuple[int, ...],
                 max_model_len: int):
        self.params = params
        self.eos = tuple(eos_token_ids)
        self.max_len = int(max_model_len)
        self.live = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.rounds = 0

    def key(self, b: BeamSearchSequence) -> float:
        return beam_score(b, self.eos, self.params.length_penalty)

    def round(self) -> list[tuple[int, list[int]]]:
        """(prompt index, tokens) of each live beam, the next round's requests; [] when over."""
        if self.rounds >= self.params.max_tokens:
            return []
        for i, beams in enumerate(self.live):  # a beam at max_model_len can take no more tokens
            self.done[i] += [_finish(b, "length") for b in beams if len(b.tokens) >= self.max_len]
            self.live[i] = [b for b in beams if len(b.tokens) < self.max_len]
        return [(i, b.tokens) for i, beams in enumerate(self.live) for b in beams]

    def advance(self, logprobs: list[PositionLogprobs]) -> None:
        """One dict per beam `round()` gave, in its order: the candidates of the beam's next token."""
        it = iter(logprobs)
        width = self.params.beam_width
        for i, beams in enumerate(self.live):
            grown = []
            for b in beams:
                lps = next(it)
                for t, lp in lps.items():
                    nb = BeamSearchSequence(b.tokens + [t], b.logprobs + [lps], b.cum_logprob + lp.logprob)
                    if t in self.eos and not self.params.ignore_eos:
                        self.done[i].append(_finish(nb, "stop"))
                    else:
                        grown.append(nb)
            self.live[i] = sorted(grown, key=self.key, reverse=True)[:width]
        self.rounds += 1

    def results(self) -> list[BeamSearchOutput]:
        """Per prompt the beam_width best of the finished and live beams, best first (no text)."""
        return [BeamSearchOutput(sorted(done + [_finish(b, "length") for b in live], key=self.key,
                                        reverse=True)[:self.params.beam_width])
                for done, live in zip(self.done, self.live)]


def step_params(params: BeamSearchParams, max_logprobs: int) -> SamplingParams:
    """The SamplingParams of a round's one-token requests (InvalidSamplingParamsError when the
    engine's max_logprobs is below 2 x beam_width)."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidSamplingParamsError(f"params must be BeamSearchParams, got {type(params).__name__}")
    k = 2 * params.beam_width
    if k > max_logprobs:
        raise InvalidSamplingParamsError(f"beam_width={params.beam_width} needs the top {k} logprobs a round; "
                                         f"this engine's max_logprobs is {max_logprobs}")
    return SamplingParams(max_tokens=1, logprobs=k, temperature=0.0, ignore_eos=True)


def beam_search(llm: Any, prompts: list[Any], params: BeamSearchParams, lora_request: Any = None,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: see the module docstring."""
    eng = llm.llm_engine
    step = step_params(params, eng.config.max_logprobs)
    search = BeamSearch([eng.validate(p, step)[1] for p in prompts], params, eng.eos_token_ids,
                        eng.config.max_model_len)
    salts = [cache_salt(p) for p in prompts]  # (each prompt's rounds keep its cache_salt)
    with tqdm(total=params.max_tokens, desc="beam search", unit="token", disable=not use_tqdm) as bar:
        while batch := search.round():
            outs = llm.generate([{"prompt_token_ids": t, **salts[i]} for i, t in batch], step,
                                lora_request=lora_request)
            search.advance([o.outputs[0].logprobs[0] for o in outs])
            bar.update(1)
    results = search.results()
    tok = eng.tokenizer
    for out in results:
        for b in out.sequences:
            # (special tokens kept, as vLLM's LLM.beam_search decodes them)
            b.text = tok.decode(b.tokens, skip_special_tokens=False) if tok is not None else None
    return results


def cache_salt(prompt: Any) -> dict:
    """{"cache_salt": ...} of a prompt dict that has one, else {}."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    return {} if salt is None else {"cache_salt": salt}


def _finish(beam: BeamSearchSequence, reason: str) -> BeamSearchSequence:
    beam.finish_reason = reason
    return beam


__all__ = ["BeamSearch", "BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "beam_search", "beam_score",
           "step_params"]
