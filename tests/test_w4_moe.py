"""4-bit MoE experts (GPTQ / AWQ / compressed-tensors / NVFP4 checkpoints of the MoE families) kept
4-bit on the device: `loading/experts.py`, `layers/moe_w4.py`, `pallas_kernels/linear/expert_w4.py`.

Oracles: the fixtures' goldens (transformers on the weights dequantized by numpy code written from
the formats' documentation, `tests/fixtures/make_fixtures.py`), the experts dequantized and run
dense, and a float64 numpy matvec for the kernel."""

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from metrale_jax import LLM, SamplingParams, load_model
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.linear import W4Linear, use_fp8_kernel
from metrale_jax.layers.moe import routed_experts
from metrale_jax.layers.moe_w4 import dense_experts
from pallas_kernels.linear.expert_w4 import ExpertW4Params, expert_matvec_w4
from tests.conftest import FIXTURES

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float64)
FIXTURE_KEYS = {"qwen3_moe_gptq_tiny": ("experts_gate_up", "experts_down"),
                "mixtral_awq_tiny": ("experts_gate_up", "experts_down")}


def _logprobs(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


@pytest.mark.parametrize("name", sorted(FIXTURE_KEYS))
def test_experts_stay_4bit_and_match_transformers(name):
    d = FIXTURES / name
    model, params = load_model(d, dtype="float32", show_progress=False)
    gu, down = (params["layers"][k] for k in FIXTURE_KEYS[name])
    for w in (gu, down, params["layers"]["wqkv"]):
        assert isinstance(w, W4Linear) and w.packed.dtype == jnp.uint8
    assert gu.packed.shape == (2, 8, 2 * 96, 32) and gu.scales.shape == (2, 8, 192, 2)  # [L, E, gate|up, H/2]
    assert down.packed.shape == (2, 8, 64, 48) and down.zeros.shape == (2, 8, 64, 3)  # K = 96: 3 groups of 32
    assert (gu.perm is not None) == (name == "qwen3_moe_gptq_tiny")  # act-order: one g_idx per expert
    if gu.perm is not None:
        assert gu.perm.shape == (2, 8, 64) and down.perm.shape == (2, 8, 96)
        assert len({np.asarray(p).tobytes() for p in np.asarray(gu.perm).reshape(16, 64)}) == 16
    assert not isinstance(params["layers"]["router"], W4Linear)
    g = np.load(d / "golden.npz")
    fwd = jax.jit(model.forward)
    logits = np.asarray(fwd(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    # 1 token: 2 pairs < 8 experts, the pairs' gather; 7 and 64 tokens: the grouped GEMM
    for b, n in enumerate(g["lengths"]):
        np.testing.assert_allclose(_logprobs(logits[b, :n]), _logprobs(g["logits"][b, :n]), atol=1e-2, rtol=0)
        np.testing.assert_allclose(logits[b, :n], g["logits"][b, :n], atol=1e-3, rtol=1e-3)
    ids = np.concatenate([g["greedy_prompt"], g["greedy_ids"]])
    full = np.asarray(fwd(params, jnp.asarray(ids[None])))[0]
    p = len(g["greedy_prompt"])
    np.testing.assert_array_equal(full[p - 1:-1].argmax(-1), g["greedy_ids"])


def _generate(d, dtype, kernels, max_tokens):
    attn = AttentionConfig(unroll_layers=True, fp8_kernel=kernels, interpret=kernels, use_pallas=kernels)
    llm = LLM(model=str(d), dtype=dtype, max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
              max_num_batched_tokens=16, prefill_buckets=(16,), attention=attn, show_progress=False)
    g = np.load(d / "golden.npz")
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return llm, llm.generate([{"prompt_token_ids": g["greedy_prompt"].tolist()}], sp)[0].outputs[0]


def test_engine_greedy_matches_transformers():
    """`LLM.generate` on the GPTQ act-order MoE (paged prefill and decode steps, the GPU's layer loop):
    transformers' greedy ids. The experts use a quarter of bf16's bytes."""
    from metrale_jax.layers.stack import Unstacked

    d = FIXTURES / "qwen3_moe_gptq_tiny"
    g = np.load(d / "golden.npz")
    llm, out = _generate(d, "float32", False, len(g["greedy_ids"]))
    assert out.token_ids == g["greedy_ids"].tolist()
    w = llm.llm_engine.params["layers"]["experts_gate_up"]
    assert isinstance(w, W4Linear) and isinstance(w.packed, Unstacked) and not w.use_kernel
    assert llm.llm_engine.model_config.quantization == "gptq"


def test_engine_with_the_gpu_kernels():
    """With the GPU's kernels (interpret mode, bf16) the 4-bit MoE runs (its experts through XLA's
    gather and the grouped GEMM: the expert kernel is off by default, `W4Linear.expert_kernel`), near
    the float32 engine without kernels. bf16 and the other kernels' roundings (the 4-bit attention
    linears, paged attention), amplified by the tiny random net, move the logprobs by up to ~0.1;
    a wiring error moves them by O(1)."""
    d = FIXTURES / "qwen3_moe_gptq_tiny"
    llm, out = _generate(d, "bfloat16", True, 3)
    w = llm.llm_engine.params["layers"]["experts_gate_up"]
    assert w.use_kernel and not w.expert_kernel and w.kernel_scales is None  # (tensor-core scales: not for experts)
    _, ref = _generate(d, "float32", False, 3)
    assert out.token_ids == ref.token_ids
    for t, a, b in zip(out.token_ids, out.logprobs, ref.logprobs):
        assert abs(a[t].logprob - b[t].logprob) < 0.15


def _pairs_case(name, tokens, seed, dtype=jnp.bfloat16):
    _, params = load_model(FIXTURES / name, dtype="bfloat16" if dtype == jnp.bfloat16 else "float32",
                           show_progress=False)
    gu, down = (jax.tree.map(lambda a: a[1], params["layers"][k]) for k in FIXTURE_KEYS[name])
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, 64)), dtype)
    idx = jnp.asarray(rng.permuted(np.tile(np.arange(8), (tokens, 1)), axis=1)[:, :2], jnp.int32)  # top-2 of 8
    w = jnp.asarray(rng.uniform(0.1, 1, (tokens, 2)), jnp.float32)
    return x, w, idx, gu, down


