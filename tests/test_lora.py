"""Multi-LoRA serving against transformers + PEFT (tests/fixtures/data/lora, made by
make_fixtures.py --only lora_*): one batch mixing rows with adapter a, the base model, adapter b
and adapter a again gives, row by row, the greedy ids, generated logprobs and prompt logprobs
(float32, 1e-3) of each adapter run alone; adapters swap through the slots (LRU) and the host
cache without a compile; bad adapters are refused before anything is queued."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from metrale_jax import LLM, LoRARequest, load_model
from metrale_jax.engine.compile import CompileCounter
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.errors import (
    InvalidRequestError,
    LoRAAdapterNotFoundError,
    LoRAError,
    LoRAFormatError,
    LoRANotEnabledError,
    LoRARankTooLargeError,
    LoRAShapeError,
    LoRATargetError,
)
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES

LORA = FIXTURES / "lora"
CFG = EngineConfig(
    dtype="float32", max_model_len=48, block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
    decode_buckets=(4,), mixed_decode_buckets=(4,), prefill_buckets=(16,), max_prefill_streams=2, max_logprobs=2,
    show_progress=False, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
)


def _engine(name: str, unroll: bool = False, lora_kernel: str = "auto", pad_rows: bool = False, **kw) -> LLMEngine:
    """pad_rows: decode steps on 8 rows (the buckets' 4 padded), as the GPU runs a few rows
    (`min_decode_rows`; the deltas on the live rows only); lora_kernel "pallas": every Pallas
    kernel (attention, RoPE + K/V write, expand-add) interpreted, as the GPU path runs them."""
    model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    fused = lora_kernel == "pallas"
    attn = AttentionConfig(unroll_layers=unroll, lora_kernel=lora_kernel, use_pallas=fused, interpret=fused,
                           min_decode_rows=8 if pad_rows else 1)
    cfg = dataclasses.replace(CFG, attention=attn, **kw)
    return LLMEngine(model, params, cfg)


def _check(outs, g, names):
    """Row i ran prompt i with adapter names[i] ("base" = none): compare with that adapter's goldens."""
    for i, (o, name) in enumerate(zip(outs, names)):
        n = int(g["prompt_lens"][i])
        prompt = g["prompts"][i, :n]
        c = o.outputs[0]
        assert c.token_ids == g[f"{name}_greedy"][i].tolist(), (i, name)
        for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(d[t].logprob - g[f"{name}_gen_lp"][i, j]) < 1e-3, (i, name, j)
        for p in range(1, n):
            got = o.prompt_logprobs[p][int(prompt[p])].logprob
            assert abs(got - g[f"{name}_prompt_lp"][i, p]) < 1e-3, (i, name, p)


def _run(llm, g, names, reqs):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": g["prompts"][i, : g["prompt_lens"][i]].tolist()} for i in range(len(names))]
    return llm.generate(prompts, sp, lora_request=[reqs[n] for n in names])


def _permuted_copy(src, dst):
    """The same adapter with its rank dimensions permuted: an identical function under another
    name and id (so it has the goldens of `src` while taking another slot)."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    t = load_file(src / "adapter_model.safetensors")
    out = {}
    for k, v in t.items():
        r = v.shape[0] if ".lora_A." in k else v.shape[1]
        perm = np.random.default_rng(r).permutation(r)
        out[k] = np.ascontiguousarray(v[perm] if ".lora_A." in k else v[:, perm])
    save_file(out, dst / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def llama_eng():
    eng = _engine("llama_tiny", max_lora_rank=8)
    assert eng.lora.folded == {"qkv_a": "wqkv", "o_a": "wo", "gate_up_a": "w_gate_up", "down_a": "w_down"}
    return eng


def test_llama_mixed_batch_and_swaps(llama_eng, tmp_path):
    eng = llama_eng
    llm = LLM.from_engine(eng)
    g = dict(np.load(LORA / "llama_tiny" / "golden.npz"))
    _permuted_copy(LORA / "llama_tiny" / "a", tmp_path / "c")
    reqs = {"base": None, "a": LoRARequest("a", 1, str(LORA / "llama_tiny" / "a")),
            "b": LoRARequest("b", 2, str(LORA / "llama_tiny" / "b")), "c": LoRARequest("c", 3, str(tmp_path / "c"))}
    with CompileCounter() as cc:
        _check(_run(llm, g, ["a", "base", "b", "a"], reqs), g, ["a", "base", "b", "a"])
        # a third adapter: slots (2) and host cache (2) both evict their least recently used
        _check(_run(llm, g, ["c", "b", "base", "c"], reqs), g, ["a", "b", "base", "a"])
        assert eng.lora.num_slot_loads == 3 and set(eng.lora.host) == {2, 3}
        # three adapters in one call, two slots: the scheduler runs at most two at once
        _check(_run(llm, g, ["a", "c", "b", "base"], reqs), g, ["a", "a", "b", "base"])
        assert len(eng.lora.host) <= 2 and eng.lora.num_host_loads >= 4  # a was read from disk again
        assert eng.lora.num_slot_loads >= 4
        assert eng.remove_lora(1) and 1 not in eng.list_loras()
    assert (cc.lowerings, cc.backend_compiles) == (0, 0)


def test_llama_preemption_keeps_adapters(llama_eng):
    """A KV pool too small for the batch: sequences are preempted (recompute) and resumed with
    their adapters; outputs stay those of each adapter alone."""
    eng = llama_eng
    g = dict(np.load(LORA / "llama_tiny" / "golden.npz"))
    reqs = {"base": None, "a": LoRARequest("a2", 31, str(LORA / "llama_tiny" / "a")),
            "b": LoRARequest("b", 2, str(LORA / "llama_tiny" / "b"))}
    saved = eng.scheduler
    eng.scheduler = eng._new_scheduler(num_blocks=14)
    try:
        names = ["a", "b", "base", "a"]
        _check(_run(LLM.from_engine(eng), g, names, reqs), g, names)
        assert eng.scheduler.num_preemptions > 0
    finally:
        eng.scheduler = saved


@pytest.mark.parametrize("name,kernel", [("qwen3_tiny", "gather"), ("llama_tiny", "pallas"),
                                         pytest.param("qwen3_tiny", "pallas", marks=pytest.mark.slow)])
def test_mixed_batch_unrolled(name, kernel):
    """Decode steps on 8 rows, 4 of them live ("auto" takes "masked" at these buckets). pallas:
    the expand-add kernel and the other Pallas kernels, interpreted (on Llama, with no q/k norm,
    the fused RoPE + K/V write kernel reads the q|k|v kernel's output)."""
    eng = _engine(name, unroll=True, lora_kernel=kernel, pad_rows=True)
    assert len(eng.lora.folded) == 4
    g = dict(np.load(LORA / name / "golden.npz"))
    reqs = {"base": None, "a": LoRARequest("a", 7, str(LORA / name / "a")),
            "b": LoRARequest("b", 9, str(LORA / name / "b"))}
    names = ["a", "base", "b", "a"]
    with CompileCounter() as cc:  # slot writes into per-layer (Unstacked) arrays compile nothing either
        _check(_run(LLM.from_engine(eng), g, names, reqs), g, names)
    assert (cc.lowerings, cc.backend_compiles) == (0, 0)


def test_qwen3_moe_expert_lora():
    eng = _engine("qwen3_moe_tiny")
    g = dict(np.load(LORA / "qwen3_moe_tiny" / "golden.npz"))
    reqs = {"base": None, "experts": LoRARequest("experts", 1, str(LORA / "qwen3_moe_tiny" / "experts")),
            "attn": LoRARequest("attn", 2, str(LORA / "qwen3_moe_tiny" / "attn"))}
    names = ["experts", "base", "attn", "experts"]
    _check(_run(LLM.from_engine(eng), g, names, reqs), g, names)
    assert eng.lora.has_experts(1) and not eng.lora.has_experts(2)
    assert eng.lora.folded == {"qkv_a": "wqkv", "o_a": "wo"}  # (the experts' A stays in its own groups)


@pytest.mark.parametrize("name", ["mixtral_tiny", "qwen2_moe_tiny"])
def test_mixtral_and_qwen2_moe_expert_lora(name):
    """Mixtral's adapter names (block_sparse_moe.experts.<e>.w1 / w3 / w2, target_modules w1-w3)
    served on its experts, with q / v beside them; Qwen2-MoE's routed experts with q / o (its
    biased q/k/v and its shared expert beside them); against the merged weights' outputs."""
    eng = _engine(name)
    g = dict(np.load(LORA / name / "golden.npz"))
    reqs = {"base": None, "experts": LoRARequest("experts", 1, str(LORA / name / "experts"))}
    names = ["experts", "base", "experts", "base"]
    _check(_run(LLM.from_engine(eng), g, names, reqs), g, names)
    assert eng.lora.has_experts(1)


@pytest.mark.slow  # (CI: Qwen3-MoE's expert adapters take the same grouped-GEMM path)
def test_qwen3_next_expert_lora():
    eng = _engine("qwen3_next_tiny", preemption_mode="recompute")
    g = dict(np.load(LORA / "qwen3_next_tiny" / "golden.npz"))
    reqs = {"base": None, "experts": LoRARequest("e1", 1, str(LORA / "qwen3_next_tiny" / "experts")),
            "experts2": LoRARequest("e2", 2, str(LORA / "qwen3_next_tiny" / "experts2"))}
    names = ["experts", "base", "experts2", "experts"]
    _check(_run(LLM.from_engine(eng), g, names, reqs), g, names)
    assert "qkv_a" not in eng.params["layers"]["lora"]  # experts only on this family


# ---- refusals (no engine step needed) ------------------------------------------------------------
def _bad(tmp_path, name, edit_cfg=None, edit_tensors=None, src=LORA / "llama_tiny" / "a"):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    if edit_cfg:
        edit_cfg(cfg)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    t = load_file(src / "adapter_model.safetensors")
    if edit_tensors:
        t = edit_tensors(t)
    if t is not None:
        save_file(t, d / "adapter_model.safetensors")
    return str(d)


def test_bad_adapters_refused(tmp_path):
    from metrale_jax.lora.adapter import LoRASpec, load_peft_adapter
    from metrale_jax.model import Model

    model, _ = load_model(FIXTURES / "llama_tiny", dtype="float32", show_progress=False)
    spec = LoRASpec.for_model(model, 2, 8)
    ok = load_peft_adapter(LORA / "llama_tiny" / "a", spec, np.float32)
    assert ok.rank == 8 and len(ok.targets) == 7 and not ok.has_experts
    cases = [
        (LoRAAdapterNotFoundError, str(tmp_path / "nowhere")),
        (LoRAAdapterNotFoundError, _bad(tmp_path, "no_st", edit_tensors=lambda t: None)),
        (LoRARankTooLargeError, str(LORA / "qwen3_tiny" / "a")),  # rank 16 > 8 (and qwen3 shapes)
        (LoRAShapeError, _bad(tmp_path, "shape", edit_tensors=lambda t: {  # another model's hidden size
            k: (v[:, :32] if ".lora_A." in k else v) for k, v in t.items()})),
        (LoRAShapeError, _bad(tmp_path, "layer", edit_tensors=lambda t: {  # a layer the model lacks
            k.replace("layers.2.", "layers.3."): v for k, v in t.items()})),
        (LoRATargetError, _bad(tmp_path, "lm_head", edit_cfg=lambda c: c.update(target_modules=["q_proj", "lm_head"]))),
        (LoRATargetError, _bad(tmp_path, "embed", edit_tensors=lambda t: {
            **t, "base_model.model.model.embed_tokens.lora_A.weight": np.zeros((8, 256), np.float32),
            "base_model.model.model.embed_tokens.lora_B.weight": np.zeros((64, 8), np.float32)})),
        (LoRATargetError, str(LORA / "qwen3_moe_tiny" / "experts")),  # experts on a dense model
        (LoRAFormatError, _bad(tmp_path, "dora", edit_cfg=lambda c: c.update(use_dora=True))),
        (LoRAFormatError, _bad(tmp_path, "half", edit_tensors=lambda t: {
            k: v for k, v in t.items() if k != "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"})),
    ]
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(LORA / "llama_tiny" / "a" / "adapter_config.json", d)
    (d / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    cases.append((LoRAFormatError, str(d)))
    for err, path in cases:
        with pytest.raises(err):
            load_peft_adapter(path, spec, np.float32)
    nxt, _ = load_model(FIXTURES / "qwen3_next_tiny", dtype="float32", show_progress=False)
    with pytest.raises(LoRATargetError, match="experts"):  # Qwen3-Next: no attention LoRA
        load_peft_adapter(LORA / "qwen3_moe_tiny" / "attn", LoRASpec.for_model(nxt, 2, 8), np.float32)
    assert issubclass(LoRAFormatError, LoRAError) and isinstance(Model, type)


def test_requests_refused_before_queuing(llama_eng):
    eng = llama_eng  # max_lora_rank=8
    sp = SamplingParams(max_tokens=2)
    p = {"prompt_token_ids": [5, 6, 7]}
    good = LoRARequest("b", 2, str(LORA / "llama_tiny" / "b"))
    bad = LoRARequest("q", 11, str(LORA / "qwen3_tiny" / "a"))  # rank 16
    with pytest.raises(LoRARankTooLargeError, match="max_lora_rank=8"):
        LLM.from_engine(eng).generate([p, p], sp, lora_request=[good, bad])
    with pytest.raises(InvalidRequestError, match="2 LoRA requests for 1 prompts"):
        LLM.from_engine(eng).generate([p], sp, lora_request=[good, good])
    assert not eng.requests and not eng.scheduler.has_work()
    with pytest.raises(LoRAError, match="already adapter"):
        eng.add_request("x", p, sp, lora_request=LoRARequest("other", 2, str(LORA / "llama_tiny" / "a")))
    with pytest.raises(LoRAError):
        LoRARequest("z", 0, "/x")
    mgr, eng.lora = eng.lora, None  # as an engine built without enable_lora
    try:
        with pytest.raises(LoRANotEnabledError):
            eng.add_request("y", p, sp, lora_request=good)
    finally:
        eng.lora = mgr
    assert not eng.requests


def test_server_lora_modules(llama_eng):
    """`model` picks the adapter; /v1/models lists it; load / unload as vLLM, behind the API key."""
    httpx = pytest.importorskip("httpx")
    from metrale_jax.server import BackgroundServer, ServerConfig

    g = dict(np.load(LORA / "llama_tiny" / "golden.npz"))
    cfg = ServerConfig(model_names=("llama",), api_key="k",
                       lora_modules=(LoRARequest("a", 21, str(LORA / "llama_tiny" / "a")),))
    auth = {"Authorization": "Bearer k"}

    def complete(c, model, i):
        body = {"model": model, "prompt": g["prompts"][i, : g["prompt_lens"][i]].tolist(), "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "logprobs": 0}
        return c.post("/v1/completions", json=body, headers=auth)

    with BackgroundServer(llama_eng, cfg) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        models = c.get("/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("llama", None), ("a", "llama")]
        for model, name, i in (("a", "a", 0), ("llama", "base", 1)):
            r = complete(c, model, i)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["choices"][0]["logprobs"]["token_logprobs"], g[f"{name}_gen_lp"][i],
                                       atol=1e-3)
        assert complete(c, "b", 2).status_code == 404
        load = {"lora_name": "b", "lora_path": str(LORA / "llama_tiny" / "b")}
        assert c.post("/v1/load_lora_adapter", json=load).status_code == 401
        assert c.post("/v1/load_lora_adapter", json=load, headers=auth).status_code == 200
        r = complete(c, "b", 2)
        np.testing.assert_allclose(r.json()["choices"][0]["logprobs"]["token_logprobs"], g["b_gen_lp"][2], atol=1e-3)
        bad = c.post("/v1/load_lora_adapter", headers=auth,
                     json={"lora_name": "q", "lora_path": str(LORA / "qwen3_tiny" / "a")})  # rank 16 > 8
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "lora_rank_too_large"
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth).status_code == 200
        assert complete(c, "b", 2).status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth).status_code == 404


# ---- the kernels against numpy -------------------------------------------------------------------
def test_lora_delta_kernels_and_token_slots():
    import jax.numpy as jnp

    from metrale_jax.lora.ops import lora_delta, token_slots
    from metrale_jax.metadata import BatchedAttnMetadata

    rng = np.random.default_rng(0)
    s, r, t, n_in, outs = 3, 4, 7, 10, (6, 5)
    x = rng.standard_normal((t, n_in), np.float32)
    a = rng.standard_normal((s, len(outs) * r, n_in), np.float32)
    bs = [rng.standard_normal((s, r, o), np.float32) for o in outs]
    bd = np.zeros((s, len(outs) * r, sum(outs)), np.float32)  # block diagonal, as the slots store it
    for j, b in enumerate(bs):
        bd[:, j * r:(j + 1) * r, sum(outs[:j]):sum(outs[:j + 1])] = b
    slot = np.array([2, -1, 0, 2, 1, -1, 0], np.int32)
    ref = np.zeros((t, sum(outs)), np.float32)
    for i, k in enumerate(slot):
        if k >= 0:
            ref[i] = np.concatenate([(a[k, j * r:(j + 1) * r] @ x[i]) @ b[k] for j, b in enumerate(bs)])
    for kernel in ("masked", "gather", "auto"):
        got = lora_delta(jnp.asarray(x), jnp.asarray(slot), jnp.asarray(a), jnp.asarray(bd), kernel)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    # the Pallas expand-add kernel (interpreted): the shrink apart (FP8 / 4-bit bases) or folded,
    # with and without the residual; past 64 tokens: "masked"
    from metrale_jax.lora.ops import LoRAInputs, add_delta

    y = rng.standard_normal((t, sum(outs)), np.float32)
    res = rng.standard_normal((t, sum(outs)), np.float32)
    lw = {"qkv_a": jnp.asarray(a), "qkv_b": jnp.asarray(bd)}
    lora = LoRAInputs(lw, jnp.asarray(slot), jnp.asarray(slot), "pallas", interpret=True)
    got = add_delta(jnp.asarray(y), jnp.asarray(x), lora, "qkv_a", "qkv_b", outs)
    np.testing.assert_allclose(np.asarray(got), y + ref, rtol=1e-5, atol=1e-5)
    got = add_delta(jnp.asarray(y), jnp.asarray(x), lora, "qkv_a", "qkv_b", outs, residual=jnp.asarray(res))
    np.testing.assert_allclose(np.asarray(got), res + y + ref, rtol=1e-5, atol=1e-5)
    # A folded into the base weight: y carries every slot's shrink after its own columns; the
    # decode rows past `live` (padding) get no delta
    y_ext = jnp.asarray(np.concatenate([y, np.einsum("ti,sri->tsr", x, a).reshape(t, -1)], axis=1))
    for kernel, pallas in (("masked", False), ("gather", False), ("auto", False), ("auto", True), ("pallas", False)):
        for live in (0, 5):
            lora = LoRAInputs({"qkv_b": jnp.asarray(bd)}, jnp.asarray(slot), jnp.asarray(slot), kernel,
                              interpret=True, live=live, pallas=pallas)
            want = y + np.where(np.arange(t)[:, None] < (live or t), ref, 0)
            got = np.asarray(add_delta(y_ext, jnp.asarray(x), lora, "qkv_a", "qkv_b", outs))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            got = np.asarray(add_delta(y_ext, jnp.asarray(x), lora, "qkv_a", "qkv_b", outs, jnp.asarray(res)))
            np.testing.assert_allclose(got, res + want, rtol=1e-5, atol=1e-5)
    # a gate|up projection returning its SwiGLU activation (the kernel: in the same launch)
    gu = np.zeros((s, 2 * r, 12), np.float32)
    gu[:, :r, :6], gu[:, r:, 6:] = bs[0], rng.standard_normal((s, r, 6), np.float32)
    g_ref = np.zeros((t, 12), np.float32)
    for i, k in enumerate(slot):
        if k >= 0:
            g_ref[i] = np.concatenate([(a[k, j * r:(j + 1) * r] @ x[i]) @ gu[k, j * r:(j + 1) * r, j * 6:(j + 1) * 6]
                                       for j in range(2)])
    y12 = rng.standard_normal((t, 12), np.float32)
    pre = y12 + g_ref
    want = pre[:, :6] / (1 + np.exp(-pre[:, :6])) * pre[:, 6:]
    y12_ext = jnp.asarray(np.concatenate([y12, np.einsum("ti,sri->tsr", x, a).reshape(t, -1)], axis=1))
    for kernel in ("masked", "gather", "pallas"):
        lora = LoRAInputs({"gate_up_b": jnp.asarray(gu)}, jnp.asarray(slot), jnp.asarray(slot), kernel, interpret=True)
        got = np.asarray(add_delta(y12_ext, jnp.asarray(x), lora, "gate_up_a", "gate_up_b", (6, 6), silu_mul=True))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # the product before an RMSNorm's row scale (`rms_norm_matmul`): y and the shrink columns times
        # r = rsqrt(sum_sq / size + eps)
        from metrale_jax.layers.norms import RowNorm

        ss = rng.uniform(2.0, 30.0, (t, 1)).astype(np.float32)
        r = 1 / np.sqrt(ss / 10 + 1e-3)
        got = np.asarray(add_delta(y12_ext / r, jnp.asarray(x), lora, "gate_up_a", "gate_up_b", (6, 6),
                                   silu_mul=True, row_norm=RowNorm(jnp.asarray(ss), 1e-3, 10)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    big = np.repeat(x, 10, axis=0)  # 70 tokens
    lora = LoRAInputs(lw, jnp.asarray(np.repeat(slot, 10)), jnp.asarray(np.repeat(slot, 10)), "pallas")
    got = add_delta(jnp.asarray(np.repeat(y, 10, axis=0)), jnp.asarray(big), lora, "qkv_a", "qkv_b", outs)
    np.testing.assert_allclose(np.asarray(got), np.repeat(y + ref, 10, axis=0), rtol=1e-5, atol=1e-5)
    # prefill tokens take their stream's slot; pad tokens -1
    pmd = BatchedAttnMetadata(*(np.zeros(8, np.int32),) * 4, block_tables=np.zeros((3, 1), np.int32),
                              cu_seqlens=np.array([0, 3, 4, 4], np.int32), kv_lens=np.zeros(3, np.int32),
                              ssm_slots=np.zeros(3, np.int32), seq_slot=np.array([5, -1, 7], np.int32),
                              moe_row_adapter=np.array([1, 2, 3], np.int32), num_tokens=8, num_streams=3)
    assert np.asarray(token_slots(None, pmd)).tolist() == [5, 5, 5, -1, -1, -1, -1, -1]
    assert np.asarray(token_slots(None, pmd, "moe_row_adapter")).tolist() == [1, 1, 1, 2, -1, -1, -1, -1]


def test_expert_lora_virtual_groups():
    import jax.numpy as jnp

    from metrale_jax.layers.moe import routed_experts

    rng = np.random.default_rng(1)
    t, k, e, h, i, s, r = 6, 2, 4, 8, 5, 2, 3
    x = rng.standard_normal((t, h), np.float32)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
    wgu = rng.standard_normal((e, h, 2 * i), np.float32)
    wd = rng.standard_normal((e, i, h), np.float32)
    v = s * e + 1
    shapes = {"x_gate_up_a": (v, h, 2 * r), "x_gate_up_b": (v, 2 * r, 2 * i), "x_down_a": (v, i, r),
              "x_down_b": (v, r, h)}
    lw = {key: rng.standard_normal(sh, np.float32) for key, sh in shapes.items()}
    lw["x_gate_up_b"][:, :r, i:] = lw["x_gate_up_b"][:, r:, :i] = 0  # block diagonal
    for key in lw:
        lw[key][-1] = 0  # the zero group
    moe_slot = np.array([1, -1, 0, 1, -1, 0], np.int32)
    ref = np.zeros((t, h), np.float32)
    for q in range(t):
        for j in range(k):
            ex = experts[q, j]
            gu = x[q] @ wgu[ex]
            if moe_slot[q] >= 0:
                vi = moe_slot[q] * e + ex
                hh = x[q] @ lw["x_gate_up_a"][vi]
                bgu = lw["x_gate_up_b"][vi]
                gu = gu + np.concatenate([hh[:r] @ bgu[:r, :i], hh[r:] @ bgu[r:, i:]])
            act = gu[:i] / (1 + np.exp(-gu[:i])) * gu[i:]
            y = act @ wd[ex]
            if moe_slot[q] >= 0:
                y = y + (act @ lw["x_down_a"][vi]) @ lw["x_down_b"][vi]
            ref[q] += w[q, j] * y
    from metrale_jax.lora.ops import LoRAInputs

    lora = LoRAInputs({kk: jnp.asarray(vv) for kk, vv in lw.items()}, jnp.asarray(moe_slot), jnp.asarray(moe_slot))
    got = routed_experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(experts), jnp.asarray(wgu), jnp.asarray(wd),
                         lora=lora)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=2e-4)


# ---- GPU: the same batches through the GPU's default kernels -------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name,adapters,names", [
    ("llama_tiny", {"a": "a", "b": "b"}, ["a", "base", "b", "a"]),
    ("qwen3_moe_tiny", {"experts": "experts", "attn": "attn"}, ["experts", "base", "attn", "experts"]),
])
@pytest.mark.parametrize("kernel", ["masked", "gather", "pallas"])
def test_gpu_kernels_mixed_batch(name, adapters, names, kernel):
    import jax

    from metrale_jax.engine.config import default_kernels

    prev = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 goldens (compiles run in threads)
    try:
        attn = dataclasses.replace(default_kernels(True, name.endswith("moe_tiny")), lora_kernel=kernel)
        model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
        eng = LLMEngine(model, params, dataclasses.replace(CFG, attention=attn))
        g = dict(np.load(LORA / name / "golden.npz"))
        reqs = {"base": None, **{n: LoRARequest(n, i + 1, str(LORA / name / d)) for i, (n, d) in
                                  enumerate(adapters.items())}}
        _check(_run(LLM.from_engine(eng), g, names, reqs), g, names)
    finally:
        jax.config.update("jax_default_matmul_precision", prev)


