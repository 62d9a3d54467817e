"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (a request's `model` may name an adapter),
/tokenize, /detokenize and /version, and OpenAI's /v1/responses for text (`_ResponsesGeneration`).

`create_app(engine, ServerConfig(...))` wraps an `LLMEngine` (or anything with its API). The
engine runs on the `EngineLoop` thread, started and stopped by the app's lifespan; see
`engine_loop.py` for how requests and outputs cross between the threads.

Streaming follows the OpenAI wire format: `data: {json}\\n\\n` server-sent events ending in
`data: [DONE]` (/v1/responses: `event:` / `data:` pairs ending with response.completed or
response.incomplete, no [DONE]). A prompt's choices open (the chat role chunk, an echoed prompt)
with its first output, as vLLM's, so `continuous_usage_stats` reports the real prompt token count
from the first chunk. Engine outputs are cumulative, so each chunk is the difference from the last
one sent. When a request has stop strings the last `max(len(stop)) - 1` characters are held
back until the request finishes, so text that a stop string later swallows is never streamed.
A stream that the server ends early ends like any other: a stream whose request the shutdown drain
aborted gets a last chunk with finish_reason "abort" per unfinished choice (then the usage chunk
when asked for, then `[DONE]`); one whose engine died gets an error event, then `[DONE]`.

Errors are OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`: `type` is
the kind, `code` always a snake_case string (never a class name, never null), `param` the
request field at fault or null.

    status  type                   code: when
    400     invalid_request_error  invalid_json: the body is not JSON, or not a JSON object
                                   invalid_value: a field of the wrong type or out of range (`param`)
                                   unsupported_parameter, unsupported_value: suffix,
                                     a non-text content part, best_of != n, "auto"
                                     tool_choice without a tool-call parser, ...
                                   context_length_exceeded: the prompt does not fit max_model_len,
                                     or prompt tokens + max_tokens exceed it
                                   empty_prompt, invalid_prompt: no tokens; text that cannot be
                                     tokenized; a token id outside the vocabulary
                                   invalid_sampling_params: a value the engine refuses
                                   chat_template_error, no_chat_template, no_tokenizer, invalid_messages
                                   invalid_structured_outputs: a JSON schema, regex, choice list or
                                     grammar that does not compile (`response_format`,
                                     `structured_outputs`, `guided_*`, `tools`, `text.format`: the
                                     field is the `param`), or more than one of them
                                   batch_too_large: more prompts (or beam-search beams) than
                                     max_waiting_requests in one request: no retry could succeed
                                   (any other InvalidRequestError: its class's `code`, errors.py)
    401     authentication_error   invalid_api_key
    404     not_found_error        model_not_found (an unknown `model`), not_found (an unknown path)
    405     invalid_request_error  method_not_allowed
    413     invalid_request_error  request_too_large: the body exceeds max_request_bytes
    500     server_error           engine_dead: the engine thread died
                                   internal_error: an unexpected exception (logged)
                                   (any other MetraleError, e.g. a LoadError: its class's `code`)
    503     server_error           queue_full (with Retry-After), shutting_down

Access log: one INFO line per finished request on the `metrale_jax.server.access` logger (method,
path, status, request id, prompt and completion tokens, seconds until the response ended),
`GET /health` and `/metrics` at DEBUG only; uvicorn's own access log is off, so there is one line
per request. `ServerConfig(log_requests=False)` (`--disable-log-requests`) turns it off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale_jax.beam_search import BeamSearch, cache_salt, step_params
from metrale_jax.engine.outputs import CompletionOutput, RequestOutput
from metrale_jax.errors import (
    InvalidPromptError,
    InvalidRequestError,
    InvalidStructuredOutputsError,
    MaxTokensTooLargeError,
    MetraleError,
)
from metrale_jax.llm import chat_template_error_message
from metrale_jax.lora.request import LoRARequest
from metrale_jax.sampling import RequestOutputKind, SamplingParams
from metrale_jax.server.engine_loop import (
    BatchTooLargeError,
    DrainTimeoutError,
    EngineDeadError,
    EngineLoop,
    QueueFullError,
    ServerStoppingError,
    Subscription,
)
from metrale_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from metrale_jax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    ResponsesRequest,
    TokenizeRequest,
    error_body,
    parse_request,
    template_messages,
)
from metrale_jax.server.reasoning import REASONING_PARSERS, split_reasoning
from metrale_jax.server.tools import TOOL_CALL_PARSERS, ToolMode, tool_mode

log = logging.getLogger(__name__)
access_log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".access")
_QUIET_PATHS = ("/health", "/metrics")  # probes: their access lines are DEBUG

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this floor too


@dataclass(frozen=True)
class ServerConfig:
    """Server options (the engine's own options live in the engine's config).

    model_names: names /v1/models lists and requests may use; the first is reported in responses
        (a LoRA adapter's own name for a request that names one), as vLLM's --served-model-name.
    api_key: when set, /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise); as vLLM's, the
        paths outside /v1 (/tokenize, /detokenize, /health, /metrics, /version) stay open.
    chat_template: the Jinja chat template that replaces the tokenizer's own for chat, Responses and
        /tokenize messages (the text, `--chat-template` read at start-up); None: the tokenizer's.
    max_waiting_requests: the bound on waiting requests; past it requests get 503 + Retry-After.
    max_request_bytes: the body size limit (413 past it).
    allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS, as vLLM's flags.
    retry_after_s: the Retry-After value sent with 503s.
    engine_stop_timeout_s: how long the lifespan shutdown waits for the engine thread.
    log_requests: one access-log line per finished request (see the module docstring).
    """

    model_names: tuple[str, ...] = ("model",)
    api_key: str | None = None
    # LoRA adapters served under their own names (`metrale serve --lora-modules name=path`): a
    # request's `model` picks one; POST /v1/load_lora_adapter / unload_lora_adapter change the set
    lora_modules: tuple = ()  # metrale_jax.lora.LoRARequest
    max_waiting_requests: int = 1024
    max_request_bytes: int = 4 << 20
    retry_after_s: int = 1
    engine_stop_timeout_s: float = 10.0
    log_requests: bool = True
    # "auto" tool choice: the parser that finds tool calls in replies (`--enable-auto-tool-choice
    # --tool-call-parser NAME`; one of tools.TOOL_CALL_PARSERS); None: "auto" is a 400
    tool_call_parser: str | None = None
    # thinking models' replies split into reasoning and content (`--reasoning-parser NAME`; one of
    # reasoning.REASONING_PARSERS); None: the reply is all content
    reasoning_parser: str | None = None
    chat_template: str | None = None
    # CORS (Starlette's CORSMiddleware, vLLM's flags --allowed-origins, --allowed-methods,
    # --allowed-headers, --allow-credentials): browsers' preflight OPTIONS get an answer
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {self.reasoning_parser!r} is not one of {REASONING_PARSERS}")


