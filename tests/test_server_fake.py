"""Server logic against a deterministic fake engine (tests/test_server_support.py): wire formats,
stop-string hold-back, n > 1, logprobs, errors and fuzzing, API key, backpressure, cancellation,
engine failure and SIGTERM. Fast: no model, no compilation. The real engine is in test_server.py."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_support import FakeEngine, FakeTokenizer, expected_fake_text, fake_continuation, sse_events

from metrale_jax.server import BackgroundServer, ServerConfig

MODEL = "fake-model"


@pytest.fixture(scope="module")
def fake():
    eng = FakeEngine(max_num_seqs=4, step_delay_s=0.001)
    cfg = ServerConfig(model_names=(MODEL, "alias"), max_waiting_requests=64, max_request_bytes=32 << 10)
    with BackgroundServer(eng, cfg) as srv:
        yield srv, eng


@pytest.fixture(scope="module")
def http(fake):
    with httpx.Client(base_url=fake[0].url, timeout=30) as c:
        yield c


def metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def stream_post(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def ids_of(text: str) -> list[int]:
    return FakeTokenizer().encode(text)


def test_completion_stream_and_not_agree(http, fake):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 11, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    j = r.json()
    want = expected_fake_text(ids_of("Hello there"), 0, 11)
    assert j["object"] == "text_completion" and j["model"] == MODEL
    assert j["choices"][0]["text"] == want and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"] == {"prompt_tokens": 11, "completion_tokens": 11, "total_tokens": 22,
                          "prompt_tokens_details": {"cached_tokens": 0}}

    # steps of 20 ms, so that a loaded machine's server still sends each token as it comes (at 1
    # ms, chunks coalesced under a full test run on 2 cores: 4 instead of >= 5, session 23)
    eng = fake[1]
    saved, eng.step_delay_s = eng.step_delay_s, 0.02
    try:
        ev = stream_post(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    finally:
        eng.step_delay_s = saved
    assert ev[-1] == "[DONE]"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"] == j["usage"]
    chunks = ev[:-2]
    assert len(chunks) >= 5  # really streamed, not one lump
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_stop_string_is_never_streamed(http):
    ids = ids_of("stop me")
    full = expected_fake_text(ids, 0, 40)
    stop = full[9:12]  # a 3-character stop string first seen after a few tokens
    first = full.find(stop)
    assert first >= 3
    body = {"model": MODEL, "prompt": "stop me", "max_tokens": 40, "stop": ["zzzz", stop], "temperature": 0}
    j = http.post("/v1/completions", json=body).json()
    assert j["choices"][0]["text"] == full[:first] and j["choices"][0]["finish_reason"] == "stop"
    ev = stream_post(http, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == full[:first]
    # include_stop_str_in_output keeps it (and then nothing needs holding back)
    j = http.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert j["choices"][0]["text"] == full[:first + len(stop)]


def test_n_and_several_prompts(http):
    prompts = ["first prompt", "2nd"]
    body = {"model": "alias", "prompt": prompts, "n": 3, "max_tokens": 6, "seed": 5}
    j = http.post("/v1/completions", json=body).json()
    assert j["model"] == MODEL  # the first served name, whichever one the request used (vLLM's)
    assert [c["index"] for c in j["choices"]] == list(range(6))
    for c in j["choices"]:
        p, i = divmod(c["index"], 3)
        assert c["text"] == expected_fake_text(ids_of(prompts[p]), i, 6)
    assert j["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert j["usage"]["completion_tokens"] == 36
    ev = stream_post(http, "/v1/completions", {**body, "stream": True})
    texts = {}
    for c in ev[:-1]:
        ch = c["choices"][0]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {c["index"]: c["text"] for c in j["choices"]}
    # token-id prompts, single and batched
    j = http.post("/v1/completions", json={"prompt": [[5, 6, 7], [9]], "max_tokens": 3}).json()
    assert j["choices"][0]["text"] == expected_fake_text([5, 6, 7], 0, 3)
    assert j["choices"][1]["text"] == expected_fake_text([9], 0, 3)
    j = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "echo": True}).json()
    assert j["choices"][0]["text"] == FakeTokenizer().decode([5, 6, 7]) + expected_fake_text([5, 6, 7], 0, 3)


def test_tokenize_detokenize_version(http):
    """vLLM's /tokenize (a prompt, or messages through the chat template), /detokenize and /version."""
    tok = FakeTokenizer()
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 96 and body["token_strs"] == [tok.decode([i]) for i in body["tokens"]]
    assert http.post("/tokenize", json={"prompt": "x"}).json()["token_strs"] is None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = http.post("/tokenize", json={"messages": msgs}).json()
    assert body["tokens"] == tok.encode("[system]be brief[user]hi[assistant]")  # as /v1/chat/completions renders
    body = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert body["tokens"] == tok.encode("[system]be brief[user]hi")
    r = http.post("/detokenize", json={"tokens": tok.encode("round trip")})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(tok.encode("round trip"))}
    kept = http.post("/detokenize", json={"tokens": [1, 5]}).json()["prompt"]  # special tokens kept
    assert kept == "<s>" + tok.decode([5])
    v = http.get("/version").json()["version"]
    assert isinstance(v, str) and v
    for path, body, status, param, code in [
            ("/tokenize", {"prompt": "a", "messages": msgs}, 400, "prompt", "invalid_value"),
            ("/tokenize", {}, 400, "prompt", "invalid_value"),
            ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model", "model_not_found"),
            ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "chat_template_error"),
            ("/detokenize", {"tokens": [3, 64]}, 400, None, "invalid_prompt"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "invalid_value"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens", "invalid_value")]:
        r = http.post(path, json=body)
        err = r.json()["error"]
        assert (r.status_code, err["param"], err["code"]) == (status, param, code), (body, r.text)


def test_chat_template_kwargs_and_continue_final_message(http, fake):
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking) and continue_final_message reach
    the template, on /v1/chat/completions and /tokenize; the renderer's own arguments cannot be set."""
    tok = fake[1].tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert tok.calls[-1]["enable_thinking"] is False and "continue_final_message" not in tok.calls[-1]
    r = http.post("/tokenize", json={**body, "continue_final_message": True, "add_generation_prompt": False})
    assert r.status_code == 200 and tok.calls[-1]["continue_final_message"] is True
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),  # (and the default
                         # add_generation_prompt: vLLM's 400 too)
                         ({"chat_template_kwargs": {"chat_template": "{{ 7 }}"}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]:
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_chat_echo(http):
    """vLLM's chat `echo`: the reply's content starts with the last message when it has the reply's
    role (an assistant message continued; with add_generation_prompt false, whatever the last role),
    streamed in the opening chunk; otherwise nothing is echoed."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "echo": True}
    plain = http.post("/v1/chat/completions", json={**body, "echo": False}).json()["choices"][0]["message"]["content"]
    got = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert got == "Once" + plain
    ev = stream_post(http, "/v1/chat/completions", {**body, "stream": True})
    deltas = [c["delta"] for e in ev[:-1] for c in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": "Once"}
    assert "".join(d.get("content") or "" for d in deltas) == got
    for extra in ({"messages": msgs[:1]}, {"echo": False}):  # (the last message is the user's: not echoed)
        r = http.post("/v1/chat/completions", json={**body, **extra}).json()["choices"][0]["message"]["content"]
        assert not r.startswith("Once") and not r.startswith("hi")
    r = http.post("/v1/chat/completions", json={**body, "messages": msgs[:1], "add_generation_prompt": False})
    assert r.json()["choices"][0]["message"]["content"].startswith("hi")


def test_continuous_usage_stats(http):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far."""
    ev = stream_post(http, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                                "stream": True, "stream_options": {"include_usage": True,
                                                                                   "continuous_usage_stats": True}})
    chunks = [e for e in ev[:-1] if e["choices"]]
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert chunks and all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
    assert done == sorted(done) and done[-1] == 4 and ev[-2]["usage"]["completion_tokens"] == 4
    plain = stream_post(http, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True})
    assert all("usage" not in e for e in plain[:-1])


