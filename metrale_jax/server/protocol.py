"""OpenAI request schemas (pydantic) and their mapping to `SamplingParams`.

Requests are parsed in pydantic's lax mode, as vLLM parses them: a numeric string where a number
belongs (`"temperature": "0.5"`) and an integral float where an integer belongs (`"max_tokens": 5.0`)
are taken, as are the usual spellings of a bool ("true", 1). Two protections of the old strict mode
stay: token ids are strict integers (`TokenId`), so a list of numeric strings never becomes token ids
(`"prompt": ["1", "2"]` is two text prompts, and `["1", 2]` is a 400, where vLLM would make it the
token ids [1, 2]); and a bool where a number belongs is a 400 (`_Base._no_bool_numbers`: vLLM takes
`"max_tokens": true` as 1; OpenAI refuses it, and so do we). Unknown fields are kept (`extra="allow"`)
and only logged, as vLLM does. Ranges are checked here, so the error names the offending field
(`param`); the engine checks them again. A value that fits none of a union's forms (`prompt`,
`stop`, `input`, ...) is reported by the form it came closest to (`parse_request`).

Responses are plain dicts built in `app.py`; their shapes follow the OpenAI API reference.
"""

from __future__ import annotations

import functools
import json
import logging
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from metrale_jax.errors import InvalidRequestError, InvalidStructuredOutputsError
from metrale_jax.structured_output import StructuredOutputsParams

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
# The most top logprobs a request may ask for (OpenAI's chat limit; the engine may allow fewer).
MAX_TOP_LOGPROBS = 20
MAX_N = 64
MAX_STOP_STRINGS = 32

TokenId = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]  # strict: no "5", 5.0 or true
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class RequestError(InvalidRequestError):
    """A request the server rejects with a 4xx status. `param` names the field, when one is at fault;
    `code` is a snake_case string (the table in app.py's docstring)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 err_type: str = "invalid_request_error", code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type
        self.code = code


def error_body(message: str, err_type: str, param: str | None, code: str) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: Any) -> Any:
        """A bool where a number belongs is a 400 (lax mode would take true as 1)."""
        if isinstance(v, bool) and info.field_name in _numeric_fields(cls):
            raise PydanticCustomError("bool_not_number", "Input should be a number, not a boolean")
        return v

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Names of fields the schema does not know, here and in nested models."""
        out = [prefix + k for k in (self.model_extra or {})]
        for name in type(self).model_fields:
            v = getattr(self, name)
            items = v if isinstance(v, list) else [v]
            for i, item in enumerate(items):
                if isinstance(item, _Base):
                    sub = f"{prefix}{name}[{i}]." if isinstance(v, list) else f"{prefix}{name}."
                    out.extend(item.unknown_fields(sub))
        return out


def _is_number(tp: Any) -> bool:
    """Whether a field's annotation is a number (int or float, maybe Annotated or in a union)."""
    if typing.get_origin(tp) is Annotated:
        return _is_number(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_number(a) for a in typing.get_args(tp))
    return tp in (int, float)


@functools.cache
def _numeric_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(n for n, f in cls.model_fields.items() if _is_number(f.annotation))


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: the usage so far in every chunk