def test_scheduler_caps_distinct_adapters():
    """At most max_loras distinct adapters run at once; base-model requests and requests of a
    running adapter are admitted past a waiting one (no head-of-line blocking)."""
    from metrale_jax.engine.scheduler import Request, Scheduler, Sequence

    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_streams=8,
                  max_prefill_tokens=64, watermark_blocks=0, max_loras=2)
    ads = {i: LoRARequest(f"x{i}", i, "/none") for i in (1, 2, 3)}
    seqs = []
    for k, lid in enumerate([1, 2, 3, 0, 1, 3]):
        req = Request(str(k), None, [5, 6, 7], SamplingParams(max_tokens=4), arrival=k, seed=0,
                      lora_request=ads.get(lid))
        seq = Sequence(k, req, 0, [5, 6, 7], 3)
        req.seqs.append(seq)
        seqs.append(seq)
        s.add(seq)
    step = s.schedule()
    assert [c.seq.lora_int_id for c in step.chunks] == [1, 2, 0, 1]  # adapter 3 waits for a slot
    assert seqs[0].lora_key == (1, "x1", "/none") and seqs[3].lora_key is None  # the prefix cache's extra key
    assert [q.lora_int_id for q in s.waiting] == [3, 3]
    s.complete(step)
    for q in [q for q in s.running if q.lora_int_id == 2]:
        s.finish(q)
    step = s.schedule()
    assert [c.seq.lora_int_id for c in step.chunks] == [3, 3]