def _now() -> int:
    return int(time.time())


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _floor(lp: float) -> float:
    lp = float(lp)
    return lp if math.isfinite(lp) and lp > _LOGPROB_FLOOR else _LOGPROB_FLOOR


def _token_str(token_id: int, lp: Any) -> str:
    tok = getattr(lp, "decoded_token", None)
    return tok if tok is not None else f"token_id:{token_id}"


def _ranked(entry: dict[int, Any]) -> list[tuple[int, Any]]:
    """A position's {token_id: Logprob} as (id, Logprob) pairs in rank order."""
    return sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))


class _Choice:
    """What has been sent so far for one choice (one output of one prompt)."""

    __slots__ = ("index", "text_sent", "tokens_sent", "finished", "text_offset", "call_id", "calls_sent",
                 "reasoning_sent")

    def __init__(self, index: int):
        self.index = index
        self.text_sent = 0
        self.tokens_sent = 0
        self.finished = False
        self.text_offset = 0
        self.call_id: str | None = None  # a named tool call's id, once its first delta went out
        self.calls_sent: list[int] = []  # auto tool calls streamed: the length of each one's arguments sent
        self.reasoning_sent = 0  # a reasoning parser's: the reasoning's length sent


# ---- logprob formats -------------------------------------------------------------------------------
def _completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]], start_offset: int) -> dict:
    """The legacy completions logprobs object for a run of tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = start_offset
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid)
        tok = _token_str(tid, lp)
        tokens.append(tok)
        token_lps.append(_floor(lp.logprob) if lp is not None else _LOGPROB_FLOOR)
        tops.append({_token_str(i, x): _floor(x.logprob) for i, x in _ranked(entry)})
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]], top_k: int) -> list[dict]:
    out = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry.get(tid)
        tok = _token_str(tid, lp)
        top = [x for x in _ranked(entry) if x[1].rank is not None and x[1].rank <= top_k][:top_k]
        out.append({
            "token": tok,
            "logprob": _floor(lp.logprob) if lp is not None else _LOGPROB_FLOOR,
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": (t := _token_str(i, x)), "logprob": _floor(x.logprob),
                              "bytes": list(t.encode("utf-8"))} for i, x in top],
        })
    return out


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class _Extras:
    """A request's vLLM output extras: max_tokens=0 with echo (`prompt_only`: the one generated token
    is dropped), prompt_logprobs (its k), return_tokens_as_token_ids, and
    stream_options.continuous_usage_stats."""

    prompt_only: bool = False
    prompt_logprobs: int | None = None
    token_ids: bool = False
    continuous_usage: bool = False

    @staticmethod
    def of(req: Any) -> _Extras:
        return _Extras(bool(getattr(req, "prompt_only", False)), req.prompt_logprobs,
                       bool(req.return_tokens_as_token_ids), req.continuous_usage)


class _Generation:
    """One HTTP generation request: its engine requests, the choices and the wire format."""

    def __init__(self, *, chat: bool, request_id: str, model: str, n: int, num_prompts: int,
                 holdback: int, top_logprobs: int | None, want_logprobs: bool, echo_texts: list[str] | None,
                 tools: ToolMode = ToolMode(), extras: _Extras = _Extras(), detok: Any = None,
                 reasoning: str | None = None, chat_echo: str | None = None):
        self.chat = chat
        self.tools = tools
        self.reasoning = reasoning  # a reasoning parser's name (chat completions), or None
        self.chat_echo = chat_echo  # chat `echo`: the text the reply's content starts with
        self.id = request_id
        self.model = model
        self.n = n
        self.created = _now()
        self.holdback = holdback
        self.top_logprobs = top_logprobs or 0
        self.want_logprobs = want_logprobs
        self.echo_texts = echo_texts
        # `extras` (see there); the prompts' logprobs when asked (`prompt_lps`: each prompt's ids
        # and logprob dicts); `detok` names a token without a logprob entry (a prompt's first)
        self.prompt_only = extras.prompt_only
        self.want_prompt_logprobs = extras.prompt_logprobs
        self.continuous_usage = extras.continuous_usage
        self.as_ids = extras.token_ids  # every logprob's token "token_id:<id>"
        self.detok = (lambda ids: f"token_id:{ids[0]}") if extras.token_ids else detok
        self.prompt_lps: dict[int, tuple[list[int], list[Any]]] = {}
        self.choices = {i: _Choice(i) for i in range(n * num_prompts)}
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}  # prompt tokens the prefix cache served
        self.completion_tokens: dict[int, int] = {}
        self.final: dict[int, Any] = {}  # choice index -> CompletionOutput: the deltas so far, joined
        self.opened: set[int] = set()  # streaming: prompts whose choices' opening chunks went out

    def _split(self, text: str, finished: bool) -> tuple[str, str | None]:
        """(reasoning, content: None while the reply still reasons) of a reply so far; without a
        reasoning parser it is all content."""
        if self.reasoning is None:
            return "", text
        thought, start = split_reasoning(text, self.reasoning, finished)
        return thought, text[start:] if start is not None else None

    def engine_ids(self, num_prompts: int) -> list[str]:
        return [f"{self.id}-{i}" for i in range(num_prompts)]

    @staticmethod
    def prompt_index(rid: str) -> int:
        return int(rid.rsplit("-", 1)[1])

    def _observe(self, out: Any) -> list[tuple[_Choice, Any]]:
        """Add a DELTA output to the choices' whole outputs so far (`final`, owned here)."""
        pi = self.prompt_index(out.request_id)
        self.prompt_tokens[pi] = len(out.prompt_token_ids or ())
        self.cached_tokens[pi] = getattr(out, "num_cached_tokens", 0)
        if out.prompt_logprobs is not None:
            self.prompt_lps[pi] = (list(out.prompt_token_ids), [self._ids_named(d) for d in out.prompt_logprobs])
        res = []
        for o in out.outputs:
            ci = pi * self.n + o.index
            acc = self.final.get(ci)
            if acc is None:
                acc = self.final[ci] = CompletionOutput(o.index, "", [], None, None)
            acc.text += o.text
            acc.token_ids.extend(o.token_ids)
            if o.logprobs is not None:
                acc.logprobs = acc.logprobs or []
                acc.logprobs.extend(map(self._ids_named, o.logprobs))
            acc.cumulative_logprob, acc.finish_reason, acc.stop_reason = o.cumulative_logprob, o.finish_reason, \
                o.stop_reason
            self.completion_tokens[ci] = 0 if self.prompt_only else len(acc.token_ids)
            res.append((self.choices[ci], acc))
        return res

    def usage(self) -> dict:
        return _usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()),
                      sum(self.cached_tokens.values()))

    def _ids_named(self, entry: dict | None) -> dict | None:
        """A position's logprobs, each token named "token_id:<id>" under return_tokens_as_token_ids."""
        if not self.as_ids or entry is None:
            return entry
        return {t: dataclasses.replace(x, decoded_token=f"token_id:{t}") for t, x in entry.items()}

    def _echo_logprobs(self, ids: list[int], lps: list[Any]) -> dict:
        """The legacy logprobs object of an echoed prompt (its first token without a logprob, as
        OpenAI's and vLLM's), with "end": the text offset after its last token."""
        first = self.detok([ids[0]]) if self.detok is not None and ids else None
        tokens, token_lps, tops, offsets = [], [], [], []
        off = 0
        for i, (tid, entry) in enumerate(zip(ids, lps)):
            if entry is None:
                tok = first if i == 0 and first is not None else _token_str(tid, None)
                token_lps.append(None)
                tops.append(None)
            else:
                lp = entry.get(tid)
                tok = _token_str(tid, lp)
                token_lps.append(_floor(lp.logprob) if lp is not None else _LOGPROB_FLOOR)
                tops.append({_token_str(j, x): _floor(x.logprob) for j, x in _ranked(entry)})
            tokens.append(tok)
            offsets.append(off)
            off += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets,
                "end": off}

    # ---- streaming ----
    def _delta(self, ch: _Choice, o: Any) -> tuple[str, list[int], list[dict] | None, str | None]:
        """New text, new token ids, their logprobs and the finish reason since the last chunk."""
        text = o.text or ""
        finished = o.finish_reason is not None
        safe = len(text) if finished else max(ch.text_sent, min(len(text) - self.holdback,
                                                                 self.tools.stream_prefix_len(text)))
        if safe < ch.text_sent:  # the text shrank (cannot happen with the hold-back): send nothing
            safe = ch.text_sent
        new_text = text[ch.text_sent:safe]
        ch.text_sent = max(ch.text_sent, safe)
        ids = list(o.token_ids[ch.tokens_sent:])
        lps = None
        if self.want_logprobs and o.logprobs is not None:
            lps = list(o.logprobs[ch.tokens_sent:ch.tokens_sent + len(ids)])
        ch.tokens_sent += len(ids)
        return new_text, ids, lps, (o.finish_reason if finished else None)

    def first_chunks(self) -> list[str]:
        """What a stream opens with before any output: nothing here (each prompt's choices open with
        its first output, `_open_chunks`, as vLLM's: so the prompt's token count is known)."""
        return []

    def _open_chunks(self, pi: int) -> list[str]:
        """A prompt's first output came: chat choices open with the assistant role, echoing
        completions with the prompt."""
        self.opened.add(pi)
        cis = range(pi * self.n, (pi + 1) * self.n)
        if self.chat:
            return [_sse(self._chunk(ci, {"role": "assistant", "content": self.chat_echo or ""}, None, None,
                                     opening=True)) for ci in cis]
        if self.echo_texts is None:
            return []
        out = []
        echo = self.echo_texts[pi]
        for ci in cis:
            self.choices[ci].text_offset = len(echo)
            if echo:
                out.append(_sse(self._chunk(ci, echo, None, None, opening=True)))
        return out

    def _chunk(self, index: int, payload: Any, logprobs: Any, finish: str | None, stop_reason: Any = None,
               opening: bool = False) -> dict:
        """One streamed choice. `stop_reason` (vLLM's: the stop string or stop token id that ended
        it) is in every completions chunk and in a chat chunk with a finish_reason, as vLLM sends it.
        The continuous usage is the choice's own: its prompt's tokens and its completion tokens
        (vLLM's per-chunk usage; 0 in the `opening` chunks, before the first tokens' chunk)."""
        if self.chat:
            choice = {"index": index, "delta": payload, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.model, "choices": [choice]}
        else:
            choice = {"index": index, "text": payload, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason}
            out = {"id": self.id, "object": "text_completion", "created": self.created,
                   "model": self.model, "choices": [choice]}
        if self.continuous_usage:
            pi = index // self.n
            out["usage"] = _usage(self.prompt_tokens.get(pi, 0), 0 if opening else self.completion_tokens.get(index, 0),
                                  self.cached_tokens.get(pi, 0))
        return out

    def stream_chunks(self, batch: list[Any]) -> list[str]:
        """The SSE chunks of a batch of DELTA outputs: a prompt's opening chunks with its first
        output, then `_choice_chunks` of each unfinished choice."""
        out = []
        for o in batch:
            pairs = self._observe(o)
            pi = self.prompt_index(o.request_id)
            if pi not in self.opened:
                out += self._open_chunks(pi)
            out += [c for ch, co in pairs if not ch.finished for c in self._choice_chunks(ch, co)]
        return out

    def _choice_chunks(self, ch: _Choice, o: Any) -> list[str]:
        thought = ""
        if self.reasoning is not None:  # the content alone goes on below (a view of the output)
            r, content = self._split(o.text or "", o.finish_reason is not None)
            thought, ch.reasoning_sent = r[ch.reasoning_sent:], max(ch.reasoning_sent, len(r))
            o = dataclasses.replace(o, text=content or "")
        text, ids, lps, finish = self._delta(ch, o)
        if not text and not ids and finish is None and not thought:
            return []
        lp_obj = None
        if lps is not None:
            if self.chat:
                lp_obj = {"content": _chat_logprobs(ids, lps, self.top_logprobs)}
            else:
                lp_obj = _completion_logprobs(ids, lps, ch.text_offset)
                ch.text_offset += sum(len(t) for t in lp_obj["tokens"])
        if self.tools.active:
            payload, finish = self._tool_payload(ch, text, finish, o.text or "")
            if not payload and finish is None and lp_obj is None and not thought:
                return []
        elif not text and finish is None and lp_obj is None and not thought:
            return []
        else:
            payload = ({"content": text} if text or (finish is None and not thought) else {}) if self.chat else text
        if thought:
            payload = {"reasoning": thought, "reasoning_content": thought, **payload}
        ch.finished = finish is not None
        return [_sse(self._chunk(ch.index, payload, lp_obj, finish, o.stop_reason if finish is not None else None))]

    def _tool_payload(self, ch: _Choice, text: str, finish: str | None, whole: str) -> tuple[dict, str | None]:
        """A chat delta when tool calls are on: a named call's arguments as they come (its id and
        name with the first); else the content that may stream, the auto calls' pieces as they come
        (`ToolMode.stream_calls` of the unsent rest of the reply, `whole[text_sent:]`), and at the
        end what is left: the rest of the calls' arguments, or the calls whole, and the content."""
        if self.tools.named is not None:
            if ch.call_id is None:
                call = self.tools.new_call(self.tools.named, text)
                ch.call_id = call["id"]
                return {"tool_calls": [{"index": 0, **call}]}, finish
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish
        payload: dict[str, Any] = {}
        if finish is None:
            if text:
                payload["content"] = text
            deltas = self._call_deltas(ch, self.tools.stream_calls(whole[ch.text_sent:]))
            if deltas:
                payload["tool_calls"] = deltas
            return payload, None
        content, calls = self.tools.parse(text)
        if ch.calls_sent and not calls:
            # the calls streamed so far never became calls (arguments cut off or not JSON): as the
            # non-streamed reply, the text is content and finish_reason the engine's, not
            # "tool_calls"; the broken calls' deltas went out already (tools.py's docstring)
            return ({"content": text} if text else {}), finish
        if ch.calls_sent:  # calls already streaming: the rest of their raw arguments (and any new
            # call), and the content outside them
            calls = self._call_deltas(ch, self.tools.stream_calls(text))
        else:
            calls = [{"index": i, **c} for i, c in enumerate(calls)]
        if content:
            payload["content"] = content
        if calls:
            payload["tool_calls"] = calls
        return payload, ("tool_calls" if (calls or ch.calls_sent) and finish == "stop" else finish)

    def _call_deltas(self, ch: _Choice, partial: list[tuple[str, str]]) -> list[dict]:
        """The tool-call deltas that bring the streamed calls up to `partial` (`stream_calls`): a new
        call's id, type and name with its arguments so far, then each call's arguments as they grow."""
        out = []
        for i, (name, args) in enumerate(partial):
            if i == len(ch.calls_sent):
                ch.calls_sent.append(len(args))
                out.append({"index": i, **self.tools.new_call(name, args)})
            elif len(args) > ch.calls_sent[i]:
                out.append({"index": i, "function": {"arguments": args[ch.calls_sent[i]:]}})
                ch.calls_sent[i] = len(args)
        return out

    def abort_chunks(self) -> list[str]:
        """The last chunk of every unfinished choice: finish_reason "abort" (text held back for
        stop strings is dropped: the request did not finish)."""
        out = []
        for ch in self.choices.values():
            if not ch.finished:
                if ch.index // self.n not in self.opened:
                    out += self._open_chunks(ch.index // self.n)
                ch.finished = True
                out.append(_sse(self._chunk(ch.index, {} if self.chat else "", None, "abort")))
        return out

    def error_event(self, message: str, code: str) -> str:
        """The event that ends a stream whose engine died (then `done_marker`)."""
        return _sse(error_body(message, "server_error", None, code))

    def done_marker(self) -> str:
        """The stream's last line: OpenAI's `data: [DONE]`."""
        return "data: [DONE]\n\n"

    def usage_chunk(self) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}
        return _sse(obj)

    # ---- non-streaming ----
    def response(self) -> dict:
        choices = []
        for ci in sorted(self.choices):
            o = self.final.get(ci)
            text = (o.text if o is not None else "") or ""
            ids = list(o.token_ids) if o is not None else []
            finish = o.finish_reason if o is not None else "abort"
            stop_reason = o.stop_reason if o is not None else None
            if self.prompt_only and o is not None:
                text, ids, finish, stop_reason = "", [], "length", None
            lp_obj = None
            if self.want_logprobs and o is not None and o.logprobs is not None:
                lps = list(o.logprobs[:len(ids)])
                if self.chat:
                    lp_obj = {"content": _chat_logprobs(ids, lps, self.top_logprobs)}
                else:
                    echo = self.echo_texts[ci // self.n] if self.echo_texts is not None else ""
                    if ci // self.n in self.prompt_lps:  # the echoed prompt's own logprobs first
                        lp_obj = self._echo_logprobs(*self.prompt_lps[ci // self.n])
                        gen = _completion_logprobs(ids, lps, lp_obj["end"])
                        lp_obj = {k: lp_obj[k] + gen[k] for k in gen}
                    else:
                        lp_obj = _completion_logprobs(ids, lps, len(echo))
            if self.chat:
                # vLLM's ChatMessage: OpenAI's fields (null where this server has nothing to say),
                # `tool_calls` only when there are calls, and vLLM's `reasoning`
                message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                           "audio": None, "function_call": None}
                thought, text = self._split(text, True)
                message["content"] = text
                if self.tools.active and o is not None and text is not None:
                    message["content"], calls = self.tools.parse(text)
                    if calls:
                        message["tool_calls"] = calls
                        if finish == "stop" and self.tools.named is None:
                            finish = "tool_calls"
                if self.chat_echo:
                    message["content"] = self.chat_echo + (message["content"] or "")
                message["reasoning"] = thought or None
                if self.reasoning is not None:  # (vLLM's older name of the field)
                    message["reasoning_content"] = thought or None
                choices.append({"index": ci, "message": message, "logprobs": lp_obj, "finish_reason": finish,
                                "stop_reason": stop_reason})
            else:
                if self.echo_texts is not None:
                    text = self.echo_texts[ci // self.n] + text
                choices.append({"index": ci, "text": text, "logprobs": lp_obj, "finish_reason": finish,
                                "stop_reason": stop_reason})
                if self.want_prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(ci // self.n)
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
        if self.chat and self.want_prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(0)
        return out

    def _prompt_logprobs(self, pi: int) -> list[dict | None] | None:
        """vLLM's prompt_logprobs format: per prompt token None (the first) or {token id: {"logprob",
        "rank", "decoded_token"}} with the actual token and the top k."""
        if pi not in self.prompt_lps:
            return None
        k = self.want_prompt_logprobs
        out: list[dict | None] = []
        for tid, entry in zip(*self.prompt_lps[pi]):
            if entry is None:
                out.append(None)
                continue
            keep = {i: x for i, x in entry.items() if i == tid or (x.rank is not None and x.rank <= k)}
            out.append({str(i): {"logprob": _floor(x.logprob), "rank": x.rank, "decoded_token": x.decoded_token}
                        for i, x in keep.items()})
        return out


class _ResponsesGeneration(_Generation):
    """/v1/responses: one choice, reported as a Response object (`response()`), or streamed as its
    events (response.created ... response.output_text.delta ... response.completed), each an SSE
    `event:` / `data:` pair with a sequence number, and no `data: [DONE]` (as OpenAI and vLLM). With
    tools, the reply's calls (`ToolMode.parse`) become function_call output items after the message
    (if it has content); streamed, the content streams while no call can be starting, and the calls
    come whole at the end. With a reasoning parser, the reasoning is a `reasoning` item (its text
    a `reasoning_text` part) before the message, streamed as response.reasoning_text.delta events."""

    def __init__(self, req: Any, **kw):
        super().__init__(chat=True, n=1, num_prompts=1, top_logprobs=None, want_logprobs=False, echo_texts=None,
                         **kw)
        self.req = req
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.rs_id = f"rs_{uuid.uuid4().hex}"
        self.seq = 0
        self.created_at = _now()  # (an integer, as OpenAI's and vLLM's)
        self.msg_open = False  # streaming: the message item's added events went out
        self.streamed = ""  # ... and the content its deltas carried
        self.rs_open = False  # streaming: the reasoning item's added event went out
        self.rs_streamed = ""  # ... and the reasoning its deltas carried

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def _items(self, status: str) -> list[dict]:
        """The output items: the reasoning (with a reasoning parser), the assistant message (unless the
        reply is tool calls or reasoning alone), the calls."""
        o = self.final.get(0)
        thought, text = self._split((o.text if o is not None else "") or "", True)
        text = text or ""
        content, calls = self.tools.parse(text) if self.tools.active and o is not None else (text, [])
        items = []
        if thought:
            items.append({"type": "reasoning", "id": self.rs_id, "summary": [], "status": status,
                          "content": [{"type": "reasoning_text", "text": thought}], "encrypted_content": None})
        if content or not (calls or thought):
            part = {"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}
            items.append({"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                          "content": [part]})
        items += [{"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"], "name": c["function"]["name"],
                   "arguments": c["function"]["arguments"], "status": "completed"} for c in calls]
        return items

    def response(self, status: str | None = None) -> dict:
        o = self.final.get(0)
        finish = o.finish_reason if o is not None else "abort"
        if status is None:
            status = "completed" if finish == "stop" else "incomplete"
        r = self.req
        fmt = (r.text or {}).get("format") or {"type": "text"}
        u = self.usage()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" and finish == "length"
            else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": [] if status == "in_progress" else self._items(status),
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "temperature": r.temperature if r.temperature is not None else 1.0,
            "top_p": r.top_p if r.top_p is not None else 1.0, "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [], "text": {"format": fmt}, "truncation": "disabled", "user": r.user,
            "metadata": r.metadata or {},
            "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["total_tokens"],
                      "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def first_chunks(self) -> list[str]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def _open_chunks(self, pi: int) -> list[str]:
        self.opened.add(pi)
        return []  # (the message item opens with its first text: `_open_message`)

    def error_event(self, message: str, code: str) -> str:
        """The Responses API's `error` event."""
        return self._event("error", code=code, message=message, param=None)

    def done_marker(self) -> str:
        return ""  # the Responses API ends with response.completed / incomplete, no [DONE] (as vLLM)

    @property
    def _msg_index(self) -> int:
        return 1 if self.rs_open else 0  # (after the reasoning item, when there is one)

    def _open_message(self) -> list[str]:
        if self.msg_open:
            return []
        self.msg_open = True
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=self._msg_index, item=item),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=self._msg_index,
                            content_index=0, part=part)]

    def _reasoning_delta(self, delta: str) -> list[str]:
        out = []
        if not self.rs_open:
            self.rs_open = True
            item = {"type": "reasoning", "id": self.rs_id, "summary": [], "status": "in_progress", "content": [],
                    "encrypted_content": None}
            out.append(self._event("response.output_item.added", output_index=0, item=item))
        self.rs_streamed += delta
        return out + [self._event("response.reasoning_text.delta", item_id=self.rs_id, output_index=0,
                                  content_index=0, delta=delta)]

    def _choice_chunks(self, ch: _Choice, o: Any) -> list[str]:
        if o.finish_reason is not None:
            self._delta(ch, o)
            ch.finished = True
            return self._done_events()
        out = []
        if self.reasoning is not None:  # the reasoning streams; the content alone goes on below
            thought, content = self._split(o.text or "", False)
            if len(thought) > len(self.rs_streamed) and not self.msg_open:
                out += self._reasoning_delta(thought[len(self.rs_streamed):])
            o = dataclasses.replace(o, text=content or "")
        text, _, _, _ = self._delta(ch, o)
        return out + (self._open_message() + [self._text_delta(text)] if text else [])

    def _text_delta(self, text: str) -> str:
        self.streamed += text
        return self._event("response.output_text.delta", item_id=self.msg_id, output_index=self._msg_index,
                           content_index=0, delta=text, logprobs=[])

    def _done_events(self, status: str | None = None) -> list[str]:
        """The stream's end: the rest of the message's content, each call, the final response."""
        final = self.response(status)
        out = []
        for i, item in enumerate(final["output"]):
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                if text.startswith(self.rs_streamed) and len(text) > len(self.rs_streamed):
                    out += self._reasoning_delta(text[len(self.rs_streamed):])
                out.append(self._event("response.reasoning_text.done", item_id=self.rs_id, output_index=i,
                                       content_index=0, text=text))
            elif item["type"] == "message":
                part = item["content"][0]
                out += self._open_message()
                if part["text"].startswith(self.streamed) and len(part["text"]) > len(self.streamed):
                    out.append(self._text_delta(part["text"][len(self.streamed):]))
                out += [self._event("response.output_text.done", item_id=self.msg_id, output_index=i,
                                    content_index=0, text=part["text"], logprobs=[]),
                        self._event("response.content_part.done", item_id=self.msg_id, output_index=i,
                                    content_index=0, part=part)]
            else:
                out += [self._event("response.output_item.added", output_index=i, item={**item, "arguments": "",
                                                                                        "status": "in_progress"}),
                        self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                    arguments=item["arguments"])]
            out.append(self._event("response.output_item.done", output_index=i, item=item))
        end = {"completed": "response.completed", "incomplete": "response.incomplete"}[final["status"]]
        return out + [self._event(end, response=final)]

    def abort_chunks(self) -> list[str]:
        return [] if self.choices[0].finished else self._done_events("incomplete")


class _BeamRun:
    """`use_beam_search` through the engine loop, shaped like a `Subscription` for `run`: each round
    of the search (`beam_search.BeamSearch`: one-token requests with the top 2n logprobs) is a
    group of engine requests of its own; `updates()` yields, when the search is over, one final
    output per prompt whose n beams are the choices (text without the prompt and a final EOS)."""

    def __init__(self, loop_: EngineLoop, search: BeamSearch, step: SamplingParams, lora: Any,
                 engine_ids: list[str], tokenizer: Any, skip_special_tokens: bool, priority: int = 0,
                 salt: dict | None = None):
        self.loop, self.search, self.step, self.lora, self.priority = loop_, search, step, lora, priority
        self.salt = salt or {}  # {"cache_salt": ...}: the rounds' requests keep the request's salt
        self.engine_ids, self.tok, self.skip = engine_ids, tokenizer, skip_special_tokens
        self.prompts = [b[0].tokens for b in search.live]
        self._sub: Subscription | None = None
        self._rids: list[str] = []
        self._round = 0

    async def start(self) -> None:
        """Queue the first round now: a prompt the engine refuses is then the request's 400."""
        await self._submit(self.search.round())

    async def _submit(self, batch: list[tuple[int, list[int]]]) -> None:
        self._sub = None
        if batch:
            self._rids = [f"{self.engine_ids[0]}-beam{self._round}.{j}" for j in range(len(batch))]
            self._sub = await self.loop.submit([
                (rid, {"prompt_token_ids": t, **self.salt}, self.step, self.lora, self.priority)
                for rid, (_, t) in zip(self._rids, batch)])

    async def updates(self) -> AsyncIterator[list[Any]]:
        while self._sub is not None:
            final: dict[str, Any] = {}
            async for outs in self._sub.updates():
                final.update((o.request_id, o) for o in outs)
            self.search.advance([final[r].outputs[0].logprobs[0] for r in self._rids])
            self._round += 1
            await self._submit(self.search.round())
        outs = []
        for rid, prompt, res in zip(self.engine_ids, self.prompts, self.search.results()):
            choices = []
            for j, b in enumerate(res.sequences):
                new = b.tokens[len(prompt):]
                text = self.tok.decode(new[:-1] if b.finish_reason == "stop" else new,
                                       skip_special_tokens=self.skip) if self.tok is not None else ""
                choices.append(CompletionOutput(j, text, new, b.cum_logprob, None, b.finish_reason))
            outs.append(RequestOutput(rid, None, prompt, None, choices, True))
        yield outs

    def abort(self) -> None:
        if self._sub is not None:
            self._sub.abort()


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, client gone, or cancelled.

    (A generator's own `finally` does not run when the client leaves before it was first pulled.)
    """

    def __init__(self, content: AsyncIterator[str], on_close: Any):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _AccessLog:
    """ASGI middleware: one access-log line per HTTP request once its response has ended.
    Handlers put their request id and `_Generation` (for the token counts) in
    `scope["metrale.access"]`."""

    def __init__(self, app: Any, enabled: bool):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        info: dict[str, Any] = {"status": None}
        scope["metrale.access"] = info

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            level = logging.DEBUG if path in _QUIET_PATHS else logging.INFO
            if access_log.isEnabledFor(level):
                gen = info.get("gen")
                usage = gen.usage() if gen is not None else {"prompt_tokens": 0, "completion_tokens": 0}
                # 499: the client went away before any response (nginx's code for it)
                status = info["status"] if info["status"] is not None else 499
                access_log.log(level, "%s %s %d id=%s prompt_tokens=%d completion_tokens=%d %.3fs",
                               scope.get("method", "-"), path, status, info.get("request_id", "-"),
                               usage["prompt_tokens"], usage["completion_tokens"], time.perf_counter() - t0)


async def _read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise RequestError("invalid Content-Length header", code="invalid_request") from None
        if declared > limit:
            raise RequestError(f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                               status=413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413,
                               code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine: Any, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The FastAPI app serving `engine`. The engine thread starts and stops with the app's lifespan."""
    metrics = ServerMetrics()
    loop_ = EngineLoop(engine, max_waiting=config.max_waiting_requests, metrics=metrics)
    has_ssm = bool(getattr(engine.stats(), "ssm_slots_total", 0))
    metrics.attach_engine(loop_.stats, loop_.num_waiting, has_ssm=has_ssm)
    max_model_len = int(engine.config.max_model_len)
    # the model's generation-config sampling defaults (vLLM's `--generation-config auto`)
    defaults = dict(getattr(engine, "sampling_defaults", None) or {})
    tokenizer = getattr(engine, "tokenizer", None)
    model_name = config.model_names[0]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_.start()
        log.info("serving %s (max_model_len=%d, max_waiting_requests=%d)", model_name, max_model_len,
                 config.max_waiting_requests)
        try:
            yield
        finally:
            app.state.shutting_down = True
            await loop_.stop(config.engine_stop_timeout_s)

    app = FastAPI(title="metrale-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_credentials=config.allow_credentials, allow_methods=list(config.allowed_methods),
                       allow_headers=list(config.allowed_headers))
    app.add_middleware(_AccessLog, enabled=config.log_requests)  # (outermost: preflights are logged too)
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = config
    app.state.shutting_down = False

    def err(status: int, message: str, err_type: str, param: str | None, code: str,
            headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestError)
    async def _on_request_error(_: Request, e: RequestError):
        if e.status == 413:
            metrics.rejected.labels(reason="too_large").inc()
        return err(e.status, e.message, e.err_type, e.param, e.code)

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(_: Request, e: InvalidRequestError):
        return err(400, str(e), "invalid_request_error", None, e.code)

    @app.exception_handler(QueueFullError)
    async def _on_full(_: Request, e: QueueFullError):
        metrics.rejected.labels(reason="queue_full").inc()
        return err(503, f"server overloaded: {e}; retry later", "server_error", None, "queue_full",
                   headers={"Retry-After": str(config.retry_after_s)})

    @app.exception_handler(ServerStoppingError)
    async def _on_stopping(_: Request, e: ServerStoppingError):
        if not isinstance(e, DrainTimeoutError):  # (a drain abort was a running request, not a rejection)
            metrics.rejected.labels(reason="shutting_down").inc()
        return err(503, str(e), "server_error", None, "shutting_down",
                   headers={"Retry-After": str(config.retry_after_s)})

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_: Request, e: EngineDeadError):
        return err(500, str(e), "server_error", None, "engine_dead")

    @app.exception_handler(MetraleError)
    async def _on_metrale(_: Request, e: MetraleError):
        # not a request error (those are InvalidRequestError): a server-side problem, e.g. a load error
        log.error("request failed: %s: %s", type(e).__name__, e)
        return err(500, str(e), "server_error", None, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, e: StarletteHTTPException):
        err_type, code = _HTTP_ERRORS.get(e.status_code, ("invalid_request_error", "invalid_request") if
                                          e.status_code < 500 else ("server_error", "internal_error"))
        return err(e.status_code, str(e.detail), err_type, None, code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _on_any(_: Request, e: Exception):
        log.exception("unhandled error")
        return err(500, f"internal error: {type(e).__name__}", "server_error", None, "internal_error")

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise RequestError("invalid or missing API key", status=401, err_type="authentication_error",
                               code="invalid_api_key")

    loras: dict[str, Any] = {r.lora_name: r for r in config.lora_modules}  # name -> LoRARequest
    lora_ids = itertools.count(max((r.lora_int_id for r in config.lora_modules), default=0) + 1)

    def check_model(name: str | None) -> Any:
        """The request's LoRARequest (None: the base model); 404 for an unknown name."""
        if name is not None and name in loras:
            return loras[name]
        if name is not None and name not in config.model_names:
            raise RequestError(f"the model {name!r} does not exist; this server serves {model_name!r}"
                               + (f" and the LoRA adapters {sorted(loras)}" if loras else ""),
                               param="model", status=404, err_type="not_found_error", code="model_not_found")
        return None

    def served_name(lora: Any) -> str:
        """The `model` responses report: the adapter's name, else the first served name (vLLM's)."""
        return lora.lora_name if lora is not None else model_name

    def check_serving() -> None:
        if app.state.shutting_down or loop_.stopping:
            raise ServerStoppingError("the server is shutting down")

    # ---- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not loop_.alive:
            return err(500, f"engine is not running: {loop_.error!r}", "server_error", None, "engine_dead")
        if app.state.shutting_down:
            return err(503, "shutting down", "server_error", None, "shutting_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        from metrale_jax import __version__

        return {"version": __version__}

    def need_tokenizer(what: str) -> Any:
        if tokenizer is None:
            raise RequestError(f"this model has no tokenizer, so no {what}", code="no_tokenizer")
        return tokenizer

    async def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None,
                          add_special_tokens: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The token ids of a conversation rendered with the chat template (--chat-template's, else
        the model's)."""
        template = config.chat_template
        if tokenizer is None or (template is None and getattr(tokenizer, "chat_template", None) is None):
            raise RequestError("this model has no chat template (serve it with --chat-template); use "
                               "/v1/completions", code="no_chat_template")
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {}),
                 **({"chat_template": template} if template is not None else {})}
        try:
            text = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                           add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
        except Exception as e:  # noqa: BLE001 - jinja2 errors from the model's template are the caller's
            raise RequestError(chat_template_error_message(e), param="messages", code="chat_template_error") from None
        try:  # as apply_chat_template(tokenize=True): the template writes its own special tokens
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:  # noqa: BLE001 - the Rust tokenizer raises bare TypeError / Exception
            raise InvalidPromptError(f"the rendered chat prompt cannot be tokenized: {type(e).__name__}: {e}") from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's endpoint: {"count", "max_model_len", "tokens", "token_strs"} (outside /v1: no API key)."""
        req = parse_request(TokenizeRequest, await _read_body(request, config.max_request_bytes))
        req.check()
        check_model(req.model)
        tok = need_tokenizer("tokenization")
        if req.messages is not None:
            ids = await render_chat(template_messages(req.messages), req.add_generation_prompt is not False,
                                    req.tools, add_special_tokens=bool(req.add_special_tokens),
                                    template_kwargs=req.template_kwargs())
        else:
            try:
                ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))
            except Exception as e:  # noqa: BLE001 - lone surrogates, or what else the tokenizer refuses
                raise InvalidPromptError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}") from None
        strs = None
        if req.return_token_strs:
            convert = getattr(tok, "convert_ids_to_tokens", None)
            strs = list(convert(ids)) if convert else [tok.decode([i], skip_special_tokens=False) for i in ids]
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's endpoint: {"tokens": [...]} -> {"prompt": text}, special tokens kept (no API key)."""
        req = parse_request(DetokenizeRequest, await _read_body(request, config.max_request_bytes))
        check_model(req.model)
        tok = need_tokenizer("detokenization")
        vocab = int(getattr(engine, "vocab_size", 0) or 0)
        bad = [t for t in req.tokens if vocab and t >= vocab]
        if bad:
            raise InvalidPromptError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        created = _now()
        data = [{"id": n, "object": "model", "created": created, "owned_by": "metrale-jax", "root": model_name,
                 "parent": None, "max_model_len": max_model_len} for n in config.model_names]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "metrale-jax", "root": r.lora_path,
                  "parent": model_name, "max_model_len": max_model_len} for n, r in loras.items()]
        return {"object": "list", "data": data}

    async def _lora_body(request: Request) -> dict:
        check_auth(request)
        try:
            body = json.loads(await _read_body(request, config.max_request_bytes))
            if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
                raise ValueError("needs a string 'lora_name'")
        except ValueError as e:
            raise RequestError(f"bad LoRA adapter request: {e}", param="lora_name", code="invalid_json") from None
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """vLLM's endpoint: {"lora_name", "lora_path"}; the adapter is read and checked now."""
        body = await _lora_body(request)
        name, path = body["lora_name"], body.get("lora_path")
        if name in loras or name in config.model_names:
            raise RequestError(f"the LoRA adapter {name!r} is already loaded", param="lora_name",
                               code="lora_already_loaded")
        if not isinstance(path, str) or not path:
            raise RequestError("load_lora_adapter needs a string 'lora_path'", param="lora_path")
        req = LoRARequest(name, next(lora_ids), path, base_model_name=model_name)
        await asyncio.to_thread(check_lora_adapter, engine, req)
        loras[name] = req
        log.info("LoRA adapter %r loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """vLLM's endpoint: {"lora_name"}; requests already running with it finish."""
        body = await _lora_body(request)
        name = body["lora_name"]
        if loras.pop(name, None) is None:
            raise RequestError(f"the LoRA adapter {name!r} is not loaded", param="lora_name", status=404,
                               err_type="not_found_error", code="lora_not_found")
        log.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def run(request: Request, gen: _Generation, sub: Subscription | _BeamRun, stream: bool,
                  include_usage: bool):
        if stream:
            async def events() -> AsyncIterator[str]:
                try:
                    for c in gen.first_chunks():
                        yield c
                    async for batch in sub.updates():
                        for c in gen.stream_chunks(batch):
                            yield c
                    if include_usage:
                        yield gen.usage_chunk()
                except ServerStoppingError:  # the shutdown drain aborted it: end it as an abort
                    for c in gen.abort_chunks():
                        yield c
                    if include_usage:
                        yield gen.usage_chunk()
                except EngineDeadError as e:
                    yield gen.error_event(str(e), "engine_dead")
                finally:
                    sub.abort()  # a no-op once finished; frees everything on disconnect
                if done := gen.done_marker():
                    yield done

            metrics.http_in_flight.inc()
            return _EventStream(events(), on_close=lambda: (sub.abort(), metrics.http_in_flight.dec()))

        async def collect() -> None:
            async for batch in sub.updates():
                for out in batch:
                    gen._observe(out)

        metrics.http_in_flight.inc()
        consumer = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            metrics.http_in_flight.dec()
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            sub.abort()
        if not consumer.done() or consumer.cancelled():
            return Response(status_code=499)  # the client is gone; nobody reads this
        consumer.result()  # re-raises EngineDeadError / ServerStoppingError
        return JSONResponse(gen.response())

    async def submit(request: Request, gen: _Generation, prompts: list[Any], kwargs: dict[str, Any], req: Any,
                     lora: Any = None, beam: bool = False, max_tokens_field: str = "max_tokens"
                     ) -> Subscription | _BeamRun:
        """The engine requests of `gen` queued (`req`: the parsed request); with `beam` a beam search.
        The engine's 400s that concern a field name the request's own: the structured-output
        constraint's (`structured_outputs_param`) and `max_tokens_field` (/v1/responses' is
        max_output_tokens)."""
        try:
            return await _submit(request, gen, prompts, kwargs, req, lora, beam)
        except InvalidStructuredOutputsError as e:
            raise RequestError(str(e), param=req.structured_outputs_param, code=e.code) from None
        except MaxTokensTooLargeError as e:
            msg = str(e) if max_tokens_field == "max_tokens" else str(e).replace("max_tokens", max_tokens_field)
            raise RequestError(msg, param=max_tokens_field, code=e.code) from None

    async def _submit(request: Request, gen: _Generation, prompts: list[Any], kwargs: dict[str, Any], req: Any,
                      lora: Any, beam: bool) -> Subscription | _BeamRun:
        priority = req.priority or 0
        access = request.scope.get("metrale.access")
        if access is not None:
            access["request_id"] = gen.id
            access["gen"] = gen
        if beam:
            if len(prompts) * kwargs["n"] > loop_.max_waiting:  # (each round has n requests a prompt)
                raise BatchTooLargeError(f"a beam search of {len(prompts)} prompt(s) with n={kwargs['n']} runs "
                                         f"{len(prompts) * kwargs['n']} engine requests at once, more than this "
                                         f"server's bound of {loop_.max_waiting} waiting requests "
                                         f"(--max-waiting-requests)")
            ids = []
            for p in prompts:
                if isinstance(p, dict) and "prompt_token_ids" in p:
                    ids.append(list(p["prompt_token_ids"]))
                elif tokenizer is None:
                    raise RequestError("this model has no tokenizer: send token ids", param="prompt")
                else:
                    ids.append(list(tokenizer.encode(p["prompt"] if isinstance(p, dict) else p)))
            bp = req.beam_search_params(kwargs, max_model_len, max(map(len, ids)))
            step = step_params(bp, engine.config.max_logprobs).clone(output_kind=RequestOutputKind.FINAL_ONLY)
            eos = tuple(getattr(engine, "eos_token_ids", ()) or getattr(tokenizer, "eos_token_ids", ()))
            run_ = _BeamRun(loop_, BeamSearch(ids, bp, eos, max_model_len), step, lora, gen.engine_ids(len(ids)),
                            tokenizer, kwargs["skip_special_tokens"], priority, cache_salt(prompts[0]))
            await run_.start()
            return run_
        params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)  # _Generation joins them
        reqs = [(rid, p, params, lora, priority) for rid, p in zip(gen.engine_ids(len(prompts)), prompts)]
        return await loop_.submit(reqs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        check_serving()
        body = await _read_body(request, config.max_request_bytes)
        req = parse_request(CompletionRequest, body)
        lora = check_model(req.model)
        kwargs = req.to_sampling_params_kwargs(max_model_len, defaults)
        prompts = req.prompts()
        if req.add_special_tokens is False and tokenizer is not None:  # text prompts encoded without BOS
            prompts = [p if isinstance(p, dict) else
                       {"prompt_token_ids": await asyncio.to_thread(tokenizer.encode, p, add_special_tokens=False),
                        "prompt": p} for p in prompts]
        if req.cache_salt is not None:
            prompts = [{**p, "cache_salt": req.cache_salt} if isinstance(p, dict) else
                       {"prompt": p, "cache_salt": req.cache_salt} for p in prompts]
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else p.get("prompt") if p.get("prompt") is not None else
                    (tokenizer.decode(p["prompt_token_ids"]) if tokenizer else "") for p in prompts]
        gen = _Generation(chat=False, request_id=f"cmpl-{uuid.uuid4().hex}", model=served_name(lora),
                          n=kwargs["n"], num_prompts=len(prompts), holdback=_holdback(kwargs),
                          top_logprobs=req.logprobs, want_logprobs=req.logprobs is not None, echo_texts=echo,
                          extras=_Extras.of(req),
                          detok=(lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None)
        sub = await submit(request, gen, prompts, kwargs, req, lora, beam=bool(req.use_beam_search))
        return await run(request, gen, sub, bool(req.stream), req.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        check_serving()
        body = await _read_body(request, config.max_request_bytes)
        req = parse_request(ChatCompletionRequest, body)
        lora = check_model(req.model)
        tools, schemas = tool_mode(req.tool_choice, req.tools, config.tool_call_parser)
        parallel_calls = req.parallel_tool_calls is not False
        kwargs = req.to_sampling_params_kwargs(max_model_len, tools.constraint(schemas, parallel_calls), defaults)
        ids = await render_chat(req.template_messages(), req.add_generation_prompt is not False, req.tools,
                                template_kwargs=req.template_kwargs())
        gen = _Generation(chat=True, request_id=f"chatcmpl-{uuid.uuid4().hex}", model=served_name(lora),
                          n=kwargs["n"], num_prompts=1, holdback=_holdback(kwargs),
                          top_logprobs=req.top_logprobs, want_logprobs=bool(req.logprobs), echo_texts=None,
                          tools=tools, extras=_Extras.of(req), reasoning=config.reasoning_parser,
                          chat_echo=req.echo_text())
        salt = {"cache_salt": req.cache_salt} if req.cache_salt is not None else {}
        sub = await submit(request, gen, [{"prompt_token_ids": list(ids), **salt}], kwargs, req, lora,
                           beam=bool(req.use_beam_search), max_tokens_field="max_completion_tokens"
                           if req.max_completion_tokens is not None else "max_tokens")
        return await run(request, gen, sub, bool(req.stream), req.include_usage)

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API for text (`ResponsesRequest`): the conversation through the chat
        template, one output message; nothing is stored (`store` is accepted and ignored)."""
        check_auth(request)
        check_serving()
        req = parse_request(ResponsesRequest, await _read_body(request, config.max_request_bytes))
        lora = check_model(req.model)
        messages = req.template_messages()
        tools, schemas = tool_mode(req.chat_tool_choice(), req.chat_tools(), config.tool_call_parser)
        kwargs = req.to_sampling_params_kwargs(
            max_model_len, tools.constraint(schemas, req.parallel_tool_calls is not False), defaults)
        ids = await render_chat(messages, req.add_generation_prompt is not False, req.chat_tools(),
                                template_kwargs=req.template_kwargs())
        gen = _ResponsesGeneration(req, request_id=f"resp_{uuid.uuid4().hex}", model=served_name(lora),
                                   holdback=_holdback(kwargs), extras=_Extras.of(req), tools=tools,
                                   reasoning=config.reasoning_parser)
        salt = {"cache_salt": req.cache_salt} if req.cache_salt is not None else {}
        sub = await submit(request, gen, [{"prompt_token_ids": list(ids), **salt}], kwargs, req, lora,
                           max_tokens_field="max_output_tokens")
        return await run(request, gen, sub, bool(req.stream), False)

    return app


_HTTP_ERRORS = {  # Starlette's own HTTP errors: status -> (type, code)
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
}


def check_lora_adapter(engine: Any, req: Any) -> None:
    """Read and check a LoRA adapter against the engine's slots without touching the engine's
    state (the engine thread owns it): raises a LoRAError when it cannot be served."""
    from metrale_jax.errors import LoRANotEnabledError
    from metrale_jax.lora.adapter import load_peft_adapter

    mgr = getattr(engine, "lora", None)
    if mgr is None:
        raise LoRANotEnabledError("this server's engine was started without --enable-lora")
    load_peft_adapter(req.lora_path, mgr.spec, mgr.dtype, req.lora_int_id, req.lora_name)


def _holdback(kwargs: dict[str, Any]) -> int:
    stop = kwargs.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not stops or kwargs.get("include_stop_str_in_output"):
        return 0
    return max(len(s) for s in stops) - 1