def test_return_tokens_as_token_ids(http):
    """vLLM's return_tokens_as_token_ids: every logprob token, chosen and top, is "token_id:<id>"."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "logprobs": 2,
                                           "return_tokens_as_token_ids": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp["top_logprobs"] for t in top)
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
                                                   "return_tokens_as_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") and c["top_logprobs"][0]["token"].startswith("token_id:")
               for c in content)


def test_beam_search_wire_format(http):
    """use_beam_search: n beams a prompt as the choices, streamed or not; the fields beam search does
    not take are 400s. (The beams themselves: test_server.py against LLM.beam_search.)"""
    body = {"model": MODEL, "prompt": ["hi", "there"], "n": 2, "max_tokens": 3, "use_beam_search": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" and c["text"] for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 4 * 3 and out["usage"]["prompt_tokens"] == 2 + 5
    events = stream_post(http, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    texts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in out["choices"]}
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "n": 2, "max_tokens": 2, "use_beam_search": True,
                                                   "length_penalty": 0.5}).json()
    assert len(chat["choices"]) == 2 and all(c["message"]["content"] for c in chat["choices"])
    for extra, param_name in [({"logprobs": 1}, "logprobs"), ({"stop": ["x"]}, "stop"),
                              ({"presence_penalty": 0.5}, "presence_penalty"), ({"guided_regex": "a+"}, "structured"),
                              ({"n": 3}, "max_logprobs")]:
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and param_name in r.json()["error"]["message"], (extra, r.text)
    assert http.post("/v1/completions", json={**body, "prompt": [[1, 99]]}).status_code == 400  # the engine's 400


def test_logprobs_formats(http):
    j = http.post("/v1/completions", json={"prompt": "lp", "max_tokens": 5, "logprobs": 2}).json()
    lp = j["choices"][0]["logprobs"]
    toks = [fake_continuation(ids_of("lp"), 0, k) for k in range(5)]
    assert lp["tokens"] == [FakeTokenizer().decode([t]) for t in toks]
    assert lp["token_logprobs"] == [-0.25] * 5
    assert all(len(d) == 3 for d in lp["top_logprobs"])
    assert lp["text_offset"] == [0, *__import__("itertools").accumulate(len(t) for t in lp["tokens"][:-1])]
    ev = stream_post(http, "/v1/completions", {"prompt": "lp", "max_tokens": 5, "logprobs": 2, "stream": True})
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in ev[:-1]), []) == lp["tokens"]
    assert sum((c["choices"][0]["logprobs"]["text_offset"] for c in ev[:-1]), []) == lp["text_offset"]

    msgs = [{"role": "user", "content": "hi"}]
    j = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "logprobs": True,
                                                "top_logprobs": 2}).json()
    content = j["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for e in content:
        assert e["logprob"] == -0.25 and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["token"] == e["token"] and e["bytes"] == list(e["token"].encode())
    j = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "logprobs": True}).json()
    assert [e["top_logprobs"] for e in j["choices"][0]["logprobs"]["content"]] == [[], []]


def test_openai_client_chat(fake):
    srv, _ = fake
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = expected_fake_text(FakeTokenizer().apply_chat_template(msgs, add_generation_prompt=True), 0, 7)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=7, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 7
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    # content parts
    r = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert r.choices[0].message.content == expected_fake_text(
        FakeTokenizer().apply_chat_template([{"role": "user", "content": "a\nb"}], add_generation_prompt=True), 0, 3)


def test_openai_client_responses(fake):
    """OpenAI's Responses API through the official client: `instructions` and `input` as the chat
    template sees them, the text, the status and usage; the stream's events in order, its deltas
    the text; what is not supported is a 400."""
    srv, _ = fake
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = expected_fake_text(FakeTokenizer().apply_chat_template(msgs, add_generation_prompt=True), 0, 7)
    r = client.responses.create(model=MODEL, instructions="be brief", input="hello", max_output_tokens=7,
                                temperature=0)
    assert r.output_text == want and r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 7 and r.usage.input_tokens == len(FakeTokenizer().apply_chat_template(
        msgs, add_generation_prompt=True))
    items = [{"role": "developer", "content": "be brief"},  # (developer: a system message)
             {"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=7).output_text == want
    events = list(client.responses.create(model=MODEL, instructions="be brief", input="hello",
                                          max_output_tokens=7, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and [e.sequence_number for e in events] == list(range(len(events)))
    for extra, param in [({"previous_response_id": "resp_x"}, "previous_response_id"),
                         # (function tools need a tool-call parser: test_server_tools.py)
                         ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),
                         ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
                         ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]"),
                         ({"text": {"format": {"type": "xml"}}}, "text.format"), ({"n": 2}, "n"),
                         ({"use_beam_search": True}, "use_beam_search")]:
        r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


BAD = [
    # (body, status, param)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"", 400, None),
    (b'{"prompt": "x", "max_tokens": "five"}', 400, "max_tokens"),  # ("5" and 5.0 are 5, as in vLLM)
    (b'{"prompt": "x", "max_tokens": 2.5}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    (b'{"prompt": "x", "temperature": true}', 400, "temperature"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "x", "top_k": -2}', 400, "top_k"),
    (b'{"prompt": "x", "n": 0}', 400, "n"),
    (b'{"prompt": "x", "presence_penalty": 3}', 400, "presence_penalty"),
    (b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "x", "logprobs": 9}', 400, None),  # over the engine's max_logprobs
    (b'{"prompt": "x", "stop": [""]}', 400, "stop"),
    (b'{"prompt": "x", "stop": 7}', 400, "stop"),
    (b'{"prompt": "x", "seed": 1e30}', 400, "seed"),
    (b'{"prompt": "x", "seed": 99999999999999999999999}', 400, "seed"),
    (b'{"prompt": "x", "min_tokens": 9, "max_tokens": 3}', 400, "min_tokens"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias"),  # (OpenAI's range: [-100, 100])
    (b'{"prompt": "x", "logit_bias": {"five": -100}}', 400, "logit_bias"),
    (b'{"prompt": "x", "allowed_token_ids": []}', 400, "allowed_token_ids"),
    (b'{"prompt": ""}', 400, None),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": [-1]}', 400, "prompt.0"),
    (b'{"prompt": [99]}', 400, None),  # out of the fake vocabulary: the engine's check
    (b'{"prompt": "' + b"y" * 200 + b'"}', 400, None),  # longer than max_model_len
    (b'{"max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": "x", "model": "nope"}', 404, "model"),
    (b'{"prompt": "x", "echo": true, "logprobs": 1, "stream": true}', 400, "stream"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),  # (with echo: scoring the prompt)
    (b'{"prompt": "x", "suffix": "s"}', 400, "suffix"),
    (b'{"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}', 400, "structured_outputs"),
    (b'{"prompt": "x", "structured_outputs": {"regexp": "a"}}', 400, "structured_outputs"),
    (b'{"prompt": "x", "guided_choice": []}', 400, "guided_choice"),
    (b'{"prompt": "x", "guided_json": 5}', 400, "guided_json"),
    (b'{"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}', 400, "guided_regex"),
]
BAD_CHAT = [
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400,
     "messages[0].content[0]"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', 400, "messages"),  # the template raises
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400, "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400, "tools[0]"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}', 400,
     "response_format.type"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}', 400,
     "response_format.json_schema"),
    (b'{"messages": [{"role": "user", "content": "x"}], "guided_regex": "a", "guided_choice": ["b"]}', 400,
     "guided_choice"),
    (b'{"messages": "hi"}', 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param",
                         [("/v1/completions", *b) for b in BAD] + [("/v1/chat/completions", *b) for b in BAD_CHAT])
def test_bad_requests(http, path, body, status, param):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert isinstance(err["code"], str) and re.fullmatch(r"[a-z]+(_[a-z]+)*", err["code"]), err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), err


# (method, path, body, status, type, code): one style, OpenAI's (the table in server/app.py)
ERROR_CODES = [
    ("POST", "/v1/completions", b"{not json", 400, "invalid_request_error", "invalid_json"),
    ("POST", "/v1/completions", b"[1]", 400, "invalid_request_error", "invalid_json"),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "invalid_request_error", "invalid_value"),
    ("POST", "/v1/completions", b'{"prompt": "x", "logit_bias": {"5": -101}}', 400, "invalid_request_error",
     "invalid_value"),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "invalid_request_error",
     "context_length_exceeded"),
    ("POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": 94}', 400, "invalid_request_error",
     "context_length_exceeded"),  # 3 + 94 > 96
    ("POST", "/v1/completions", b'{"prompt": "' + b"y" * 200 + b'"}', 400, "invalid_request_error",
     "context_length_exceeded"),
    ("POST", "/v1/completions", b'{"prompt": ""}', 400, "invalid_request_error", "empty_prompt"),
    ("POST", "/v1/completions", b'{"prompt": "x", "logprobs": 9}', 400, "invalid_request_error",
     "invalid_sampling_params"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}]}', 400,
     "invalid_request_error", "chat_template_error"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 95}', 400,
     "invalid_request_error", "context_length_exceeded"),
    ("POST", "/v1/completions", b'{"prompt": "x", "model": "nope"}', 404, "not_found_error", "model_not_found"),
    ("GET", "/v1/nothing", None, 404, "not_found_error", "not_found"),
    ("GET", "/v1/completions", None, 405, "invalid_request_error", "method_not_allowed"),
    ("POST", "/v1/completions", b'{"prompt": "' + b"a" * (40 << 10) + b'"}', 413, "invalid_request_error",
     "request_too_large"),
]


@pytest.mark.parametrize("method,path,body,status,err_type,code", ERROR_CODES)
def test_error_codes(http, method, path, body, status, err_type, code):
    r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (err_type, code), err
    if code == "context_length_exceeded" and b"max_tokens" in body:
        assert err["message"].startswith("This model") or "exceed max_model_len" in err["message"]


def test_unknown_fields_are_ignored_and_limits(http, caplog):
    with caplog.at_level("DEBUG", logger="metrale_jax.server.protocol"):
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1},
                                               "response_format": {"type": "text", "zz": 1}})
    assert r.status_code == 200
    assert "frobnicate" in caplog.text and "response_format.zz" in caplog.text
    assert [r.levelname for r in caplog.records if "frobnicate" in r.getMessage()] == ["WARNING"]
    caplog.clear()
    with caplog.at_level("DEBUG", logger="metrale_jax.server.protocol"):  # each name warned of once
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 2})
    assert [r.levelname for r in caplog.records if "frobnicate" in r.getMessage()] == ["DEBUG"]
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (40 << 10) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/health").status_code == 200


def test_api_key():
    with BackgroundServer(FakeEngine(), ServerConfig(model_names=(MODEL,), api_key="sekrit")) as srv:
        with httpx.Client(base_url=srv.url) as c:
            body = {"prompt": "x", "max_tokens": 2}
            assert c.post("/v1/completions", json=body).status_code == 401
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models").status_code == 401
            assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
            assert c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}).status_code == 401
            # as vLLM's: only /v1/* asks for the key; the root paths stay open
            assert c.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == ids_of("hi")
            assert c.post("/detokenize", json={"tokens": [5, 6]}).json() == {"prompt": FakeTokenizer().decode([5, 6])}
            for path in ("/health", "/version", "/metrics"):
                assert c.get(path).status_code == 200, path
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_served_model_names():
    """vLLM's --served-model-name: the names replace the model's path in /v1/models and in requests'
    `model` (the path is then unknown); every name is accepted, and responses report the first."""
    with BackgroundServer(FakeEngine(), ServerConfig(model_names=("first", "second"))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["first", "second"]
        msgs = [{"role": "user", "content": "hi"}]
        for name in ("first", "second", None):
            given = {"model": name} if name else {}
            r = c.post("/v1/completions", json={**given, "prompt": "ab", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "first", (name, r.text)
            r = c.post("/v1/chat/completions", json={**given, "messages": msgs, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "first", (name, r.text)
            r = c.post("/v1/responses", json={**given, "input": "hi", "max_output_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "first", (name, r.text)
            ev = stream_post(c, "/v1/chat/completions", {**given, "messages": msgs, "max_tokens": 2, "stream": True})
            assert {e["model"] for e in ev[:-1]} == {"first"}
            assert c.post("/tokenize", json={**given, "prompt": "ab"}).status_code == 200
        for path, body in (("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
                           ("/tokenize", {"prompt": "ab"})):
            r = c.post(path, json={**body, "model": "/models/fake-model"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (path, r.text)


def test_served_model_names_from_the_command_line():
    """`serve MODEL --served-model-name a b` (vLLM's form) or the flag repeated: the names alone;
    without it, MODEL as given and the model's own name."""
    from metrale_jax.cli import build_parser
    from metrale_jax.server.cli import served_model_names

    parser = build_parser()
    for argv in (["--served-model-name", "a", "b"], ["--served-model-name", "a", "--served-model-name", "b"]):
        args = parser.parse_args(["serve", "/models/m", *argv, "--port", "0"])
        assert served_model_names(args, "m-own-name") == ("a", "b")
    args = parser.parse_args(["serve", "/models/m"])
    assert served_model_names(args, "m-own-name") == ("/models/m", "m-own-name")
    assert served_model_names(args, "/models/m") == served_model_names(args, "") == ("/models/m",)


CUSTOM_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<bot>{% endif %}")


def test_chat_template_replaces_the_tokenizers(tmp_path):
    """--chat-template (ServerConfig.chat_template): chat, Responses and /tokenize messages are
    rendered with it instead of the tokenizer's template, and a model without a template of its own
    serves chat (without the flag: 400 no_chat_template)."""
    from test_server_support import make_tiny_text_model

    from metrale_jax.loading.tokenizer import Tokenizer

    msgs = [{"role": "user", "content": "hi"}]
    want = ids_of("<user>hi<bot>")
    eng = FakeEngine()
    eng.tokenizer.chat_template = None  # a model without a chat template
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,), chat_template=CUSTOM_TEMPLATE)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == want
        assert c.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["tokens"] == \
            ids_of("<user>hi")
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
        assert r.json()["choices"][0]["message"]["content"] == expected_fake_text(want, 0, 3)
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(want), r.text
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,))) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template", r.text
    # the real tokenizer: the flag's template wins over the model's own (ChatML)
    eng = FakeEngine()
    eng.tokenizer = tok = Tokenizer.from_dir(make_tiny_text_model(tmp_path / "tiny"))
    assert tok.chat_template is not None
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,), chat_template=CUSTOM_TEMPLATE)) as srv:
        r = httpx.post(srv.url + "/tokenize", json={"messages": msgs})
        assert r.json()["tokens"] == tok.encode("<user>hi<bot>", add_special_tokens=False), r.text


