"""Block-FP8 MoE experts (Qwen3-30B-A3B-FP8 layout) kept FP8 on the device (layers/moe_fp8.py).

Oracle: the qwen3_moe_fp8_tiny golden, transformers on the dequantized weights."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from metrale_jax import LLM, SamplingParams, load_model
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.linear import Fp8Linear
from metrale_jax.layers.moe import routed_experts
from metrale_jax.layers.moe_fp8 import dense_experts
from pallas_kernels.linear.expert_fp8 import ExpertParams, expert_matvec_fp8
from tests.conftest import FIXTURES

D = FIXTURES / "qwen3_moe_fp8_tiny"


def test_fp8_experts_stay_fp8_and_match_transformers():
    model, params = load_model(D, dtype="float32", show_progress=False)
    gu, down = params["layers"]["experts_gate_up"], params["layers"]["experts_down"]
    assert isinstance(gu, Fp8Linear) and gu.w8.dtype == jnp.float8_e4m3fn
    assert gu.w8.shape == (2, 4, 512, 64) and gu.segments == ((0, 136), (256, 136))  # gate, up: 2 blocks each
    assert down.w8.shape == (2, 4, 128, 136) and down.scale_inv.shape == (2, 4, 1, 2)
    g = np.load(D / "golden.npz")
    fwd = jax.jit(model.forward)
    logits = np.asarray(fwd(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    for b, n in enumerate(g["lengths"]):  # 1 token (2 pairs < 4 experts): the gathered path; 7, 64: grouped GEMM
        np.testing.assert_allclose(logits[b, :n], g["logits"][b, :n], rtol=1e-4, atol=1e-4)


def test_gathered_path_equals_grouped_gemm():
    """P = T * k < E takes the per-pair gather; it must equal the dense grouped GEMM on the same weights."""
    _, params = load_model(D, dtype="float32", show_progress=False)
    gu, down = (jax.tree.map(lambda a: a[1], params["layers"][k]) for k in ("experts_gate_up", "experts_down"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    idx = jnp.asarray([[3, 1]], jnp.int32)  # P = 2 < E = 4
    w = jnp.asarray(rng.uniform(0.1, 1, (1, 2)), jnp.float32)
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


def _np_expert_matvec(x, w8, s, experts):
    """Independent numpy oracle: per pair, dequantize its expert block by block (128x128)."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    out = np.zeros((x.shape[0], w8.shape[1]))
    for p, e in enumerate(np.asarray(experts)):
        w = np.asarray(w8[e]).astype(np.float64)
        for i in range(s.shape[1]):
            for j in range(s.shape[2]):
                w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= float(s[e, i, j])
        out[p] = w @ x[p]
    return out


@pytest.mark.parametrize("p,e,n,k,params", [(1, 4, 200, 300, ExpertParams(16, 128)),
                                            (7, 3, 64, 1000, ExpertParams(32, 256)),
                                            (5, 8, 130, 96, ExpertParams(128, 64))])
