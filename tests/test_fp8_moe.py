"""Block-FP8 MoE experts (Qwen3-30B-A3B-FP8 layout) kept FP8 on the device (layers/moe_fp8.py).

Oracle: the qwen3_moe_fp8_tiny golden, transformers on the dequantized weights."""

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax import LLM, SamplingParams, load_model
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.linear import Fp8Linear
from metrale_jax.layers.moe import routed_experts
from metrale_jax.layers.moe_fp8 import dense_experts
from tests.conftest import FIXTURES

D = FIXTURES / "qwen3_moe_fp8_tiny"


def test_fp8_experts_stay_fp8_and_match_transformers():
    model, params = load_model(D, dtype="float32", show_progress=False)
    gu, down = params["layers"]["experts_gate_up"], params["layers"]["experts_down"]
    assert isinstance(gu, Fp8Linear) and gu.w8.dtype == jnp.float8_e4m3fn
    assert gu.w8.shape == (2, 8, 512, 64) and gu.segments == ((0, 160), (256, 160))  # gate, up: 2 blocks each
    assert down.w8.shape == (2, 8, 128, 160) and down.scale_inv.shape == (2, 8, 1, 2)
    g = np.load(D / "golden.npz")
    fwd = jax.jit(model.forward)
    logits = np.asarray(fwd(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    for b, n in enumerate(g["lengths"]):  # 1 token: the gathered (decode) path; 7 and 64: the grouped GEMM
        np.testing.assert_allclose(logits[b, :n], g["logits"][b, :n], rtol=1e-4, atol=1e-4)


def test_gathered_path_equals_grouped_gemm():
    """P = T * k < E takes the per-pair gather; it must equal the dense grouped GEMM on the same weights."""
    _, params = load_model(D, dtype="float32", show_progress=False)
    gu, down = (jax.tree.map(lambda a: a[1], params["layers"][k]) for k in ("experts_gate_up", "experts_down"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    idx = jnp.asarray([[0, 5], [7, 5], [2, 3]], jnp.int32)  # P = 6 < E = 8
    w = jnp.asarray(rng.uniform(0.1, 1, (3, 2)), jnp.float32)
    got = routed_experts(x, w, idx, gu, down)
    want = routed_experts(x, w, idx, dense_experts(gu, jnp.float32), dense_experts(down, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_engine_greedy_with_fp8_experts():
    g = np.load(D / "golden.npz")
    llm = LLM(model=str(D), dtype="float32", max_num_seqs=1, max_model_len=64, num_kv_blocks=16,
              max_num_batched_tokens=16, prefill_buckets=(16,), attention=AttentionConfig(unroll_layers=True),
              show_progress=False)
    out = llm.generate([{"prompt_token_ids": g["greedy_prompt"].tolist()}],
                       SamplingParams(temperature=0, max_tokens=len(g["greedy_ids"]), ignore_eos=True))
    assert out[0].outputs[0].token_ids == g["greedy_ids"].tolist()