def test_serve_loads_the_chat_template_and_names_at_start(monkeypatch, tmp_path, capsys):
    """`metrale serve`: --chat-template is a file's text, or the template itself; a value that names
    a file (no '{', '}' or newline) which does not open is one `error:` line and exit 2 before the
    model loads. The served names and the template reach the ServerConfig."""
    import metrale_jax.server.runner as runner
    from metrale_jax import cli
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.server.cli import load_chat_template

    (tmp_path / "t.jinja").write_text(CUSTOM_TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == CUSTOM_TEMPLATE
    assert load_chat_template(CUSTOM_TEMPLATE) == CUSTOM_TEMPLATE
    assert load_chat_template("{{ '</s>' }}") == "{{ '</s>' }}"  # text with a '/' in it is still text
    assert load_chat_template(None) is None
    monkeypatch.setattr(LLMEngine, "from_config", lambda c: pytest.fail("the model loaded"))
    for bad in (str(tmp_path / "missing.jinja"), "templates/chat.j2", "chatml", str(tmp_path)):
        assert cli.main(["serve", "m", "--port", "0", "--chat-template", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --chat-template {bad!r} looks like a file path") and err.count("\n") == 1, err
    seen = {}
    eng = FakeEngine()
    eng.lockstep, eng.release_followers = None, lambda: None

    def from_config(config):
        seen["engine"] = config
        return eng

    monkeypatch.setattr(LLMEngine, "from_config", from_config)
    monkeypatch.setattr(runner, "serve", lambda engine, config, **kw: seen.setdefault("config", config))
    assert cli.main(["serve", "/models/m", "--port", "0", "--served-model-name", "a", "b",
                     "--chat-template", str(tmp_path / "t.jinja"), "--tokenizer", "/tok",
                     "--generation-config", "vllm"]) == 0
    assert seen["config"].chat_template == CUSTOM_TEMPLATE and seen["config"].model_names == ("a", "b")
    assert (seen["engine"].tokenizer, seen["engine"].generation_config) == ("/tok", "vllm")


def test_queue_full_gives_503_and_recovers():
    eng = FakeEngine(max_num_seqs=2, step_delay_s=0.01)
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,), max_waiting_requests=3, retry_after_s=2)) as srv:
        results = []

        def long_request():
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                results.append(c.post("/v1/completions", json={"prompt": "long", "max_tokens": 60}).status_code)

        threads = [threading.Thread(target=long_request) for _ in range(5)]  # 2 run, 3 wait
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            for t in threads[:2]:
                t.start()
            wait_until(lambda: metric(c, "metrale_num_requests_running") == 2, what="2 running")
            for t in threads[2:]:
                t.start()
            wait_until(lambda: metric(c, "metrale_num_requests_waiting") == 3, what="3 waiting")
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            assert time.monotonic() - t0 < 1.0  # answered at once, not queued
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "queue_full"
            assert metric(c, 'metrale_requests_rejected_total{reason="queue_full"}') == 1
            for t in threads:
                t.join()
            assert results == [200] * 5
            assert c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2}).status_code == 200


