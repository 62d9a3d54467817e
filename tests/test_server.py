"""The HTTP server over the real engine, on a live uvicorn server at 127.0.0.1 (a thread), with the
tiny Llama fixture plus a character-level tokenizer (test_server_support.make_tiny_text_model).

References come from `LLM.generate` / `LLM.chat` on the same engine, run before the server takes
it over (greedy, float32): the server must return exactly what the offline API returns, whatever
batches its concurrent requests land in. Server-only logic (wire formats in depth, fuzzing,
engine failure, bounded shutdown) is tested faster against a fake engine in test_server_fake.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_support import make_tiny_text_model, sse_events

from metrale_jax.beam_search import BeamSearchParams
from metrale_jax.engine import EngineConfig, LLMEngine
from metrale_jax.llm import LLM
from metrale_jax.sampling import SamplingParams
from metrale_jax.server import BackgroundServer, ServerConfig, free_port

MODEL = "tiny"
MAX_MODEL_LEN = 128
# Three step executables (decode 16, prefill 128, mixed 16 + 128): quick to compile, and the CLI
# subprocess test passes the same options so that it hits the persistent compilation cache.
ENGINE_KW = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=128,
                 num_kv_blocks=256, block_size=16, decode_buckets=(16,), mixed_decode_buckets=(16,),
                 prefill_buckets=(128,), show_progress=False)
PROMPTS = ["Hello, my name is", "The capital of France", "a", "Once upon a time, in a land far away, there",
           "1 2 3 4 5 6 7 8 9"]
LOAD_N = 200
LOAD_TOKENS = 5
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
MASKED = dict(allowed_token_ids=list(range(60, 120)), logit_bias={60: -100, 61: -100})


def _load_prompts() -> list[list[int]]:
    rng = np.random.default_rng(1234)
    return [rng.integers(6, 256, size=int(rng.integers(3, 40))).tolist() for _ in range(LOAD_N)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_text_model(tmp_path_factory.mktemp("tiny_text") / "model")


@pytest.fixture(scope="module")
def refs_and_server(model_dir):
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), **ENGINE_KW))
    llm = LLM.from_engine(engine)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    refs = {
        "greedy": llm.generate(PROMPTS, greedy),
        "logprobs": llm.generate(PROMPTS[:2], greedy.clone(logprobs=3)),
        "chat": llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))[0],
        "load": llm.generate([{"prompt_token_ids": p} for p in _load_prompts()],
                             SamplingParams(temperature=0, max_tokens=LOAD_TOKENS, ignore_eos=True)),
        "long": llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0],
        "beam": llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=6)),
        "masked": llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                           **MASKED))[0],
        "scored": llm.generate(PROMPTS[3:4], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                            logprobs=2, prompt_logprobs=2))[0],
    }
    assert engine.stats().kv_blocks_used == 0
    cfg = ServerConfig(model_names=(MODEL,), max_waiting_requests=512, max_request_bytes=64 << 10)
    with BackgroundServer(engine, cfg) as srv:
        yield refs, srv


@pytest.fixture(scope="module")
def refs(refs_and_server):
    return refs_and_server[0]


@pytest.fixture(scope="module")
def srv(refs_and_server):
    return refs_and_server[1]


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def metric(http: httpx.Client, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", http.get("/metrics").text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_until(cond, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_pool_empty(http: httpx.Client) -> None:
    wait_until(lambda: metric(http, "metrale_kv_blocks_used") == 0, what="the KV pool to empty")
    assert metric(http, "metrale_kv_blocks_free") == metric(http, "metrale_kv_blocks_total") > 0
    assert metric(http, "metrale_num_requests_running") == 0
    assert metric(http, "metrale_num_requests_waiting") == 0


def test_completions_equal_llm_generate(client, refs):
    want = [o.outputs[0].text for o in refs["greedy"]]
    assert any(want) and len(set(want)) > 1  # the references say something, and differ
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs["greedy"])
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in refs["greedy"])
    assert [c.finish_reason for c in sorted(r.choices, key=lambda c: c.index)] == [
        o.outputs[0].finish_reason for o in refs["greedy"]]
    # streamed, one prompt at a time
    for p, w in zip(PROMPTS[:2], want):
        chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == w
        assert chunks[-1].usage.completion_tokens == len(refs["greedy"][PROMPTS.index(p)].outputs[0].token_ids)


def test_logprobs_equal_llm_generate(client, refs):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0, logprobs=3)
    for c, ref in zip(sorted(r.choices, key=lambda c: c.index), refs["logprobs"]):
        o = ref.outputs[0]
        lp = c.logprobs
        assert len(lp.tokens) == len(o.token_ids)
        np.testing.assert_allclose(lp.token_logprobs, [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)],
                                   rtol=0, atol=1e-6)
        for top, d in zip(lp.top_logprobs, o.logprobs):
            assert max(top.values()) == pytest.approx(max(x.logprob for x in d.values()), abs=1e-6)
            assert len(top) >= 3
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    for e in r.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6


def test_chat_equals_llm_chat(client, refs):
    want = refs["chat"].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(refs["chat"].prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == refs["chat"].outputs[0].finish_reason


def test_tokenize_matches_what_the_engine_is_given(http, refs):
    """/tokenize of the chat gives the prompt ids `LLM.chat` ran; of a prompt, those `generate` ran;
    /detokenize gives back the text."""
    r = http.post("/tokenize", json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 200 and r.json()["tokens"] == list(refs["chat"].prompt_token_ids)
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    assert ids == list(refs["greedy"][0].prompt_token_ids)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith(PROMPTS[0])


def test_beam_search_equals_llm_beam_search(client, refs, model_dir):
    """use_beam_search=true with n=3: the choices are LLM.beam_search's beams, best first (text
    without the prompt and a final EOS)."""
    from metrale_jax.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=6,
                                  extra_body={"use_beam_search": True})
    for pi, (prompt, out) in enumerate(zip(PROMPTS[:2], refs["beam"])):
        plen = len(tok.encode(prompt))
        want = []
        for s in out.sequences:
            new = s.tokens[plen:]
            want.append((tok.decode(new[:-1] if s.finish_reason == "stop" else new), s.finish_reason))
        got = [(c.text, c.finish_reason) for c in r.choices[3 * pi:3 * pi + 3]]
        assert got == want


def test_echo_with_logprobs_scores_the_prompt(http, refs):
    """The legacy scoring call (lm-eval's): echo + logprobs gives the prompt's logprobs (the first
    token's null) before the completion's, as LLM.generate's prompt_logprobs; max_tokens=0 gives the
    prompt alone."""
    want = refs["scored"]
    ids = list(want.prompt_token_ids)
    body = {"model": MODEL, "prompt": PROMPTS[3], "echo": True, "logprobs": 2, "temperature": 0, "max_tokens": 2,
            "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == PROMPTS[3] + want.outputs[0].text
    assert len(lp["tokens"]) == len(ids) + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    prompt_lps = [d[t].logprob for t, d in zip(ids[1:], want.prompt_logprobs[1:])]
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], prompt_lps, atol=1e-5)
    gen_lps = [d[t].logprob for t, d in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    np.testing.assert_allclose(lp["token_logprobs"][len(ids):], gen_lps, atol=1e-5)
    assert all(len(t) >= 2 for t in lp["top_logprobs"][1:])  # the actual token and the top 2
    assert lp["text_offset"] == sorted(lp["text_offset"])
    r = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()
    c = r["choices"][0]
    assert c["text"] == PROMPTS[3] and c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert len(c["logprobs"]["tokens"]) == len(ids)
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], prompt_lps, atol=1e-5)
    # vLLM's prompt_logprobs field: {token id: {logprob, rank, decoded_token}} per prompt token
    r = http.post("/v1/completions", json={**body, "echo": False, "logprobs": None, "prompt_logprobs": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for t, d, w in zip(ids[1:], plp[1:], want.prompt_logprobs[1:]):
        assert abs(d[str(t)]["logprob"] - w[t].logprob) < 1e-5 and d[str(t)]["rank"] == w[t].rank
        assert all(x["rank"] <= 1 for k, x in d.items() if k != str(t)) and 1 <= len(d) <= 2
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == len(refs["chat"].prompt_token_ids) and chat["prompt_logprobs"][0] is None


def test_truncate_prompt_tokens(http, refs):
    """vLLM's truncate_prompt_tokens keeps the prompt's last k tokens: the completion is that of
    the truncated prompt; -1 lets a prompt longer than the context run on its tail."""
    ids = list(refs["greedy"][3].prompt_token_ids)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0}
    short = http.post("/v1/completions", json={**body, "prompt": ids[-6:]}).json()
    r = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 6}).json()
    assert r["choices"][0]["text"] == short["choices"][0]["text"] and r["usage"]["prompt_tokens"] == 6
    long = (ids * 10)[:MAX_MODEL_LEN + 20]
    assert http.post("/v1/completions", json={**body, "prompt": long}).status_code == 400
    r = http.post("/v1/completions", json={**body, "prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    assert http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0}).status_code == 400


def test_add_special_tokens_false(http, refs):
    """add_special_tokens=false encodes a text prompt without BOS: the completion of the ids without
    it, and one prompt token fewer."""
    ids = list(refs["greedy"][1].prompt_token_ids)
    plain = http.post("/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False}).json()["tokens"]
    assert plain == ids[1:]  # (this tokenizer's only special token here is the BOS)
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = http.post("/v1/completions", json={**body, "prompt": plain}).json()["choices"][0]["text"]
    with_bos = http.post("/v1/completions", json={**body, "prompt": PROMPTS[1]}).json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={**body, "prompt": PROMPTS[1], "add_special_tokens": False}).json()
    assert r["usage"]["prompt_tokens"] == len(ids) - 1 and r["choices"][0]["text"] == want
    assert with_bos == refs["greedy"][1].outputs[0].text[:len(with_bos)]
    echo = http.post("/v1/completions", json={**body, "prompt": PROMPTS[1], "add_special_tokens": False,
                                              "echo": True}).json()["choices"][0]["text"]
    assert echo == PROMPTS[1] + want  # the echo is the text as sent


def test_cached_tokens_and_cache_salt(http):
    """usage.prompt_tokens_details.cached_tokens reports the prefix cache's share of the prompt;
    cache_salt keeps requests with other salts from it."""
    prompt = list(range(40, 40 + 50))  # 3 full blocks of 16, then a tail
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def cached(**extra):
        r = http.post("/v1/completions", json={**body, **extra}).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached() == 0 and cached() == 48
    assert cached(cache_salt="t1") == 0 and cached(cache_salt="t1") == 48
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "cache_salt": "t2"}
    first = http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    again = http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first == 0 and again > 0


def test_priority_needs_the_priority_policy(http):
    """A request's priority reaches the engine, which (scheduling "fcfs" here) refuses a nonzero one."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
    r = http.post("/v1/completions", json={**body, "priority": 3})
    assert r.status_code == 400 and "scheduling_policy" in r.json()["error"]["message"]


def test_logit_bias_and_allowed_token_ids(client, refs):
    """OpenAI's logit_bias (-100 bans) and vLLM's allowed_token_ids: what LLM.generate gives."""
    want = refs["masked"].outputs[0]
    assert set(want.token_ids) <= set(range(62, 120))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  logit_bias={str(k): v for k, v in MASKED["logit_bias"].items()},
                                  extra_body={"allowed_token_ids": MASKED["allowed_token_ids"], "ignore_eos": True})
    assert r.choices[0].text == want.text


def test_responses_equals_llm_chat(client, refs):
    """/v1/responses (the official client): instructions + input give LLM.chat's reply."""
    r = client.responses.create(model=MODEL, instructions=CHAT[0]["content"], input=CHAT[1]["content"],
                                max_output_tokens=10, temperature=0)
    want = refs["chat"].outputs[0]
    assert r.output_text == want.text and r.usage.output_tokens == len(want.token_ids)
    assert r.status == ("completed" if want.finish_reason == "stop" else "incomplete")


def test_n_seed_and_stop_strings(client, refs):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert len({c.text for c in a.choices}) > 1  # the n samples differ
    assert a.usage.completion_tokens == 30 or any(c.finish_reason == "stop" for c in a.choices)
    # a stop string taken from the middle of the greedy continuation
    full = refs["long"].outputs[0].text
    stop = next(full[i:i + 2] for i in range(5, len(full) - 2) if full[i:i + 2].strip() and
                full.find(full[i:i + 2]) == i)
    cut = full.find(stop)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]


