"""OpenAI tool calling on /v1/chat/completions (metrale_jax/server/tools.py): the parsers on their
own, then the wire format against the fake engine replying with scripted text. The constrained
("required" and named) calls through a real model are in test_structured_output.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server_support import FakeEngine, FakeTokenizer, sse_events

from metrale_jax.server import BackgroundServer, ServerConfig
from metrale_jax.server.reasoning import split_reasoning
from metrale_jax.server.tools import ToolMode, tool_mode

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


# ---- parsers --------------------------------------------------------------------------------------
def test_hermes_parser():
    mode = ToolMode(parser="hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
    content, calls = mode.parse(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # a call cut off before its closing tag still parses when its JSON is whole; a broken one stays text
    assert mode.parse('<tool_call>{"name": "get_time", "arguments": {}}')[1][0]["function"]["name"] == "get_time"
    assert mode.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert mode.parse("no calls here") == ("no calls here", [])
    # streaming: content up to a call, or up to what could still become "<tool_call>"
    assert mode.stream_prefix_len("Hi <tool_call>{") == 3
    assert mode.stream_prefix_len("Hi <tool") == 3
    assert mode.stream_prefix_len("Hi <b>") == 6
    assert mode.stream_prefix_len("a < b") == 5


def test_llama3_json_parser():
    mode = ToolMode(parser="llama3_json")
    content, calls = mode.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                '{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"},
                                                                                             {"tz": "UTC"}]
    assert mode.parse("The weather is fine.") == ("The weather is fine.", [])
    assert mode.parse('{"city": "Oslo"}') == ('{"city": "Oslo"}', [])  # JSON, but not a call
    assert mode.stream_prefix_len("  {") == 0 and mode.stream_prefix_len("<|python") == 0
    assert mode.stream_prefix_len("Sure") == 4


def _named_args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_pythonic_parser():
    mode = ToolMode(parser="pythonic")
    content, calls = mode.parse('[get_weather(city="Oslo", unit=\'C\'), get_time(tz="UTC"), '
                                'search(q="x", opts={"n": 2, "tags": ["a", None]}, strict=true)]')
    assert content is None and _named_args(calls) == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"tz": "UTC"}),
        ("search", {"q": "x", "opts": {"n": 2, "tags": ["a", None]}, "strict": True})]
    assert _named_args(mode.parse('<|python_start|>[get_time(tz="CET")]<|python_end|>')[1]) == [
        ("get_time", {"tz": "CET"})]
    assert _named_args(mode.parse("[get_time()]")[1]) == [("get_time", {})]
    for text in ("The answer is [1, 2].", "[get_time(\"CET\")]",  # not calls: positional args, plain lists
                 "[get_time(tz=now())]", "[os.system(cmd='x')]", "[get_time(tz=", "[]", "[f(**kw)]",
                 "[f(a=1e999)]", "[f(a={1, 2})]", "[f(a=b'x')]", "[" * 300 + "]" * 300):  # no JSON for these
        assert mode.parse(text) == (text, []), text
    assert mode.stream_prefix_len(" [get_") == 0 and mode.stream_prefix_len("<|python") == 0
    assert mode.stream_prefix_len("Sure") == 4


def test_mistral_parser():
    mode = ToolMode(parser="mistral")
    array = '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {"tz": "X"}}]'
    for text in ("[TOOL_CALLS]" + array, array, "[TOOL_CALLS] " + array + " "):
        content, calls = mode.parse(text)
        assert content is None and _named_args(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "X"})]
    # tokenizer v11: name[ARGS]{...} per call, and text before the first call is content
    content, calls = mode.parse('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
                                '[TOOL_CALLS]get_time{"tz": "X"}')
    assert content == "Let me look." and _named_args(calls) == [("get_weather", {"city": "Rome"}),
                                                                 ("get_time", {"tz": "X"})]
    assert _named_args(mode.parse('[TOOL_CALLS]get-time_2[ARGS]{}')[1]) == [("get-time_2", {})]
    for text in ("No calls.", "[TOOL_CALLS][{broken", "[TOOL_CALLS]get weather{}", "[1, 2]",
                 '[TOOL_CALLS]{"name": "f", "arguments": {}} trailing'):
        assert mode.parse(text) == (text, []), text
    assert mode.stream_prefix_len("Hi [TOOL") == 3 and mode.stream_prefix_len("Hi [TOOL_CALLS][") == 3
    assert mode.stream_prefix_len(' [{"name"') == 0 and mode.stream_prefix_len("Hi [b]") == 6
    assert mode.stream_prefix_len(" ") == 0  # (what follows may be an array)


def test_mistral_servers_make_short_call_ids():
    for choice, reply in [({"type": "function", "function": {"name": "get_time"}}, '{"tz": "UTC"}'),
                          ("required", '[{"name": "get_time", "parameters": {"tz": "UTC"}}]'),
                          ("auto", '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]')]:
        (call,) = tool_mode(choice, TOOLS, "mistral")[0].parse(reply)[1]
        assert len(call["id"]) == 9 and call["id"].isalnum(), (choice, call)
    assert tool_mode("required", TOOLS, "hermes")[0].parse('[{"name": "get_time", "parameters": {}}]')[1][0][
        "id"].startswith("chatcmpl-tool-")


def test_tool_choice_modes_and_constraints():
    named, schemas = tool_mode({"type": "function", "function": {"name": "get_time"}}, TOOLS, None)
    assert named.constraint(schemas, True) == TOOLS[1]["function"]["parameters"]
    assert named.parse('{"tz": "UTC"}')[1][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    req, schemas = tool_mode("required", TOOLS, None)
    schema = req.constraint(schemas, True)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {"tz": "X"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"tz": "X"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call at most
        jsonschema.validate(good, req.constraint(schemas, False))
    assert [c["function"]["name"] for c in req.parse(json.dumps(good))[1]] == ["get_weather", "get_time"]
    assert req.parse("[oops") == ("[oops", [])
    assert tool_mode(None, TOOLS, "hermes")[0] == ToolMode(parser="hermes")  # "auto" when tools are given
    assert tool_mode("none", TOOLS, "hermes")[0] == ToolMode() and not ToolMode().active
    assert tool_mode(None, None, None)[0] == ToolMode()
    no_args = [{"type": "function", "function": {"name": "now", "parameters": None}}]
    assert tool_mode("required", no_args, None)[1] == {"now": {"type": "object", "properties": {}}}


# ---- the server, the fake engine replying with a script ------------------------------------------
class _ToolTokenizer(FakeTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kw):
        self.calls.append({"messages": messages, **kw})
        text = "".join(f"[{m['role']}]{m.get('content') or ''}{json.dumps(m.get('tool_calls') or '')}"
                       for m in messages) + json.dumps(kw.get("tools") or "")[:40]
        return self.encode(text) if tokenize else text


def _server(parser: str | None, reasoning: str | None = None):
    eng = FakeEngine(max_model_len=4096, max_num_seqs=4, step_delay_s=0.002)
    eng.tokenizer = _ToolTokenizer()
    return eng, BackgroundServer(eng, ServerConfig(model_names=("m",), tool_call_parser=parser,
                                                   reasoning_parser=reasoning))


@pytest.fixture(scope="module")
def auto():
    eng, srv = _server("hermes")
    with srv:
        yield eng, srv


@pytest.fixture(scope="module")
def plain():
    eng, srv = _server(None)
    with srv:
        yield eng, srv


def _chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "max_tokens": 400, **body}, timeout=30)


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                      json={"model": "m", "max_tokens": 400, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]


def _call_pieces(events: list[dict]) -> list[tuple[int, bool, str]]:
    """A stream's tool-call deltas in order: (index, whether it carries the id and name, arguments)."""
    return [(tc["index"], "id" in tc, tc.get("function", {}).get("arguments") or "") for e in events
            for c in e["choices"] for tc in c["delta"].get("tool_calls") or ()]


