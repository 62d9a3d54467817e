"""The bench's hybrid shapes (`--shape qwen3-next-80b-a3b | nemotron-h-8b --num-layers N`) end to end
on CPU with the widths shrunk, and `decode_bytes` (the roofline bytes of a decode step) against
hand counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale_jax.engine import bench
from metrale_jax.model import random_model

# Same keys and layer patterns as the real shapes, widths small enough for a CPU test.
SMALL = {
    "qwen3-next-80b-a3b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, max_position_embeddings=256),
    "nemotron-h-8b": dict(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
        intermediate_size=96, chunk_size=16, max_position_embeddings=256),
}
# the fewest layers holding every kind: 3 GDN + 1 attention; "M-M-M-M-M-M*-" (Mamba, MLP, attention)
LAYERS = {"qwen3-next-80b-a3b": 4, "nemotron-h-8b": 13}


def test_shape_config_layers():
    q = bench.shape_config("qwen3-next-80b-a3b", 8)
    assert q["num_hidden_layers"] == 8 and q["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert "layer_types" not in bench.shape_config("qwen3-next-80b-a3b")
    n = bench.shape_config("nemotron-h-8b")
    p = n["hybrid_override_pattern"]
    assert len(p) == n["num_hidden_layers"] == 52 and (p.count("M"), p.count("-"), p.count("*")) == (24, 24, 4)
    n13 = bench.shape_config("nemotron-h-8b", 13)
    assert n13["num_hidden_layers"] == 13 and n13["hybrid_override_pattern"] == "M-M-M-M-M-M*-"
    with pytest.raises(ValueError, match="no attention layer"):
        bench.shape_config("nemotron-h-8b", 8)
    with pytest.raises(ValueError, match="at least 4"):
        bench.shape_config("qwen3-next-80b-a3b", 3)
    with pytest.raises(ValueError, match="cut, not grown"):
        bench.shape_config("nemotron-h-8b", 53)
    assert bench.shape_config("llama3-8b", 2)["num_hidden_layers"] == 2


def test_decode_bytes_dense_llama_by_hand():
    """Untied tiny Llama: every weight once, but only B rows of the input embedding; live KV."""
    V, H, I, L, hq, hkv, d = 256, 64, 96, 3, 4, 2, 16
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=H, intermediate_size=I,
               num_hidden_layers=L, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
               tie_word_embeddings=False)
    model, params = random_model(cfg, dtype="float32")
    per_layer = 2 * H + H * (hq + 2 * hkv) * d + hq * d * H + H * 2 * I + I * H  # norms, qkv, o, gate_up, down
    every = 4 * (V * H + L * per_layer + H + H * V)
    assert bench.weight_bytes(params) == every
    for b, ctx in ((1, 10), (5, 33)):
        got = bench.decode_bytes(model, params, b, ctx)
        assert got["weights"] == every - 4 * (V - b) * H  # the one change from "all weights"
        assert got["kv"] == b * ctx * 2 * L * hkv * d * 4
        assert got["ssm"] == 0 and got["total"] == got["weights"] + got["kv"]
        assert got["weights_all"] == every and got["experts_all"] == 0
    # tied embeddings: the LM head reads the whole table
    model_t, params_t = random_model({**cfg, "tie_word_embeddings": True}, dtype="float32")
    assert bench.decode_bytes(model_t, params_t, 3, 8)["weights"] == bench.weight_bytes(params_t)


def test_decode_bytes_moe_and_state_by_hand():
    """Tiny Qwen3-Next: B=1 touches exactly k of E experts per layer; SSM state read + written."""
    cfg = bench.shape_config("qwen3-next-80b-a3b", 4) | SMALL["qwen3-next-80b-a3b"]
    model, params = random_model(cfg, dtype="float32")
    s = SMALL["qwen3-next-80b-a3b"]
    e, k, h, im, v = s["num_experts"], s["num_experts_per_tok"], s["hidden_size"], s["moe_intermediate_size"], \
        s["vocab_size"]
    experts = 4 * 4 * e * (h * 2 * im + im * h)  # 4 layers, float32: gate_up + down
    every = bench.weight_bytes(params)
    nk, nv, dk, dv, w = 2, 4, 16, 16, 4
    state = 4 * 3 * ((2 * nk * dk + nv * dv) * (w - 1) + nv * dk * dv)  # 3 GDN layers: conv + recurrent
    assert model.ssm_bytes_per_slot() == state
    one = bench.decode_bytes(model, params, 1, 7)
    assert one["experts_all"] == experts and one["experts_per_layer"] == pytest.approx(k)
    assert one["weights"] == every - experts + experts * k // e - 4 * (v - 1) * h
    assert one["kv"] == 7 * 2 * 1 * 2 * 32 * 4 and one["ssm"] == 2 * state
    many = bench.decode_bytes(model, params, 1000, 7)  # every expert touched
    assert many["experts_per_layer"] == pytest.approx(e) and many["weights"] == every  # B >= V: every row
    assert many["ssm"] == 2000 * state


# both `slow` for CI time (~28 s each on 2 cores; the engine's hybrid paths are the engine tests',
# this checks the bench)
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow) for s in sorted(SMALL)])
def test_bench_decode_latency_end_to_end(shape, tmp_path, monkeypatch):
    name = f"{shape}-small"
    monkeypatch.setitem(bench.SHAPES, name, {**bench.SHAPES[shape], **SMALL[shape]})
    out = tmp_path / "bench.json"
    argv = ["--random-weights", "--shape", name, "--num-layers", str(LAYERS[shape]), "--dtype", "float32",
            "--batches", "1,2", "--context", "6", "--decode-steps", "2", "--skip-throughput", "--max-model-len", "32",
            "--block-size", "4", "--prefill-buckets", "16", "--mixed-decode-buckets", "2",
            "--max-num-batched-tokens", "16", "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    mc = res["model_config"]
    assert mc["num_layers"] == LAYERS[shape] and mc["attention_layers"] == 1 and mc["ssm_bytes_per_slot"] > 0
    assert res["model"] == f"random-{name}-{LAYERS[shape]}l"
    rows = res["decode_latency"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("engine_step_ms", "device_step_ms", "tok_per_s", "device_tok_per_s", "roofline_step_ms",
                    "roofline_ratio_engine", "roofline_ratio_device", "bytes_weights", "bytes_kv", "bytes_ssm"):
            assert np.isfinite(r[key]) and r[key] > 0, (key, r[key])
        assert r["bytes_per_step"] == r["bytes_weights"] + r["bytes_kv"] + r["bytes_ssm"]
        assert r["bytes_weights"] < res["weight_bytes"]  # B embedding rows (and touched experts) only
        assert r["bytes_ssm"] == 2 * r["batch"] * mc["ssm_bytes_per_slot"]
        assert r["context"] == 6 + 2
    e, k = mc["experts"]
    assert (e, k) == ((16, 4) if shape.startswith("qwen3") else (0, 0))
    if e:
        assert [r["experts_per_layer"] for r in rows] == pytest.approx([k, e * (1 - (1 - k / e) ** 2)])
    assert rows[1]["bytes_kv"] == 2 * rows[0]["bytes_kv"]
    md = out.with_suffix(".md").read_text()
    assert "weights GB" in md and "SSM GB" in md and f"{LAYERS[shape]} layers (1 attention)" in md
