"""The engine on real checkpoints against transformers' goldens: greedy ids, logprobs and prompt
logprobs (float32, 1e-3) for the tiny fixtures and the real SmolLM2 GGUF, and batch invariance
(alone vs mixed with prompts of very different lengths, chunked prefill at odd places)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from metrale_jax import load_model
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.stack import Unstacked
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES

TINY = ["llama_tiny", "qwen2_tiny", "qwen3_tiny", "qwen3_yarn_tiny", "mistral_swa_tiny",
        "llama_bias_tiny", "llama_tied_sharded"]

# tiny buckets: block_size 4 and a 16-token budget split prompts across blocks and steps
TINY_CONFIG = EngineConfig(
    dtype="float32", max_model_len=96, block_size=4, num_kv_blocks=80, max_num_seqs=4, max_num_batched_tokens=16,
    decode_buckets=(4,), mixed_decode_buckets=(4,), prefill_buckets=(16,), max_prefill_streams=2, max_logprobs=4,
    show_progress=False,
)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    path = FIXTURES / request.param
    model, params = load_model(path, dtype="float32", show_progress=False)
    # two of the four walk the layers in Python over per-layer arrays and run decode steps on 8
    # padded rows (the decode bucket has 4), as on the GPU; one of them samples with the searches'
    # counting kernel (interpreted)
    unroll = request.param in ("qwen3_tiny", "llama_tied_sharded")
    kernel = request.param == "llama_tied_sharded"
    # qwen2 (q/k/v biases) and llama_bias (q/k/v/o biases) run in a LoRA engine without adapters: its
    # A columns appended to the base weights, the biases padded (lora/manager.py) must leave the base
    # model's outputs as they are
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=4) if request.param in ("qwen2_tiny",
                                                                                    "llama_bias_tiny") else {}
    cfg = dataclasses.replace(TINY_CONFIG, attention=AttentionConfig(
        unroll_layers=unroll, min_decode_rows=8 if unroll else 1, sampler_kernel=kernel, interpret=kernel), **lora)
    eng = LLMEngine(model, params, cfg)
    assert not lora or set(eng.lora.folded.values()) == {"wqkv", "wo", "w_gate_up", "w_down"}
    assert ("bo" in params["layers"]) == (request.param == "llama_bias_tiny")
    assert isinstance(params["layers"]["wo"], Unstacked) == unroll  # split in place
    return eng, dict(np.load(path / "golden.npz"))


def test_tiny_greedy_logprobs_prompt_logprobs(tiny):
    eng, g = tiny
    prompt = g["greedy_prompt"].tolist()
    n = len(g["greedy_ids"])
    ref_lp = _log_softmax(g["greedy_logits"])  # position t predicts token t+1
    # the greedy prompt alongside the three logits-golden sequences (lengths 1, 7, 64)
    seqs = [g["input_ids"][i, : g["lengths"][i]].tolist() for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=2, prompt_logprobs=2)
    outs = eng.generate([{"prompt_token_ids": prompt}] + [{"prompt_token_ids": s} for s in seqs],
                        [sp] + [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)] * 3)
    c = outs[0].outputs[0]
    assert c.token_ids == g["greedy_ids"].tolist()
    for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref_lp[len(prompt) - 1 + i]
        assert abs(d[t].logprob - row[t]) < 1e-3 and d[t].rank == 1
        assert set(np.argsort(-row)[:2]) == set(d)
    plp = outs[0].prompt_logprobs
    assert plp[0] is None
    for i in range(1, len(prompt)):
        assert abs(plp[i][prompt[i]].logprob - ref_lp[i - 1, prompt[i]]) < 1e-3
    for s, o, j in zip(seqs, outs[1:], range(3)):
        ref = _log_softmax(g["logits"][j, : len(s)])
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(s)
        for i in range(1, len(s)):
            d = o.prompt_logprobs[i]
            assert abs(d[s[i]].logprob - ref[i - 1, s[i]]) < 1e-3
            assert d[s[i]].rank == int((ref[i - 1] >= ref[i - 1, s[i]] - 1e-6).sum())
        # the first generated token is the argmax of the last prompt position
        assert o.outputs[0].token_ids[0] == int(np.argmax(ref[-1]))


def test_batch_invariance(tiny):
    """Greedy tokens of prompts run alone equal those run together with very different lengths,
    arriving at different times so prefill chunks split them at other places."""
    eng, g = tiny
    if eng.model_name.endswith(("qwen2_tiny", "llama_tied_sharded")):
        pytest.skip("one llama and one qwen run this (compile budget)")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 37, 1, 23, 61)]
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    alone = [eng.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=9, ignore_eos=True)
    alone_seeded = eng.generate([{"prompt_token_ids": prompts[1]}], seeded)[0].outputs[0].token_ids
    # mixed: staggered arrivals (the step in between shifts every later chunk boundary)
    for i in (4, 0):
        eng.add_request(f"m{i}", {"prompt_token_ids": prompts[i]}, sp)
    eng.step()
    for i in (2, 1, 3):
        eng.add_request(f"m{i}", {"prompt_token_ids": prompts[i]}, sp)
        eng.step()
    eng.add_request("seeded", {"prompt_token_ids": prompts[1]}, seeded)
    final = eng.run_to_completion()
    assert [final[f"m{i}"].outputs[0].token_ids for i in range(5)] == alone
    assert final["seeded"].outputs[0].token_ids == alone_seeded


# ---- SmolLM2 (the real GGUF) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from tests._smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    golden = json.loads((FIXTURES / "smollm2_golden.json").read_text())
    model, params = load_model(path, dtype="float32", show_progress=False)
    cfg = EngineConfig(dtype="float32", max_model_len=80, block_size=16, num_kv_blocks=12, max_num_seqs=2,
                       max_num_batched_tokens=32, decode_buckets=(2,), mixed_decode_buckets=(2,),
                       prefill_buckets=(32,), max_prefill_streams=2, max_logprobs=2, show_progress=False)
    return LLMEngine(model, params, cfg), golden


def test_smollm2_greedy_and_logprobs(smollm2):
    eng, golden = smollm2
    cases = golden["cases"]
    assert len(cases) >= 2
    sps = [SamplingParams(temperature=0, max_tokens=len(c["greedy_ids"]), min_tokens=len(c["greedy_ids"]),
                          logprobs=1, prompt_logprobs=1) for c in cases]
    outs = eng.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases], sps)
    for c, o in zip(cases, outs):
        out = o.outputs[0]
        assert len(c["greedy_ids"]) >= 24
        assert out.token_ids == c["greedy_ids"], c["name"]
        assert out.text == c["greedy_text"]
        gen = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
        np.testing.assert_allclose(gen, c["generated_logprobs"], atol=1e-3)
        assert o.prompt_logprobs[0] is None and c["prompt_logprobs"][0] is None
        got = [o.prompt_logprobs[i][t].logprob for i, t in enumerate(c["prompt_token_ids"]) if i > 0]
        np.testing.assert_allclose(got, c["prompt_logprobs"][1:], atol=1e-3)