def _joined_calls(events: list[dict]) -> tuple[str, list[dict], str]:
    """A stream's content, its tool-call deltas joined per index (as the openai client does), and
    the finish reason."""
    content, calls, finish = "", {}, None
    for e in events:
        for ch in e["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or ():
                c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.get("id") or c["id"]
                c["name"] = tc.get("function", {}).get("name") or c["name"]
                c["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = ch["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parser,script", [
    ("pythonic", '[get_weather(city="Paris", unit="C")]'),
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]'),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'),  # tokenizer v11
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'),
])
def test_auto_pythonic_mistral_llama3_calls(parser, script):
    eng, srv = _server(parser)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with srv:
        eng.script = script
        ch = _chat(srv.url, {"messages": msgs, "tools": TOOLS}).json()["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and _named_args(ch["message"]["tool_calls"]) == [
            ("get_weather", {"city": "Paris", "unit": "C"})]
        # Mistral's templates take back only 9-character alphanumeric call ids
        short = parser == "mistral"
        assert all((len(c["id"]) == 9 and c["id"].isalnum()) == short for c in ch["message"]["tool_calls"])
        events = _stream(srv.url, {"messages": msgs, "tools": TOOLS})
        content, calls, finish = _joined_calls(events)
        assert content.strip() == (ch["message"]["content"] or "") and "[" not in content and finish == "tool_calls"
        # the JSON formats' calls stream piece by piece, pythonic ones come whole at the end
        assert (len(_call_pieces(events)) > 5) == (parser != "pythonic")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris",
                                                                                               "unit": "C"})]
        assert all((len(c["id"]) == 9) == short for c in calls)


def test_auto_hermes_calls(auto):
    eng, auto = auto
    eng.script = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                  '</tool_call>')
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = _chat(auto.url, {"messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Checking."
    (call,) = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert eng.tokenizer.calls[-1]["tools"] == TOOLS  # the template saw the tools
    # streamed: the content comes before the call, never a piece of the tag
    content, calls, finish = _joined_calls(_stream(auto.url, {"messages": msgs, "tools": TOOLS}))
    assert content.strip() == "Checking." and "<" not in content and finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather"] and json.loads(calls[0]["arguments"])["city"] == "Paris"
    # the calls stream as they are generated: id and name first, then the arguments piece by piece,
    # before the last chunk; two calls in order
    eng.script = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
                  '<tool_call>{"name": "get_time", "arguments": {"tz": "CE\\"T"}}</tool_call>')
    events = _stream(auto.url, {"messages": msgs, "tools": TOOLS})
    pieces = _call_pieces(events)
    assert [i for i, head, _ in pieces if head] == [0, 1] and sum(i == 0 for i, _, _ in pieces) > 5
    last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][0]
    assert not last["choices"][0]["delta"].get("tool_calls")  # every piece came before the end
    content, calls, finish = _joined_calls(events)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": 'CE"T'})]
    # a call whose JSON breaks after it started streaming (cut off): not a call, as the non-streamed
    # reply says (its raw text as content, finish_reason "stop", not "tool_calls"); the pieces that
    # went out already stand
    eng.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    ch = _chat(auto.url, {"messages": msgs, "tools": TOOLS}).json()["choices"][0]
    assert ch["message"]["content"] == eng.script and "tool_calls" not in ch["message"]
    assert ch["finish_reason"] == "stop"
    content, calls, finish = _joined_calls(_stream(auto.url, {"messages": msgs, "tools": TOOLS}))
    assert (content, finish) == (eng.script, "stop")
    assert [c["name"] for c in calls] == ["get_weather"] and '{"city": "Par'.startswith(calls[0]["arguments"])
    # a reply without calls is plain content, streamed or not
    eng.script = "It is sunny <b>today</b>."
    ch = _chat(auto.url, {"messages": msgs, "tools": TOOLS}).json()["choices"][0]
    assert ch["message"] == {"role": "assistant", "content": eng.script, "refusal": None, "annotations": None,
                             "audio": None, "function_call": None, "reasoning": None}  # (vLLM's fields)
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] is None
    assert _joined_calls(_stream(auto.url, {"messages": msgs, "tools": TOOLS})) == (eng.script, [], "stop")


