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
                            "hermes" (Qwen2.5/3, Hermes: `<tool_call>{"name", "arguments"}</tool_call>`),
                            "llama3_json" (Llama 3.1-3.3: `{"name", "parameters"}` objects, `;`
                            between them, after an optional `<|python_tag|>`), "pythonic" (Llama
                            3.2 / 4: `[f(a=1), g(b="x")]`, a Python list of calls with literal
                            keyword arguments, optionally inside `<|python_start|>`..`<|python_end|>`)
                            or "mistral" (`[TOOL_CALLS]` then a JSON array of {"name", "arguments"},
                            or, from tokenizer v11, `name[ARGS]{...}` per call; the control token is
                            dropped when special tokens are skipped, so a reply that is such an
                            array alone parses too); without a parser, "auto" is a 400 as in vLLM

Streaming: a named call streams its arguments as they are generated; so do "auto" calls in the
JSON formats (hermes, llama3_json, mistral), as vLLM's parsers do: each call's id and name once
its `{"name": ..., "arguments":` head has come, then its arguments' text as it grows (text before
the first call streams as content); pythonic and "required" calls come whole when the reply ends.
A streamed call can turn out not to be one: cut off (`{"city": "Par`) or not JSON. The non-streamed
reply then is the raw text as content with the engine's finish_reason ("stop", "length"); the
stream agrees as far as it can: its last chunk carries the rest of the raw text (from the call on)
as content and the engine's finish_reason, never "tool_calls". The broken call's id, name and
argument pieces went out already and cannot be taken back: a client should trust tool_calls only
with finish_reason "tool_calls".
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from metrale_jax.server.protocol import RequestError
from metrale_jax.server.reasoning import partial_tag_len

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")


def _call_id(short: bool = False) -> str:
    # short: 9 alphanumerics, the only ids Mistral's chat templates accept when a conversation
    # carries the calls back (vLLM makes them so for Mistral models too)
    return uuid.uuid4().hex[:9] if short else f"chatcmpl-tool-{uuid.uuid4().hex}"


def new_call(name: str, arguments: Any, short_id: bool = False) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": _call_id(short_id), "type": "function", "function": {"name": name, "arguments": args}}


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
    short_ids: bool = False  # Mistral's 9-character call ids (the server's parser is "mistral")

    @property
    def active(self) -> bool:
        return self.named is not None or self.required or self.parser is not None

    def new_call(self, name: str, arguments: Any) -> dict:
        return new_call(name, arguments, self.short_ids)

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

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        """A whole reply -> (content, tool calls); a reply that does not parse stays content."""
        if self.named is not None:
            return None, [self.new_call(self.named, text)]
        if self.required:
            try:
                items = json.loads(text)
                return None, [self.new_call(it["name"], it["parameters"]) for it in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        parse = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json, "pythonic": _parse_pythonic,
                 "mistral": _parse_mistral}.get(self.parser)
        if parse is None:
            return text, []
        content, calls = parse(text)
        return content, [self.new_call(name, args) for name, args in calls]

    def stream_prefix_len(self, text: str) -> int:
        """How much of the reply so far can stream: auto replies up to where a tool call starts
        or could be starting, a named call's arguments all, a required reply nothing."""
        if self.parser in ("hermes", "mistral"):  # text before the first call's opening tag
            tag = _HERMES_OPEN if self.parser == "hermes" else _MISTRAL_TAG
            if self.parser == "mistral" and (not text.strip() or text.lstrip().startswith("[")):
                return 0  # a bare array (the control token skipped when decoding) may be coming
            at = text.find(tag)
            return at if at >= 0 else len(text) - partial_tag_len(text, tag)  # (less a partial tag at the end)
        if self.parser in ("llama3_json", "pythonic"):  # the whole reply is calls, or none of it is
            head = text.lstrip()
            opens = ("{", _PYTHON_TAG) if self.parser == "llama3_json" else ("[", _PYTHON_START)
            if not head or head.startswith(opens) or any(o.startswith(head) for o in opens):
                return 0
            return len(text)
        return 0 if self.required else len(text)  # a named call streams its arguments as they come

    def stream_calls(self, region: str) -> list[tuple[str, str]]:
        """Calls of an auto reply's unsent part so far, for streaming: (name, the raw text of its
        arguments so far), in order; [] where the format streams no calls."""
        if self.parser not in ("hermes", "llama3_json", "mistral"):
            return []
        calls, pos = [], 0
        while m := (_CALL_HEAD.search(region, pos) or
                    (_MISTRAL_V11_HEAD.search(region, pos) if self.parser == "mistral" else None)):
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                break
            start = m.end()
            end = _value_end(region, start)
            calls.append((name, region[start:len(region) if end is None else end]))
            if end is None:
                break
            pos = end
        return calls