def test_serve_lora_arguments():
    pytest.importorskip("fastapi")
    from metrale_jax.cli import build_parser
    from metrale_jax.server.cli import engine_config_from_args, lora_modules_from_args

    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
                                      "--lora-modules", "sql=/a", '{"name": "chat", "path": "/b"}'])
    cfg = engine_config_from_args(args, args.model)
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (True, 3, 8, None)
    mods = lora_modules_from_args(args.lora_modules, "m")
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in mods] == [("sql", 1, "/a"), ("chat", 2, "/b")]
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_modules_from_args(["nopath"], "m")


@pytest.mark.gpu
def test_gpu_expert_lora_tokamax_bf16():
    """bf16 Qwen3-MoE with expert LoRA: tokamax's grouped GEMM (the GPU default, virtual experts
    included) against jax.lax.ragged_dot on the same weights: prompt logprobs within bf16 noise."""
    from metrale_jax.engine.config import default_kernels
    from metrale_jax.layers.moe import tokamax_available

    if not tokamax_available():
        pytest.skip("tokamax is not installed")
    g = dict(np.load(LORA / "qwen3_moe_tiny" / "golden.npz"))
    reqs = {"base": None, "experts": LoRARequest("experts", 1, str(LORA / "qwen3_moe_tiny" / "experts")),
            "attn": LoRARequest("attn", 2, str(LORA / "qwen3_moe_tiny" / "attn"))}
    names = ["experts", "base", "attn", "experts"]
    outs = {}
    for tk in (True, False):
        attn = dataclasses.replace(default_kernels(True, True), tokamax_moe=tk)
        model, params = load_model(FIXTURES / "qwen3_moe_tiny", dtype="bfloat16", show_progress=False)
        eng = LLMEngine(model, params, dataclasses.replace(CFG, dtype="bfloat16", attention=attn))
        outs[tk] = _run(LLM.from_engine(eng), g, names, reqs)
    for a, b, i in zip(outs[True], outs[False], range(4)):
        n = int(g["prompt_lens"][i])
        for p in range(1, n):
            t = int(g["prompts"][i, p])
            assert abs(a.prompt_logprobs[p][t].logprob - b.prompt_logprobs[p][t].logprob) < 0.05, (i, p)


