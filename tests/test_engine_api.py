"""The faces over the engine: `LLM` (generate, chat, errors), the `metrale` CLI, and the
examples/custom_decode_loop.py script (run in-process, checked against transformers' greedy ids)."""

from __future__ import annotations

import dataclasses
import runpy
import sys

import numpy as np
import pytest

from metrale_jax.engine.testing import fake_engine, fake_greedy
from metrale_jax.errors import EmptyPromptError, InvalidPromptError, ModelNotFoundError
from metrale_jax.llm import LLM, SamplingParams
from tests.conftest import FIXTURES

ROOT = FIXTURES.parents[2]


@pytest.fixture(scope="module")
def llm():
    eng = fake_engine(use_ssm=True)
    eng.scheduler = eng._new_scheduler()
    return LLM.from_engine(eng)


def test_llm_generate_and_chat(llm):
    w = np.asarray(llm.llm_engine.params["w"])
    tok = llm.get_tokenizer()
    outs = llm.generate(["hello there", {"prompt_token_ids": [5, 9, 11]}],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        fake_greedy(w, tok.encode("hello there"), 6, use_ssm=True, ignore_eos=True),
        fake_greedy(w, [5, 9, 11], 6, use_ssm=True, ignore_eos=True)]
    assert outs[0].prompt == "hello there" and outs[0].finished
    one = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(one) == 1
    # chat: one conversation or several, through the tokenizer's template
    conv = [{"role": "user", "content": "hi"}]
    r = llm.chat(conv, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    assert r[0].prompt_token_ids == ids
    assert r[0].outputs[0].token_ids == fake_greedy(w, ids, 3, use_ssm=True, ignore_eos=True)
    assert len(llm.chat([conv, conv + [{"role": "assistant", "content": "yo"}]], SamplingParams(max_tokens=2))) == 2

def test_chat_template_kwargs_reach_the_template(llm, monkeypatch):
    """vLLM's `chat_template_kwargs` dict and plain keyword arguments both reach the template."""
    seen = {}
    tok = llm.get_tokenizer()
    render = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda m, **kw: seen.update(kw) or render(m, **kw))
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), chat_template="T",
             chat_template_kwargs={"enable_thinking": False, "x": 1}, x=2, tools=[{"type": "function"}])
    assert seen["enable_thinking"] is False and seen["x"] == 2 and seen["tools"] == [{"type": "function"}]
    assert seen["chat_template"] == "T" and "chat_template_kwargs" not in seen
    # a bad prompt in a batch rejects the whole batch before anything is queued
    with pytest.raises(EmptyPromptError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    for bad in (5, None, 2.5):  # not a prompt: InvalidPromptError, as for any bad prompt
        with pytest.raises(InvalidPromptError, match="unsupported prompt type"):
            llm.generate(bad, SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_llm_load_errors():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model=str(FIXTURES / "llama_tiny"), dtype="float32", max_model_len=100_000)


def test_cli_generate_streams(llm, monkeypatch, capsys):
    from metrale_jax import cli

    eng = llm.llm_engine
    monkeypatch.setattr(cli, "_load", lambda args: (eng.model, eng.params))
    monkeypatch.setattr(cli, "_build_engine", lambda args, model, params, t0, **kw: eng)
    assert cli.main(["generate", "hello", "--stream", "--temperature", "0", "--max-tokens", "5"]) == 0
    w = np.asarray(llm.llm_engine.params["w"])
    tok = llm.get_tokenizer()
    ref = fake_greedy(w, tok.encode("hello"), 5, use_ssm=True)
    assert capsys.readouterr().out.strip() == tok.decode(ref).strip()
    assert cli.main(["generate", "a", "b", "--temperature", "0", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "--- [0]" in out and "--- [1]" in out
    # a bad request is a clean error exit, not a traceback
    assert cli.main(["generate", "x", "--max-tokens", "0"]) == 2


def test_cli_help_lists_commands(capsys):
    from metrale_jax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "chat", "bench"):
        assert cmd in out


def test_cli_chat_session(llm, monkeypatch, capsys):
    from metrale_jax import cli

    eng = llm.llm_engine
    monkeypatch.setattr(cli, "_load", lambda args: (eng.model, eng.params))
    monkeypatch.setattr(cli, "_build_engine", lambda args, model, params, t0, **kw: eng)
    tok = eng.tokenizer
    monkeypatch.setattr(type(tok), "chat_template", "fake", raising=False)
    lines = iter(["hi", "/reset", "ok?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat", "--temperature", "0", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2  # two streamed replies
    monkeypatch.setattr(type(tok), "chat_template", None, raising=False)


def test_example_custom_decode_loop(capsys, monkeypatch):
    g = np.load(FIXTURES / "llama_tiny" / "golden.npz")
    prompt = [str(t) for t in g["greedy_prompt"]]
    argv = ["custom_decode_loop.py", "--model", str(FIXTURES / "llama_tiny"), "--max-tokens", "16",
            "--prompt-ids", *prompt]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "examples" / "custom_decode_loop.py"), run_name="__main__")
    assert e.value.code == 0
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert line == "ids: " + " ".join(str(t) for t in g["greedy_ids"])


def test_kernel_defaults_and_cli_overrides():
    """GPU default: Pallas kernels and the Python layer loop (tokamax MoE when installed); CPU
    default: the XLA reference in lax.scan; the CLI flags override either part."""
    import argparse

    from metrale_jax.cli import kernels_from_args
    from metrale_jax.engine.config import default_kernels

    gpu, cpu = default_kernels(True), default_kernels(False)
    assert gpu.use_pallas and gpu.unroll_layers and not gpu.interpret
    assert gpu.mosaic_prefill and gpu.fp8_w8a8 and gpu.fp8_kernel  # (asked for on the CPU: an H200's)
    # a GPU without wgmma (e.g. an A100, compute capability 8.0): no Mosaic GPU kernel
    from unittest import mock

    from metrale_jax.engine import config as config_module

    a100 = mock.Mock(platform="gpu", compute_capability="8.0")
    with mock.patch("jax.devices", return_value=[a100]):
        assert not config_module.hopper()
        old = default_kernels(True)
    assert old.use_pallas and old.fp8_kernel and not (old.mosaic_prefill or old.fp8_w8a8)
    with mock.patch("jax.devices", return_value=[mock.Mock(platform="gpu", compute_capability="9.0")]):
        assert config_module.hopper()
    assert not (cpu.use_pallas or cpu.unroll_layers or cpu.tokamax_moe)
    # decode steps of < 8 rows run on 8 on the GPU, only where every linear is a plain dot and no
    # layer routes to experts (the test of the padded rows' outputs: test_engine_models' tiny fixtures)
    assert gpu.min_decode_rows == 8 and cpu.min_decode_rows == 1
    # the sampler skips unneeded work under lax.cond everywhere: the CPU's form, the GPU's form
    assert gpu.sampler_skip and not gpu.sampler_branches and cpu.sampler_branches and not cpu.sampler_skip
    from metrale_jax.layers.linear import Fp8Linear
    from metrale_jax.step import _pads_pay

    dense, moe = mock.Mock(has_experts=False), mock.Mock(has_experts=True)
    w = np.zeros((4, 4), np.float32)
    fp8 = Fp8Linear(np.zeros((128, 4), np.float32), np.ones((1, 1), np.float32), ((0, 128),))
    assert _pads_pay(dense, {"layers": {"wo": w}}, gpu)
    assert not _pads_pay(moe, {"layers": {"wo": w}}, gpu)
    lora = {"layers": {"wo": w, "lora": {"o_a": w}}}
    assert _pads_pay(dense, lora, gpu)  # (the deltas of the live rows only: tests/test_lora.py, pad_rows)
    assert not _pads_pay(dense, {"layers": {"wo": fp8}}, gpu)
    ns = argparse.Namespace
    assert kernels_from_args(ns(pallas=None, unroll_layers=None)) is None
    assert kernels_from_args(ns(pallas=True, unroll_layers=False)) == dataclasses.replace(gpu, unroll_layers=False)
    assert kernels_from_args(ns(pallas=False, unroll_layers=True)) == dataclasses.replace(cpu, unroll_layers=True)


def test_startup_heap_frozen_and_dropped_engines_freed():
    """An engine freezes the start-up heap out of the garbage collector's full passes (gc.freeze);
    an engine dropped afterwards, even in a reference cycle, is freed when the next one starts (it
    unfreezes, collects before sizing its KV pool from free GPU memory and before its own freeze)."""
    import gc
    import weakref

    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.engine.testing import FAKE_ENGINE_CONFIG, FakeModel

    model = FakeModel(use_ssm=False)
    cfg = EngineConfig(**FAKE_ENGINE_CONFIG).replace(max_num_seqs=2, max_num_batched_tokens=8, decode_buckets=(2,),
                                                     mixed_decode_buckets=(2,), prefill_buckets=(8,),
                                                     max_prefill_streams=1, max_logprobs=0)
    a = LLMEngine(model, model.init_params(), cfg)
    assert gc.get_freeze_count() > 0
    a.cycle = a  # (whatever else holds it, a cycle keeps it from being freed by reference counts)
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is not None  # frozen: a full collection does not see it
    b = LLMEngine(model, model.init_params(), cfg)
    assert ref() is None and gc.get_freeze_count() > 0
    del b


def test_priority_scheduling():
    """scheduling_policy="priority" (vLLM's): waiting requests are admitted lowest priority first,
    whatever their arrival; under "fcfs" a nonzero priority is refused."""
    from metrale_jax.errors import InvalidRequestError

    eng = fake_engine(use_ssm=False, scheduling_policy="priority")
    eng.scheduler = eng._new_scheduler()
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prios = [5, 5, 5, 5, 0, -1, 0, 2]  # max_num_seqs=4, two prefill streams a step
    for i, pr in enumerate(prios):
        eng.add_request(f"p{i}", {"prompt_token_ids": [3 + i, 4, 5]}, sp, priority=pr)
    admitted = []
    for _ in range(2):
        eng.step()
        admitted.append(sorted(s.request.request_id for s in eng.scheduler.running
                               if s.request.request_id not in sum(admitted, [])))
    assert admitted == [["p4", "p5"], ["p6", "p7"]]  # (-1, 0 first; then 0, 2; the 5s wait)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert set(order[:4]) == {"p4", "p5", "p6", "p7"} and len(order) == 8
    llm = LLM.from_engine(eng)
    outs = llm.generate([{"prompt_token_ids": [9, 9]}] * 2, sp, priority=[3, -3])
    assert len(outs) == 2
    with pytest.raises(InvalidRequestError, match="2 priorities for 1 prompts"):
        llm.generate([{"prompt_token_ids": [9, 9]}], sp, priority=[1, 2])
    fcfs = fake_engine(use_ssm=False)
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
        fcfs.add_request("x", {"prompt_token_ids": [3, 4]}, sp, priority=1)
    assert not fcfs.has_unfinished_requests() and not eng.has_unfinished_requests()
    eng.scheduler = eng._new_scheduler()


def test_llm_takes_vllms_constructor_arguments(monkeypatch, caplog, tmp_path):
    """What ported vLLM scripts pass: `tokenizer` (loaded in place of the model's: a GGUF file or a
    folder with tokenizer.json), `swap_space` (GiB), `trust_remote_code` and `enforce_eager`
    (accepted; the latter logged); unknown names still fail. The same through `EngineArgs` and
    `LLMEngine.from_engine_args`."""
    from metrale_jax.engine import engine as engine_mod
    from metrale_jax.loading.checkpoint import load_tokenizer
    from tests._smollm2 import smollm2_gguf_path

    gguf_tok = load_tokenizer(smollm2_gguf_path())
    gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
    folder_tok = load_tokenizer(tmp_path)
    ids = gguf_tok.encode("hello there, tokenizer")
    assert ids == folder_tok.encode("hello there, tokenizer") and len(ids) > 3
    assert gguf_tok.eos_token_id == gguf_tok.eos_token_ids[0] == gguf_tok.token_to_id("<|im_end|>")
    with pytest.raises(ModelNotFoundError, match="neither tokenizer.json"):
        load_tokenizer(FIXTURES / "llama_tiny")
    # through the engine: llama_tiny has no tokenizer of its own
    llm = LLM(model=str(FIXTURES / "llama_tiny"), tokenizer=str(tmp_path), dtype="float32", show_progress=False,
              trust_remote_code=True, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32)
    cfg = llm.llm_engine.config  # (the defaults: the test below, one LLM(model=...) on them in CI)
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens) == (2, 64, 32)
    assert llm.get_tokenizer().encode("hello there, tokenizer") == ids
    prompt = "a,b+1"  # ids under llama_tiny's 256 (single characters)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == gguf_tok.encode(prompt) and len(out.outputs[0].token_ids) == 3

    seen = {}
    monkeypatch.setattr(engine_mod.LLMEngine, "from_config", classmethod(lambda cls, c: seen.setdefault("c", c)))
    with caplog.at_level("INFO", logger="metrale_jax.llm"):
        LLM(model="m", tokenizer="t", swap_space=2, trust_remote_code=True, enforce_eager=True)
    c = seen["c"]
    assert (c.model, c.tokenizer, c.swap_space_gb) == ("m", "t", 2.0)
    assert "enforce_eager" in caplog.text
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(model="m", no_such_arg=1)
    # vLLM's EngineArgs -> LLMEngine.from_engine_args: the same arguments, mapped the same way
    from metrale_jax import EngineArgs, LLMEngine

    seen.clear()
    LLMEngine.from_engine_args(EngineArgs(model="m2", kv_cache_dtype="fp8", swap_space=1, max_model_len=64))
    c = seen["c"]
    assert (c.model, c.kv_dtype, c.swap_space_gb, c.max_model_len) == ("m2", "float8_e4m3fn", 1.0, 64)
    with pytest.raises(TypeError, match="no_such_arg"):
        EngineArgs(model="m", no_such_arg=1).create_engine_config()
    assert llm.get_default_sampling_params() == SamplingParams()


def test_generation_config_sampling_defaults(tmp_path, caplog):
    """vLLM's `generation_config`: "auto" makes the sampling fields of the model's
    generation_config.json the defaults of requests that set none (max_new_tokens as max_tokens);
    "vllm" keeps SamplingParams' own; a folder gives its file; values SamplingParams refuses are
    left out with a warning."""
    import json
    import shutil

    from metrale_jax.sampling import sampling_defaults

    ckpt = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_tiny", ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=5, top_p=0.5, do_sample=False)
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    with caplog.at_level("WARNING", logger="metrale_jax.sampling"):
        llm = LLM(model=str(ckpt), dtype="float32", show_progress=False)
    assert "generation config" in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5, top_p=0.5)
    prompt = {"prompt_token_ids": [5, 17, 33]}
    got = llm.generate(prompt)[0].outputs[0]
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert len(got.token_ids) == 5 and got.token_ids == want.token_ids
    plain = LLM.from_engine(llm.llm_engine)
    plain.llm_engine.sampling_defaults = sampling_defaults("vllm", gen)
    assert plain.get_default_sampling_params() == SamplingParams()
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 7, "temperature": -1, "max_new_tokens": 0}))
    assert sampling_defaults(str(folder), gen) == {"top_k": 7}  # (the refused values left out)
    with pytest.raises(ValueError, match="does not exist"):
        sampling_defaults(str(tmp_path / "nowhere"), gen)
