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
    token (the candidates of that round); `text` the decoded tokens, prompt included (vLLM's
    offline API); finish_reason "stop" (EOS) or "length"."""

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


def beam_search(llm: Any, prompts: list[Any], params: BeamSearchParams, lora_request: Any = None,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: see the module docstring."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidSamplingParamsError(f"params must be BeamSearchParams, got {type(params).__name__}")
    eng = llm.llm_engine
    width = params.beam_width
    if 2 * width > eng.config.max_logprobs:
        raise InvalidSamplingParamsError(f"beam_width={width} needs the top {2 * width} logprobs a round; this "
                                         f"engine's max_logprobs is {eng.config.max_logprobs}")
    eos = tuple(eng.eos_token_ids)
    max_len = int(eng.config.max_model_len)
    step = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=0.0, ignore_eos=True)
    live: list[list[BeamSearchSequence]] = []
    for p in prompts:
        ids = eng.validate(p, step)[1]
        live.append([BeamSearchSequence(tokens=list(ids))])
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def key(b: BeamSearchSequence) -> float:
        return beam_score(b, eos, params.length_penalty)

    for _ in tqdm(range(params.max_tokens), desc="beam search", unit="token", disable=not use_tqdm):
        for i, beams in enumerate(live):  # a beam at max_model_len can take no more tokens
            done[i] += [_finish(b, "length") for b in beams if len(b.tokens) >= max_len]
            live[i] = [b for b in beams if len(b.tokens) < max_len]
        batch = [b for beams in live for b in beams]
        if not batch:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for b in batch], step, lora_request=lora_request)
        it = iter(outs)
        for i, beams in enumerate(live):
            grown = []
            for b in beams:
                lps = next(it).outputs[0].logprobs[0]
                for t, lp in lps.items():
                    nb = BeamSearchSequence(b.tokens + [t], b.logprobs + [lps], b.cum_logprob + lp.logprob)
                    if t in eos and not params.ignore_eos:
                        done[i].append(_finish(nb, "stop"))
                    else:
                        grown.append(nb)
            live[i] = sorted(grown, key=key, reverse=True)[:width]
    tok = eng.tokenizer
    results = []
    for i, beams in enumerate(live):
        best = sorted(done[i] + [_finish(b, "length") for b in beams], key=key, reverse=True)[:width]
        for b in best:
            b.text = tok.decode(b.tokens) if tok is not None else None
        results.append(BeamSearchOutput(best))
    return results


def _finish(beam: BeamSearchSequence, reason: str) -> BeamSearchSequence:
    beam.finish_reason = reason
    return beam


__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "beam_search", "beam_score"]