@pytest.mark.parametrize("name", sorted(FIXTURE_KEYS))
@pytest.mark.parametrize("tokens", [1, 3, 4, 16, 32])
def test_paths_equal_dense_experts(name, tokens):
    """Every path of 4-bit experts against the same experts dequantized and run dense: XLA's pair
    gather (P < E), the grouped GEMM (P >= E) and, with `expert_kernel`, the expert kernel
    (interpret; P < 8E, so not at 32 tokens = 64 pairs)."""
    x, w, idx, gu, down = _pairs_case(name, tokens, tokens)
    want = np.asarray(routed_experts(x, w, idx, dense_experts(gu, jnp.float32), dense_experts(down, jnp.float32)),
                      np.float32)
    marked = {k: dataclasses.replace(w, expert_kernel=True, interpret=True) for k, w in
              use_fp8_kernel({"experts_gate_up": gu, "experts_down": down}, interpret=True).items()}
    for a, b, kernel in ((gu, down, False), (marked["experts_gate_up"], marked["experts_down"], True)):
        got = np.asarray(jax.jit(routed_experts)(x, w, idx, a, b), np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2, (kernel, tokens)
        jaxpr = str(jax.make_jaxpr(routed_experts)(x, w, idx, a, b))
        assert ("expert_matvec_w4" in jaxpr) == (kernel and 2 * tokens < 64)
        assert ("ragged_dot" in jaxpr) == (2 * tokens >= (64 if kernel else 8))


def test_pair_gather_is_exact_in_float32():
    """In float32 the pairs' gather and the grouped GEMM compute the same sums: 1e-5."""
    x, w, idx, gu, down = _pairs_case("qwen3_moe_gptq_tiny", 2, 7, jnp.float32)
    want = routed_experts(x, w, idx, dense_experts(gu, jnp.float32), dense_experts(down, jnp.float32))
    np.testing.assert_allclose(routed_experts(x, w, idx, gu, down), want, rtol=1e-5, atol=1e-5)


QUANTIZE_ON_LOAD = [("qwen3_moe_tiny", "int4"), ("qwen3_moe_tiny", "nvfp4"), ("qwen3_next_tiny", "int4"),
                    ("nemotron_h_tiny", "int4"), ("nemotron_h_tiny", "fp8")]


@pytest.mark.parametrize("name,q", QUANTIZE_ON_LOAD)
def test_quantize_on_load_takes_the_experts(name, q, caplog):
    """quantization="int4" / "nvfp4" quantizes a dense MoE checkpoint's experts too (they stayed in
    the model dtype before, with a warning naming them; Qwen3-Next under int4 and Nemotron-H under
    any choice were errors: nothing took it), and so does "fp8" Nemotron-H's relu² experts; the model
    equals itself with those experts dequantized and run dense."""
    from metrale_jax.layers import moe_fp8
    from metrale_jax.layers.linear import Fp8Linear

    d = FIXTURES / name
    with caplog.at_level(logging.WARNING):
        model, params = load_model(d, dtype="float32", quantization=q, show_progress=False)
    assert not [r for r in caplog.records if "experts_" in r.getMessage().split(" stay ")[0]]  # (the list left)
    group, keys = ("moe", ("experts_up", "experts_down")) if name.startswith("nemotron") else \
        ("layers", ("experts_gate_up", "experts_down"))
    ws = {k: params[group][k] for k in keys}
    kind = Fp8Linear if q == "fp8" else W4Linear
    assert all(isinstance(w, kind) for w in ws.values())
    if q != "fp8":
        w = ws[keys[0]]
        assert w.kind == ("fp4" if q == "nvfp4" else "int4") and w.packed.ndim == 4  # [L, E, N, K/2]
    dense_of = moe_fp8.dense_experts if q == "fp8" else dense_experts
    dense = dict(params, **{group: dict(params[group], **{k: dense_of(w, jnp.float32) for k, w in ws.items()})})
    g = np.load(d / "golden.npz")
    ids, lengths = jnp.asarray(g["input_ids"]), jnp.asarray(g["lengths"])
    np.testing.assert_allclose(model.forward(params, ids, None, lengths), model.forward(dense, ids, None, lengths),
                               rtol=1e-4, atol=1e-4)


def test_lora_on_4bit_experts_is_refused():
    from metrale_jax.lora.ops import LoRAInputs

    x, w, idx, gu, down = _pairs_case("mixtral_awq_tiny", 1, 0)
    slots = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="quantized .* MoE experts"):
        routed_experts(x, w, idx, gu, down, lora=LoRAInputs(w={"x_down_b": jnp.zeros((1,))}, slot=slots,
                                                            moe_slot=slots))