def test_expert_slots_can_be_left_out():
    from metrale_jax.lora.adapter import LoRASpec, load_peft_adapter

    model, _ = load_model(FIXTURES / "qwen3_moe_tiny", dtype="float32", show_progress=False)
    full, lean = LoRASpec.for_model(model, 2, 4), LoRASpec.for_model(model, 2, 4, experts=False)
    assert "x_down_b" in full.leaf_shapes() and set(lean.leaf_shapes()) == {"qkv_a", "qkv_b", "o_a", "o_b"}
    assert load_peft_adapter(LORA / "qwen3_moe_tiny" / "attn", lean, np.float32).targets == ("k_proj", "q_proj",
                                                                                              "v_proj")
    with pytest.raises(LoRATargetError, match="lora_experts=False"):
        load_peft_adapter(LORA / "qwen3_moe_tiny" / "experts", lean, np.float32)


def test_fold_in_copies_or_rewrites_in_place():
    """The A columns appended to a base weight: into a new leaf when the caller's params must stay
    as they were, in place (each layer's old array dropped as its successor exists) when the
    engine owns them (`LLMEngine.from_config`)."""
    import jax.numpy as jnp

    from metrale_jax.layers.stack import Unstacked
    from metrale_jax.lora.manager import _fold_in

    parts = [jnp.full((3, 2), i + 1.0) for i in range(2)]
    caller = {"w": Unstacked(parts), "s": jnp.ones((2, 3, 2))}
    layers = dict(caller)
    for name in ("w", "s"):
        _fold_in(layers, name, 4, owned=False)
    assert [p.shape for p in caller["w"].parts] == [(3, 2)] * 2 and caller["s"].shape == (2, 3, 2)
    assert [p.shape for p in layers["w"].parts] == [(3, 6)] * 2 and layers["s"].shape == (2, 3, 6)
    np.testing.assert_array_equal(np.asarray(layers["w"].parts[1]), [[2, 2, 0, 0, 0, 0]] * 3)
    owned = {"w": Unstacked(parts)}
    leaf = owned["w"]
    _fold_in(owned, "w", 4, owned=True)
    assert owned["w"] is leaf and [p.shape for p in leaf.parts] == [(3, 6)] * 2