def _raw_request(port: int, path: str, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_disconnect_aborts_and_frees_blocks():
    eng = FakeEngine(max_num_seqs=8, step_delay_s=0.005)
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        # streaming: read a few events, then hang up
        with c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 80, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data: ") for x in got)
            assert metric(c, "metrale_kv_blocks_used") > 0
        wait_until(lambda: len(eng.aborted) == 1, what="the stream's abort")
        # non-streaming: the client closes its socket while the request runs
        s = _raw_request(srv.port, "/v1/completions", {"prompt": "abcd", "max_tokens": 80})
        wait_until(lambda: metric(c, "metrale_num_requests_running") == 1, what="running")
        s.close()
        wait_until(lambda: len(eng.aborted) == 2, what="the non-streaming abort")
        wait_until(lambda: metric(c, "metrale_kv_blocks_used") == 0, what="blocks freed")
        assert metric(c, "metrale_requests_aborted_total") == 2
        assert metric(c, "metrale_num_requests_running") == 0
        assert metric(c, "metrale_http_requests_in_flight") == 0
        assert eng.thread_ids and len(eng.thread_ids) == 1  # only the engine thread touched the engine


def test_engine_failure_fails_requests_not_the_server():
    eng = FakeEngine(step_delay_s=0.002, fail_after_steps=5)
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        ev = stream_post(c, "/v1/completions", {"prompt": "x", "max_tokens": 50, "stream": True})
        assert ev[-1] == "[DONE]" and "error" in ev[-2]
        assert c.get("/health").status_code == 500
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        assert r.json()["error"]["type"] == "server_error" and ev[-2]["error"]["code"] == "engine_dead"


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=8), lambda ch: st.lists(ch, max_size=3)
                     | st.dictionaries(st.text(max_size=5), ch, max_size=3), max_leaves=6)
_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
           "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "ignore_eos", "min_tokens", "stream", "stream_options", "echo", "model",
           "stop_token_ids", "response_format", "best_of", "whatever", "structured_outputs", "guided_json",
           "guided_regex", "guided_choice"]
_VALUE = st.one_of(_JSON, st.integers(-3, 70), st.floats(-3, 3), st.sampled_from(["hi", "", "ab\u00e9", "\x00"]),
                   st.lists(st.integers(-2, 80), max_size=5),
                   st.just([{"role": "user", "content": "hey"}]), st.just({"include_usage": True}))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from(_FIELDS), _VALUE, max_size=8) | _JSON,
       garble=st.integers(0, 3))
def test_fuzzed_bodies_never_break_the_server(http, path, body, garble):
    if isinstance(body, dict) and "max_tokens" not in body:
        body["max_tokens"] = 3
    raw = json.dumps(body).encode()
    if garble == 1:
        raw = raw[: len(raw) // 2]
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"]
        assert isinstance(err["code"], str) and re.fullmatch(r"[a-z]+(_[a-z]+)*", err["code"]), err
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    # The server still answers promptly.
    r = http.post("/v1/completions", json={"prompt": "canary", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200


def _access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "metrale_jax.server.access" and r.levelno >= logging.INFO]


def test_access_log_one_line_per_request(caplog):
    # (capture from this server's start on: the module's server may still log its last request)
    with BackgroundServer(FakeEngine(step_delay_s=0.001), ServerConfig(model_names=(MODEL,))) as srv:
        with caplog.at_level(logging.DEBUG, logger="metrale_jax.server.access"), \
                httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5}).status_code == 200
            ev = stream_post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 4, "n": 2, "stream": True})
            assert ev[-1] == "[DONE]"
            assert c.post("/v1/completions", json={"prompt": "", "max_tokens": 5}).status_code == 400  # the engine's
            assert c.post("/v1/completions", json={"prompt": "a", "n": 0}).status_code == 400  # the schema's
            for path in ("/health", "/metrics", "/v1/models"):
                assert c.get(path).status_code == 200
            # a stream's line is written when its response closes, which can come after the client
            # read [DONE] (so after later requests' lines)
            wait_until(lambda: len(_access_lines(caplog)) >= 5, what="five access-log lines")
    lines = sorted(_access_lines(caplog), key=lambda x: "/chat/" not in x)  # the stream's first
    assert len(lines) == 5, lines
    pat = r"{} {} {} id={} prompt_tokens={} completion_tokens={} \d+\.\d{{3}}s"
    chat_prompt = len(FakeTokenizer().apply_chat_template([{"role": "user", "content": "hi"}],
                                                          add_generation_prompt=True))
    for line, want in zip(lines, [("POST", "/v1/chat/completions", 200, r"chatcmpl-[0-9a-f]{32}", chat_prompt, 8),
                                  ("POST", "/v1/completions", 200, r"cmpl-[0-9a-f]{32}", 3, 5),
                                  ("POST", "/v1/completions", 400, r"cmpl-[0-9a-f]{32}", 0, 0),
                                  ("POST", "/v1/completions", 400, "-", 0, 0),
                                  ("GET", "/v1/models", 200, "-", 0, 0)]):
        assert re.fullmatch(pat.format(*want), line), (line, want)
    debug = [r.getMessage() for r in caplog.records if r.name == "metrale_jax.server.access"
             and r.levelno == logging.DEBUG]
    assert [x.split(" id=")[0] for x in debug] == ["GET /health 200", "GET /metrics 200"]
    assert not [r for r in caplog.records if r.name.startswith("uvicorn.access")]
    # --disable-log-requests
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="metrale_jax.server.access"):
        with BackgroundServer(FakeEngine(), ServerConfig(model_names=(MODEL,), log_requests=False)) as srv:
            assert httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if r.name == "metrale_jax.server.access"]