# ---- the kernel -------------------------------------------------------------------------------------
def _np_expert_matvec(x, packed, scales, aux, experts, k, g, kind):
    """float64 numpy: per pair, its expert's codes unpacked nibble by nibble and dequantized."""
    out = np.zeros((x.shape[0], packed.shape[1]))
    for p, e in enumerate(experts):
        codes = np.zeros((packed.shape[1], 2 * packed.shape[2]), np.int64)
        codes[:, 0::2], codes[:, 1::2] = packed[e] & 15, packed[e] >> 4
        codes = codes[:, :k]
        s = np.repeat(scales[e].astype(np.float64), g, axis=1)[:, :k]
        if kind == "fp4":
            vals = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
            wt = vals * s * aux[e].astype(np.float64)[:, None]
        else:
            wt = (codes - np.repeat(aux[e].astype(np.float64), g, axis=1)[:, :k]) * s
        out[p] = wt @ x[p].astype(np.float64)
    return out


def _random_experts(rng, e, n, k, g, kind):
    packed = rng.integers(0, 256, (e, n, -(-k // 2)), dtype=np.uint8)
    ng = -(-k // g)
    if kind == "fp4":
        scales = rng.uniform(0.25, 2, (e, n, ng)).astype(ml_dtypes.float8_e4m3fn)
        aux = rng.uniform(0.01, 0.3, (e, n)).astype(np.float32)
    else:
        scales = rng.uniform(0.005, 0.05, (e, n, ng)).astype(np.float16)
        aux = rng.integers(0, 16, (e, n, ng), dtype=np.uint8)
    return packed, scales, aux


@pytest.mark.parametrize("kind,p,e,n,k,g,params,dt", [
    ("int4", 1, 4, 64, 64, 32, None, jnp.bfloat16),
    ("int4", 7, 5, 33, 300, 32, ExpertW4Params(block_n=8, block_k=64), jnp.bfloat16),  # partial N, K tiles
    ("int4", 3, 3, 65, 63, 16, ExpertW4Params(block_k=32), jnp.float16),  # odd K: a half-empty last byte
    ("int4", 2, 2, 15, 130, 130, None, jnp.bfloat16),  # one group (channel-wise)
    ("fp4", 1, 4, 64, 64, 16, None, jnp.bfloat16),
    ("fp4", 9, 6, 40, 304, 16, ExpertW4Params(block_n=32, block_k=128), jnp.bfloat16),
    ("fp4", 4, 3, 17, 48, 16, None, jnp.float16),
])
def test_expert_kernel_interpret(kind, p, e, n, k, g, params, dt):
    rng = np.random.default_rng(p * 100 + n)
    packed, scales, aux = _random_experts(rng, e, n, k, g, kind)
    x = rng.standard_normal((p, k)).astype(np.float32)
    experts = rng.integers(0, e, p).astype(np.int32)
    y = expert_matvec_w4(jnp.asarray(x, dt), packed, scales, aux, jnp.asarray(experts), k=k, group_size=g, kind=kind,
                         params=params, interpret=True)
    assert y.shape == (p, n) and y.dtype == dt
    want = _np_expert_matvec(np.asarray(jnp.asarray(x, dt).astype(jnp.float32)), packed, scales, aux, experts, k, g,
                             kind)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    # bf16 weights (int4) and output: ~2^-8 relative per term
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


def test_expert_kernel_ignores_the_padding_nibble():
    """Codes past K (odd K's last high nibble) do not leak in: the same weights with that nibble set
    differently give the same, finite result."""
    rng = np.random.default_rng(3)
    packed, scales, aux = _random_experts(rng, 3, 20, 31, 16, "int4")
    x = jnp.asarray(rng.standard_normal((5, 31)), jnp.bfloat16)
    ex = jnp.asarray([2, 0, 2, 1, 0], jnp.int32)
    a = expert_matvec_w4(x, packed, scales, aux, ex, k=31, group_size=16, kind="int4", interpret=True)
    other = packed.copy()
    other[..., -1] ^= 0xF0
    b = expert_matvec_w4(x, other, scales, aux, ex, k=31, group_size=16, kind="int4", interpret=True)
    assert np.isfinite(np.asarray(a, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_expert_kernel_rejects_bad_input():
    rng = np.random.default_rng(0)
    packed, scales, aux = _random_experts(rng, 2, 16, 64, 32, "int4")
    x = jnp.zeros((1, 64), jnp.bfloat16)
    ex = jnp.zeros((1,), jnp.int32)
    kw = dict(k=64, group_size=32, kind="int4", interpret=True)
    with pytest.raises(ValueError, match="kind"):
        expert_matvec_w4(x, packed, scales, aux, ex, **(kw | dict(kind="int8")))
    with pytest.raises(ValueError, match="x \\[P, K=64\\]"):
        expert_matvec_w4(jnp.zeros((1, 62), jnp.bfloat16), packed, scales, aux, ex, **kw)
    with pytest.raises(ValueError, match="groups of 32"):
        expert_matvec_w4(x, packed, scales[..., :1], aux, ex, **kw)
    with pytest.raises(ValueError, match="zeros"):
        expert_matvec_w4(x, packed, scales, aux[..., :1], ex, **kw)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        expert_matvec_w4(x.astype(jnp.float32), packed, scales, aux, ex, **kw)
    with pytest.raises(ValueError, match="power of two"):
        ExpertW4Params(block_k=48)


@pytest.mark.parametrize("kind,g", [("int4", 128), ("fp4", 16)])
def test_expert_kernel_lowers_for_h200(kind, g):
    """Cross-lowered to the Triton IR on the CPU at a Qwen3-30B-A3B gate|up shape (PTX needs the GPU)."""
    h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    p, e, n, k = 8, 128, 1536, 2048
    sds = jax.ShapeDtypeStruct
    scale_dt = jnp.float8_e4m3fn if kind == "fp4" else jnp.bfloat16
    aux = sds((e, n), jnp.float32) if kind == "fp4" else sds((e, n, k // g), jnp.uint8)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = expert_matvec_w4.trace(sds((p, k), jnp.bfloat16), sds((e, n, k // 2), jnp.uint8),
                                        sds((e, n, k // g), scale_dt), aux, sds((p,), jnp.int32), k=k, group_size=g,
                                        kind=kind)
        low = traced.lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in low.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,p,e,n,k,g", [("int4", 8, 128, 1536, 2048, 128), ("int4", 64, 128, 2048, 768, 128),
                                            ("fp4", 8, 512, 1024, 2048, 16), ("int4", 3, 16, 200, 300, 32)])
def test_expert_kernel_gpu(kind, p, e, n, k, g):
    rng = np.random.default_rng(p + n)
    packed, scales, aux = _random_experts(rng, e, n, k, g, kind)
    x = rng.standard_normal((p, k)).astype(np.float32)
    experts = rng.integers(0, e, p).astype(np.int32)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = np.asarray(expert_matvec_w4(xb, packed, scales, aux, jnp.asarray(experts), k=k, group_size=g, kind=kind),
                   np.float64)
    want = _np_expert_matvec(np.asarray(xb.astype(jnp.float32)), packed, scales, aux, experts, k, g, kind)
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-2


def test_mixed_expert_formats_load_dense(tmp_path, caplog):
    """A checkpoint whose experts are 4-bit in some experts only loads the experts dense (dequantized,
    with the warning that names them), as a partly quantized linear does; the rest stays 4-bit."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from metrale_jax.layers.linear_w4 import dequantize_w4

    src = FIXTURES / "mixtral_awq_tiny"
    _, quantized = load_model(src, dtype="float32", show_progress=False)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    t = load_file(d / "model.safetensors")
    pre = "model.layers.1.block_sparse_moe.experts.3.w2."  # one expert's down projection stored dense
    one = jax.tree.map(lambda a: a[1, 3], quantized["layers"]["experts_down"])
    for x in ("qweight", "qzeros", "scales"):
        del t[pre + x]
    t[pre + "weight"] = np.asarray(dequantize_w4(one, jnp.float32))
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        model, params = load_model(d, dtype="float32", show_progress=False)
    assert not isinstance(params["layers"]["experts_gate_up"], W4Linear)  # (both: one path runs them)
    assert not isinstance(params["layers"]["experts_down"], W4Linear)
    assert isinstance(params["layers"]["wqkv"], W4Linear)
    assert any("some layers or parts only" in r.getMessage() for r in caplog.records)
    g = np.load(src / "golden.npz")
    logits = np.asarray(model.forward(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    np.testing.assert_allclose(logits[2], g["logits"][2], atol=1e-3, rtol=1e-3)


def test_dense_experts_put_act_order_columns_back():
    """`dense_experts` of act-order experts equals each expert dequantized with its columns permuted
    back one by one (numpy)."""
    _, params = load_model(FIXTURES / "qwen3_moe_gptq_tiny", dtype="float32", show_progress=False)
    w = jax.tree.map(lambda a: a[0], params["layers"]["experts_down"])
    got = np.asarray(dense_experts(w, jnp.float32))  # [E, K, N]
    from metrale_jax.layers.linear_w4 import dequantize_w4

    for e in range(8):
        one = dataclasses.replace(jax.tree.map(lambda a, e=e: a[e], w), perm=None)
        wd = np.asarray(dequantize_w4(one, jnp.float32))  # [N, K] packed order
        back = np.zeros_like(wd)
        back[:, np.asarray(w.perm[e])] = wd
        np.testing.assert_array_equal(got[e], back.T)


def test_kv_sizing_holds_back_the_dequantized_experts():
    """The grouped GEMM's transient dense copy of one layer's 4-bit experts (gate|up 8 x 192 x 64,
    down 8 x 64 x 96 here) is what the engine's KV sizing holds back for it; none without them."""
    from metrale_jax.layers.moe_w4 import dequantized_scratch_bytes
    from metrale_jax.layers.stack import split_layers

    _, params = load_model(FIXTURES / "qwen3_moe_gptq_tiny", dtype="bfloat16", show_progress=False)
    want = (8 * 192 * 64 + 8 * 64 * 96) * 2
    assert dequantized_scratch_bytes(params, "bfloat16") == want
    assert dequantized_scratch_bytes(split_layers(params), "bfloat16") == want  # (the engine's GPU layout)
    _, dense = load_model(FIXTURES / "qwen3_moe_tiny", dtype="bfloat16", show_progress=False)
    assert dequantized_scratch_bytes(dense, "bfloat16") == 0
    # FP8 experts: the same dense copy where tokamax's FP8 grouped GEMM does not take them (here K =
    # 64 and 96, not multiples of 128: every case), none on it (a made-up K of 128)
    _, fp8 = load_model(FIXTURES / "qwen3_moe_tiny", dtype="bfloat16", quantization="fp8", show_progress=False)
    gu, down = fp8["layers"]["experts_gate_up"], fp8["layers"]["experts_down"]
    rows = sum(w.w8.shape[-3] * w.w8.shape[-2] * w.w8.shape[-1] for w in (gu, down))
    assert dequantized_scratch_bytes(fp8, "bfloat16") == dequantized_scratch_bytes(fp8, "bfloat16", True) == 2 * rows
    wide = {"experts_x": dataclasses.replace(gu, w8=jnp.zeros((*gu.w8.shape[:-1], 128), jnp.float8_e4m3fn))}
    assert dequantized_scratch_bytes(wide, "bfloat16", tokamax=True) == 0
    assert dequantized_scratch_bytes(wide, "float16", tokamax=True) == 2 * math.prod(wide["experts_x"].w8.shape[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("name,quantization", [("qwen3_moe_gptq_tiny", None), ("mixtral_awq_tiny", None),
                                               ("qwen3_next_tiny", "int4"), ("nemotron_h_tiny", "fp8")])
def test_default_gpu_engine_runs_quantized_moe_and_hybrids(name, quantization):
    """The GPU's default EngineConfig (the expert kernel at decode, the grouped GEMM through tokamax,
    the hybrids' FP8 / 4-bit linears on the Llama linears' kernels) through `LLM.generate`: it runs,
    and a batch of ragged requests gives each request's first greedy id alone (bf16, and other
    kernels at other batch sizes: the tiny random nets' later ids may flip on near ties)."""
    g = np.load(FIXTURES / name / "golden.npz")
    # (a fixed KV pool: the gpu tests run in several processes on one GPU, where the default pool
    # would take 90% of the memory in each)
    llm = LLM(model=str(FIXTURES / name), dtype="bfloat16", quantization=quantization, max_model_len=128,
              max_num_seqs=4, num_kv_blocks=64, show_progress=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": g["input_ids"][i, :n].tolist()} for i, n in enumerate(g["lengths"])]
    together = [o.outputs[0] for o in llm.generate(prompts, sp)]
    for p, out in zip(prompts, together):
        alone = llm.generate([p], sp)[0].outputs[0]
        t = out.token_ids[0]
        assert t == alone.token_ids[0] and abs(out.logprobs[0][t].logprob - alone.logprobs[0][t].logprob) < 0.1
        assert len(out.token_ids) == 8 and all(np.isfinite(lp[t].logprob) for t, lp in zip(out.token_ids,
                                                                                           out.logprobs))
    if quantization is None:  # transformers' greedy ids on the dequantized weights (the first: bf16 drifts)
        ref = llm.generate([{"prompt_token_ids": g["greedy_prompt"].tolist()}], sp)[0].outputs[0]
        assert ref.token_ids[:2] == g["greedy_ids"][:2].tolist()