def test_max_tokens_beyond_the_context_is_a_400_like_vllm(client, refs):
    n = len(refs["greedy"][0].prompt_token_ids)
    for mt in (MAX_MODEL_LEN - n + 1, 100_000):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=mt)
        err = e.value.body
        assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
        assert err["message"].startswith(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {n + mt} tokens "
            f"({n} in the prompt, {mt} for the completion).")
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN - n, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - n and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_MODEL_LEN)


def test_200_concurrent_streams_each_get_their_own_output(srv, refs, http):
    prompts = _load_prompts()

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": LOAD_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, finish = [], None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                for ev in sse_events([line]):
                    if ev != "[DONE]":
                        text.append(ev["choices"][0]["text"])
                        finish = ev["choices"][0]["finish_reason"] or finish
        return "".join(text), finish

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(LOAD_N)))

    got = asyncio.run(main())
    want = [o.outputs[0].text for o in refs["load"]]
    assert [g[0] for g in got] == want
    assert all(g[1] == "length" for g in got)
    assert_pool_empty(http)
    assert metric(http, "metrale_time_to_first_token_seconds_count") >= LOAD_N


def slow_steps(srv, monkeypatch, delay_s: float) -> None:
    """Make every engine step take at least `delay_s` (until monkeypatch.undo()), so requests
    outlive the test's checks however fast the machine is."""
    eng = srv.engine_loop.engine
    step = eng.step

    def slow():
        time.sleep(delay_s)
        return step()

    monkeypatch.setattr(eng, "step", slow)


