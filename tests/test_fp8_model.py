"""FP8 block-scaled checkpoints (DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv` format) and
quantize-on-load, through the model and the engine."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_jax import LLM, SamplingParams, load_model
from metrale_jax.errors import MissingTensorError, TensorShapeError, UnsupportedDtypeError
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.linear import Fp8Linear, use_fp8_kernel
from metrale_jax.layers.stack import Unstacked
from tests._paged import Layout
from tests.conftest import FIXTURES

FP8 = FIXTURES / "llama_fp8_tiny"


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_checkpoint_keeps_fp8_and_matches_dequantized_reference():
    model, params = load_model(FP8, dtype="float32")
    wqkv = params["layers"]["wqkv"]
    assert isinstance(wqkv, Fp8Linear) and wqkv.w8.dtype == jnp.float8_e4m3fn
    # q (160 rows), k and v (32 each), each padded to whole 128-row blocks.
    assert wqkv.segments == ((0, 160), (256, 32), (384, 32)) and wqkv.w8.shape == (2, 512, 160)
    g = np.load(FP8 / "golden.npz")
    logits = np.asarray(jax.jit(model.forward)(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    for b, n in enumerate(g["lengths"]):
        # The golden ran transformers on the dequantized weights: the same function, up to rounding.
        np.testing.assert_allclose(logits[b, :n], g["logits"][b, :n], rtol=1e-4, atol=1e-4)
    # Against the unquantized model: within FP8 error (the tiny random net amplifies it, see README).
    assert _rel(logits[2], g["logits_unquantized"][2]) < 0.3


def test_fp8_kernel_in_decode_steps_matches_xla_dequant():
    """use_fp8_kernel: the decode rows' FP8 linears (fused q|k|v with padded parts, gate|up, o,
    down) go through the Pallas kernel (interpret mode here), the prefill rows stay on XLA."""
    model, params = load_model(FP8, dtype="bfloat16")
    marked = use_fp8_kernel(params, interpret=True)
    assert marked["layers"]["wqkv"].use_kernel and not params["layers"]["wqkv"].use_kernel
    lay = Layout(2, num_blocks=32, block_size=4, max_blocks=8, seed=1)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(3, 250, 16).astype(np.int32))
    for p in (params, marked):
        state = model.init_state(32, lay.bs)
        # prefill 9 + 7 tokens of two sequences (XLA path: 16 rows), then 3 decode rows (kernel)
        state, _ = jax.jit(model.forward_paged, static_argnums=(5,))(
            p, state, prompt, None, lay.prefill([(0, 0, 9), (1, 0, 7)], 16, 2), AttentionConfig())
        dmd = lay.decode([(0, 9), (1, 7)], 3)
        toks = jnp.asarray([11, 12, 0], jnp.int32)
        _, hidden = jax.jit(model.forward_paged, static_argnums=(5,))(p, state, toks, dmd, None, AttentionConfig())
        logits = np.asarray(model.compute_logits(p, hidden)[:2], np.float32)
        if p is params:
            want = logits
        # the kernel is on the decode path of the marked weights only
        jaxpr = str(jax.make_jaxpr(model.forward_paged, static_argnums=(5,))(p, state, toks, dmd, None,
                                                                            AttentionConfig()))
        assert ("skinny_matmul_fp8" in jaxpr) == (p is marked)
    assert np.isfinite(logits).all() and _rel(logits, want) < 2e-2, _rel(logits, want)


@pytest.mark.parametrize("fixture", ["llama_tiny", "qwen3_moe_tiny"])
def test_quantize_on_load(tmp_path, fixture):
    """quantization="fp8" equals a dense model whose linears (and MoE experts) went through the
    block format's quantize -> dequantize in numpy (quant.fp8), and stays within FP8 error of the
    original."""
    from metrale_jax.quant.fp8 import dequantize_fp8_block, quantize_fp8_block

    src = FIXTURES / fixture
    model, q = load_model(src, dtype="float32", quantization="fp8")
    mlp = ("experts_gate_up", "experts_down") if fixture == "qwen3_moe_tiny" else ("w_down",)
    assert all(isinstance(q["layers"][k], Fp8Linear) for k in mlp) and not isinstance(q["embed"], Fp8Linear)
    d = tmp_path / "qdq"
    shutil.copytree(src, d)
    t = load_file(d / "model.safetensors")
    for name in t:
        if name.endswith("_proj.weight"):
            t[name] = dequantize_fp8_block(*quantize_fp8_block(t[name]))
    save_file(t, d / "model.safetensors")
    qdq_model, qdq = load_model(d, dtype="float32")
    ref_model, ref = load_model(src, dtype="float32")
    toks = jnp.asarray(np.load(src / "golden.npz")["input_ids"][2:3])
    got = np.asarray(model.forward(q, toks))
    np.testing.assert_allclose(got, np.asarray(qdq_model.forward(qdq, toks)), rtol=1e-4, atol=1e-4)
    assert 0 < _rel(got, np.asarray(ref_model.forward(ref, toks))) < 0.3


# True: the GPU's layer loop over per-layer arrays (Fp8Linear fields split); False (the scan over
# stacked FP8 linears, forward_paged's path in test_fp8_kernel_in_decode_steps_matches_xla_dequant) is slow
@pytest.mark.parametrize("unroll", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_engine_generates_from_fp8_checkpoint(unroll):
    model, params = load_model(FP8, dtype="float32")
    prompt = [5, 17, 42, 99, 3, 250, 7]
    fwd = jax.jit(model.forward)
    ids = list(prompt)
    for _ in range(8):  # greedy by repeated dense forwards: the reference
        ids.append(int(jnp.argmax(fwd(params, jnp.asarray([ids]))[0, -1])))
    llm = LLM(model=str(FP8), dtype="float32", max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
              max_num_batched_tokens=32, attention=AttentionConfig(unroll_layers=unroll))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ids[len(prompt):]
    w = llm.llm_engine.params["layers"]["wqkv"]
    assert isinstance(w, Fp8Linear) and isinstance(w.w8, Unstacked) == unroll == isinstance(w.scale_inv, Unstacked)


@pytest.fixture
def fp8_copy(tmp_path):
    d = tmp_path / "fp8"
    shutil.copytree(FP8, d)
    return d


_CODES = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0"}


def _edit(d, fn):
    """Rewrite model.safetensors after fn(tensors) (safetensors' numpy API has no FP8 dtypes,
    so the file is written by hand: an 8-byte header length, a JSON header, the raw data)."""
    from metrale_jax.loading.tensors import SafetensorsSource

    src = SafetensorsSource(d / "model.safetensors")
    t = {name: src.load(name) for name in src.names()}
    src.close()
    fn(t)
    _write(d / "model.safetensors", t)


def _write(path, t):
    header, blobs, off = {}, [], 0
    for name, a in t.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": _CODES[a.dtype.name], "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def test_missing_scale_is_an_error(fp8_copy):
    _edit(fp8_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv"):
        load_model(fp8_copy)


def test_wrong_scale_shape_is_an_error(fp8_copy):
    def cut(t):
        name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
        t[name] = t[name][:1]

    _edit(fp8_copy, cut)
    with pytest.raises(TensorShapeError, match="o_proj.weight_scale_inv"):
        load_model(fp8_copy)


def test_e8m0_scales_are_unsupported(fp8_copy):
    def to_e8m0(t):
        name = "model.layers.0.mlp.down_proj.weight_scale_inv"
        t[name] = t[name].astype(ml_dtypes.float8_e8m0fnu)

    _edit(fp8_copy, to_e8m0)
    with pytest.raises(UnsupportedDtypeError, match="down_proj"):
        load_model(fp8_copy)


def test_unsupported_block_size_is_an_error(fp8_copy):
    cfg = json.loads((fp8_copy / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (fp8_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedDtypeError, match=r"\[64, 64\]"):
        load_model(fp8_copy)


# ---- other FP8 checkpoints: per tensor, compressed-tensors (tensor, channel, block) ----------------
_CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
       "ignore": ["lm_head"]}


def _ct_config(strategy, **extra):
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy, **extra}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {**_CT, "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                 "input_activations": acts}}}


def _scaled_fp8(w, per):
    """Test-local FP8 of w f32[N, K] with one scale per tensor or per row: (w8, scale as stored, w8 * scale)."""
    amax = np.abs(w).max() if per == "tensor" else np.abs(w).max(axis=1, keepdims=True)
    s = (np.maximum(amax, 1e-12) / 448.0).astype(np.float32)
    w8 = (w / s).astype(ml_dtypes.float8_e4m3fn)
    return w8, (s.reshape(()) if per == "tensor" else s), w8.astype(np.float32) * s


@pytest.mark.parametrize("fixture", ["llama_tiny", "qwen3_moe_tiny"])
@pytest.mark.parametrize("kind", ["fp8_tensor", "ct_tensor", "ct_channel", "modelopt_tensor", "modelopt_channel",
                                  "fbgemm_channel"])
def test_fp8_per_tensor_and_per_channel_checkpoints(tmp_path, fixture, kind, caplog):
    """Per-tensor FP8 (`quant_method: fp8` without blocks, compressed-tensors "tensor", ModelOpt "FP8") stays FP8
    (its scale is every block's); per-channel FP8 linears and experts (compressed-tensors, ModelOpt,
    FBGEMM) stay FP8 with `col_scale`.
    All match a dense checkpoint holding the same dequantized weights."""
    per = kind.split("_")[1]
    t = load_file(FIXTURES / fixture / "model.safetensors")
    quant, dense = dict(t), dict(t)
    for name, w in t.items():
        if name.endswith("_proj.weight"):
            w8, s, dense[name] = _scaled_fp8(w.astype(np.float32), per)
            quant[name], quant[name[: -len("weight")] + "weight_scale"] = w8, s
            if kind == "fbgemm_channel":  # (FBGEMM's activation clamp: not read)
                quant[name[: -len("weight")] + "input_scale_ub"] = np.array([1200.0], np.float32)
    cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
    qc = {"fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"}, "ct": _ct_config(per),
          "modelopt": {"quant_method": "modelopt", "quant_algo": "FP8" if per == "tensor" else
                       "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": ["lm_head"]},
          "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                     "modules_to_not_convert": ["lm_head"]}}[kind.split("_")[0]]
    if kind == "modelopt_channel":  # (ModelOpt stores per-channel scales as [N])
        quant = {name: v.reshape(-1) if name.endswith("weight_scale") else v for name, v in quant.items()}
    for sub, tensors, c in (("q", quant, dict(cfg, quantization_config=qc)), ("dense", dense, cfg)):
        (tmp_path / sub).mkdir()
        _write(tmp_path / sub / "model.safetensors", tensors)
        (tmp_path / sub / "config.json").write_text(json.dumps(c))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 9)))
    ref_model, ref = load_model(tmp_path / "dense", dtype="float32")
    with caplog.at_level("WARNING"):
        model, params = load_model(tmp_path / "q", dtype="float32")
    np.testing.assert_allclose(np.asarray(model.forward(params, ids)), np.asarray(ref_model.forward(ref, ids)),
                               rtol=1e-4, atol=1e-4)
    # linears and experts stay FP8 either way: per-channel scales as col_scale
    for key in ("wqkv", "experts_down") if fixture == "qwen3_moe_tiny" else ("wqkv",):
        w = params["layers"][key]
        assert isinstance(w, Fp8Linear) and (w.col_scale is not None) == (per == "channel"), key
    assert "to run dense" not in caplog.text
    if fixture == "llama_tiny":  # streamed a layer at a time (`LayerStack`, the GPU engine's load): the same arrays
        from metrale_jax.layers.stack import host_stacked

        _, split = load_model(tmp_path / "q", dtype="float32", split_layers=True)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(host_stacked(split)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("m", [1, 24])
def test_per_channel_fp8_through_the_kernels(m):
    """`Fp8Linear.col_scale` (per-channel FP8, block scales 1) on the kernel path (the W8A16 kernel
    at 1 row, W8A8 at 24; interpret mode) and on XLA's, against float64."""
    from metrale_jax.layers.linear import matmul_f32

    rng = np.random.default_rng(m)
    n, k = 200, 256
    w = (rng.standard_normal((n, k)) * np.exp2(rng.uniform(-4, 4, (n, 1)))).astype(np.float32)
    w8, s, deq = _scaled_fp8(w, "channel")
    w8p = np.zeros((256, k), ml_dtypes.float8_e4m3fn)
    w8p[:n] = w8
    col = np.ones(256, np.float32)
    col[:n] = s[:, 0]
    lin = Fp8Linear(jnp.asarray(w8p), jnp.ones((2, 2), jnp.float32), ((0, n),), col_scale=jnp.asarray(col))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ deq.astype(np.float64).T
    for y in (matmul_f32(x, lin), matmul_f32(x, use_fp8_kernel(lin, interpret=True))):
        assert y.shape == (m, n)
        assert float(np.linalg.norm(np.asarray(y) - want) / np.linalg.norm(want)) < 8e-3


