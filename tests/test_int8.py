"""8-bit integer checkpoints (GPTQ 8-bit, compressed-tensors W8A16 `pack-quantized` and W8A8-INT8
`int-quantized`), dequantized at load to run dense.

Oracles: tensors packed here element by element from the formats' documentation (nothing shared
with metrale_jax/quant/int8.py), and a dense checkpoint holding the same dequantized values.
"""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_jax import LLM, SamplingParams, load_model
from metrale_jax.errors import TensorShapeError, UnsupportedDtypeError
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.linear import Fp8Linear, W4Linear
from metrale_jax.quant import int8 as q8
from tests.conftest import FIXTURES, DictLoad

FORMATS = ["gptq", "gptq_act_order", "gptq_v2", "ct-packed", "ct-packed_asym", "ct-packed_act_order",
           "ct-int_channel", "ct-int_group_asym", "ct-int_tensor"]


def _quantize(w: np.ndarray, g: int, unsigned: bool, asym: bool, rng):
    """w f32[N, K] -> (q i64[N, K], zeros i64[N, ng], scales f16[N, ng], g_idx i64[K]) for groups of g
    columns (a shuffled g_idx with `rng`): q in 0..255 (unsigned) or -128..127, W = (q - z) * s."""
    n, k = w.shape
    ng = -(-k // g)
    g_idx = np.arange(k) // g
    if rng is not None:
        g_idx = rng.permutation(g_idx)
    lo_q, hi_q = (0, 255) if unsigned else (-128, 127)
    q = np.zeros((n, k), np.int64)
    z = np.zeros((n, ng), np.int64)
    s = np.zeros((n, ng), np.float16)
    for gi in range(ng):
        cols = np.nonzero(g_idx == gi)[0]
        blk = w[:, cols]
        if asym:
            lo, hi = np.minimum(blk.min(1), 0), np.maximum(blk.max(1), 0)
            sc = ((hi - lo) / 255).astype(np.float16)
        else:
            sc = (np.abs(blk).max(1) / 127).astype(np.float16)
        sc[sc == 0] = 1
        sf = sc.astype(np.float32)
        # (GPTQ v1 stores zero - 1, so a zero of 0 has no code: its quantizers' zeros are >= 1 in practice)
        zz = np.clip(np.round(lo_q - lo / sf), lo_q + unsigned, hi_q) if asym else np.full(n, 128 if unsigned else 0)
        q[:, cols] = np.clip(np.round(blk / sf[:, None]) + zz[:, None], lo_q, hi_q)
        z[:, gi], s[:, gi] = zz, sc
    return q, z, s, g_idx


def _pack(fmt: str, w: np.ndarray, g: int, seed: int = 0) -> tuple[dict, np.ndarray, dict]:
    """w f32[N, K] -> (the module's tensors by suffix, the dequantized f32[N, K], quantization_config)."""
    n, k = w.shape
    rng = np.random.default_rng(seed) if fmt.endswith("act_order") else None
    asym = "asym" in fmt or fmt.startswith("gptq")
    if fmt.startswith("ct-int_channel"):
        g = k
    if fmt.startswith("ct-int_tensor"):  # one scale: quantize against the whole matrix's range
        sc = np.float16(np.abs(w).max() / 127)
        q = np.clip(np.round(w / np.float32(sc)), -128, 127).astype(np.int64)
        return ({"weight": q.astype(np.int8), "weight_scale": np.array([sc], np.float16)},
                q * np.float32(sc), _ct_config("int-quantized", "tensor", None, True))
    q, z, s, g_idx = _quantize(w, g, unsigned=fmt.startswith("gptq"), asym=asym, rng=rng)
    deq = (q - z[:, g_idx]).astype(np.float32) * s.astype(np.float32)[:, g_idx]
    ng = s.shape[1]
    if fmt.startswith("gptq"):  # qweight [K/4, N]: byte k % 4 of word k // 4; qzeros [ng, N/4] along N
        v1 = fmt != "gptq_v2"
        qw = np.zeros((-(-k // 4), n), np.uint32)
        qz = np.zeros((ng, -(-n // 4)), np.uint32)
        for r in range(n):
            for c in range(k):
                qw[c // 4, r] |= np.uint32(q[r, c] << (8 * (c % 4)))
            for gi in range(ng):
                qz[gi, r // 4] |= np.uint32((z[r, gi] - v1) << (8 * (r % 4)))
        t = {"qweight": qw.view(np.int32), "qzeros": qz.view(np.int32), "scales": np.ascontiguousarray(s.T),
             "g_idx": g_idx.astype(np.int32)}
        qc = {"quant_method": "gptq", "bits": 8, "group_size": g, "desc_act": rng is not None, "sym": False,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
        return t, deq, qc
    if fmt.startswith("ct-packed"):  # weight_packed [N, K/4]: value + 128 in byte k % 4 of word k // 4
        wp = np.zeros((n, -(-k // 4)), np.uint32)
        zp = np.zeros((-(-n // 4), ng), np.uint32)
        for r in range(n):
            for c in range(k):
                wp[r, c // 4] |= np.uint32((q[r, c] + 128) << (8 * (c % 4)))
            for gi in range(ng):
                zp[r // 4, gi] |= np.uint32((z[r, gi] + 128) << (8 * (r % 4)))
        t = {"weight_packed": wp.view(np.int32), "weight_scale": s, "weight_shape": np.array([n, k], np.int64)}
        if asym:
            t["weight_zero_point"] = zp.view(np.int32)
        if rng is not None:
            t["weight_g_idx"] = g_idx.astype(np.int32)
        return t, deq, _ct_config("pack-quantized", "group", g, not asym)
    t = {"weight": q.astype(np.int8), "weight_scale": s}
    if asym:
        t["weight_zero_point"] = z.astype(np.int8)
    strategy = "channel" if g == k else "group"
    return t, deq, _ct_config("int-quantized", strategy, None if g == k else g, not asym)


def _ct_config(fmt: str, strategy: str, g: int | None, symmetric: bool) -> dict:
    w = {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": g,
         "dynamic": False, "observer": "minmax"}
    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": w}
    if fmt == "int-quantized":
        group["input_activations"] = act  # W8A8: activation quantization, not applied here
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(12, 12), (8, 30), (10, 13), (4, 64)])
def test_readers_read_each_value(fmt, n, k):
    """Each reader against values packed one by one, on shapes that are not multiples of a word (4
    values) along either axis, with act-order, asymmetric zero points and v1 / v2 GPTQ zeros."""
    w = np.random.default_rng(n * k).standard_normal((n, k)).astype(np.float32)
    t, deq, qc = _pack(fmt, w, g=4, seed=n + k)
    scheme = q8.parse_int8_config(qc)
    assert scheme is not None
    got = q8.READERS[scheme.method][1](DictLoad({"m." + x: v for x, v in t.items()}), "m.", n, k, scheme)
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_allclose(got, deq, rtol=1e-6, atol=0)
    assert np.abs(got - w).max() < 0.05 * np.abs(w).max()  # and it is w, quantized


def test_reader_errors_name_the_tensor():
    w = np.ones((8, 16), np.float32)
    t, _, qc = _pack("ct-packed", w, g=4)
    scheme = q8.parse_int8_config(qc)
    bad = {"m." + x: v for x, v in t.items()}
    bad["m.weight_scale"] = bad["m.weight_scale"][:, :3]  # 3 groups cannot cover K = 16 in groups of 4
    with pytest.raises(TensorShapeError, match="weight_scale"):
        q8.READERS["ct-packed"][1](DictLoad(bad), "m.", 8, 16, scheme)
    t, _, qc = _pack("ct-int_channel", w, g=4)
    bad = {"m." + x: v for x, v in t.items()}
    bad["m.weight"] = bad["m.weight"].astype(np.int16)
    with pytest.raises(UnsupportedDtypeError, match="int8"):
        q8.READERS["ct-int"][1](DictLoad(bad), "m.", 8, 16, q8.parse_int8_config(qc))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "block"}}}}, "block"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"a": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
                        "b": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}, "mixing"),
])
def test_unsupported_8bit_variants_are_named(qc, match):
    with pytest.raises(UnsupportedDtypeError, match=match):
        q8.parse_int8_config(qc)


def test_other_methods_are_not_8bit():
    assert q8.parse_int8_config({"quant_method": "gptq", "bits": 4, "group_size": 128}) is None
    assert q8.parse_int8_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None
    ct4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}
    assert q8.parse_int8_config(ct4) is None


def _pair(tmp_path, name: str, fmt: str, which, g: int = 16):
    """Fixture `name` twice: "q" with the 2-D weights `which(name)` selects in format `fmt`, "dense"
    with those weights replaced by their dequantized values."""
    t = load_file(FIXTURES / name / "model.safetensors")
    dense, quant = dict(t), dict(t)
    qc = None
    for i, (nm, w) in enumerate(sorted(t.items())):
        if w.ndim == 2 and which(nm):
            tensors, dense[nm], qc = _pack(fmt, w.astype(np.float32), g, seed=i)
            del quant[nm]
            quant.update({nm[: -len("weight")] + x: v for x, v in tensors.items()})
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    for kind, tensors, c in (("dense", dense, cfg), ("q", quant, dict(cfg, quantization_config=qc))):
        (tmp_path / kind).mkdir()
        save_file(tensors, tmp_path / kind / "model.safetensors")
        (tmp_path / kind / "config.json").write_text(json.dumps(c))
    return tmp_path / "dense", tmp_path / "q"


def _is_linear(nm: str) -> bool:
    return nm.endswith("_proj.weight")


@pytest.mark.parametrize("name,fmt", [("llama_tiny", "gptq_act_order"), ("llama_tiny", "ct-packed_asym"),
                                      ("llama_tiny", "ct-int_channel"), ("qwen3_moe_tiny", "ct-int_group_asym")])
def test_8bit_checkpoints_load_dense(tmp_path, caplog, name, fmt):
    """An 8-bit checkpoint gives the logits of the dense checkpoint holding its dequantized weights
    (MoE experts included), loads them in the model dtype, and says so in one warning."""
    import jax
    import jax.numpy as jnp

    dense, q = _pair(tmp_path, name, fmt, _is_linear)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 11)))
    model, ref = load_model(dense, dtype="float32", show_progress=False)
    with caplog.at_level("WARNING"):
        _, params = load_model(q, dtype="float32", show_progress=False)
    np.testing.assert_allclose(np.asarray(model.forward(params, ids)), np.asarray(model.forward(ref, ids)),
                               atol=2e-4, rtol=2e-4)
    assert not any(isinstance(x, (W4Linear, Fp8Linear)) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, (W4Linear, Fp8Linear))))
    assert "no kernel here runs 8-bit integer weights" in caplog.text and "self_attn.q_proj" in caplog.text
    assert caplog.text.count("dequantized to float32") == 1


def test_8bit_checkpoint_through_the_engine(tmp_path):
    """LLM.generate (paged prefill and decode steps) on a W8A8-INT8 checkpoint: the greedy ids of the
    dense checkpoint with the same dequantized weights."""
    dense, q = _pair(tmp_path, "llama_tiny", "ct-int_group_asym", _is_linear)
    kw = dict(dtype="float32", max_num_seqs=2, max_model_len=64, num_kv_blocks=32, max_num_batched_tokens=16,
              prefill_buckets=(16,), attention=AttentionConfig(unroll_layers=True), show_progress=False)
    prompts = [{"prompt_token_ids": [5, 17, 33, 4, 250, 9]}, {"prompt_token_ids": [1, 2, 3]}]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM(model=str(q), **kw).generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in LLM(model=str(dense), **kw).generate(prompts, sp)]
    assert got == want
