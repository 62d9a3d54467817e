"""OpenAI tool calling for /v1/chat/completions, as vLLM serves it.

`tools` reach the chat template (`apply_chat_template(tools=...)`), and `tool_choice` decides how the
reply becomes `tool_calls`:

    "none"                  plain text (the template still sees the tools, as in vLLM's default)
    {"type": "function", "function": {"name": N}}
                            the reply is constrained to the JSON schema of N's `parameters` and
                            returned as one call of N (finish_reason "stop", as OpenAI does)
    "required"              the reply is constrained to a JSON array of {"name", "parameters"}
                            objects, one of the tools each (one item when parallel_tool_calls is
                            false), returned as calls (finish_reason "tool_calls")
    "auto" (the default when tools are given)
                            free text that the server's tool-call parser (`--tool-call-parser`,
                            with `--enable-auto-tool-choice`) splits into content and calls:
                            "hermes" (Qwen2.5/3, Hermes: `<tool_call>{"name", "arguments"}</tool_call>`)
                            or "llama3_json" (Llama 3.1-3.3: `{"name", "parameters"}` objects, `;`
                            between them, after an optional `<|python_tag|>`); without a parser,
                            "auto" is a 400 as in vLLM

Streaming: a named call streams its arguments as they are generated; "required" and "auto" calls
come whole in one delta each once the reply ends (text before an auto reply's first call streams
as content as it comes).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from metrale_jax.server.protocol import RequestError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def new_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def check_tools(tools: Any) -> dict[str, dict]:
    """The request's `tools` -> {name: its `parameters` schema}; a 400 naming the bad entry."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list of {'type': 'function', 'function': {...}}",
                           param="tools")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                               param=f"tools[{i}]")
        name, params = fn.get("name"), fn.get("parameters")
        if params is None:  # a function without arguments
            params = {"type": "object", "properties": {}}
        if not isinstance(name, str) or not name:
            raise RequestError("a function needs a non-empty string name", param=f"tools[{i}].function.name")
        if name in out:
            raise RequestError(f"two tools are named {name!r}", param=f"tools[{i}].function.name")
        if not isinstance(params, dict):
            raise RequestError("function parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters")
        out[name] = params
    return out


@dataclass(frozen=True)
class ToolMode:
    """How one request's replies become tool calls: `named` (a forced function's name), `required`,
    or `parser` (the "auto" parser's name); all None: plain text."""

    named: str | None = None
    required: bool = False
    parser: str | None = None

    @property
    def active(self) -> bool:
        return self.named is not None or self.required or self.parser is not None

    def constraint(self, schemas: dict[str, dict], parallel: bool) -> dict | None:
        """The JSON schema the reply is constrained to (None: unconstrained)."""
        if self.named is not None:
            return schemas[self.named]
        if not self.required:
            return None
        one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"]} for n, p in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
        return schema if parallel else {**schema, "maxItems": 1}

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply -> (content, tool calls); a reply that does not parse stays content."""
        if self.named is not None:
            return None, [new_call(self.named, text)]
        if self.required:
            try:
                items = json.loads(text)
                return None, [new_call(it["name"], it["parameters"]) for it in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        if self.parser == "hermes":
            return _parse_hermes(text)
        if self.parser == "llama3_json":
            return _parse_llama3_json(text)
        return text, []

    def stream_prefix_len(self, text: str) -> int:
        """How much of the reply so far can stream: auto replies up to where a tool call starts
        or could be starting, a named call's arguments all, a required reply nothing."""
        if self.parser == "hermes":
            at = text.find(_HERMES_OPEN)
            if at >= 0:
                return at
            for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_call>" at the end
                if _HERMES_OPEN.startswith(text[-k:]):
                    return len(text) - k
            return len(text)
        if self.parser == "llama3_json":
            head = text.lstrip()
            if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                return 0
            return len(text)
        return 0 if self.required else len(text)  # a named call streams its arguments as they come


def tool_mode(tool_choice: Any, tools: Any, parser: str | None) -> tuple[ToolMode, dict[str, dict]]:
    """The request's (tool_choice, tools) -> (ToolMode, {name: parameters}); 400s as vLLM's."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return ToolMode(), {}
    schemas = check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolMode(), schemas
    if choice == "required":
        return ToolMode(required=True), schemas
    if choice == "auto":
        if parser is None:
            raise RequestError('"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                               'and --tool-call-parser', param="tool_choice", code="unsupported_value")
        return ToolMode(parser=parser), schemas
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise RequestError("tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if fn["name"] not in schemas:
        raise RequestError(f"tool_choice names {fn['name']!r}, which is not among the tools", param="tool_choice")
    return ToolMode(named=fn["name"]), schemas


# ---- parsers -------------------------------------------------------------------------------------
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _as_call(obj: Any, args_key: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return new_call(obj["name"], args)


def _parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    calls, content, pos = [], [], 0
    while (start := text.find(_HERMES_OPEN, pos)) >= 0:
        end = text.find(_HERMES_CLOSE, start)
        body = text[start + len(_HERMES_OPEN):end if end >= 0 else len(text)]
        try:
            call = _as_call(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:  # not a call after all: the rest stays text
            break
        content.append(text[pos:start])
        calls.append(call)
        pos = len(text) if end < 0 else end + len(_HERMES_CLOSE)
    content.append(text[pos:])
    rest = "".join(content).strip()
    return (rest or None) if calls else text, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    dec, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = dec.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _as_call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls
