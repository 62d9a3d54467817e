"""load_model: every load error is a clear exception naming the file or tensor; orbax caching."""

import json
import logging
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_jax import load_model
from metrale_jax.errors import (
    CorruptCheckpointError,
    MissingTensorError,
    ModelNotFoundError,
    TensorShapeError,
    UnknownArchitectureError,
    UnsupportedDtypeError,
)
from tests.conftest import FIXTURES

SRC = FIXTURES / "llama_tiny"


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(SRC, d)
    return d


def _edit_tensors(d, fn):
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors")


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownArchitectureError, match="FrobnicatorForCausalLM"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ckpt)


def test_misshaped_tensor(ckpt):
    def cut(t):
        t["model.layers.2.self_attn.k_proj.weight"] = t["model.layers.2.self_attn.k_proj.weight"][:-1]

    _edit_tensors(ckpt, cut)
    with pytest.raises(TensorShapeError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight.*\(31, 64\)"):
        load_model(ckpt)


def test_unsupported_dtype(ckpt):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)

    _edit_tensors(ckpt, to_int)
    with pytest.raises(UnsupportedDtypeError, match=r"model\.norm\.weight"):
        load_model(ckpt)


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_model(ckpt)


def test_truncated_config(ckpt):
    (ckpt / "config.json").write_text((SRC / "config.json").read_text()[:40])
    with pytest.raises(CorruptCheckpointError, match="config.json"):
        load_model(ckpt)


def test_unknown_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        load_model("no-such-model-alias")


def test_truncated_gguf(tmp_path):
    from metrale_jax.loading.hub import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    with pytest.raises(CorruptCheckpointError, match="cut.gguf"):
        load_model(bad)


@pytest.mark.parametrize("split", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gguf_conversion_cached_with_orbax(tmp_path, monkeypatch, caplog, split):
    """The second load of a GGUF restores the dequantized parameters instead of converting (also
    when they are loaded split per layer: the cache holds them stacked, either layout restores;
    each case restores both layouts, so CI runs one)."""
    from metrale_jax.layers.stack import Unstacked
    from metrale_jax.loading.hub import resolve_model
    from metrale_jax.models import llama

    src = resolve_model("smollm2-135m-instruct")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _, first = load_model(src, dtype="bfloat16", show_progress=False, split_layers=split)

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(llama, "load_params", no_conversion)
    with caplog.at_level(logging.INFO, logger="metrale_jax.model"):
        model, second = load_model(src, dtype="bfloat16", show_progress=False, split_layers=split)
        _, other = load_model(src, dtype="bfloat16", show_progress=False, split_layers=not split)
    assert "restored converted parameters" in caplog.text
    layer3 = [p["layers"]["wqkv"].parts[3] if isinstance(p["layers"]["wqkv"], Unstacked) else p["layers"]["wqkv"][3]
              for p in (first, second, other)]
    assert isinstance(second["layers"]["wqkv"], Unstacked) == split != isinstance(other["layers"]["wqkv"], Unstacked)
    for a in layer3[1:]:
        np.testing.assert_array_equal(np.asarray(layer3[0]), np.asarray(a))
        assert a.dtype == layer3[0].dtype
    assert model.cfg.num_layers == 30


def test_split_layers_at_load_serves_the_same(ckpt):
    """Parameters put on the device per layer at load (the GPU default) give the engine the same
    tokens as stacked ones split by the engine, and the engine leaves them as they are."""
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.layers.attention import AttentionConfig
    from metrale_jax.layers.stack import Unstacked
    from metrale_jax.sampling import SamplingParams

    cfg = EngineConfig(dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=40, max_num_seqs=2,
                       max_num_batched_tokens=16, decode_buckets=(2,), prefill_buckets=(16,), max_prefill_streams=2,
                       show_progress=False, attention=AttentionConfig(unroll_layers=True))
    outs = []
    for split in (False, True):
        model, params = load_model(ckpt, dtype="float32", show_progress=False, split_layers=split)
        assert isinstance(params["layers"]["wo"], Unstacked) == split and not isinstance(params["embed"], Unstacked)
        parts = params["layers"]["wo"].parts if split else None
        eng = LLMEngine(model, params, cfg)
        if split:
            assert eng.params["layers"]["wo"].parts == parts  # not split again
        o = eng.generate([[3, 1, 4, 1, 5], [9, 2]], SamplingParams(temperature=0, max_tokens=5, logprobs=1))
        outs.append([(x.outputs[0].token_ids, round(x.outputs[0].cumulative_logprob, 4)) for x in o])
    assert outs[0] == outs[1]


def test_hub_config_dialect(ckpt):
    """The hub dialect (rope_theta + rope_scaling, torch_dtype) reads the same as transformers 5's."""
    cfg = json.loads((ckpt / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model, params = load_model(ckpt)
    ref_model, _ = load_model(SRC)
    assert model.cfg.rope_scaling == ref_model.cfg.rope_scaling and model.cfg.rope_scaling.kind == "llama3"
    assert model.cfg.rope_theta == ref_model.cfg.rope_theta and model.dtype == "float32"
    g = np.load(SRC / "golden.npz")
    logits = np.asarray(model.forward(params, g["input_ids"][2:3]))
    np.testing.assert_allclose(logits[0], g["logits"][2], rtol=1e-4, atol=1e-4)


def test_forward_is_differentiable():
    """The dense forward serves gradients: d(loss)/d(params) is finite and non-zero everywhere."""
    import jax

    model, params = load_model(FIXTURES / "qwen3_tiny")
    g = np.load(FIXTURES / "qwen3_tiny" / "golden.npz")
    toks = g["input_ids"][1:2, :7]

    def loss(p):
        lp = jax.nn.log_softmax(model.forward(p, toks))
        return -lp[0, :-1][np.arange(6), toks[0, 1:]].mean()

    grads = jax.grad(loss)(params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        assert np.isfinite(np.asarray(leaf)).all(), path
    assert float(np.abs(np.asarray(grads["layers"]["wqkv"])).sum()) > 0


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny", "qwen3_moe_tiny", "qwen2_moe_tiny", "mixtral_tiny",
                                  "qwen3_moe_fp8_tiny",
                                  "llama_fp8_tiny",
                                  "llama_gptq_tiny", "llama_nvfp4_ct_tiny", "qwen3_next_tiny", "nemotron_h_tiny",
                                  "mamba2_tiny"])
def test_split_layers_load_equals_stacked(name):
    """Loading straight into per-layer device arrays (the GPU layout, each layer streamed to the
    device as soon as it is read) gives, layer by layer, exactly the stacked load's parameters,
    for every family and weight format."""
    from metrale_jax.layers.stack import Unstacked

    _, stacked = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    _, split = load_model(FIXTURES / name, dtype="float32", show_progress=False, split_layers=True)
    want = jax.tree_util.tree_flatten_with_path(stacked)[0]
    got = jax.tree_util.tree_flatten_with_path(split, is_leaf=lambda x: isinstance(x, Unstacked))[0]
    assert [p for p, _ in got] == [p for p, _ in want]
    n_split = 0
    for (path, g), (_, w) in zip(got, want):
        if isinstance(g, Unstacked):
            n_split += 1
            assert len(g.parts) == w.shape[0], path
            for i, part in enumerate(g.parts):
                assert part.dtype == w.dtype and part.shape == w.shape[1:], path
                np.testing.assert_array_equal(np.asarray(part), np.asarray(w[i]), err_msg=str(path))
        else:
            assert g.dtype == w.dtype, path
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))
    assert n_split >= 4


def test_rope_scaling_matches_transformers():
    """YaRN (factor, beta_fast / beta_slow, truncate off, mscale / mscale_all_dim, an explicit
    attention_factor, partial rotary) and llama3 without an original context: the frequencies and
    cos / sin factor transformers computes (`qwen3_yarn_tiny/rope_cases.json`, written by the
    fixture script from `ROPE_INIT_FUNCTIONS`); the context limit is vLLM's (original x factor)."""
    from metrale_jax.config import ModelConfig, rope_attention_factor, rope_inv_freq

    cases = json.loads((FIXTURES / "qwen3_yarn_tiny" / "rope_cases.json").read_text())
    assert {c["config"]["rope_parameters"]["rope_type"] for c in cases} == {"yarn", "llama3", "dynamic"}
    for c in cases:
        cfg = ModelConfig.from_hf(c["config"])
        np.testing.assert_allclose(rope_inv_freq(cfg), c["inv_freq"], rtol=2e-6, err_msg=str(c["config"]))
        assert abs(rope_attention_factor(cfg) - c["attention_factor"]) < 1e-6, c["config"]
        rp = c["config"]["rope_parameters"]
        want = rp["original_max_position_embeddings"] * rp["factor"] if rp["rope_type"] == "yarn" else 256
        assert cfg.max_positions == want
    yarn = json.loads((FIXTURES / "qwen3_yarn_tiny" / "config.json").read_text())
    hub = {**yarn, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    del hub["rope_parameters"]
    assert ModelConfig.from_hf(hub).rope_scaling == ModelConfig.from_hf(yarn).rope_scaling  # the hub dialect
    with pytest.raises(ValueError, match="needs a factor"):
        ModelConfig.from_hf({**hub, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32}})
    with pytest.raises(NotImplementedError, match="longrope"):
        ModelConfig.from_hf({**hub, "rope_scaling": {"type": "longrope", "factor": 2.0}})


def test_yarn_context_beyond_max_position_embeddings():
    """A yarn model's context limit is its original context times the factor (vLLM's derived
    max_model_len), not max_position_embeddings: 32 x 4 = 128 here, where the config says 256."""
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.engine import LLMEngine

    model, params = load_model(FIXTURES / "qwen3_yarn_tiny", dtype="float32", show_progress=False)
    assert model.cfg.max_position_embeddings == 256 and model.cfg.max_positions == 128
    small = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_seqs=2, max_num_batched_tokens=16,
                 show_progress=False)
    assert LLMEngine(model, params, EngineConfig(max_model_len=128, **small)).config.max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len=129"):
        LLMEngine(model, params, EngineConfig(max_model_len=129, **small))


def test_sliding_window_rules():
    """The attention window from config.json, as transformers reads it: Mistral's sliding_window
    (4096 when absent, null = none), Qwen2's use_sliding_window from max_window_layers on, and
    transformers 5's layer_types; mixed full / sliding layers are refused, not run wrong."""
    from metrale_jax.config import ModelConfig

    base = dict(vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=4)

    def window(**kw):
        return ModelConfig.from_hf({**base, **kw}).sliding_window

    assert window(architectures=["MistralForCausalLM"]) == 4096
    assert window(architectures=["MistralForCausalLM"], sliding_window=None) is None
    assert window(architectures=["MistralForCausalLM"], sliding_window=8) == 8
    assert window(architectures=["LlamaForCausalLM"], sliding_window=8) is None  # Llama has no window
    assert window(architectures=["MixtralForCausalLM"]) is None  # (Mixtral's default: none)
    assert window(architectures=["MixtralForCausalLM"], sliding_window=4096) == 4096
    q2 = dict(architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert window(**q2) is None and window(**q2, use_sliding_window=False) is None
    assert window(**q2, use_sliding_window=True, max_window_layers=4) is None  # no layer from 4 on
    assert window(**q2, use_sliding_window=True, max_window_layers=0) == 32
    assert window(**q2, layer_types=["sliding_attention"] * 4) == 32
    assert window(**q2, layer_types=["full_attention"] * 4) is None
    nxt = dict(architectures=["Qwen3NextForCausalLM"], layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert window(**nxt) is None
    with pytest.raises(NotImplementedError, match="mixed"):
        window(**q2, use_sliding_window=True, max_window_layers=2)
    with pytest.raises(NotImplementedError, match="mixed"):
        window(**q2, layer_types=["full_attention", "sliding_attention"] * 2)


def test_llama_mlp_bias_is_refused(tmp_path):
    """Llama's mlp_bias (gate / up / down biases) is refused at load rather than run without them."""
    ckpt = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_bias_tiny", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        load_model(ckpt, show_progress=False)


def test_hf_overrides(tmp_path, capsys, monkeypatch):
    """vLLM's hf_overrides: config.json keys replaced before the model is built (Qwen3's YaRN
    long-context setting here), from load_model, EngineConfig (a dict or JSON, kept as JSON) and the
    --hf-overrides flag; anything but a JSON object is refused before loading."""
    from metrale_jax import cli
    from metrale_jax.engine.config import EngineConfig

    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
    model, _ = load_model(FIXTURES / "qwen3_tiny", dtype="float32", show_progress=False, hf_overrides=yarn)
    plain, _ = load_model(FIXTURES / "qwen3_tiny", dtype="float32", show_progress=False)
    assert (model.cfg.rope_scaling.kind, model.cfg.max_positions) == ("yarn", 1024)
    assert (plain.cfg.rope_scaling.kind, plain.cfg.max_positions) == ("default", 256)
    assert EngineConfig(hf_overrides=yarn).hf_overrides == EngineConfig(hf_overrides=json.dumps(yarn)).hf_overrides
    assert EngineConfig(hf_overrides={}).hf_overrides is None
    for bad in ("{nope", "[1]"):
        with pytest.raises(ValueError, match="hf_overrides"):
            EngineConfig(hf_overrides=bad)
    args = cli.build_parser().parse_args(["generate", "x", "--hf-overrides", json.dumps(yarn)])
    assert cli._hf_overrides(args) == yarn and cli.engine_config_from_args(args).hf_overrides == json.dumps(
        yarn, sort_keys=True)
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("loaded the model"))
    assert cli.main(["generate", "-q", "--hf-overrides", "[1]", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: hf_overrides must be a JSON object")