def test_disconnect_frees_blocks(srv, http, monkeypatch):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 80, "ignore_eos": True, "stream": True}
    aborted = metric(http, "metrale_requests_aborted_total")
    slow_steps(srv, monkeypatch, 0.02)
    try:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert metric(http, "metrale_kv_blocks_used") > 0
            assert metric(http, "metrale_num_requests_running") == 1
        assert_pool_empty(http)
        assert metric(http, "metrale_requests_aborted_total") == aborted + 1
        # a non-streaming request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
        assert_pool_empty(http)
        assert metric(http, "metrale_requests_aborted_total") == aborted + 2
    finally:
        monkeypatch.undo()


def test_queue_full_gives_503_then_recovers(srv, http, monkeypatch):
    """16 streams run, 2 wait (the bound is lowered to 2): the next request gets 503 at once.
    Then every stream hangs up: all 18 are aborted and the pool empties."""
    loop = srv.engine_loop
    old = loop.max_waiting
    release = threading.Event()
    started = [threading.Event() for _ in range(18)]
    statuses: list[int] = []

    def hold_stream(i: int):
        with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream(
                "POST", "/v1/completions",
                json={"prompt": [7 + i] * 5, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            statuses.append(r.status_code)
            started[i].set()
            release.wait(60)

    threads = [threading.Thread(target=hold_stream, args=(i,)) for i in range(18)]
    aborted = metric(http, "metrale_requests_aborted_total")
    slow_steps(srv, monkeypatch, 0.05)
    try:
        for t in threads[:16]:
            t.start()
        wait_until(lambda: metric(http, "metrale_num_requests_running") == 16, what="16 running")
        # (lowered only now: a burst counts as waiting until the next step admits it)
        monkeypatch.setattr(loop, "max_waiting", 2)
        for t in threads[16:]:
            t.start()
        wait_until(lambda: metric(http, "metrale_num_requests_waiting") == 2, what="2 waiting")
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full" and time.monotonic() - t0 < 2
        assert metric(http, 'metrale_requests_rejected_total{reason="queue_full"}') >= 1
        assert http.get("/health").status_code == 200
        assert all(e.wait(30) for e in started)
    finally:
        release.set()
        for t in threads:
            if t.ident is not None:
                t.join()
        monkeypatch.undo()
    assert loop.max_waiting == old
    assert statuses == [200] * 18
    assert_pool_empty(http)
    assert metric(http, "metrale_requests_aborted_total") == aborted + 18
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(-3, 3, allow_nan=False),
                    st.text(max_size=6), st.lists(st.integers(-1, 300), max_size=4), st.just([]),
                    st.just([{"role": "user", "content": "hi"}]), st.just({"include_usage": True}))
_FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
           "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
           "ignore_eos", "stream", "stream_options", "stop_token_ids", "model", "junk"]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=7))
def test_fuzzed_bodies_never_break_the_server(http, path, body):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4
    body.setdefault("max_tokens", 3)
    r = http.post(path, json=body)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/completions", json={"prompt": "canary", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_cli_subprocess_serves_and_stops_on_sigterm(model_dir):
    """`python -m metrale_jax.server` with engine options and an API key; SIGTERM mid-stream lets the
    stream finish, then the process exits 0."""
    port = free_port()
    cache = jax.config.jax_compilation_cache_dir or "none"
    cmd = [sys.executable, "-m", "metrale_jax.server", str(model_dir), "--port", str(port), "--api-key", "k3y",
           "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--num-kv-blocks", "256",
           "--decode-buckets", "16", "--mixed-decode-buckets", "16", "--prefill-buckets", "128",
           "--compilation-cache-dir", cache, "--no-show-progress", "--shutdown-timeout", "60",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(__file__).parent.parent), env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
        headers = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"] == MODEL
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