def test_shutdown_drain_ends_streams_with_abort_chunks(caplog):
    """Past the drain limit every running request is aborted in the engine; a stream gets a
    finish_reason "abort" chunk per unfinished choice (then usage, [DONE]), a non-streaming
    request a 503; one warning line, no error."""
    eng = FakeEngine(max_num_seqs=4, step_delay_s=0.02)  # 80 tokens take 1.6 s, the drain limit is 0.5 s
    srv = BackgroundServer(eng, ServerConfig(model_names=(MODEL,)), shutdown_timeout_s=0.5).start()
    results: dict = {}
    started = threading.Event()

    def stream(name, path, body):
        with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", path, json=body) as r:
            events = []
            for line in r.iter_lines():
                events.extend(sse_events([line]))
                started.set()
            results[name] = events

    def plain():
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            results["plain"] = c.post("/v1/completions", json={"prompt": "xyz", "max_tokens": 80})

    threads = [threading.Thread(target=stream, args=("chat", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "n": 2, "stop": ["zzz"],
        "stream": True, "stream_options": {"include_usage": True}})),
        threading.Thread(target=stream, args=("cmpl", "/v1/completions", {"prompt": "abc", "max_tokens": 80,
                                                                           "stream": True})),
        threading.Thread(target=plain)]
    with caplog.at_level(logging.INFO):
        for t in threads:
            t.start()
        assert started.wait(20)
        wait_until(lambda: len(eng.reqs) == 3 and all(r.running for r in eng.reqs.values()), what="3 running")
        t0 = time.monotonic()
        srv.stop()
        for t in threads:
            t.join(20)
    assert time.monotonic() - t0 < 3
    chat, cmpl = results["chat"], results["cmpl"]
    assert chat[-1] == "[DONE]" and chat[-2]["choices"] == [] and chat[-2]["usage"]["completion_tokens"] > 0
    assert sorted((c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chat[-4:-2]) == [
        (0, "abort"), (1, "abort")]
    assert all(c["choices"][0]["finish_reason"] is None for c in chat[:-4])
    assert cmpl[-1] == "[DONE]" and cmpl[-2]["choices"][0]["finish_reason"] == "abort"
    text = "".join(e["choices"][0]["text"] for e in cmpl[:-1])
    assert text and expected_fake_text(ids_of("abc"), 0, 80).startswith(text) and len(text) < len(
        expected_fake_text(ids_of("abc"), 0, 80))
    r = results["plain"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.json()["error"]["type"] == "server_error" and "drain limit" in r.json()["error"]["message"]
    assert len(eng.aborted) == 3 and not eng.reqs  # aborted in the engine
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["shutdown: the drain limit of 0.5 s passed; aborted 3 running request(s)"], warnings


_SERVE_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
sys.path.insert(0, {tests!r})
from test_server_support import FakeEngine
from metrale_jax.server import ServerConfig, serve
serve(FakeEngine(max_num_seqs=4, step_delay_s={delay}), ServerConfig(model_names=("fake-model",)),
      port={port}, shutdown_timeout_s={timeout}, log_level="info")
"""


def _start_subprocess_server(delay: float, timeout: float) -> tuple[subprocess.Popen, str]:
    from metrale_jax.server.runner import free_port

    port = free_port()
    script = _SERVE_SCRIPT.format(tests=str(Path(__file__).parent), delay=delay, port=port, timeout=timeout)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=str(Path(__file__).parent.parent), env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {proc.stdout.read()}")
        time.sleep(0.1)


def test_sigterm_finishes_running_requests_then_exits_in_bounded_time():
    # Steps of 50 ms: a 10-token request finishes within the 2 s grace period, a 90-token one cannot:
    # it is aborted then, and its stream still ends properly (a finish_reason "abort" chunk, [DONE]).
    # The log: one access line per request, one line for the abort, no traceback.
    proc, url = _start_subprocess_server(delay=0.05, timeout=2)
    results: dict[str, list] = {}

    def stream(name: str, prompt: str, max_tokens: int, started: threading.Event):
        events = []
        try:
            with httpx.Client(base_url=url, timeout=30) as c, c.stream(
                    "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True}) as r:
                for line in r.iter_lines():
                    events.extend(sse_events([line]))
                    started.set()
        except httpx.HTTPError as e:
            events.append(e)
        started.set()
        results[name] = events

    try:
        ev_short, ev_long = threading.Event(), threading.Event()
        threads = [threading.Thread(target=stream, args=("long", "slow", 90, ev_long)),
                   threading.Thread(target=stream, args=("short", "bye", 10, ev_short))]
        for t in threads:
            t.start()
        assert ev_short.wait(20) and ev_long.wait(20)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(url + "/health", timeout=2)
        for t in threads:
            t.join(30)
        short = results["short"]
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in short[:-1]) == expected_fake_text(
            FakeTokenizer().encode("bye"), 0, 10)
        long = results["long"]
        assert long[-1] == "[DONE]" and long[-2]["choices"][0]["finish_reason"] == "abort"
        assert all(e["choices"][0]["finish_reason"] is None for e in long[:-2])
        text = "".join(e["choices"][0]["text"] for e in long[:-1])
        assert 10 <= len(text) < 90 and expected_fake_text(FakeTokenizer().encode("slow"), 0, 90).startswith(text)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 4.5  # 90 tokens would take 4.5 s
        log = proc.stdout.read()
        assert "Traceback" not in log and "CancelledError" not in log and "Cancel " not in log, log
        assert len(re.findall(r"drain limit of 2 s passed; aborted 1 running request", log)) == 1, log
        access = re.findall(r"metrale_jax\.server\.access: POST /v1/completions 200 id=cmpl-\w+ "
                            r"prompt_tokens=(\d+) completion_tokens=(\d+) [0-9.]+s", log)
        assert len(access) == 2 and ("3", "10") in access, log
        n_long = int(next(c for p, c in access if p == "4"))  # what the aborted stream had been sent
        assert 5 <= n_long < 90 and expected_fake_text(FakeTokenizer().encode("slow"), 0, n_long) == text
        assert "GET /health" not in log  # probes are DEBUG
    finally:
        proc.kill()


# ---- vLLM's behaviour, field by field ------------------------------------------------------------
def test_cors_preflight_and_flags():
    """A browser's preflight OPTIONS gets CORS headers (vLLM's CORSMiddleware and flags), before the
    API key is asked for; --allowed-origins narrows it."""
    import argparse

    from metrale_jax.server.cli import add_serve_arguments, cors_from_args

    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    with BackgroundServer(FakeEngine(), ServerConfig(model_names=(MODEL,), api_key="k")) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=pre)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["m", "--allowed-origins", '["http://app.example"]', "--allowed-methods", '["GET", "POST"]',
                         "--allow-credentials"])
    cors = cors_from_args(args)
    assert cors == {"allowed_origins": ("http://app.example",), "allowed_methods": ("GET", "POST"),
                    "allowed_headers": ("*",), "allow_credentials": True}
    assert cors_from_args(p.parse_args(["m"]))["allowed_origins"] == ("*",)
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--allowed-origins", "http://x"])  # not a JSON list
    with BackgroundServer(FakeEngine(), ServerConfig(model_names=(MODEL,), **cors)) as srv:
        ok = httpx.options(srv.url + "/v1/completions", headers=pre)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        bad = httpx.options(srv.url + "/v1/completions", headers={**pre, "Origin": "http://evil.example"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_a_batch_larger_than_the_waiting_bound_is_a_400_not_a_503():
    """A request whose prompts (or beam search's n beams a prompt) alone exceed max_waiting_requests
    can never be queued: 400 batch_too_large, not 503 + Retry-After; up to the bound it runs."""
    with BackgroundServer(FakeEngine(), ServerConfig(model_names=(MODEL,), max_waiting_requests=3)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "batch_too_large")
        assert "4" in err["message"] and "3" in err["message"]
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "use_beam_search": True, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "batch_too_large", r.text
        assert c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2}).status_code == 200


def test_stream_options_need_stream(http):
    """vLLM's 400 for stream_options without stream=True (an empty object passes, as there)."""
    so = {"include_usage": True}
    for body in ({"stream_options": so}, {"stream": False, "stream_options": so}):
        for path, extra in (("/v1/completions", {"prompt": "x"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = http.post(path, json={"max_tokens": 2, **extra, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "stream_options" and "stream=True" in err["message"]
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream_options": {}}).status_code == 200


def test_stop_reason_and_chat_message_fields(http):
    """vLLM's stop_reason: the stop string (or stop token id) that ended a choice, null otherwise;
    in every completions chunk, in the chat chunk with the finish_reason. Chat messages carry vLLM's
    fields (refusal, annotations, audio, function_call, reasoning: null; tool_calls only with calls)."""
    ids = ids_of("stop me")
    full = expected_fake_text(ids, 0, 40)
    stop = full[9:12]
    body = {"model": MODEL, "prompt": "stop me", "max_tokens": 40, "stop": ["zzzz", stop], "temperature": 0}
    j = http.post("/v1/completions", json=body).json()
    assert (j["choices"][0]["finish_reason"], j["choices"][0]["stop_reason"]) == ("stop", stop)
    ev = stream_post(http, "/v1/completions", {**body, "stream": True})
    assert all("stop_reason" in e["choices"][0] for e in ev[:-1])
    assert [e["choices"][0]["stop_reason"] for e in ev[:-1]] == [None] * (len(ev) - 2) + [stop]
    j = http.post("/v1/completions", json={**body, "max_tokens": 3}).json()
    assert (j["choices"][0]["finish_reason"], j["choices"][0]["stop_reason"]) == ("length", None)
    msgs = [{"role": "user", "content": "hi"}]
    chat_ids = FakeTokenizer().apply_chat_template(msgs, add_generation_prompt=True)
    chat_stop = expected_fake_text(chat_ids, 0, 40)[6:8]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 40, "stop": [chat_stop]}
    j = http.post("/v1/chat/completions", json=chat).json()
    ch = j["choices"][0]
    assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", chat_stop)
    assert ch["message"] == {"role": "assistant", "content": expected_fake_text(chat_ids, 0, 40, [chat_stop]),
                             "refusal": None, "annotations": None, "audio": None, "function_call": None,
                             "reasoning": None}
    ev = stream_post(http, "/v1/chat/completions", {**chat, "stream": True})
    last = ev[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", chat_stop)
    assert all("stop_reason" not in e["choices"][0] for e in ev[:-2])


def test_continuous_usage_is_per_choice_from_the_first_chunk(http):
    """continuous_usage_stats as vLLM reports it: the real prompt token count from the first chunk
    (the role chunk of a chat stream) on, and each chunk the completion tokens of its own choice."""
    msgs = [{"role": "user", "content": "hi"}]
    prompt_len = len(FakeTokenizer().apply_chat_template(msgs, add_generation_prompt=True))
    so = {"include_usage": True, "continuous_usage_stats": True}
    ev = stream_post(http, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4, "n": 2,
                                                     "stream": True, "stream_options": so})
    chunks = [e for e in ev[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"]["prompt_tokens"] == prompt_len for c in chunks)
    for i in (0, 1):
        mine = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0] == 0 and mine == sorted(mine) and mine[-1] == 4, mine
    assert ev[-2]["usage"]["completion_tokens"] == 8 and ev[-2]["usage"]["prompt_tokens"] == prompt_len
    # completions: each choice its own prompt's tokens
    ev = stream_post(http, "/v1/completions", {"model": MODEL, "prompt": ["ab", "abcd"], "max_tokens": 3,
                                               "echo": True, "stream": True, "stream_options": so})
    chunks = [e for e in ev[:-1] if e["choices"]]
    assert {(c["choices"][0]["index"], c["usage"]["prompt_tokens"]) for c in chunks} == {(0, 2), (1, 4)}
    assert [c["choices"][0]["text"] for c in chunks if c["usage"]["completion_tokens"] == 0] == ["ab", "abcd"]
    assert ev[-2]["usage"]["prompt_tokens"] == 6 and ev[-2]["usage"]["completion_tokens"] == 6


def test_responses_wire_details(fake, http):
    """/v1/responses: created_at an integer, the stream ends with response.completed / incomplete
    and no `data: [DONE]` (as OpenAI's and vLLM's), a too-large output limit named as
    max_output_tokens."""
    srv, _ = fake
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 3})
    assert r.status_code == 200 and isinstance(r.json()["created_at"], int), r.text
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 3,
                                                    "stream": True}) as s:
        lines = [x for x in s.iter_lines() if x]
    assert "[DONE]" not in "\n".join(lines)
    assert lines[-2] == "event: response.incomplete" and json.loads(lines[-1][6:])["response"]["created_at"] > 0
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 95})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_output_tokens" and err["code"] == "context_length_exceeded"
    assert "max_output_tokens <=" in err["message"] and "max_tokens" not in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 95}
    assert http.post("/v1/chat/completions", json=chat).json()["error"]["param"] == "max_completion_tokens"


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/completions", {"prompt": [-1]}, "prompt.0", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": []}, "prompt", "at least 1 item"),
    ("/v1/completions", {"prompt": [[]]}, "prompt.0", "at least 1 item"),
    ("/v1/completions", {"prompt": 5}, "prompt", "expected a string, an array of integers, an array of strings "
                                                 "or an array of arrays of integers"),
    ("/v1/completions", {"prompt": ["1", 2]}, "prompt", "expected a string"),  # never token ids from strings
    ("/v1/completions", {"prompt": [True]}, "prompt", "expected a string"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 33}, "stop", "at most 32 items"),
    ("/v1/completions", {"prompt": "x", "stop": 7}, "stop", "expected a string or an array of strings"),
    ("/v1/responses", {"input": []}, "input", "at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "needs a string `text`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "expected a string or an array of objects"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature", "not a boolean"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", "fractional part"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"x-fake-invalid": 1}}}},
     "response_format", "does not compile"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"x-fake-invalid": 1}}, "guided_json", "does not compile"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"x-fake-invalid": 1}}}},
     "text.format", "does not compile"),
])
def test_validation_errors_say_the_real_cause(http, path, body, param, says):
    r = http.post(path, json={"model": MODEL, "max_tokens": 2, **body} if path != "/v1/responses" else
                  {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert "valid string" not in err["message"], err


def test_numbers_are_parsed_as_vllm_parses_them(http):
    """Lax numbers, as vLLM's pydantic models: numeric strings and integral floats are taken; a text
    list stays text (never token ids)."""
    body = {"model": MODEL, "prompt": "hello", "temperature": "0", "max_tokens": 5.0, "n": "1", "seed": "3"}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_fake_text(ids_of("hello"), 0, 5)
    j = http.post("/v1/completions", json={"model": MODEL, "prompt": ["1", "2"], "max_tokens": 2}).json()
    assert [c["text"] for c in j["choices"]] == [expected_fake_text(ids_of(p), 0, 2) for p in ("1", "2")]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "2",
            "top_logprobs": 1.0, "logprobs": "true"}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_generation_config_defaults_fill_unset_fields():
    """As vLLM's server (`--generation-config auto`): the engine's request defaults (the model's
    generation config, `LLMEngine.sampling_defaults`) fill the sampling fields a request leaves
    unset, on every endpoint; what a request sets wins."""
    eng = FakeEngine(step_delay_s=0.001)
    eng.sampling_defaults = {"temperature": 0.0, "top_p": 0.5, "repetition_penalty": 1.2, "max_tokens": 3}
    seen = []
    add = eng.add_request
    eng.add_request = lambda rid, prompt, params: seen.append(params) or add(rid, prompt, params)
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hello"}).json()
        assert r["usage"]["completion_tokens"] == 3
        p = seen[-1]
        assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens, p.top_k) == (0.0, 0.5, 1.2, 3, 0)
        c.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "temperature": 0.9, "max_tokens": 5})
        assert (seen[-1].temperature, seen[-1].top_p, seen[-1].max_tokens) == (0.9, 0.5, 5)
        msgs = [{"role": "user", "content": "hi"}]
        c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_completion_tokens": 4})
        assert (seen[-1].temperature, seen[-1].max_tokens) == (0.0, 4)
        c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
        assert seen[-1].max_tokens == 3
        c.post("/v1/responses", json={"model": MODEL, "input": "hi", "top_p": 0.25})
        assert (seen[-1].temperature, seen[-1].top_p, seen[-1].max_tokens) == (0.0, 0.25, 3)


def test_fractional_logit_bias_reaches_the_engine():
    """OpenAI's logit_bias takes any value in [-100, 100]: passed on as numbers, keys as token ids."""
    eng = FakeEngine(step_delay_s=0.001)
    seen = []
    add = eng.add_request
    eng.add_request = lambda rid, prompt, params: seen.append(params) or add(rid, prompt, params)
    with BackgroundServer(eng, ServerConfig(model_names=(MODEL,))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                            "logit_bias": {"7": 2.5, "9": -100, "11": -0.25}})
        assert r.status_code == 200, r.text
        assert seen[-1].logit_bias == {7: 2.5, 9: -100.0, 11: -0.25}
        assert seen[-1].additive_bias == ((7, 2.5), (11, -0.25))
        # vLLM's bad_words (chat and completions), refused with beam search
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "bad_words": ["foo", "bar baz"]})
        assert r.status_code == 200 and seen[-1].bad_words == ["foo", "bar baz"], r.text
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "bad_words": ["x"], "n": 2,
                                            "use_beam_search": True})
        assert r.status_code == 400 and "bad_words" in r.json()["error"]["message"], r.text