def tool_mode(tool_choice: Any, tools: Any, parser: str | None) -> tuple[ToolMode, dict[str, dict]]:
    """The request's (tool_choice, tools) -> (ToolMode, {name: parameters}); 400s as vLLM's."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return ToolMode(), {}
    schemas = check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    short = parser == "mistral"
    if choice == "none":
        return ToolMode(), schemas
    if choice == "required":
        return ToolMode(required=True, short_ids=short), schemas
    if choice == "auto":
        if parser is None:
            raise RequestError('"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                               'and --tool-call-parser', param="tool_choice", code="unsupported_value")
        return ToolMode(parser=parser, short_ids=short), schemas
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise RequestError("tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if fn["name"] not in schemas:
        raise RequestError(f"tool_choice names {fn['name']!r}, which is not among the tools", param="tool_choice")
    return ToolMode(named=fn["name"], short_ids=short), schemas


# ---- parsers -------------------------------------------------------------------------------------
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_MISTRAL_TAG, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# a streamed call's head: `{"name": "...", "arguments" | "parameters":` (the JSON formats), or
# Mistral v11's `[TOOL_CALLS]name[ARGS]` before its arguments object
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_FN_NAME = r"[A-Za-z0-9_.-]+"  # OpenAI's function names: letters, digits, _ and - (and . as vLLM allows)
_MISTRAL_V11_HEAD = re.compile(r"\[TOOL_CALLS\]\s*(" + _FN_NAME + r")\s*(?:\[ARGS\])?\s*(?=\{)")


def _value_end(s: str, i: int) -> int | None:
    """The end of the JSON value that starts at s[i] (None: not ended yet): the closing bracket
    or quote of an object, array or string, the delimiter after a number or literal."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return j + 1 if depth == 0 else j
        elif depth == 0 and c in ", \t\r\n;":
            return j
    return None


# The parsers: a whole reply -> (content, [(name, arguments)]), the calls made by `ToolMode.parse`
def _as_call(obj: Any, args_key: str) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))


def _parse_hermes(text: str) -> tuple[str | None, list[tuple[str, Any]]]:
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


def _parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, Any]]]:
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


def _literal(node: ast.AST) -> Any:
    """A keyword argument's value: a Python literal, or JSON's true / false / null as names."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _parse_pythonic(text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for c in tree.elts:
            if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name) or c.args or \
                    any(kw.arg is None for kw in c.keywords):
                return text, []
            args = {kw.arg: _literal(kw.value) for kw in c.keywords}
            calls.append((c.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))  # JSON or raise
    except (SyntaxError, ValueError, TypeError, RecursionError):  # (the model's text: anything may come)
        return text, []
    return None, calls


def _parse_mistral(text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    at = text.find(_MISTRAL_TAG)
    if at < 0 and not text.lstrip().startswith("["):
        return text, []
    content = text[:at].strip() if at >= 0 else ""
    parts = [p.strip() for p in (text[at:].split(_MISTRAL_TAG) if at >= 0 else [text])]
    calls = []
    for part in filter(None, parts):
        if part.startswith(("[", "{")):  # a JSON array (or one object) of {"name", "arguments"}
            try:
                obj, end = json.JSONDecoder().raw_decode(part)
            except ValueError:
                return text, []
            got = [_as_call(o, "arguments") for o in (obj if isinstance(obj, list) else [obj])]
            if part[end:].strip() or not got or None in got:
                return text, []
            calls += got
            continue
        name, sep, args = part.partition(_MISTRAL_ARGS)  # tokenizer v11: name[ARGS]{...}
        if not sep:
            name, brace, rest = part.partition("{")
            args = brace + rest
        try:
            arguments = json.loads(args)
        except ValueError:
            return text, []
        if not re.fullmatch(_FN_NAME, name.strip()) or not isinstance(arguments, dict):
            return text, []
        calls.append((name.strip(), arguments))
    return (content or None, calls) if calls else (text, [])