class JsonSchemaFormat(_Base):
    """OpenAI's `response_format.json_schema`: {"name", "description", "schema", "strict"}. The schema is
    always enforced (`strict` or not), as vLLM does."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: str
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural-tag response format: {"type": "structural_tag", "structures", "triggers"}
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


# vLLM's `structured_outputs` request field: StructuredOutputsParams' fields
_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "whitespace_pattern",
              "disable_additional_properties", "structural_tag")


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions, with vLLM's extras."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras.
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: Annotated[list[str], Field(max_length=1024)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    return_tokens_as_token_ids: bool | None = False  # logprobs' tokens as "token_id:<id>"
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # prefix-cache sharing only with this salt
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = 0  # scheduling_policy "priority": lower first
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    use_beam_search: bool | None = False  # n beams a prompt (metrale_jax/beam_search.py)
    length_penalty: Annotated[float, Field(ge=-100.0, le=100.0)] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # the request field the structured-output constraint came from (`structured_outputs_param`)
    _so_param: str | None = PrivateAttr(default=None)

    @property
    def structured_outputs_param(self) -> str | None:
        """The field that set the request's structured-output constraint (response_format,
        structured_outputs, a guided_* field, tools, text.format), named in the 400 when the engine
        cannot compile it; None before `to_sampling_params_kwargs` or without one."""
        return self._so_param

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request sets (400 when it sets several)."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None:
            if rf.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise RequestError("response_format of type json_schema needs json_schema.schema",
                                       param="response_format.json_schema")
                given.append(("response_format", {"json": rf.json_schema.schema_}))
            elif rf.type == "structural_tag":
                tag = {"type": "structural_tag", "structures": rf.structures, "triggers": rf.triggers}
                given.append(("response_format", {"structural_tag": tag}))
            elif rf.type != "text":
                raise RequestError(f"response_format type {rf.type!r} is not supported (text, json_object, "
                                   "json_schema, structural_tag)", param="response_format.type",
                                   code="unsupported_value")
        if self.structured_outputs is not None:
            bad = sorted(set(self.structured_outputs) - set(_SO_FIELDS))
            if bad:
                raise RequestError(f"structured_outputs: unsupported fields {bad} (supported: {list(_SO_FIELDS)})",
                                   param="structured_outputs", code="unsupported_parameter")
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            v = getattr(self, name)
            if v is not None:
                given.append((name, {key: v}))
        if len(given) > 1:
            raise RequestError(f"set one structured-output constraint, not {' and '.join(n for n, _ in given)}",
                               param=given[1][0], code="invalid_structured_outputs")
        if not given:
            return None
        param, kw = given[0]
        self._so_param = param
        if self.guided_whitespace_pattern is not None:
            kw.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        try:
            return StructuredOutputsParams(**kw)
        except InvalidStructuredOutputsError as e:
            raise RequestError(str(e), param=param, code=e.code) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias (token ids as strings) with integer keys; values in [-100, 100]."""
        if not self.logit_bias:
            return None
        try:
            bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias keys must be token ids", param="logit_bias") from None
        odd = [(k, v) for k, v in bias.items() if not -100 <= v <= 100]
        if odd:
            raise RequestError(f"logit_bias {odd[0][0]}: {odd[0][1]:g} must be in [-100, 100]", param="logit_bias")
        return bias

    def _common_checks(self) -> None:
        so = self.stream_options
        if so is not None and not self.stream and (so.model_fields_set or so.model_extra):
            # vLLM's check and message (an empty object passes, as in vLLM)
            raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs does not stream", param="prompt_logprobs",
                               code="unsupported_parameter")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        for s in stops:
            if not s:
                raise RequestError("stop strings must be non-empty", param="stop")

    def _sampling_kwargs(self, max_tokens: int | None, max_model_len: int, logprobs: int | None,
                         defaults: dict[str, Any] | None) -> dict[str, Any]:
        """SamplingParams keyword arguments; `max_tokens` None means "up to max_model_len". A
        max_tokens that does not fit beside the prompt is the engine's 400 (context_length_exceeded),
        never silently capped. `defaults`: the engine's request defaults (the model's generation
        config, `LLMEngine.sampling_defaults`) for the sampling fields the request leaves unset, as
        vLLM's server applies them: temperature, top_p, top_k, min_p, repetition_penalty, and
        max_tokens when no max-tokens field is given."""
        self._common_checks()
        d = defaults or {}
        given = "max_tokens" in self.model_fields_set or any(
            getattr(self, f, None) is not None for f in ("max_completion_tokens", "max_output_tokens"))
        if "max_tokens" in d and not given:
            max_tokens = d["max_tokens"]
        min_tokens = self.min_tokens or 0
        if min_tokens > (max_tokens if max_tokens is not None else max_model_len):
            raise RequestError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})",
                               param="min_tokens")
        return dict(
            n=self.n if self.n is not None else 1,
            temperature=self.temperature if self.temperature is not None else d.get("temperature", 1.0),
            top_p=self.top_p if self.top_p is not None else d.get("top_p", 1.0),
            top_k=self.top_k if self.top_k is not None else d.get("top_k", 0),
            min_p=self.min_p if self.min_p is not None else d.get("min_p", 0.0),
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else d.get(
                "repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            seed=self.seed,
            logprobs=logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            structured_outputs=self._structured_outputs(),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words else None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self._logit_bias(),
        )

    def beam_search_params(self, kwargs: dict[str, Any], max_model_len: int, prompt_len: int):
        """use_beam_search: vLLM's BeamSearchParams (n beams; max_tokens None = up to the context),
        or a 400 for the fields beam search does not take (it ranks by raw logprobs and ends at EOS)."""
        from metrale_jax.beam_search import BeamSearchParams

        unsupported = [("logprobs", kwargs["logprobs"] is not None), ("stop", bool(kwargs["stop"])),
                       ("stop_token_ids", bool(kwargs["stop_token_ids"])), ("min_tokens", kwargs["min_tokens"] > 0),
                       ("structured outputs", kwargs["structured_outputs"] is not None),
                       ("presence_penalty", kwargs["presence_penalty"] != 0),
                       ("frequency_penalty", kwargs["frequency_penalty"] != 0),
                       ("repetition_penalty", kwargs["repetition_penalty"] != 1),
                       ("logit_bias", bool(kwargs["logit_bias"])),
                       ("prompt_logprobs", kwargs["prompt_logprobs"] is not None),
                       ("allowed_token_ids", kwargs["allowed_token_ids"] is not None),
                       ("bad_words", bool(kwargs["bad_words"]))]
        bad = [name for name, given in unsupported if given]
        if bad:
            raise RequestError(f"use_beam_search does not take {', '.join(bad)}", param="use_beam_search",
                               code="unsupported_parameter")
        max_tokens = kwargs["max_tokens"] if kwargs["max_tokens"] is not None else max_model_len - prompt_len
        return BeamSearchParams(beam_width=kwargs["n"], max_tokens=max(1, max_tokens), ignore_eos=kwargs["ignore_eos"],
                                length_penalty=1.0 if self.length_penalty is None else self.length_penalty)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1)] | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                                                    Field(min_length=1)]
    # 0 with echo: score the prompt only (its logprobs with `logprobs`), generate nothing
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True  # vLLM's: False encodes a text prompt without BOS
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | dict]:
        """The prompts as the engine takes them: strings or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        return [{"prompt_token_ids": list(x)} for x in p]

    def to_sampling_params_kwargs(self, max_model_len: int, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError("best_of must equal n (or be omitted)", param="best_of", code="unsupported_value")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens=0 generates nothing; it needs echo (to score the prompt)",
                               param="max_tokens")
        if self.stream and (self.max_tokens == 0 or (self.echo and self.logprobs is not None)):
            raise RequestError("echo with logprobs, or max_tokens=0, does not stream", param="stream",
                               code="unsupported_parameter")
        kwargs = self._sampling_kwargs(1 if self.max_tokens == 0 else self.max_tokens, max_model_len, self.logprobs,
                                       defaults)
        if self.echo and self.logprobs is not None:  # the prompt's logprobs too (the legacy API's scoring)
            kwargs["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return kwargs

    @property
    def prompt_only(self) -> bool:
        """max_tokens=0 with echo: the one token the engine generates is not returned."""
        return self.max_tokens == 0


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self, where: str) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise RequestError(f"only text content parts are supported, got type {part.type!r}",
                                   param=f"{where}.content[{j}]", code="unsupported_value")
            if part.text is None:
                raise RequestError(f"{where}.content[{j}]: a text content part needs a string `text`",
                                   param=f"{where}.content[{j}].text")
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM extras.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False  # the reply prefixed with the last message when it has the reply's role

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def echo_text(self) -> str | None:
        """vLLM's chat `echo`: the last message's text when it has the reply's role (the assistant's,
        or with add_generation_prompt false, the last message's own), else None."""
        if not self.echo:
            return None
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt is not False else last.role
        return last.text(f"messages[{len(self.messages) - 1}]") if last.role == role else None

    def template_kwargs(self) -> dict[str, Any]:
        return chat_template_kwargs(self)

    def to_sampling_params_kwargs(self, max_model_len: int, tool_schema: dict | None = None,
                                  defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """`tool_schema`: the JSON schema a forced tool call constrains the reply to (tools.py);
        `defaults`: the engine's request defaults (`_sampling_kwargs`)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kwargs = self._sampling_kwargs(max_tokens, max_model_len, logprobs, defaults)
        if tool_schema is not None:
            if kwargs["structured_outputs"] is not None:
                raise RequestError("a forced tool_choice cannot be combined with another structured-output "
                                   "constraint", param="tool_choice", code="invalid_structured_outputs")
            try:
                kwargs["structured_outputs"] = StructuredOutputsParams(json=tool_schema)
            except InvalidStructuredOutputsError as e:
                raise RequestError(f"tools: {e}", param="tools", code=e.code) from None
            self._so_param = "tools"
        return kwargs


class TokenizeRequest(_Base):
    """POST /tokenize (vLLM's): `prompt`, or chat `messages` rendered as /v1/chat/completions
    renders them. add_special_tokens defaults to true for a prompt and false for messages (the
    chat template writes its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    tools: list[Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give either 'prompt' or 'messages'", param="prompt")

    def template_kwargs(self) -> dict[str, Any]:
        return chat_template_kwargs(self)


class DetokenizeRequest(_Base):
    """POST /detokenize (vLLM's): token ids -> {"prompt": text} (special tokens kept)."""

    model: str | None = None
    tokens: list[TokenId]


# what a request's chat_template_kwargs may not set: the renderer's own arguments, and the
# template itself (a request-supplied template is what vLLM guards with a server flag)
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                                       "continue_final_message", "chat_template"})


def chat_template_kwargs(req: Any) -> dict[str, Any]:
    """The extra keyword arguments of a request's chat-template rendering (vLLM's
    chat_template_kwargs, e.g. Qwen3's {"enable_thinking": false}, and continue_final_message)."""
    kw = dict(req.chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS & set(kw))
    if bad:
        raise RequestError(f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs")
    if req.continue_final_message:
        if req.add_generation_prompt is not False:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true (set "
                               "add_generation_prompt to false)", param="continue_final_message")
        kw["continue_final_message"] = True
    return kw


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: text content joined, the tool-call keys kept."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text(f"messages[{i}]")}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        out.append(d)
    return template_tool_calls(out)


def template_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier assistant tool calls as chat templates read them: each call's `arguments` JSON
    string parsed to a dict (as vLLM passes them; templates write them with `tojson`)."""
    for m in messages:
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
    return messages


def parse_request[T: _Base](model: type[T], body: bytes) -> T:
    """Parse a JSON body; raise RequestError (400) naming the first bad field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = errors[0]
        if err.get("type") == "json_invalid":
            raise RequestError(f"malformed JSON: {err.get('msg')}", code="invalid_json") from None
        if err.get("type") == "model_type" and not err.get("loc"):
            raise RequestError("the request body must be a JSON object", code="invalid_json") from None
        loc, msg = _union_error(errors) or (_loc(err.get("loc", ())), str(err.get("msg")))
        msg = msg.replace(" after validation", "")  # (pydantic's wording for a list's length)
        raise RequestError(f"{loc}: {msg}" if loc else msg, param=loc or None) from None
    unknown = req.unknown_fields()
    if unknown:
        # (as vLLM warns of them; each name once per process, so that a client's habit does not
        # fill the log)
        new = [u for u in unknown if u not in _WARNED_FIELDS]
        _WARNED_FIELDS.update(new)
        (log.warning if new else log.debug)("ignoring request fields this server does not know: %s",
                                            ", ".join(unknown))
    return req


_WARNED_FIELDS: set[str] = set()


def _loc(loc: tuple) -> str:
    return ".".join(str(x) for x in loc if not _is_union_tag(x))


def _is_type_error(kind: str) -> bool:
    """A value of the wrong form for a union member (as opposed to the right form out of range)."""
    return kind.endswith(("_type", "_parsing")) or kind == "int_from_float"


def _union_error(errors: list[dict]) -> tuple[str, str] | None:
    """(param, message) for a value that fits none of a union's members (pydantic reports one error
    per member, the first usually "should be a valid string"): the deepest error that is not about
    the value's JSON type, i.e. the member the value came closest to (`prompt: [-1]`: the token id
    out of range); when every member refused the value's type, the members the field takes. None
    when the first error is not inside a union."""
    first = errors[0].get("loc", ())
    at = next((i for i, x in enumerate(first) if _is_union_tag(x)), None)
    if at is None:
        return None
    field = first[:at]
    same = [er for er in errors if er.get("loc", ())[:at] == field and len(er.get("loc", ())) > at
            and _is_union_tag(er["loc"][at])]
    near = [er for er in same if not _is_type_error(er.get("type", ""))]
    if near:
        best = max(near, key=lambda er: len(er["loc"]))  # (max keeps the first of equals)
        return _loc(best["loc"]), str(best.get("msg"))
    forms = list(dict.fromkeys(_describe(er["loc"][at]) for er in same))
    return _loc(field), "expected " + (", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else forms[0])


_NOUNS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _noun(tag: str) -> str:
    tag = tag.removeprefix("constrained-")
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _noun(tag[5:-1])
        return "array of " + (inner.replace("array", "arrays", 1) if inner.startswith("array") else inner + "s")
    return _NOUNS.get(tag, "object")  # dict[...] and models


def _describe(tag: str) -> str:
    """A union member's pydantic tag as words: 'list[constrained-int]' -> 'an array of integers'."""
    noun = _noun(tag)
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _is_union_tag(x: Any) -> bool:
    """pydantic puts union member names ('str', 'list[int]', 'constrained-int') into error locations."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or "[" in x or x.startswith(
        ("constrained-", "function-", "list[", "dict[", "is-instance")))


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses (OpenAI's Responses API, text in and out): `input` a string or a list of
    items: messages ({"role", "content": str | [{"type": "input_text" | "output_text", "text"}]}),
    earlier `function_call`s and their `function_call_output`s; `instructions` a system message
    first; `text.format` a structured-output constraint; function `tools` as on the chat endpoint
    (`chat_tools`). Stored responses (`previous_response_id`) are 400s: nothing is stored."""

    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    # (vLLM's chat extras, as on /v1/chat/completions)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it."""
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id is not supported: responses are not stored; send the "
                               "conversation in `input`", param="previous_response_id", code="unsupported_parameter")
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind == "function_call":  # an earlier call: the assistant's tool_calls (consecutive ones joined)
                if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                    raise RequestError(f"{where}: a function_call needs string call_id, name and arguments",
                                       param=where)
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                continue
            if kind == "function_call_output":
                if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                    raise RequestError(f"{where}: a function_call_output needs string call_id and output",
                                       param=where)
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
                continue
            role, content = item.get("role"), item.get("content")
            if kind != "message" or role not in ("system", "developer", "user", "assistant"):
                raise RequestError(f"{where}: only messages with a role system, developer, user or assistant are "
                                   f"supported (type {item.get('type', 'message')!r}, role {role!r})", param=where,
                                   code="unsupported_value")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                            or not isinstance(part.get("text"), str):
                        raise RequestError("only input_text / output_text content parts are supported",
                                           param=f"{where}.content[{j}]", code="unsupported_value")
                    texts.append(part["text"])
                content = "\n".join(texts)
            if not isinstance(content, str):
                raise RequestError(f"{where}.content must be a string or a list of text parts",
                                   param=f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return template_tool_calls(out)

    def chat_tools(self) -> list[dict] | None:
        """The Responses API's function tools ({"type": "function", "name", "description",
        "parameters"}) in the chat endpoint's form; other tool types are 400s."""
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise RequestError("only function tools are supported", param=f"tools[{i}]",
                                   code="unsupported_value")
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                         if k in t}})
        return out

    def chat_tool_choice(self) -> Any:
        """tool_choice in the chat endpoint's form ({"type": "function", "name"} nests its name)."""
        c = self.tool_choice
        if isinstance(c, dict) and c.get("type") == "function" and "name" in c:
            return {"type": "function", "function": {"name": c["name"]}}
        return c

    def template_kwargs(self) -> dict[str, Any]:
        return chat_template_kwargs(self)

    def to_sampling_params_kwargs(self, max_model_len: int, tool_schema: dict | None = None,
                                  defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """`tool_schema`: a forced tool call's JSON schema (tools.py), as on the chat endpoint."""
        for name, given in (("n", (self.n or 1) != 1), ("use_beam_search", bool(self.use_beam_search))):
            if given:
                raise RequestError(f"/v1/responses makes one output; {name} is for the chat endpoint", param=name,
                                   code="unsupported_parameter")
        kwargs = self._sampling_kwargs(self.max_output_tokens, max_model_len, None, defaults)
        if tool_schema is not None:
            if kwargs["structured_outputs"] is not None:
                raise RequestError("a forced tool_choice cannot be combined with another structured-output "
                                   "constraint", param="tool_choice", code="invalid_structured_outputs")
            kwargs["structured_outputs"] = StructuredOutputsParams(json=tool_schema)
            self._so_param = "tools"
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError("text.format.type must be text, json_object or json_schema", param="text.format",
                               code="unsupported_value")
        if fmt["type"] != "text":
            if kwargs["structured_outputs"] is not None:
                raise RequestError("set one structured-output constraint", param="text.format",
                                   code="invalid_structured_outputs")
            if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
                raise RequestError("text.format of type json_schema needs a schema", param="text.format.schema")
            try:
                kwargs["structured_outputs"] = StructuredOutputsParams(
                    **({"json_object": True} if fmt["type"] == "json_object" else {"json": fmt["schema"]}))
            except InvalidStructuredOutputsError as e:
                raise RequestError(str(e), param="text.format", code=e.code) from None
            self._so_param = "text.format"
        return kwargs