def test_compressed_tensors_fp8_blocks_match_weight_scale_inv(tmp_path):
    """compressed-tensors' block FP8 (`weight_scale`, block_structure [128, 128]) is the
    `weight_scale_inv` format under other names: the same logits as the fixture."""
    d = tmp_path / "ct"
    shutil.copytree(FP8, d)

    def rename(t):
        for name in [n for n in t if n.endswith(".weight_scale_inv")]:
            t[name[: -len("_inv")]] = t.pop(name)

    _edit(d, rename)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = _ct_config("block", block_structure=[128, 128])
    (d / "config.json").write_text(json.dumps(cfg))
    model, params = load_model(d, dtype="float32")
    _, ref = load_model(FP8, dtype="float32")
    assert isinstance(params["layers"]["w_gate_up"], Fp8Linear)
    ids = jnp.asarray(np.load(FP8 / "golden.npz")["input_ids"][:1])
    np.testing.assert_array_equal(np.asarray(model.forward(params, ids)), np.asarray(model.forward(ref, ids)))


@pytest.mark.parametrize("qc,match", [
    (_ct_config("group", group_size=128), "strategy 'group'"),
    (_ct_config("block", block_structure=[64, 64]), r"\[64, 64\]"),
    ({**_ct_config("tensor"), "format": "int-quantized"}, "int-quantized"),
    ({**_CT, "config_groups": {"a": _ct_config("tensor")["config_groups"]["group_0"],
                               "b": {"format": "pack-quantized", "weights": {"num_bits": 4}}}}, "mixing FP8"),
])
def test_unsupported_fp8_variants_are_named(fp8_copy, qc, match):
    cfg = json.loads((fp8_copy / "config.json").read_text())
    cfg["quantization_config"] = qc
    (fp8_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedDtypeError, match=match):
        load_model(fp8_copy)