def test_expert_matvec_fp8_interpret(p, e, n, k, params):
    rng = np.random.default_rng(p + e + n + k)
    w8 = np.clip(rng.standard_normal((e, n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = np.exp2(rng.uniform(-10, 0, (e, -(-n // 128), -(-k // 128)))).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((p, k)), jnp.bfloat16)
    ex = rng.integers(0, e, p).astype(np.int32)
    y = expert_matvec_fp8(x, jnp.asarray(w8), jnp.asarray(s), jnp.asarray(ex), params=params, interpret=True)
    assert y.shape == (p, n) and y.dtype == jnp.bfloat16
    want = _np_expert_matvec(x, w8, s, ex)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_fp8_experts_kernel_in_decode_step(tokens):
    """use_fp8_kernel marks the experts too: a decode-sized MoE call (P = 2 or 6 pairs, E = 4
    experts: P < 4E) runs the expert kernel (interpret) and equals the unmarked path (the XLA
    gather at P < E, the dense grouped GEMM above); P = 16 = 4E takes the dense path."""
    from metrale_jax.layers.linear import use_fp8_kernel

    _, params = load_model(D, dtype="bfloat16", show_progress=False)
    marked = use_fp8_kernel(params, interpret=True)
    gu, down = (jax.tree.map(lambda a: a[0], marked["layers"][k]) for k in ("experts_gate_up", "experts_down"))
    gu0, down0 = (jax.tree.map(lambda a: a[0], params["layers"][k]) for k in ("experts_gate_up", "experts_down"))
    assert gu.use_kernel and not gu0.use_kernel
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.bfloat16)
    idx = jnp.asarray(rng.permuted(np.tile(np.arange(4), (tokens, 1)), axis=1)[:, :2], jnp.int32)  # top-2 of 4
    w = jnp.asarray(rng.uniform(0.1, 1, (tokens, 2)), jnp.float32)
    f = jax.jit(routed_experts)
    got = np.asarray(f(x, w, idx, gu, down), np.float32)
    assert ("expert_matvec_fp8" in str(jax.make_jaxpr(routed_experts)(x, w, idx, gu, down))) == (tokens * 2 < 16)
    want = np.asarray(f(x, w, idx, gu0, down0), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("tokens", [1, 8])
def test_per_channel_fp8_experts(tokens):
    """`Fp8Linear.col_scale` on FP8 experts (per-channel checkpoints; here on top of the fixture's
    block scales): the expert kernel (interpret) and XLA's gather at P < E, the grouped GEMM at
    P = 4E, against the same experts dequantized (scales included) and run dense."""
    import dataclasses

    from metrale_jax.layers.linear import use_fp8_kernel

    _, params = load_model(D, dtype="bfloat16", show_progress=False)
    rng = np.random.default_rng(tokens)

    def with_cols(w):
        return dataclasses.replace(w, col_scale=jnp.asarray(rng.uniform(0.25, 4, w.w8.shape[:-1]), jnp.float32))

    gu, down = (with_cols(jax.tree.map(lambda a: a[0], params["layers"][key]))
                for key in ("experts_gate_up", "experts_down"))
    gu_k, down_k = use_fp8_kernel((gu, down), interpret=True)
    x = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.bfloat16)
    idx = jnp.asarray(rng.permuted(np.tile(np.arange(4), (tokens, 1)), axis=1)[:, :2], jnp.int32)  # top-2 of 4
    w = jnp.asarray(rng.uniform(0.1, 1, (tokens, 2)), jnp.float32)
    want = np.asarray(routed_experts(x, w, idx, dense_experts(gu, jnp.bfloat16), dense_experts(down, jnp.bfloat16)),
                      np.float32)
    for a, b in ((gu, down), (gu_k, down_k)):
        got = np.asarray(jax.jit(routed_experts)(x, w, idx, a, b), np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("p,e,n,k", [(8, 128, 1536, 2048), (64, 512, 1024, 2048), (3, 16, 200, 300)])
def test_expert_matvec_fp8_gpu(p, e, n, k):
    from pallas_kernels.linear.expert_fp8 import expert_matvec_fp8_reference

    rng = np.random.default_rng(0)
    w8 = jnp.asarray(np.clip(rng.standard_normal((e, n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn))
    s = jnp.asarray(np.exp2(rng.uniform(-10, 0, (e, -(-n // 128), -(-k // 128)))).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((p, k)), jnp.bfloat16)
    ex = jnp.asarray(rng.integers(0, e, p).astype(np.int32))
    y = expert_matvec_fp8(x, w8, s, ex).astype(jnp.float32)
    want = expert_matvec_fp8_reference(x, w8, s, ex)
    assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 1e-2


def _np_grouped(x, w8, s, sizes):
    """Independent numpy oracle of the grouped GEMM: x [M, K] rows by group, each group's FP8
    weights [N_pad, K] dequantized block by block (128 x 128) -> f64[M, N_pad]."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    out, row = np.zeros((x.shape[0], w8.shape[1])), 0
    for g, n in enumerate(np.asarray(sizes)):
        w = np.asarray(w8[g]).astype(np.float64)
        for i in range(s.shape[1]):
            for j in range(s.shape[2]):
                w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= float(s[g, i, j])
        out[row:row + n] = x[row:row + n] @ w.T
        row += n
    return out


def _fp8_case(seed, m, g, n_pad, k):
    rng = np.random.default_rng(seed)
    w8 = np.clip(rng.standard_normal((g, n_pad, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = np.exp2(rng.uniform(-14, -4, (g, n_pad // 128, k // 128))).astype(np.float32)
    # rows of very different sizes (one all zero, one large): each row gets its own power of two
    x = rng.standard_normal((m, k)) * np.exp2(rng.uniform(-8, 12, (m, 1)))
    if m > 1:
        x[m // 2] = 0
    cuts = np.sort(rng.integers(0, m + 1, g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)  # some groups empty
    return jnp.asarray(x, jnp.bfloat16), w8, s, sizes


@pytest.mark.parametrize("m", [1, 15, 65, 300])
def test_f16_operands_rebuild_the_product_without_overflow(m):
    """The FP8 grouped GEMM's f16 operands (what tokamax's kernel multiplies, `moe_fp8.f16_operands`):
    the product of the f16 values, rounded to f16 as the kernel's output is, times `undo` equals the
    dequantized product; and the worst case (every |x16| and |w8| at their maximum, the largest
    block scale everywhere) stays finite in f16."""
    from metrale_jax.layers.moe_fp8 import f16_operands

    x, w8, s, sizes = _fp8_case(m, m, 4, 256, 384)
    x16, scales, undo = f16_operands(x, jnp.asarray(w8), jnp.asarray(s))
    assert x16.dtype == scales.dtype == jnp.float16 and scales.shape == (4, 3, 256)
    assert float(jnp.max(jnp.abs(x16))) < 1
    wq = jnp.asarray(w8).astype(jnp.float32) * jnp.repeat(jnp.swapaxes(scales, -1, -2).astype(jnp.float32), 128, -1)
    y16 = jax.lax.ragged_dot(x16.astype(jnp.float32), jnp.swapaxes(wq, -1, -2), jnp.asarray(sizes)).astype(jnp.float16)
    assert bool(jnp.all(jnp.isfinite(y16)))
    got = np.asarray(y16.astype(jnp.float32) * undo)
    want = _np_grouped(x, w8, s, sizes)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
    if m > 1:
        np.testing.assert_allclose(got[m // 2], 0)
    worst = 448.0 * float(jnp.max(scales.astype(jnp.float32))) * 384  # every |x16| -> 1
    assert worst <= 2.0 ** 15


@pytest.mark.gpu
@pytest.mark.parametrize("m,g,n_pad,k,segments", [(1, 8, 256, 512, ((0, 256),)),
                                                  (15, 4, 1536, 2048, ((0, 768), (768, 768))),
                                                  (300, 16, 1024, 512, ((0, 512), (512, 512))),
                                                  (65, 512, 2048, 512, ((0, 2048),))])
def test_fp8_grouped_matmul_tokamax_gpu(m, g, n_pad, k, segments):
    """tokamax's quantized grouped GEMM (the engine's FP8 experts at prefill sizes) against the numpy oracle."""
    from metrale_jax.layers.moe import tokamax_available
    from metrale_jax.layers.moe_fp8 import fp8_grouped_matmul

    if not tokamax_available():
        pytest.skip("tokamax is not installed")
    x, w8, s, sizes = _fp8_case(m + g, m, g, n_pad, k)
    w = Fp8Linear(jnp.asarray(w8), jnp.asarray(s), segments)
    got = np.asarray(jax.jit(fp8_grouped_matmul, static_argnums=3)(x, w, jnp.asarray(sizes), True))
    want = _np_grouped(x, w8, s, sizes)
    cols = np.concatenate([np.arange(a, a + n) for a, n in segments])
    assert got.shape == (m, sum(n for _, n in segments))
    assert np.linalg.norm(got - want[:, cols]) / np.linalg.norm(want[:, cols]) < 5e-3
    # per-channel FP8 (`col_scale`): each row's output columns times its group's channel scales
    col = np.random.default_rng(m).uniform(0.25, 4, (g, n_pad)).astype(np.float32)
    w = Fp8Linear(jnp.asarray(w8), jnp.asarray(s), segments, col_scale=jnp.asarray(col))
    got = np.asarray(jax.jit(fp8_grouped_matmul, static_argnums=3)(x, w, jnp.asarray(sizes), True))
    want = (want * np.repeat(col, sizes, axis=0))[:, cols]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