def test_named_and_required_wire_format(plain):
    eng, plain = plain
    eng.script = '{"tz": "UTC"}'
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    ch = _chat(plain.url, body).json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["content"] is None
    assert ch["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    events = _stream(plain.url, body)
    content, calls, finish = _joined_calls(events)
    assert content == "" and finish == "stop" and len(calls) == 1 and calls[0]["id"]
    assert calls[0]["name"] == "get_time" and calls[0]["arguments"] == eng.script
    # the arguments streamed as they came: more than one delta carried them
    assert sum(bool(tc.get("function", {}).get("arguments")) for e in events for c in e["choices"]
               for tc in c["delta"].get("tool_calls") or ()) > 1
    eng.script = json.dumps([{"name": "get_weather", "parameters": {"city": "Rome"}},
                             {"name": "get_time", "parameters": {"tz": "CET"}}])
    body["tool_choice"] = "required"
    ch = _chat(plain.url, body).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ch["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]
    content, calls, finish = _joined_calls(_stream(plain.url, body))
    assert content == "" and finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "get_time"]
    # with the openai client, and a conversation that carries the call and its result back
    client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=body["messages"], tools=TOOLS, tool_choice="required")
    msg = r.choices[0].message
    assert [tc.function.name for tc in msg.tool_calls] == ["get_weather", "get_time"]
    eng.script = "It is 20 C in Rome."
    history = [*body["messages"], msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "20 C"}]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == eng.script and not r.choices[0].message.tool_calls
    seen = eng.tokenizer.calls[-1]["messages"]
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # a dict for the template
    assert seen[2] == {"role": "tool", "content": "20 C", "tool_call_id": msg.tool_calls[0].id}


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # no parser on this server
    ({}, "tool_choice"),  # "auto" is the default when tools are given
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(plain, body, param):
    eng, plain = plain
    eng.script = "x"
    r = _chat(plain.url, {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _chat(plain.url, {"messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_parser_names_are_checked_at_start():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="xlam")
    from metrale_jax.server.cli import serve_main

    args = type("Args", (), {"log_level": "warning", "enable_auto_tool_choice": True, "tool_call_parser": None})()
    with pytest.raises(ValueError, match="--tool-call-parser"):
        serve_main(args)  # before anything loads


def test_responses_api_function_calls(auto):
    """/v1/responses with function tools (the Responses API's flat form), through the official
    client: the hermes calls become function_call items after the message, streamed whole at the
    end; earlier calls and their outputs in `input` reach the template as tool_calls and tool
    messages; a named tool_choice forces the call."""
    eng, srv = auto
    tools = [{"type": "function", **t["function"]} for t in TOOLS]  # (the Responses API's flat form)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    eng.script = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                  '</tool_call>')
    r = client.responses.create(model="m", input="Weather in Paris?", tools=tools, max_output_tokens=400)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Checking."
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris", "unit": "C"} and fc.call_id
    assert eng.tokenizer.calls[-1]["tools"] == TOOLS  # the template saw them in the chat form
    events = list(client.responses.create(model="m", input="Weather in Paris?", tools=tools, max_output_tokens=400,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.strip() == "Checking." and "<" not in deltas
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.type for d in done] == ["message", "function_call"] and done[1].name == "get_weather"
    assert events[-1].type == "response.completed"
    # the call and its output sent back: an assistant message with tool_calls, then a tool message
    eng.script = "It is 20 C."
    r = client.responses.create(model="m", tools=tools, max_output_tokens=400, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": fc.call_id, "name": "get_weather", "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "20 C"}])
    assert r.output_text == "It is 20 C." and [o.type for o in r.output] == ["message"]
    sent = eng.tokenizer.calls[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}  # parsed for templates
    assert sent[2] == {"role": "tool", "tool_call_id": fc.call_id, "content": "20 C"}
    eng.script = '{"tz": "CET"}'
    r = client.responses.create(model="m", input="Time?", tools=tools, max_output_tokens=400,
                                tool_choice={"type": "function", "name": "get_time"})
    assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "get_time"
    r = httpx.post(srv.url + "/v1/responses", json={"model": "m", "input": "x", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"


# ---- reasoning parsers (vLLM's --reasoning-parser) -------------------------------------------------


def test_split_reasoning():
    """<think> ... </think> then content; qwen3 reasons only in a reply that opens with <think>,
    deepseek_r1 from the start; unfinished text keeps back what may become a tag."""
    done = "<think>\nplan it</think>\n\nThe answer."
    for parser in ("qwen3", "deepseek_r1"):
        r, start = split_reasoning(done, parser, True)
        assert (r, done[start:]) == ("\nplan it", "\n\nThe answer.")
        assert split_reasoning("<think>half way", parser, True) == ("half way", None)  # (cut off)
        assert split_reasoning("<think>half </th", parser, False) == ("half ", None)  # (may be </think>)
        assert split_reasoning("<thi", parser, False) == ("", None)  # (may be <think>)
    assert split_reasoning("plain answer", "qwen3", True) == ("", 0)  # (thinking off: content)
    r, start = split_reasoning("plan</think>Answer", "deepseek_r1", True)  # (the prompt opened it)
    assert (r, start) == ("plan", len("plan</think>"))
    assert split_reasoning("no end yet", "deepseek_r1", True) == ("no end yet", None)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_on_the_wire(parser):
    """The message's `reasoning` (and vLLM's older `reasoning_content`) and its content, streamed
    and not; tool calls only in the content; replies that do not reason are content."""
    eng, srv = _server("hermes", parser)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with srv:
        eng.script = "<think>\nThe user wants <tool_call> weather.\n</think>\n\nIt is sunny."
        ch = _chat(srv.url, {"messages": msgs}).json()["choices"][0]
        m = ch["message"]
        assert m["reasoning"] == m["reasoning_content"] == "\nThe user wants <tool_call> weather.\n"
        assert m["content"] == "\n\nIt is sunny." and ch["finish_reason"] == "stop"
        events = _stream(srv.url, {"messages": msgs})
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == m["reasoning"]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == m["content"]
        assert sum(bool(d.get("reasoning")) for d in deltas) > 5  # (streamed as it is generated; the joins
        # above hold no piece of <think> or </think>)
        # a call after the reasoning is a tool call; the <tool_call> inside the reasoning was not
        eng.script = ('<think>call the tool</think><tool_call>\n{"name": "get_weather", "arguments": '
                      '{"city": "Paris"}}\n</tool_call>')
        ch = _chat(srv.url, {"messages": msgs, "tools": TOOLS}).json()["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["reasoning"] == "call the tool"
        assert _named_args(ch["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
        events = _stream(srv.url, {"messages": msgs, "tools": TOOLS})
        content, calls, finish = _joined_calls(events)
        assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"] and not content.strip()
        assert "".join(c["delta"].get("reasoning") or "" for e in events for c in e["choices"]) == "call the tool"
        # no <think>: qwen3's reply is content, deepseek_r1's is reasoning
        eng.script = "Just sunny."
        m = _chat(srv.url, {"messages": msgs}).json()["choices"][0]["message"]
        want = (None, "Just sunny.") if parser == "qwen3" else ("Just sunny.", None)
        assert (m["reasoning"], m["content"]) == want
        deltas = [c["delta"] for e in _stream(srv.url, {"messages": msgs}) for c in e["choices"]]
        assert ("".join(d.get("reasoning") or "" for d in deltas) or None,
                "".join(d.get("content") or "" for d in deltas) or None) == want
        # the Responses API (the official client): a reasoning item before the message
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        eng.script = "<think>\nweigh it\n</think>\n\nIt is sunny."
        r = client.responses.create(model="m", input="Weather?", max_output_tokens=400)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "\n\nIt is sunny."
        assert r.output[0].content[0].text == "\nweigh it\n"
        events = list(client.responses.create(model="m", input="Weather?", max_output_tokens=400, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nweigh it\n"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nIt is sunny."
        assert sum(e.type == "response.reasoning_text.delta" for e in events) > 3
        added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
        done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
        assert added == done == [(0, "reasoning"), (1, "message")]
        assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
        assert events[-1].type == "response.completed" and [o.type for o in events[-1].response.output] == [
            "reasoning", "message"]
        eng.script = "Just sunny."  # (qwen3: no reasoning item; deepseek_r1: reasoning only)
        r = client.responses.create(model="m", input="Weather?", max_output_tokens=400)
        assert [o.type for o in r.output] == (["message"] if parser == "qwen3" else ["reasoning"])
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="nope")
