"""4-bit weights: GPTQ, AWQ, compressed-tensors W4A16 / NVFP4 and ModelOpt NVFP4 checkpoints, the
4-bit decode kernel, and int4 / nvfp4 quantize-on-load.

Oracles: the fixtures' goldens are transformers run on weights dequantized by compressed-tensors
itself or by numpy in make_fixtures.py written per element from the formats' documentation (it
shares nothing with metrale_jax/quant/w4.py); the kernel tests unpack nibbles with a numpy loop
written here.
"""

import dataclasses
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
from metrale_jax.layers.linear import W4Linear, use_fp8_kernel
from metrale_jax.quant import w4 as q4
from pallas_kernels.linear import W4Params, skinny_matmul_w4
from tests._paged import Layout
from tests.conftest import FIXTURES, DictLoad

W4_FIXTURES = ["llama_gptq_tiny", "llama_gptq_sym_tiny", "llama_awq_tiny", "llama_w4a16_ct_tiny",
               "llama_w4a16_ct_channel_tiny", "llama_nvfp4_ct_tiny", "llama_nvfp4_modelopt_tiny"]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _logprobs(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


@pytest.mark.parametrize("name", W4_FIXTURES)
def test_checkpoint_stays_4bit_and_matches_transformers(name):
    d = FIXTURES / name
    model, params = load_model(d, dtype="float32", show_progress=False)
    for key in ("wqkv", "wo", "w_gate_up", "w_down"):
        w = params["layers"][key]
        assert isinstance(w, W4Linear) and w.packed.dtype == jnp.uint8
    assert not isinstance(params["lm_head"], W4Linear)
    wqkv = params["layers"]["wqkv"]
    assert wqkv.packed.shape == (2, 64 + 32 + 32, 32)  # q|k|v rows, K = 64 -> 32 bytes
    assert (wqkv.perm is not None) == (name == "llama_gptq_tiny")  # act-order: a shuffled g_idx
    g = np.load(d / "golden.npz")
    fwd = jax.jit(model.forward)
    logits = np.asarray(fwd(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    for b, n in enumerate(g["lengths"]):
        np.testing.assert_allclose(_logprobs(logits[b, :n]), _logprobs(g["logits"][b, :n]), atol=1e-2, rtol=0)
        np.testing.assert_allclose(logits[b, :n], g["logits"][b, :n], atol=1e-3, rtol=1e-3)  # in fact much closer
    # greedy: the argmax chain over prompt + transformers' greedy ids reproduces those ids
    ids = np.concatenate([g["greedy_prompt"], g["greedy_ids"]])
    full = np.asarray(fwd(params, jnp.asarray(ids[None])))[0]
    p = len(g["greedy_prompt"])
    np.testing.assert_array_equal(full[p - 1:-1].argmax(-1), g["greedy_ids"])
    np.testing.assert_allclose(_logprobs(full), _logprobs(g["greedy_logits"]), atol=1e-2, rtol=0)


def test_engine_greedy_matches_transformers():
    """The engine (paged prefill + decode steps) on GPTQ act-order weights: transformers' greedy ids.
    With the GPU's layer loop (unroll_layers: W4Linear fields split into per-layer arrays; the
    scan path is the forwards above)."""
    from metrale_jax.layers.stack import Unstacked

    d = FIXTURES / "llama_gptq_tiny"
    g = np.load(d / "golden.npz")
    llm = LLM(model=str(d), dtype="float32", max_num_seqs=1, max_model_len=64, num_kv_blocks=16,
              max_num_batched_tokens=16, prefill_buckets=(16,), attention=AttentionConfig(unroll_layers=True),
              show_progress=False)
    out = llm.generate([{"prompt_token_ids": g["greedy_prompt"].tolist()}],
                       SamplingParams(temperature=0, max_tokens=len(g["greedy_ids"]), ignore_eos=True))
    assert out[0].outputs[0].token_ids == g["greedy_ids"].tolist()
    w = llm.llm_engine.params["layers"]["wqkv"]
    assert isinstance(w, W4Linear) and isinstance(w.packed, Unstacked) and isinstance(w.perm, Unstacked)
    mc = llm.llm_engine.model_config  # (vLLM's: what scripts read off the engine)
    assert (mc.quantization, mc.dtype, mc.max_model_len, mc.get_vocab_size()) == ("gptq", "float32", 64, 256)
    assert llm.llm_engine.get_model_config() == mc and mc.model.endswith("llama_gptq_tiny")


@pytest.mark.parametrize("name,fuse", [("llama_gptq_tiny", True), ("llama_awq_tiny", True),
                                       ("llama_nvfp4_ct_tiny", True),
                                       pytest.param("llama_nvfp4_ct_tiny", False, marks=pytest.mark.slow)])
def test_w4_kernel_in_decode_steps(name, fuse):
    """use_fp8_kernel marks W4Linear too: the decode rows' 4-bit linears go through the Pallas
    kernel (interpret mode here), with act-order x gathers; prefill rows stay on XLA. With
    w4_fused_decode, one row without act-order runs the norms, SwiGLU and residual adds in the
    kernel's launches."""
    model, params = load_model(FIXTURES / name, dtype="bfloat16", show_progress=False)
    marked = use_fp8_kernel(params, interpret=True, w4_fused_decode=fuse)
    assert marked["layers"]["w_down"].use_kernel and not params["layers"]["w_down"].use_kernel
    lay = Layout(2, num_blocks=32, block_size=4, max_blocks=8, seed=1)
    prompt = jnp.asarray(np.random.default_rng(4).integers(3, 250, 16).astype(np.int32))
    fwd = jax.jit(model.forward_paged, static_argnums=(5,))
    # 3 decode rows (the dot path), then 1 (M = 1: the tuned table's half2 variant, its jnp twin here)
    for rows, toks in ([(0, 9), (1, 7)], [11, 12, 0]), ([(1, 7)], [12]):
        for p in (params, marked):
            state = model.init_state(32, lay.bs)
            state, _ = fwd(p, state, prompt, None, lay.prefill([(0, 0, 9), (1, 0, 7)], 16, 2), AttentionConfig())
            dmd = lay.decode(rows, len(toks))
            toks = jnp.asarray(toks, jnp.int32)
            _, hidden = fwd(p, state, toks, dmd, None, AttentionConfig())
            logits = np.asarray(model.compute_logits(p, hidden)[:len(rows)], np.float32)
            if p is params:
                want = logits
            jaxpr = str(jax.make_jaxpr(model.forward_paged, static_argnums=(5,))(p, state, toks, dmd, None,
                                                                                AttentionConfig()))
            assert ("skinny_matmul_w4" in jaxpr) == (p is marked)
            # SwiGLU's logistic in XLA, unless fused (the kernel computes it with exp)
            fused = fuse and p is marked and len(rows) == 1 and name != "llama_gptq_tiny"
            assert ("logistic" in jaxpr) != fused
        assert np.isfinite(logits).all()
        # bf16 both ways; the kernel rounds its output to bf16 before the norm's row scale (the tiny
        # random net amplifies that to ~2.5%); a wiring error (perm, fused parts) is O(1)
        assert np.linalg.norm(logits - want) / np.linalg.norm(want) < 5e-2


# ---- the kernel -------------------------------------------------------------------------------------
def _oracle_weight(packed, scales, aux, k, g, kind):
    """Per-row numpy unpacking (independent of the package): f64[N, K]."""
    n = packed.shape[0]
    out = np.zeros((n, k))
    for r in range(n):
        for c in range(k):
            byte = int(packed[r, c // 2])
            code = (byte >> 4) if c % 2 else (byte & 15)
            s = float(np.float32(scales[r, c // g]))
            if kind == "int4":
                out[r, c] = (code - int(aux[r, c // g])) * s
            else:
                v = E2M1[code & 7] * (-1 if code & 8 else 1)
                out[r, c] = v * s * float(aux[r])
    return out


def _random_w4(rng, n, k, g, kind):
    packed = rng.integers(0, 256, (n, (k + 1) // 2), dtype=np.uint8)
    ng = -(-k // g)
    if kind == "int4":
        scales = np.exp2(rng.uniform(-8, 0, (n, ng))).astype(np.float16)
        aux = rng.integers(0, 17, (n, ng), dtype=np.uint8)
    else:
        scales = np.exp2(rng.uniform(-8, 2, (n, ng))).astype(ml_dtypes.float8_e4m3fn)
        aux = np.exp2(rng.uniform(-4, 4, n)).astype(np.float32)
    return packed, scales, aux


@pytest.mark.parametrize("kind,m,n,k,g,params", [
    ("int4", 5, 70, 201, 128, W4Params(block_n=32, block_k=128)),  # odd K, partial group and tiles
    ("int4", 64, 33, 64, 64, W4Params(block_n=16, block_k=32)),
    ("fp4", 3, 50, 112, 16, W4Params(block_n=16, block_k=64)),
    ("fp4", 17, 24, 48, 16, W4Params(block_n=32, block_k=512)),
    ("int4", 2, 48, 160, 32, W4Params(block_n=16, block_k=64)),  # float16 activations (GPTQ / AWQ models)
    # group_partial: per-group dots of raw codes, zero * sum(x) subtracted, scale on the partial
    ("int4", 9, 40, 190, 96, W4Params(block_n=16, block_k=32, group_partial=True)),  # 3 steps per group
    ("int4", 1, 24, 256, 32, W4Params(block_n=16, block_k=128, group_partial=True)),  # 4 groups per step
    # gemv: M = 1 on the CUDA cores
    ("int4", 1, 40, 201, 64, W4Params(block_n=16, block_k=64, gemv=True)),
    ("fp4", 1, 24, 80, 16, W4Params(block_n=16, block_k=32, gemv=True)),
    # gemv + group_partial: per-group sums of code * x, zero and scale per group (no conversions)
    ("int4", 1, 40, 201, 64, W4Params(block_n=16, block_k=32, gemv=True, group_partial=True)),  # 2 steps a group
    ("int4", 1, 24, 256, 32, W4Params(block_n=16, block_k=128, gemv=True, group_partial=True)),  # 4 groups a step
    ("int4", 1, 24, 192, 192, W4Params(block_n=32, block_k=64, gemv=True, group_partial=True)),  # one group (channel)
    ("fp4", 1, 24, 80, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True)),
    ("int4", 1, 40, 201, 64, W4Params(block_n=16, block_k=32, gemv=True, group_partial=True, unroll=True)),
    ("int4", 3, 40, 201, 32, W4Params(block_n=16, block_k=64, scale_tile=True, unroll=True)),
    # half2: u32 words, half2 sums of codes as f16 subnormals (K % 8 == 0), group sizes around block_k
    ("int4", 1, 40, 200, 64, W4Params(block_n=16, block_k=32, gemv=True, group_partial=True, half2=True)),
    ("int4", 1, 24, 256, 32, W4Params(block_n=16, block_k=128, gemv=True, group_partial=True, half2=True)),
    ("int4", 1, 70, 192, 192, W4Params(block_n=32, block_k=64, gemv=True, group_partial=True, half2=True)),
    ("int4", 1, 40, 200, 64, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      prefetch=True)),  # next step's words carried in the loop
    ("fp4", 1, 40, 200, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True)),
    # half2 split along K: 4 steps over 3 programs (one program's second step past K), f32 partials added
    ("int4", 1, 40, 248, 64, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      split_k=3)),
    ("fp4", 1, 24, 256, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True, split_k=2,
                                     prefetch=True)),
    ("fp4", 1, 24, 96, 16, W4Params(block_n=32, block_k=32, gemv=True, group_partial=True, half2=True, prefetch=True)),
    ("int4", 1, 24, 160, 32, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      unroll=True)),  # float16 activations
    # half2 with word_scales: each word's own group scale (and zero), no per-group sums
    ("fp4", 1, 40, 200, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                     word_scales=True)),
    ("int4", 1, 40, 248, 64, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      word_scales=True, split_k=3, prefetch=True)),
    ("int4", 1, 24, 256, 32, W4Params(block_n=16, block_k=128, gemv=True, group_partial=True, half2=True,
                                      word_scales=True)),  # 4 groups a step
    # scale_tile: [BN, BK/G] scale / zero tiles broadcast in registers (partial last group, odd K)
    ("int4", 3, 40, 201, 32, W4Params(block_n=16, block_k=128, scale_tile=True)),
    ("fp4", 5, 24, 112, 16, W4Params(block_n=16, block_k=64, scale_tile=True)),
    # packed_x: x's f16 pairs packed once per word column (the interpret twin unpacks them)
    ("int4", 1, 40, 248, 64, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      packed_x=True, split_k=3, prefetch=True)),
    ("fp4", 1, 40, 200, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                     packed_x=True, word_scales=True)),
    ("int4", 1, 24, 160, 32, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      packed_x=True, unroll=True)),  # float16 activations
    # prefetch rings: 2-4 steps ahead (past a program's last step along K: masked; 4 ahead of 3 steps)
    ("int4", 1, 40, 456, 64, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      prefetch=2, split_k=3)),
    ("fp4", 1, 24, 200, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                     prefetch=3, word_scales=True, unroll=True)),
    ("int4", 1, 24, 160, 32, W4Params(block_n=32, block_k=64, gemv=True, group_partial=True, half2=True,
                                      prefetch=4)),  # float16 activations; 3 steps
    # ring_scales: the scales and zeros carried with the words (float8 ones as their bytes)
    ("int4", 1, 40, 456, 32, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      prefetch=2, split_k=3, ring_scales=True)),  # 2 groups a step
    ("int4", 1, 24, 200, 64, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                      word_scales=True, ring_scales=True)),
    ("fp4", 1, 40, 200, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                     prefetch=True, split_k=2, word_scales=True, ring_scales=True)),
    ("fp4", 1, 24, 136, 16, W4Params(block_n=16, block_k=64, gemv=True, group_partial=True, half2=True,
                                     prefetch=3, unroll=True, ring_scales=True)),
    # whole-K tiles (block_k past K: one masked step per program), split along K too
    ("int4", 1, 40, 248, 64, W4Params(block_n=16, block_k=4096, gemv=True, group_partial=True, half2=True)),
    ("fp4", 1, 24, 200, 16, W4Params(block_n=16, block_k=4096, gemv=True, group_partial=True, half2=True,
                                     word_scales=True)),
    ("int4", 1, 40, 248, 32, W4Params(block_n=16, block_k=128, gemv=True, group_partial=True, half2=True, split_k=4)),
    # swap_ab: y^T = W_tile @ x^T (partial row, column and K tiles; with scale tiles; group_partial)
    ("fp4", 17, 70, 112, 16, W4Params(block_n=64, block_k=64, swap_ab=True, scale_tile=True)),
    ("fp4", 64, 24, 48, 16, W4Params(block_n=16, block_k=32, swap_ab=True)),
    ("int4", 9, 40, 190, 96, W4Params(block_n=16, block_k=32, group_partial=True, swap_ab=True)),
    ("int4", 2, 48, 201, 32, W4Params(block_n=32, block_k=64, swap_ab=True)),
])
def test_w4_kernel_interpret(kind, m, n, k, g, params):
    rng = np.random.default_rng(m * 1000 + n + k)
    packed, scales, aux = _random_w4(rng, n, k, g, kind)
    dt = jnp.float16 if k == 160 else jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    y = skinny_matmul_w4(x, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(aux), k=k, group_size=g,
                         kind=kind, params=params, interpret=True)
    assert y.shape == (m, n) and y.dtype == dt
    want = np.asarray(x.astype(jnp.float32), np.float64) @ _oracle_weight(packed, scales, aux, k, g, kind).T
    got = np.asarray(y.astype(jnp.float32), np.float64)
    # bf16 weights (int4: (q - z) * s rounded; fp4: exact) and a bf16 output
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() < 1e-2, err


_H2 = dict(gemv=True, group_partial=True, half2=True)


@pytest.mark.parametrize("kind,n,k,g,params,fusion", [
    # in the launch (one row, half2): each fusion alone and the decode layer's combinations
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, **_H2), "norm"),
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, **_H2), "norm+bias"),
    ("int4", 70, 200, 32, W4Params(block_n=32, block_k=64, prefetch=True, **_H2), "norm"),
    ("fp4", 24, 256, 16, W4Params(block_n=16, block_k=64, word_scales=True, unroll=True, **_H2), "norm"),
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, **_H2), "residual"),
    ("fp4", 40, 200, 16, W4Params(block_n=16, block_k=64, packed_x=True, **_H2), "residual+bias"),
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, **_H2), "silu"),
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, prefetch=True, **_H2), "silu+residual"),
    ("int4", 70, 248, 64, W4Params(block_n=16, block_k=64, **_H2), "silu+residual"),  # (N 70: float16 x)
    ("fp4", 24, 96, 16, W4Params(block_n=32, block_k=32, prefetch=True, **_H2), "silu+residual"),
    # split along K: the partials (and the norm's shares of the sum of squares) added in XLA
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, split_k=3, **_H2), "norm+bias"),
    ("fp4", 24, 256, 16, W4Params(block_n=16, block_k=64, split_k=2, prefetch=True, **_H2), "norm"),
    ("int4", 40, 248, 64, W4Params(block_n=16, block_k=64, split_k=3, **_H2), "silu+residual"),
    ("int4", 40, 456, 64, W4Params(block_n=16, block_k=64, split_k=2, prefetch=3, **_H2), "norm"),  # a ring of 3
    ("fp4", 24, 256, 16, W4Params(block_n=16, block_k=64, prefetch=2, ring_scales=True, **_H2), "silu+residual"),
    # other paths: the same in XLA around the kernel
    ("int4", 40, 201, 64, W4Params(block_n=16, block_k=32, gemv=True, group_partial=True), "norm+bias"),
    ("int4", 40, 201, 64, W4Params(block_n=16, block_k=64), "silu+residual"),
])
@pytest.mark.parametrize("m", [1, 3])
def test_w4_kernel_fused_interpret(kind, n, k, g, params, fusion, m):
    """Norm, SwiGLU, bias and residual around the product against float64 (the roundings the unfused
    layers make: x * w and silu(gate) * up in x's dtype, the result, then + residual in x's dtype);
    bf16 x, float16 for N = 70 (GPTQ / AWQ models)."""
    if m > 1 and params.half2:
        params = W4Params(block_n=16, block_k=64)  # (the dot path)
    rng = np.random.default_rng(n + k + m + len(fusion))
    packed, scales, aux = _random_w4(rng, n, k, g, kind)
    w = _oracle_weight(packed, scales, aux, k, g, kind)

    dt = jnp.float16 if n == 70 else jnp.bfloat16

    def rnd(v):  # f64 -> x's dtype -> f64
        return np.asarray(jnp.asarray(v, jnp.float32).astype(dt).astype(jnp.float32), np.float64)

    silu, norm = "silu" in fusion, "norm" in fusion
    x = jnp.asarray(rng.standard_normal((m, 2 * k if silu else k)) * 3, dt)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    kw = {}
    if silu:
        gate, up = xf[:, :k], xf[:, k:]
        xin, r = rnd(rnd(gate / (1 + np.exp(-gate))) * up), 1.0
    elif norm:
        nw = jnp.asarray(rng.uniform(0.5, 1.5, k), dt)
        kw.update(norm_weight=nw, eps=1e-5)
        xin = rnd(xf * np.asarray(nw.astype(jnp.float32), np.float64))
        r = 1 / np.sqrt((xf * xf).mean(axis=1, keepdims=True) + 1e-5)
    else:
        xin, r = xf, 1.0
    want = xin @ w.T * r
    if "bias" in fusion:
        b = jnp.asarray(rng.standard_normal(n), dt)
        kw["bias"] = b
        want = want + np.asarray(b.astype(jnp.float32), np.float64)
    if "residual" in fusion:
        res = jnp.asarray(rng.standard_normal((m, n)) * 4, dt)
        kw["residual"] = res
        want = np.asarray(res.astype(jnp.float32), np.float64) + rnd(want)
    y = skinny_matmul_w4(x, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(aux), k=k, group_size=g, kind=kind,
                         params=params, interpret=True, silu_mul=silu, **kw)
    assert y.shape == (m, n) and y.dtype == dt
    got = np.asarray(y.astype(jnp.float32), np.float64)
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() < 1e-2, err


def test_w4_kernel_rejects_bad_input():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    packed = jnp.zeros((8, 32), jnp.uint8)
    s = jnp.ones((8, 2), jnp.float16)
    z = jnp.zeros((8, 2), jnp.uint8)
    with pytest.raises(ValueError, match="m=65"):
        skinny_matmul_w4(jnp.zeros((65, 64), jnp.bfloat16), packed, s, z, k=64, group_size=32, kind="int4")
    with pytest.raises(ValueError, match="scales"):
        skinny_matmul_w4(x, packed, s[:, :1], z, k=64, group_size=32, kind="int4")
    with pytest.raises(ValueError, match="group"):
        skinny_matmul_w4(x, packed, jnp.ones((8, 3), jnp.float16), z, k=64, group_size=31, kind="int4")
    with pytest.raises(ValueError, match="group_partial"):  # 48 and 64 do not divide one another
        skinny_matmul_w4(x, packed, s, z, k=64, group_size=48, kind="int4",
                         params=W4Params(block_k=64, group_partial=True))
    with pytest.raises(ValueError, match="group_partial"):  # NVFP4's groups of 16
        skinny_matmul_w4(x, packed, jnp.ones((8, 4), ml_dtypes.float8_e4m3fn), jnp.ones(8), k=64, group_size=16,
                         kind="fp4", params=W4Params(block_k=64, group_partial=True))
    with pytest.raises(ValueError, match="group_partial with gemv"):  # 48 does not divide 64 nor is a multiple
        skinny_matmul_w4(x[:1], packed, s, z, k=64, group_size=48, kind="int4",
                         params=W4Params(block_k=64, gemv=True, group_partial=True))
    with pytest.raises(ValueError, match="scale_tile"):  # groups of 48: not a power of two
        skinny_matmul_w4(x, packed, s, z, k=64, group_size=48, kind="int4",
                         params=W4Params(block_k=64, scale_tile=True))
    with pytest.raises(ValueError, match="split_k"):
        skinny_matmul_w4(x[:1], packed, s, z, k=64, group_size=32, kind="int4", params=W4Params(block_k=32, split_k=2))
    with pytest.raises(ValueError, match="packed_x"):
        skinny_matmul_w4(x[:1], packed, s, z, k=64, group_size=32, kind="int4",
                         params=W4Params(block_k=32, packed_x=True))
    with pytest.raises(ValueError, match="prefetch"):
        W4Params(prefetch=-1)
    with pytest.raises(ValueError, match="row_scale"):
        skinny_matmul_w4(x, packed, s, z, k=64, group_size=32, kind="fp4")


@pytest.mark.parametrize("kind,g,params", [
    ("int4", 128, W4Params()), ("int4", 128, W4Params(group_partial=True)), ("int4", 128, W4Params(scale_tile=True)),
    ("fp4", 16, W4Params()), ("fp4", 16, W4Params(scale_tile=True)), ("fp4", 16, W4Params(gemv=True)),
    ("int4", 128, W4Params(block_k=512, gemv=True, group_partial=True)),
    ("fp4", 16, W4Params(block_k=512, gemv=True, group_partial=True)),
    ("int4", 128, W4Params(block_k=1024, gemv=True, group_partial=True, unroll=True)),
    ("int4", 128, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True)),
    ("int4", 128, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True, prefetch=True, unroll=True)),
    ("fp4", 16, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True)),
    ("int4", 128, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True, split_k=2)),
    ("fp4", 16, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True, word_scales=True, prefetch=True)),
    ("int4", 128, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True, word_scales=True)),
    ("fp4", 16, W4Params(block_n=64, block_k=256, swap_ab=True, scale_tile=True)),
    ("int4", 128, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True, packed_x=True)),
    ("fp4", 16, W4Params(block_k=1024, gemv=True, group_partial=True, half2=True, word_scales=True, packed_x=True)),
    ("int4", 128, W4Params(block_k=4096, gemv=True, group_partial=True, half2=True)),  # whole K (session 39)
    ("int4", 128, W4Params(block_k=512, gemv=True, group_partial=True, half2=True, prefetch=3, split_k=2)),
    ("fp4", 16, W4Params(block_k=4096, num_warps=8, gemv=True, group_partial=True, half2=True, word_scales=True)),
])
def test_w4_kernel_lowers_for_h200(kind, g, params):
    """Cross-lower every variant to the Triton IR on the CPU (catches what Triton's lowering lacks,
    e.g. an integer fill cast to float8 scales, without a GPU; PTX still needs the GPU run)."""
    h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    m, n, k = (1 if params.gemv else 8), 1024, 4096
    sds = jax.ShapeDtypeStruct
    scale_dt = jnp.float8_e4m3fn if kind == "fp4" else jnp.bfloat16
    aux = sds((n,), jnp.float32) if kind == "fp4" else sds((n, k // g), jnp.uint8)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = skinny_matmul_w4.trace(sds((m, k), jnp.bfloat16), sds((n, k // 2), jnp.uint8),
                                        sds((n, k // g), scale_dt), aux, k=k, group_size=g, kind=kind, params=params)
        low = traced.lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in low.as_text()


_LAYER_FUSIONS = [  # a Llama-3-8B layer's projections at one row with what the decode layer fuses into each
    ("int4", 6144, 4096, 128, "norm"), ("int4", 4096, 4096, 128, "residual"), ("int4", 28672, 4096, 128, "norm"),
    ("int4", 4096, 14336, 128, "silu+residual"), ("fp4", 6144, 4096, 16, "norm+bias"),
    ("fp4", 4096, 4096, 16, "residual"), ("fp4", 28672, 4096, 16, "norm"), ("fp4", 4096, 14336, 16, "silu+residual"),
]


def _fused_args(rng, m, n, k, fusion, sds=None):
    """x and the fused keyword arguments of a `skinny_matmul_w4` call (ShapeDtypeStructs with sds)."""
    def arr(shape, scale=1.0, lo=None):
        if sds is not None:
            return sds(shape, jnp.bfloat16)
        v = rng.uniform(lo, 1.5, shape) if lo is not None else rng.standard_normal(shape) * scale
        return jnp.asarray(v, jnp.bfloat16)

    kw = dict(silu_mul="silu" in fusion)
    if "norm" in fusion:
        kw.update(norm_weight=arr((k,), lo=0.5), eps=1e-5)
    if "bias" in fusion:
        kw["bias"] = arr((n,))
    if "residual" in fusion:
        kw["residual"] = arr((m, n), 4.0)
    return arr((m, 2 * k if kw["silu_mul"] else k), 3.0), kw


@pytest.mark.parametrize("kind,n,k,g,fusion", _LAYER_FUSIONS)
def test_w4_kernel_fused_lowers_for_h200(kind, n, k, g, fusion):
    """The tuned table's one-row variants with the decode layer's fusions lower to the Triton IR."""
    h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    sds = jax.ShapeDtypeStruct
    x, kw = _fused_args(None, 1, n, k, fusion, sds)
    scale_dt = jnp.float8_e4m3fn if kind == "fp4" else jnp.bfloat16
    aux = sds((n,), jnp.float32) if kind == "fp4" else sds((n, k // g), jnp.uint8)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = skinny_matmul_w4.trace(x, sds((n, k // 2), jnp.uint8), sds((n, k // g), scale_dt), aux, k=k,
                                        group_size=g, kind=kind, **kw)
        low = traced.lower(lowering_platforms=("cuda",)).as_text()
    first = {"norm": "norm", "residual": "res", "silu": "silu"}[fusion.split("+")[0]]
    assert "__gpu$xla.gpu.triton" in low and f"skinny_matmul_w4_{first}" in low


@pytest.mark.gpu
@pytest.mark.parametrize("kind,n,k,g,fusion", _LAYER_FUSIONS)
def test_w4_kernel_fused_gpu(kind, n, k, g, fusion):
    """The fusions in the launch against the same kernel's product with them in XLA around it (the
    interpret-mode test holds both to a float64 oracle on small shapes)."""
    from pallas_kernels.linear.w4 import _epilogue, _prologue

    rng = np.random.default_rng(n + k)
    packed, scales, aux = (jnp.asarray(a) for a in _random_w4(rng, n, k, g, kind))
    x, kw = _fused_args(rng, 1, n, k, fusion)
    y = skinny_matmul_w4(x, packed, scales, aux, k=k, group_size=g, kind=kind, **kw)
    xin, r = _prologue(x, kw.get("norm_weight"), kw.get("eps", 1e-6), kw["silu_mul"])
    prod = skinny_matmul_w4(xin, packed, scales, aux, k=k, group_size=g, kind=kind)
    want = np.asarray(_epilogue(prod.astype(jnp.float32), r, kw.get("bias"), kw.get("residual"), x.dtype), np.float32)
    got = np.asarray(y, np.float32)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2

@pytest.mark.gpu
@pytest.mark.parametrize("kind,m,n,k,g,params", [
    ("int4", 1, 4096, 4096, 128, None), ("int4", 64, 1024, 4096, 128, None), ("fp4", 8, 6144, 4096, 16, None),
    ("int4", 3, 200, 1000, 128, None),
    ("int4", 1, 6144, 4096, 128, W4Params(32, 512, 4, 4, gemv=True, group_partial=True)),
    ("fp4", 1, 6144, 4096, 16, W4Params(32, 512, 4, 4, gemv=True, group_partial=True)),
    ("int4", 1, 6144, 4096, 128, W4Params(16, 1024, 4, 4, gemv=True, group_partial=True, half2=True)),
    ("int4", 1, 1000, 1000, 64, W4Params(16, 128, 4, 4, gemv=True, group_partial=True, half2=True)),
    ("int4", 1, 1000, 1000, 64, W4Params(16, 128, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=True)),
    ("fp4", 1, 6144, 4096, 16, W4Params(16, 1024, 4, 4, gemv=True, group_partial=True, half2=True)),
    ("fp4", 1, 1000, 1000, 16, W4Params(16, 128, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=True)),
    ("int4", 1, 4096, 14336, 128, W4Params(16, 2048, 4, 3, gemv=True, group_partial=True, half2=True, split_k=4)),
    ("fp4", 1, 4096, 14336, 16, None),  # the tuned table: down split in 4
    ("fp4", 1, 6144, 4096, 16, W4Params(16, 1024, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=True,
                                        word_scales=True)),
    ("int4", 1, 4096, 14336, 128, W4Params(16, 1024, 4, 3, gemv=True, group_partial=True, half2=True, split_k=2,
                                           word_scales=True)),
    ("fp4", 64, 4096, 14336, 16, None), ("fp4", 17, 1000, 1000, 16, None),  # the tuned table at 17-64 rows
    ("fp4", 64, 6144, 4096, 16, W4Params(64, 256, 4, 3, scale_tile=True, swap_ab=True)),
    ("fp4", 40, 1000, 1000, 16, W4Params(128, 128, 8, 3, swap_ab=True)),
    ("int4", 1, 6144, 4096, 128, W4Params(32, 2048, 4, 3, gemv=True, group_partial=True, half2=True, packed_x=True)),
    ("int4", 1, 4096, 14336, 128, W4Params(16, 2048, 4, 3, gemv=True, group_partial=True, half2=True, split_k=2,
                                           packed_x=True)),
    ("fp4", 1, 6144, 4096, 16, W4Params(16, 2048, 4, 3, gemv=True, group_partial=True, half2=True, word_scales=True,
                                        packed_x=True)),
    ("fp4", 1, 1000, 1000, 16, W4Params(16, 128, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=True,
                                        packed_x=True)),
    ("int4", 1, 6144, 4096, 128, W4Params(16, 512, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=3)),
    ("int4", 1, 4096, 14336, 128, W4Params(16, 1024, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=2,
                                           split_k=2)),
    # the table's one-row picks of sessions 47-48 (unrolled prefetch rings, packed x, NVFP4 at 8 warps) for
    # q|k|v, o and gate|up
    ("int4", 1, 6144, 4096, 128, None), ("int4", 1, 28672, 4096, 128, None), ("fp4", 1, 6144, 4096, 16, None),
    ("fp4", 1, 4096, 4096, 16, None), ("fp4", 1, 28672, 4096, 16, None),
    # ring_scales (the scales and zeros carried by the ring; float8 ones as their bytes)
    ("int4", 1, 6144, 4096, 128, W4Params(16, 512, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=2,
                                          ring_scales=True)),
    ("fp4", 1, 4096, 14336, 16, W4Params(16, 512, 4, 1, gemv=True, group_partial=True, half2=True, prefetch=True,
                                         split_k=4, word_scales=True, ring_scales=True)),
    # 8 warps on the unrolled ring (NVFP4's q|k|v and o picks of session 48) at awkward sizes, and 16
    ("fp4", 1, 1000, 1000, 16, W4Params(16, 512, 8, 1, gemv=True, group_partial=True, unroll=True, half2=True,
                                        prefetch=2)),
    ("int4", 1, 200, 1000, 64, W4Params(16, 1024, 8, 1, gemv=True, group_partial=True, unroll=True, half2=True,
                                        prefetch=2, packed_x=True)),
    ("fp4", 1, 6144, 4096, 16, W4Params(16, 512, 16, 1, gemv=True, group_partial=True, unroll=True, half2=True,
                                        prefetch=2)),
])
def test_w4_kernel_gpu(kind, m, n, k, g, params):
    from pallas_kernels.linear import skinny_matmul_w4_reference

    rng = np.random.default_rng(0)
    packed, scales, aux = (jnp.asarray(a) for a in _random_w4(rng, n, k, g, kind))
    x = rng.standard_normal((m, k))
    x[:, 7] = 3000.0  # an outlier (the half2 variant scales x into f16 by max |x|)
    x = jnp.asarray(x, jnp.bfloat16)
    y = skinny_matmul_w4(x, packed, scales, aux, k=k, group_size=g, kind=kind, params=params).astype(jnp.float32)
    want = skinny_matmul_w4_reference(x, packed, scales, aux, k=k, group_size=g, kind=kind)
    assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 1e-2


# ---- the int4 tensor-core kernel (Mosaic GPU, 2-64 rows on Hopper) -------------------------------------
def _mgpu_case(rng, m, n, k, g, dt=jnp.bfloat16, kind="int4"):
    """-> x, packed, scales, aux (int4: zeros; fp4: the global row scale), the kernel's scales."""
    from pallas_kernels.linear.w4_mgpu import w4_mgpu_scales

    packed, scales, aux = _random_w4(rng, n, k, k if g == -1 else g, kind)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    ks = w4_mgpu_scales(jnp.asarray(scales), jnp.asarray(aux) if kind == "int4" else None)
    return x, packed, scales, aux, ks


@pytest.mark.parametrize("m,n,k,g,split,dt,variant", [
    (1, 72, 256, 128, 1, jnp.bfloat16, {}),  # N not a multiple of the 64-row tile
    (5, 136, 512, 128, 2, jnp.bfloat16, {}),  # K split in 2 (f32 partials)
    (17, 64, 384, -1, 1, jnp.float16, {}),  # per-channel scales (one group), f16 x (GPTQ / AWQ)
    (64, 128, 512, 256, 4, jnp.bfloat16, {}),  # 64 rows, groups of 2 steps, split 4
    (9, 64, 256, 128, 1, jnp.bfloat16, {"signed_upcast": True}),  # codes read as int4 with the top bit flipped
    (8, 64, 256, 64, 1, jnp.bfloat16, {"chunks": 2}),  # groups of 64: two slices per step
    (12, 72, 512, 128, 1, jnp.bfloat16, {"overlap": True}),  # a step's wgmma waited for by the next step
    (16, 200, 512, 128, 2, jnp.bfloat16, {"compute_wgs": 2}),  # two compute warpgroups, a TMA one
    (100, 72, 256, 128, 1, jnp.bfloat16, {"block_m": 32}),  # prefill: 4 tiles of x's rows, the last padded
    (40, 136, 512, 128, 2, jnp.float16, {"block_m": 16, "compute_wgs": 2}),  # the same with split K, 2 WGs
    # NVFP4: e2m1 codes, e4m3 scales per 16 columns (8 a step), a global scale per row
    (3, 72, 256, 16, 1, jnp.bfloat16, {"kind": "fp4"}),
    (15, 136, 512, 16, 2, jnp.float16, {"kind": "fp4"}),  # f16 x (the products e2m1 x e4m3 exact in f16)
    (9, 64, 512, 16, 1, jnp.bfloat16, {"kind": "fp4", "chunks": 2, "overlap": True}),
    (65, 72, 256, 16, 1, jnp.bfloat16, {"kind": "fp4", "block_m": 32}),  # prefill tiles
    # promote: the codes' products with x exact in f32, scaled per row and slice afterwards
    (1, 72, 256, 128, 1, jnp.bfloat16, {"promote": True}),
    (5, 136, 512, 128, 2, jnp.bfloat16, {"promote": True}),
    (17, 64, 384, -1, 1, jnp.bfloat16, {"promote": True}),  # per-channel scales
    (64, 128, 512, 256, 4, jnp.bfloat16, {"promote": True}),  # groups of 2 steps
    (8, 64, 256, 64, 1, jnp.bfloat16, {"promote": True, "chunks": 2}),  # groups of 64: a slice each
    (100, 72, 256, 128, 1, jnp.bfloat16, {"promote": True, "block_m": 32}),  # prefill tiles
    # x's slice sums padded to 32 floats a tile (24-row tile; 3 tiles of 40 rows, the last padded)
    (24, 64, 256, 64, 1, jnp.bfloat16, {"promote": True, "chunks": 2}),
    (100, 72, 256, 128, 2, jnp.bfloat16, {"promote": True, "block_m": 40}),
])
def test_w4_mgpu_interpret(m, n, k, g, split, dt, variant):
    """Mosaic GPU interpret mode (the dequantized tile through shared memory: the interpreter has
    no register operand; the GPU test below runs that one) against the numpy oracle."""
    from pallas_kernels.linear.w4_mgpu import W4MgpuParams, skinny_matmul_w4_mgpu

    rng = np.random.default_rng(m * 100 + n + k)
    variant = dict(variant)
    kind = variant.pop("kind", "int4")
    x, packed, scales, aux, ks = _mgpu_case(rng, m, n, k, g, dt, kind)
    params = W4MgpuParams(split_k=split, max_concurrent_steps=2, a_smem=True, **variant)
    row_scale = jnp.asarray(aux) if kind == "fp4" else None
    y = skinny_matmul_w4_mgpu(x, jnp.asarray(packed), ks, row_scale, group_size=g, kind=kind, params=params,
                              interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    want = np.asarray(x.astype(jnp.float32), np.float64) @ _oracle_weight(packed, scales, aux, k, k if g == -1 else g,
                                                                          kind).T
    err = np.abs(np.asarray(y, np.float64) - want).max(axis=1) / np.abs(want).max(axis=1)
    # the weights rounded to x's dtype (int4; NVFP4's and promote's products are exact), f32 accumulation
    assert err.max() < (1e-5 if kind == "fp4" or params.promote else 1e-2), err


def test_w4_mgpu_rejects_bad_input():
    from pallas_kernels.linear.w4_mgpu import W4MgpuParams, skinny_matmul_w4_mgpu, w4_mgpu_supports

    rng = np.random.default_rng(0)
    x, packed, _, _, ks = _mgpu_case(rng, 4, 64, 256, 128)
    assert w4_mgpu_supports(4, 64, 256, 128) is None
    assert "block_k" in w4_mgpu_supports(4, 64, 256, 64)  # groups of 64 narrower than a step, one slice
    assert w4_mgpu_supports(4, 64, 256, 64, W4MgpuParams(chunks=2)) is None  # a slice per group
    assert "block_k" in w4_mgpu_supports(4, 64, 256, 32, W4MgpuParams(chunks=2))  # groups of 32: not taken
    with pytest.raises(ValueError, match="chunks"):
        W4MgpuParams(chunks=4)  # 32-column slices
    with pytest.raises(ValueError, match="compute_wgs"):
        W4MgpuParams(compute_wgs=2, overlap=True)
    assert "warpgroups" in w4_mgpu_supports(4, 64, 256, 64, W4MgpuParams(compute_wgs=2))
    assert "K=320" in w4_mgpu_supports(4, 64, 320, -1)
    assert "N=60" in w4_mgpu_supports(4, 60, 256, 128)
    with pytest.raises(ValueError, match="m=0"):
        skinny_matmul_w4_mgpu(jnp.zeros((0, 256), jnp.bfloat16), jnp.asarray(packed), ks, group_size=128)
    with pytest.raises(ValueError, match="block_m"):
        W4MgpuParams(block_m=12)
    with pytest.raises(ValueError, match="kscales"):
        skinny_matmul_w4_mgpu(x, jnp.asarray(packed), ks[:, :1], group_size=128)
    # NVFP4: groups of 16, e4m3 scales in one plane, the global row scale required (and int4's refused)
    assert "must be 16" in w4_mgpu_supports(4, 64, 256, 32, kind="fp4")
    assert "compute_wgs" in w4_mgpu_supports(4, 64, 256, 16, W4MgpuParams(compute_wgs=2), kind="fp4")
    _, p4, _, rs, ks4 = _mgpu_case(rng, 4, 64, 256, 16, kind="fp4")
    rs = jnp.asarray(rs)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        skinny_matmul_w4_mgpu(x, jnp.asarray(p4), ks4.astype(jnp.float32), rs, group_size=16, kind="fp4")
    with pytest.raises(ValueError, match="row_scale"):
        skinny_matmul_w4_mgpu(x, jnp.asarray(p4), ks4, group_size=16, kind="fp4")
    with pytest.raises(ValueError, match="row_scale"):
        skinny_matmul_w4_mgpu(x, jnp.asarray(packed), ks, rs, group_size=128)
    with pytest.raises(ValueError, match="kind"):
        skinny_matmul_w4_mgpu(x, jnp.asarray(p4), ks4, rs, group_size=16, kind="nvfp4")
    with pytest.raises(ValueError, match="packed must be"):
        skinny_matmul_w4_mgpu(x, jnp.asarray(packed)[:, :64], ks, group_size=128)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        skinny_matmul_w4_mgpu(x.astype(jnp.float32), jnp.asarray(packed), ks, group_size=128)
    with pytest.raises(ValueError, match="promote takes bfloat16"):
        skinny_matmul_w4_mgpu(x.astype(jnp.float16), jnp.asarray(packed), ks, group_size=128,
                              params=W4MgpuParams(promote=True))
    with pytest.raises(ValueError, match="promote"):
        W4MgpuParams(promote=True, overlap=True)
    assert "promote" in w4_mgpu_supports(4, 64, 256, 16, W4MgpuParams(promote=True), kind="fp4")


def test_w4_mgpu_routing():
    """`use_fp8_kernel(..., w8a8=True)` (Hopper) gives int4 linears the tensor-core kernel's scales:
    2-64 rows and prefill (tiles of x's rows) run it, one row the streaming kernel; without it
    (not Hopper) prefill runs XLA; NVFP4 the same unless `fp4_tensor_cores=False`; shapes it cannot tile
    keep the streaming kernel.
    Each path against the numpy oracle (interpret mode)."""
    from metrale_jax.layers.linear import linear

    rng = np.random.default_rng(3)
    n, k, g = 128, 256, 128
    packed, scales, zeros = _random_w4(rng, n, k, g, "int4")
    perm = rng.permutation(k).astype(np.int32)  # act-order: x's columns gathered first
    w = W4Linear(jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(zeros), None, jnp.asarray(perm), k=k,
                 group_size=g)
    oracle = np.zeros((n, k))
    oracle[:, perm] = _oracle_weight(packed, scales, zeros, k, g, "int4")
    marked = use_fp8_kernel({"w": w}, interpret=True, w8a8=True)["w"]
    assert marked.kernel_scales.shape == (2, k // g, n)
    plain = use_fp8_kernel({"w": w}, interpret=True, w8a8=False)["w"]
    assert plain.kernel_scales is None
    for m, kernel, wm in ((3, "skinny_matmul_w4_mgpu", marked), (1, "skinny_matmul_w4", marked),
                          (80, "skinny_matmul_w4_mgpu", marked), (80, None, plain), (8, "skinny_matmul_w4", plain)):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        jaxpr = str(jax.make_jaxpr(linear)(x, wm))
        assert ("skinny_matmul_w4_mgpu" in jaxpr) == (kernel == "skinny_matmul_w4_mgpu")
        assert ("skinny_matmul_w4" in jaxpr) == (kernel is not None)
        want = np.asarray(x.astype(jnp.float32), np.float64) @ oracle.T
        got = np.asarray(linear(x, wm).astype(jnp.float32), np.float64)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-2, m
    # `w4_promote`: bf16 x of 1-1,024 rows through the tensor cores' promote form, whose products are
    # exact in f32 (no bf16 rounding of the weights: within 1e-5 of the oracle, where the plain form
    # is ~1e-3 off); f16 x keeps the plain paths (one row: the streaming kernel), and the one-row
    # fusion yields to it
    from metrale_jax.layers.linear import matmul_f32
    from metrale_jax.layers.linear_w4 import w4_fuses

    promoted = use_fp8_kernel({"w": w}, interpret=True, w8a8=True, w4_promote=True, w4_fused_decode=True)["w"]
    assert not use_fp8_kernel({"w": w}, interpret=True, w8a8=False, w4_promote=True)["w"].promote  # (not Hopper)
    tc = "skinny_matmul_w4_mgpu"
    for m, dt, kernel, tol in ((1, jnp.bfloat16, tc, 1e-5), (3, jnp.bfloat16, tc, 1e-5), (80, jnp.bfloat16, tc, 1e-5),
                               (1, jnp.float16, "skinny_matmul_w4", 1e-2), (3, jnp.float16, tc, 1e-2)):
        x = jnp.asarray(rng.standard_normal((m, k)), dt)
        assert not w4_fuses(x, dataclasses.replace(promoted, perm=None)) or dt == jnp.float16
        jaxpr = str(jax.make_jaxpr(linear)(x, promoted))
        assert ("skinny_matmul_w4_mgpu" in jaxpr) == (kernel == "skinny_matmul_w4_mgpu") and kernel in jaxpr
        want = np.asarray(x.astype(jnp.float32), np.float64) @ oracle.T
        got = np.asarray(matmul_f32(x, promoted), np.float64)  # (linear's output is rounded to x's dtype)
        assert np.abs(got - want).max() / np.abs(want).max() < tol, (m, dt)
    # the engine's unrolled layers (`split_layers`: per-layer arrays) get per-layer kernel scales
    from metrale_jax.layers.stack import Unstacked, split_layers
    from pallas_kernels.linear.w4_mgpu import w4_mgpu_scales

    two = jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), w)
    params = split_layers({"layers": {"w": two}})
    ks = use_fp8_kernel(params, interpret=True, w8a8=True)["layers"]["w"].kernel_scales
    assert isinstance(ks, Unstacked) and len(ks) == 2
    np.testing.assert_array_equal(ks.parts[1], w4_mgpu_scales(two.scales[1], two.zeros[1]))
    g64 = W4Linear(*(jnp.asarray(a) for a in _random_w4(rng, n, k, 64, "int4")), None, None, k=k, group_size=64)
    ks64 = use_fp8_kernel({"w": g64}, interpret=True, w8a8=True)["w"].kernel_scales  # groups of 64: two slices a step
    np.testing.assert_array_equal(ks64, w4_mgpu_scales(g64.scales, g64.zeros))
    # NVFP4: the same routing, e4m3 scales in one plane, the global scale on the output
    p4, s4, rs4 = _random_w4(rng, n, k, 16, "fp4")
    fp4 = W4Linear(jnp.asarray(p4), jnp.asarray(s4), None, jnp.asarray(rs4), None, k=k, group_size=16, kind="fp4")
    assert use_fp8_kernel({"w": fp4}, interpret=True, w8a8=True, fp4_tensor_cores=False)["w"].kernel_scales is None
    assert use_fp8_kernel({"w": fp4}, interpret=True, w8a8=False)["w"].kernel_scales is None  # (not Hopper)
    m4 = use_fp8_kernel({"w": fp4}, interpret=True, w8a8=True)["w"]  # the default
    assert m4.kernel_scales.shape == (1, k // 16, n) and m4.kernel_scales.dtype == jnp.float8_e4m3fn
    oracle4 = _oracle_weight(p4, s4, rs4, k, 16, "fp4")
    for m, kernel in ((5, "skinny_matmul_w4_mgpu"), (1, "skinny_matmul_w4"), (70, "skinny_matmul_w4_mgpu")):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        jaxpr = str(jax.make_jaxpr(linear)(x, m4))
        assert ("skinny_matmul_w4_mgpu" in jaxpr) == (kernel == "skinny_matmul_w4_mgpu") and kernel in jaxpr
        want = np.asarray(x.astype(jnp.float32), np.float64) @ oracle4.T
        got = np.asarray(linear(x, m4).astype(jnp.float32), np.float64)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-2, m


def test_w4_mgpu_lowers_for_h200():
    """The register-operand kernel (what the GPU runs) through Mosaic GPU's lowering on the CPU:
    layout inference, the int4 upcast, TMA tile checks."""
    from pallas_kernels.linear.w4_mgpu import skinny_matmul_w4_mgpu, w4_mgpu_params_for

    sds = jax.ShapeDtypeStruct
    # (33 rows: x padded to 40 for TMA; groups of 64: two slices a step)
    for m, k, n, g in ((2, 4096, 6144, 128), (64, 14336, 4096, 128), (33, 4096, 4096, 128), (16, 4096, 4096, 64),
                       (64, 4096, 4096, 128), (300, 4096, 6144, 128)):
        params = w4_mgpu_params_for(m, n, k, g)
        assert not params.a_smem and params.chunks == 128 // min(g, 128)
        if n == k == 4096 and m == 64:  # the bench's variants
            params = dataclasses.replace(params, overlap=True, chunks=2)
        if m == 2:
            params = dataclasses.replace(params, compute_wgs=2)
        if m == 300:  # prefill: tiles of 128 rows of x (64 f32 accumulator registers a thread)
            assert params.block_m == 128
        dt = jnp.float16 if g == 64 else jnp.bfloat16  # (GPTQ / AWQ checkpoints are float16)
        traced = skinny_matmul_w4_mgpu.trace(sds((m, k), dt), sds((n, k // 2), jnp.uint8),
                                             sds((2, k // g, n), jnp.float32), group_size=g, params=params)
        assert "skinny_matmul_w4_mgpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
    # NVFP4: the float16 bit pattern, e4m3 scales converted in registers, 16-column pieces joined
    for m, k, n, dt, variant in ((2, 4096, 6144, jnp.bfloat16, {}), (64, 14336, 4096, jnp.float16, {}),
                                 (300, 4096, 6144, jnp.bfloat16, {}),
                                 (64, 4096, 4096, jnp.bfloat16, {"overlap": True, "chunks": 2})):
        params = dataclasses.replace(w4_mgpu_params_for(m, n, k, 16), **variant)
        traced = skinny_matmul_w4_mgpu.trace(sds((m, k), dt), sds((n, k // 2), jnp.uint8),
                                             sds((1, k // 16, n), jnp.float8_e4m3fn), sds((n,), jnp.float32),
                                             group_size=16, kind="fp4", params=params)
        assert "skinny_matmul_w4_mgpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,g,variant", [
    (2, 6144, 4096, 128, {}), (64, 4096, 14336, 128, {}), (33, 200, 1024, -1, {}), (16, 28672, 4096, 128, {}),
    (64, 4096, 14336, 128, {"signed_upcast": True}),
    (24, 2048, 4096, 64, {}),  # groups of 64 (two slices a step), float16 x
    (64, 4096, 4096, 128, {"overlap": True, "chunks": 2}), (40, 6144, 4096, 128, {"compute_wgs": 2}),
    (300, 6144, 4096, 128, {}), (1000, 4096, 14336, 64, {}),  # prefill: tiles of 128 rows of x
    (256, 4096, 4096, 128, {"block_m": 256, "max_concurrent_steps": 2}),
    # NVFP4 (groups of 16), bf16 and f16 x, decode and prefill sizes
    (2, 6144, 4096, 16, {"kind": "fp4"}), (64, 4096, 14336, 16, {"kind": "fp4"}),
    (17, 1024, 4096, 16, {"kind": "fp4", "dtype": jnp.float16}), (300, 6144, 4096, 16, {"kind": "fp4"}),
    (64, 4096, 4096, 16, {"kind": "fp4", "overlap": True, "chunks": 2}),
    # programmatic dependent launch (x written by the XLA kernel just before, in the same executable)
    (2, 6144, 4096, 128, {"pdl": True}), (64, 4096, 14336, 128, {"pdl": True}), (24, 2048, 4096, 64, {"pdl": True}),
    (300, 6144, 4096, 128, {"pdl": True}), (64, 4096, 14336, 16, {"kind": "fp4", "pdl": True}),
    # promote (int4, bf16 x), one row too, with and without PDL
    (1, 6144, 4096, 128, {"promote": True}), (1, 28672, 4096, 128, {"promote": True, "pdl": True}),
    (64, 4096, 14336, 128, {"promote": True}), (24, 2048, 4096, 64, {"promote": True, "dtype": jnp.bfloat16}),
    (300, 6144, 4096, 128, {"promote": True, "pdl": True}), (7, 4096, 4096, -1, {"promote": True}),
])
def test_w4_mgpu_gpu(m, n, k, g, variant):
    """The register-operand kernel and its variants on the GPU against the float32 reference; x is
    computed (x * 3) in the same executable, just before the kernel, so a PDL kernel that read x
    before its grid-dependency wait would read a stale or half-written x."""
    from pallas_kernels.linear import skinny_matmul_w4_reference
    from pallas_kernels.linear.w4_mgpu import skinny_matmul_w4_mgpu, w4_mgpu_params_for

    rng = np.random.default_rng(1)
    variant = dict(variant)
    kind = variant.pop("kind", "int4")
    dt = variant.pop("dtype", jnp.float16 if g == 64 else jnp.bfloat16)
    x, packed, scales, aux, ks = _mgpu_case(rng, m, n, k, g, dt, kind)
    params = dataclasses.replace(w4_mgpu_params_for(m, n, k, g), **variant)
    row_scale = jnp.asarray(aux) if kind == "fp4" else None
    y = jax.jit(lambda x: skinny_matmul_w4_mgpu(x * 3, jnp.asarray(packed), ks, row_scale, group_size=g, kind=kind,
                                                params=params))(x)
    want = skinny_matmul_w4_reference(x * 3, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(aux), k=k,
                                      group_size=k if g == -1 else g, kind=kind)
    assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < (1e-5 if params.promote else 1e-2)


# ---- formats: config and tensor errors ---------------------------------------------------------------
@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),  # (8-bit: quant/int8.py)
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 7}, "group_size 7"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero points"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"8-bit weights is not supported \(4-bit only\)"),
    ({"quant_method": "gptq", "group_size": 128}, "no 'bits'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "W4A8_AWQ"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}}, "tensor"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                              "input_activations": {"num_bits": 8, "type": "int"}}}}, "W4A8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 2, "type": "int", "strategy": "channel"}}}}, "2-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {r"+:.*\.layers\.0\..*": {"bits": 8}}},
     r"dynamic rule '\+:.*' sets bits 8 where the config has 4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {r".*mlp.*": {"group_size": 64}}},
     "sets group_size 64"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": [".*mlp.*"]}, "dynamic must be a mapping"),
])
def test_unsupported_variants_are_named(qc, match):
    with pytest.raises(UnsupportedDtypeError, match=match):
        q4.parse_w4_config(qc)


def test_gptq_dynamic_rules_that_change_nothing_are_taken():
    """GPTQModel's `dynamic`: rules that skip modules ("-:", left unquantized in the checkpoint, so
    they load dense) or restate the config's bits and group size parse to the config's scheme; the
    8-bit reader refuses another width as the 4-bit one does."""
    from metrale_jax.quant.int8 import parse_int8_config

    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    rules = {"-:.*lm_head.*": {},
             r"-:.*\.layers\.1\.mlp\..*": {"bits": 8},  # (a skipped module's overrides are moot)
             "+:.*self_attn.*": {"bits": 4, "group_size": 128},
             ".*mlp.*": {"sym": False}}
    assert q4.parse_w4_config({**base, "dynamic": rules}) == q4.parse_w4_config(base)
    assert q4.parse_w4_config({**base, "group_size": -1, "dynamic": {".*": {"group_size": -1}}}).group_size is None
    eight = {"quant_method": "gptq", "bits": 8, "group_size": 128}
    assert parse_int8_config({**eight, "dynamic": {"-:.*": {}}}) == parse_int8_config(eight)
    with pytest.raises(UnsupportedDtypeError, match="sets bits 4 where the config has 8"):
        parse_int8_config({**eight, "dynamic": {".*": {"bits": 4}}})


def test_unknown_method_is_an_error(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_awq_tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedDtypeError, match="hqq"):
        load_model(d, show_progress=False)


@pytest.fixture
def gptq_copy(tmp_path):
    d = tmp_path / "gptq"
    shutil.copytree(FIXTURES / "llama_gptq_tiny", d)
    return d


def _edit(d, fn):
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors")


def test_missing_qzeros_is_an_error(gptq_copy):
    _edit(gptq_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"))
    with pytest.raises(MissingTensorError, match=r"layers\.1\.mlp\.up_proj\.qzeros"):
        load_model(gptq_copy, show_progress=False)


def test_tensors_the_config_promises_are_required(gptq_copy, tmp_path):
    """An act-order GPTQ linear without its g_idx, or an asymmetric compressed-tensors one without
    its zero points, is a named error (loaded without them, their weights would be silently wrong);
    so is a 4-bit linear without the tensor that marks its format."""
    from metrale_jax.loading.tensors import SafetensorsSource

    _edit(gptq_copy, lambda t: t.pop("model.layers.0.self_attn.q_proj.g_idx"))
    with pytest.raises(MissingTensorError, match=r"layers\.0\.self_attn\.q_proj\.g_idx.*desc_act"):
        load_model(gptq_copy, show_progress=False)
    nq = tmp_path / "nq"  # (a missing qweight is named beside the dense weight)
    shutil.copytree(FIXTURES / "llama_gptq_tiny", nq)
    _edit(nq, lambda t: t.pop("model.layers.1.mlp.down_proj.qweight"))
    with pytest.raises(MissingTensorError, match=r"down_proj\.weight' \(nor its gptq tensor .*down_proj\.qweight'\)"):
        load_model(nq, show_progress=False)
    ct = tmp_path / "ct"
    shutil.copytree(FIXTURES / "llama_w4a16_ct_tiny", ct)
    _edit(ct, lambda t: t.pop("model.layers.1.mlp.down_proj.weight_zero_point"))
    with pytest.raises(MissingTensorError, match=r"layers\.1\.mlp\.down_proj\.weight_zero_point.*symmetric"):
        load_model(ct, show_progress=False)
    mo = tmp_path / "mo"  # ModelOpt NVFP4 without weight_scale_2: not read as a dense weight of the wrong shape
    shutil.copytree(FIXTURES / "llama_nvfp4_modelopt_tiny", mo)
    src = SafetensorsSource(mo)
    kept = {n: np.array(src.load(n)) for n in src.names() if n != "model.layers.0.self_attn.q_proj.weight_scale_2"}
    src.close()
    save_file(kept, mo / "model.safetensors")  # (safetensors.numpy writes, but cannot read, float8)
    with pytest.raises(MissingTensorError, match=r"q_proj\.weight_scale_2' is missing .*packed 4-bit codes"):
        load_model(mo, show_progress=False)
    sym = tmp_path / "sym"  # (a symmetric one has none, and needs none)
    shutil.copytree(FIXTURES / "llama_w4a16_ct_channel_tiny", sym)
    assert not any(n.endswith("weight_zero_point") for n in load_file(sym / "model.safetensors"))
    load_model(sym, show_progress=False)


def test_wrong_scales_shape_is_an_error(gptq_copy):
    def cut(t):
        t["model.layers.0.self_attn.o_proj.scales"] = t["model.layers.0.self_attn.o_proj.scales"][:1]

    _edit(gptq_copy, cut)
    with pytest.raises(TensorShapeError, match="o_proj.scales"):
        load_model(gptq_copy, show_progress=False)


def test_fused_parts_with_different_g_idx_load_dense(gptq_copy, caplog):
    """Fused parts (q|k|v) must share one act-order; when they do not, that linear loads dense
    (dequantized) with a warning, and the others stay 4-bit."""
    def shuffle(t):
        name = "model.layers.0.self_attn.k_proj.g_idx"
        t[name] = np.ascontiguousarray(t[name][::-1])

    _edit(gptq_copy, shuffle)
    with caplog.at_level("WARNING"):
        _, params = load_model(gptq_copy, dtype="float32", show_progress=False)
    assert not isinstance(params["layers"]["wqkv"], W4Linear)
    assert isinstance(params["layers"]["wo"], W4Linear) and isinstance(params["layers"]["w_down"], W4Linear)
    assert "act-order g_idx" in caplog.text and "q_proj" in caplog.text


def test_gptq_v2_zero_convention(gptq_copy):
    """checkpoint_format "gptq_v2" stores the zero point itself (v1: zero - 1): the v1 fixture
    rewritten as v2 (every qzeros nibble + 1; the fixture's v1 nibbles are 0..14) gives the same logits."""
    def to_v2(t):
        for name in [n for n in t if n.endswith(".qzeros")]:
            u = t[name].view(np.uint32)
            nib = [((u >> (4 * j)) & 15) + 1 for j in range(8)]
            assert max(int(x.max()) for x in nib) <= 15
            t[name] = sum(x.astype(np.uint32) << np.uint32(4 * j) for j, x in enumerate(nib)).view(np.int32)

    _edit(gptq_copy, to_v2)
    cfg = json.loads((gptq_copy / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (gptq_copy / "config.json").write_text(json.dumps(cfg))
    g = np.load(gptq_copy / "golden.npz")
    model, params = load_model(gptq_copy, dtype="float32", show_progress=False)
    logits = np.asarray(model.forward(params, jnp.asarray(g["input_ids"][2:3])))[0]
    np.testing.assert_allclose(logits, g["logits"][2], atol=1e-3, rtol=1e-3)


def _gptq_v1(w: np.ndarray, g: int) -> tuple[dict, np.ndarray]:
    """w f32[N, K] -> (GPTQ v1 tensors {qweight, qzeros, scales}, their dequantized f32[N, K]):
    asymmetric, groups of g along K, packed element by element from GPTQ's layout (shares nothing
    with quant/w4.py). Zero points 1..15 (v1 stores zero - 1)."""
    n, k = w.shape
    ng = -(-k // g)
    q = np.zeros((n, k), np.uint32)
    s = np.zeros((ng, n), np.float16)
    z = np.zeros((ng, n), np.uint32)
    deq = np.zeros((n, k), np.float32)
    for gi in range(ng):
        cols = slice(gi * g, min(k, gi * g + g))
        blk = w[:, cols]
        lo, hi = np.minimum(blk.min(1), 0), np.maximum(blk.max(1), 0)
        sc = ((hi - lo) / 15).astype(np.float16)
        sc[sc == 0] = 1
        sf = sc.astype(np.float32)
        zz = np.clip(np.round(-lo / sf), 1, 15)
        qq = np.clip(np.round(blk / sf[:, None]) + zz[:, None], 0, 15)
        q[:, cols], s[gi], z[gi] = qq, sc, zz
        deq[:, cols] = (qq - zz[:, None]) * sf[:, None]
    qweight = np.zeros((-(-k // 8), n), np.uint32)
    for c in range(k):
        qweight[c // 8] |= q[:, c] << np.uint32(4 * (c % 8))
    qzeros = np.zeros((ng, -(-n // 8)), np.uint32)
    for r in range(n):
        qzeros[:, r // 8] |= (z[:, r] - 1) << np.uint32(4 * (r % 8))
    return {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32), "scales": s}, deq


def _quantized_pair(tmp_path, name: str, which, g: int = 16, pack=None, qc=None):
    """Two copies of fixture `name`: "q" with the 2-D weights `which(name)` selects in GPTQ 4-bit
    (config.json says so), "dense" with those weights replaced by their dequantized values.
    pack(name, w f32[N, K]) -> (tensors {suffix: array}, dequantized f32[N, K]) and qc (the
    quantization_config) for another format."""
    pack = pack or (lambda nm, w: _gptq_v1(w, g))
    qc = qc or {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": False}
    t = load_file(FIXTURES / name / "model.safetensors")
    dense, quant = dict(t), dict(t)
    for nm, w in t.items():
        if w.ndim == 2 and which(nm):
            tensors, dense[nm] = pack(nm, w.astype(np.float32))
            del quant[nm]
            quant.update({nm[: -len("weight")] + x: v for x, v in tensors.items()})
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    out = {}
    for kind, tensors in (("dense", dense), ("q", quant)):
        d = tmp_path / kind
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        c = dict(cfg, quantization_config=qc) if kind == "q" else cfg
        (d / "config.json").write_text(json.dumps(c))
        out[kind] = d
    return out["dense"], out["q"]


def _words(v: np.ndarray) -> np.ndarray:
    """[R, C] codes 0..15 -> i32[R, ceil(C/8)], code 8w + j in bits 4j..4j+3 of word w."""
    r, c = v.shape
    v = np.concatenate([v, np.zeros((r, -c % 8), v.dtype)], 1).astype(np.uint64)
    out = np.zeros((r, v.shape[1] // 8), np.uint64)
    for j in range(8):
        out |= v[:, j::8] << np.uint64(4 * j)
    return out.astype(np.uint32).view(np.int32)


def _ct_int4(w: np.ndarray, g: int, sym: bool) -> tuple[dict, np.ndarray]:
    """compressed-tensors pack-quantized tensors of w f32[N, K] in groups of g (the last one partial
    where g does not divide K), symmetric (no weight_zero_point, codes offset by 8) or asymmetric,
    and their dequantized f32[N, K]; from the format's documentation, per group in numpy."""
    n, k = w.shape
    groups = [np.arange(i, min(k, i + g)) for i in range(0, k, g)]
    q = np.zeros((n, k), np.int64)
    s = np.zeros((n, len(groups)), np.float32)
    z = np.full((n, len(groups)), 8, np.int64)
    deq = np.zeros((n, k), np.float32)
    for j, cols in enumerate(groups):
        blk = w[:, cols]
        if sym:
            sc = np.abs(blk).max(1) / 7.5
        else:
            lo, hi = np.minimum(blk.min(1), 0), np.maximum(blk.max(1), 0)
            sc = (hi - lo) / 15
        sc = np.where(sc == 0, 1, sc).astype(ml_dtypes.bfloat16).astype(np.float32)
        if not sym:
            z[:, j] = np.clip(np.round(-np.minimum(blk.min(1), 0) / sc), 0, 15)
        q[:, cols] = np.clip(np.round(blk / sc[:, None]) + z[:, j][:, None], 0, 15)
        s[:, j] = sc
        deq[:, cols] = (q[:, cols] - z[:, j][:, None]) * sc[:, None]
    t = {"weight_packed": _words(q), "weight_scale": s.astype(ml_dtypes.bfloat16),
         "weight_shape": np.array([n, k], np.int64)}
    if not sym:
        t["weight_zero_point"] = np.ascontiguousarray(_words(z.T).T)  # [ceil(N/8), G], packed along N
    return t, deq


def _modelopt_nvfp4(w: np.ndarray) -> tuple[dict, np.ndarray]:
    """ModelOpt NVFP4 tensors of w f32[N, K] (codes in `weight` u8[N, K/2], e4m3 scales per 16, the
    global multiplier `weight_scale_2`) and their dequantized f32[N, K]: nearest e2m1 magnitude."""
    n, k = w.shape
    e2m1 = np.array(E2M1, np.float32)
    g2 = np.float32(np.abs(w).max() / (6 * 448))
    blk = w.reshape(n, k // 16, 16)
    s8 = (np.abs(blk).max(-1) / 6 / g2).astype(ml_dtypes.float8_e4m3fn)
    sf = s8.astype(np.float32) * g2
    sf[sf == 0] = 1
    v = blk / sf[..., None]
    mag = np.argmin(np.abs(np.abs(v)[..., None] - e2m1), axis=-1)
    codes = (mag | ((v < 0) & (mag > 0)) * 8).reshape(n, k).astype(np.uint8)
    deq = np.where(codes & 8, -1, 1) * e2m1[codes & 7] * np.repeat(sf, 16, axis=1)
    return {"weight": codes[:, 0::2] | (codes[:, 1::2] << 4), "weight_scale": s8,
            "weight_scale_2": np.array(g2, np.float32)}, deq.astype(np.float32)


def test_nvfp4_quantize_on_load_leaves_k_not_in_16s_dense(caplog):
    """quantization="nvfp4" on a linear whose K is not a multiple of 16 (here the down projection,
    K = 24) leaves that linear dense with the warning that names it, instead of failing the load."""
    from metrale_jax.model import random_model

    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=24,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=64, tie_word_embeddings=True)
    with caplog.at_level("WARNING"):
        _, q = random_model(cfg, dtype="float32", quantization="nvfp4")
    assert isinstance(q["layers"]["w_gate_up"], W4Linear) and not isinstance(q["layers"]["w_down"], W4Linear)
    assert "K=24, not a multiple of NVFP4's groups of 16; left in the model dtype" in caplog.text


def test_compressed_tensors_groups_that_differ(tmp_path):
    """config_groups with a symmetric group (no weight_zero_point, as llm-compressor writes it) beside
    an asymmetric one, in groups of 32 where K = 48 (Qwen2-MoE's shared expert down: a partial last
    group): each module takes its own tensors. Before, a symmetric module was refused for a missing
    zero point, and with several groups the group size was taken as ceil(K / groups) = 24 (silently
    wrong weights)."""
    def ctw(sym):
        return {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": sym,
                "dynamic": False}

    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"mlp": {"targets": ["re:.*mlp.*"], "weights": ctw(True)},
                            "attn": {"targets": ["re:.*self_attn.*"], "weights": ctw(False)}},
          "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]}
    dense, q = _quantized_pair(tmp_path, "qwen2_moe_tiny", lambda nm: nm.endswith("_proj.weight"),
                               pack=lambda nm, w: _ct_int4(w, 32, sym=".mlp." in nm), qc=qc)
    params = _same_logits(dense, q, None)
    assert isinstance(params["layers"]["shared_down"], W4Linear) and params["layers"]["shared_down"].group_size == 32
    scheme = q4.parse_w4_config(qc)
    assert scheme.group_size == 32 and scheme.zero_points is None
    two = dict(qc, config_groups={"a": {"targets": ["re:.*mlp.*"], "weights": ctw(False)},
                                  "b": {"targets": ["Linear"], "weights": dict(ctw(False), group_size=64)}})
    assert q4.parse_w4_config(two).group_sizes == (32, 64) and q4.parse_w4_config(two).group_size is None
    scales = {"p.weight_scale": np.ones((4, 2), np.float32)}
    load = DictLoad(scales)
    assert q4.ct_scales(load, "p.", 4, 48, None, (32, 64))[1] == 32  # 2 groups along 48: 32, not 64 (1 group)
    with pytest.raises(TensorShapeError, match="fit none of the config's group sizes"):
        q4.ct_scales(load, "p.", 4, 300, None, (32, 64))


def test_modelopt_weights_left_dense_load(tmp_path, caplog):
    """A ModelOpt NVFP4 checkpoint with one linear left unquantized (layer 1's o_proj, as
    exclude_modules writes it) and a quantized lm_head: the o_proj stack and the head load dense,
    dequantized from the packed `weight` bytes (before: a TensorShapeError on those bytes)."""
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}
    dense, q = _quantized_pair(tmp_path, "llama_tiny",
                               lambda nm: (nm.endswith("_proj.weight") and "layers.1.self_attn.o_proj" not in nm)
                               or nm == "lm_head.weight", pack=lambda nm, w: _modelopt_nvfp4(w), qc=qc)
    params = _same_logits(dense, q, caplog)
    assert isinstance(params["layers"]["wqkv"], W4Linear) and not isinstance(params["layers"]["wo"], W4Linear)
    assert "some layers or parts only" in caplog.text and "layers.1.self_attn.o_proj" in caplog.text





def _same_logits(dense_dir, q_dir, caplog):
    import contextlib

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 11)))
    _, ref = load_model(dense_dir, dtype="float32", show_progress=False)
    with caplog.at_level("WARNING") if caplog is not None else contextlib.nullcontext():
        model, params = load_model(q_dir, dtype="float32", show_progress=False)
    np.testing.assert_allclose(np.asarray(model.forward(params, ids)), np.asarray(model.forward(ref, ids)),
                               atol=2e-4, rtol=2e-4)
    return params


@pytest.mark.parametrize("name", ["qwen3_moe_tiny", "qwen3_next_tiny", "nemotron_h_tiny"])
def test_4bit_weights_outside_the_kernels_load_dense(tmp_path, name, caplog):
    """A GPTQ checkpoint of each MoE / hybrid family: the 4-bit weights no 4-bit kernel runs (the
    LM head) load dequantized, with a warning naming them; the linears (Qwen3-Next's attention and
    Gated DeltaNet, Nemotron-H's Mamba and attention, the shared experts) and the MoE experts
    (Nemotron-H's relu² ones too) stay 4-bit; the model matches the dense checkpoint holding the
    same dequantized values."""
    def which(nm):
        return nm.endswith(".weight") and not any(x in nm for x in ("embed", "norm", ".gate.", "expert_gate"))

    dense, q = _quantized_pair(tmp_path, name, which)
    params = _same_logits(dense, q, caplog)
    assert "to run dense" in caplog.text and "lm_head" in caplog.text
    assert "experts.*" not in caplog.text
    experts = params["moe"]["experts_up"] if name == "nemotron_h_tiny" else params["layers"]["experts_gate_up"]
    assert isinstance(experts, W4Linear) and experts.packed.ndim == 4
    linears = {"qwen3_next_tiny": [("gdn", "w_qkvz"), ("gdn", "w_ba"), ("attn", "wq"), ("layers", "shared_down")],
               "nemotron_h_tiny": [("mamba", "in_proj"), ("attn", "wqkv"), ("mlp", "down"), ("moe", "shared_up")],
               "qwen3_moe_tiny": [("layers", "wqkv")]}[name]
    assert all(isinstance(params[a][b], W4Linear) for a, b in linears)
    assert "linear_attn" not in caplog.text and "mixer" not in caplog.text
    if name == "qwen3_moe_tiny":  # its attention linears are Llama's: the 4-bit kernels'
        assert isinstance(params["layers"]["wqkv"], W4Linear) and isinstance(params["layers"]["wo"], W4Linear)
        assert "self_attn" not in caplog.text


def test_dense_copies_that_do_not_fit_are_named(tmp_path, monkeypatch):
    """Out of device memory while placing weights that were dequantized (e.g. a 4-bit model whose
    LM head no 4-bit kernel takes only fits packed): a LoadError that says so, not the bare allocator error."""
    from metrale_jax.errors import LoadError
    from metrale_jax.loading.weights import WeightReader

    _, q = _quantized_pair(tmp_path, "qwen3_next_tiny", lambda nm: nm == "lm_head.weight")

    def oom(self, tree):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")

    monkeypatch.setattr(WeightReader, "to_device", oom)
    with pytest.raises(LoadError, match=r"out of device memory .* 1 quantized weights .*: lm_head; the dense"):
        load_model(q, dtype="float32", show_progress=False)


def test_linears_4bit_in_some_layers_or_parts_load_dense(tmp_path, caplog):
    """A linear quantized in some layers only (layer 1's o_proj and down_proj left out, as an
    `ignore` list can) or in some of its fused parts only (layer 1's up_proj) loads dense; the
    fully quantized q|k|v stays 4-bit."""
    def which(nm):
        skip = ("layers.1.self_attn.o_proj", "layers.1.mlp.down_proj", "layers.1.mlp.up_proj")
        return nm.endswith("_proj.weight") and not nm.startswith(tuple("model." + x for x in skip))

    dense, q = _quantized_pair(tmp_path, "llama_tiny", which)
    params = _same_logits(dense, q, caplog)
    assert isinstance(params["layers"]["wqkv"], W4Linear)
    for key in ("wo", "w_gate_up", "w_down"):
        assert not isinstance(params["layers"][key], W4Linear), key
    assert "some layers or parts only" in caplog.text and "o_proj" in caplog.text
    assert "layers.*.mlp.gate_proj" in caplog.text  # the summary of what was dequantized


@pytest.mark.parametrize("method", ["gptq", "gptq_act_order", "awq", "compressed-tensors", "ct_act_order", "nvfp4-ct"])
@pytest.mark.parametrize("n,k", [(12, 12), (8, 30), (24, 64), (40, 16), (8, 13)])
def test_readers_unpack_each_code(method, n, k):
    """Each reader against codes packed one by one as the format documents them, on shapes that
    are not multiples of a word (8 codes) along either axis: `codes`, and the scales / zeros /
    permutation the reader keeps."""
    rng = np.random.default_rng(n * k)
    g = 2 if method == "nvfp4-ct" else 4
    ng = -(-k // g)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint32)
    zeros = rng.integers(1, 16, (n, ng)).astype(np.uint32)
    scales = rng.random((n, ng)).astype(np.float16)
    g_idx = np.arange(k) // g
    if method.endswith("act_order"):
        g_idx = rng.permutation(g_idx)
    perm = np.argsort(g_idx, kind="stable")
    t = {}
    if method.startswith("gptq"):  # qweight [K/8, N]: code k of column n in bits 4(k % 8) of word k // 8
        qw = np.zeros((-(-k // 8), n), np.uint32)
        qz = np.zeros((ng, -(-n // 8)), np.uint32)
        for r in range(n):
            for c in range(k):
                qw[c // 8, r] |= np.uint32(codes[r, c] << (4 * (c % 8)))
            for gi in range(ng):
                qz[gi, r // 8] |= np.uint32((zeros[r, gi] - 1) << (4 * (r % 8)))
        t = {"qweight": qw, "qzeros": qz, "scales": np.ascontiguousarray(scales.T), "g_idx": g_idx.astype(np.int32)}
        scheme = q4.W4Scheme("gptq", g)
    elif method == "awq":  # qweight [K, N/8]: nibble i of word c holds column 8c + ORDER[i]
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        qw = np.zeros((k, -(-n // 8)), np.uint32)
        qz = np.zeros((ng, -(-n // 8)), np.uint32)
        for r in range(n):
            nib = order.index(r % 8)
            for c in range(k):
                qw[c, r // 8] |= np.uint32(codes[r, c] << (4 * nib))
            for gi in range(ng):
                qz[gi, r // 8] |= np.uint32(zeros[r, gi] << (4 * nib))
        t = {"qweight": qw, "qzeros": qz, "scales": np.ascontiguousarray(scales.T)}
        scheme = q4.W4Scheme("awq", g)
    elif method in ("compressed-tensors", "ct_act_order"):  # weight_packed [N, K/8], zero points [N/8, G]
        wp = np.zeros((n, -(-k // 8)), np.uint32)
        zp = np.zeros((-(-n // 8), ng), np.uint32)
        for r in range(n):
            for c in range(k):
                wp[r, c // 8] |= np.uint32(codes[r, c] << (4 * (c % 8)))
            for gi in range(ng):
                zp[r // 8, gi] |= np.uint32(zeros[r, gi] << (4 * (r % 8)))
        t = {"weight_packed": wp, "weight_zero_point": zp, "weight_scale": scales,
             "weight_shape": np.array([n, k], np.int64), "weight_g_idx": g_idx.astype(np.int32)}
        scheme = q4.W4Scheme("compressed-tensors", g)
    else:  # NVFP4: bytes [N, K/2], element 2i in the low nibble
        if k % 16:
            pytest.skip("NVFP4 needs K % 16 == 0")
        p = np.zeros((n, k // 2), np.uint8)
        for r in range(n):
            for c in range(k):
                p[r, c // 2] |= np.uint8(codes[r, c] << (4 * (c % 2)))
        t = {"weight_packed": p, "weight_scale": rng.random((n, k // 16)).astype(ml_dtypes.float8_e4m3fn),
             "weight_global_scale": np.array([2.0], np.float32)}
        scheme = q4.W4Scheme("nvfp4-ct", 16)
    t = {"m." + name: (v.view(np.int32) if v.dtype == np.uint32 else v) for name, v in t.items()}

    read = q4.READERS[scheme.method][1]
    w = read(DictLoad(t), "m.", n, k, scheme)
    assert w.shape == (n, k) and w.packed.shape == (n, -(-k // 2))
    if method.endswith("act_order"):
        np.testing.assert_array_equal(w.perm, perm)
        np.testing.assert_array_equal(w.codes, codes[:, perm])
    else:
        assert w.perm is None
        np.testing.assert_array_equal(w.codes, codes)
    if method != "nvfp4-ct":
        np.testing.assert_array_equal(w.zeros, zeros)
        np.testing.assert_array_equal(w.scales, scales)
        # dequantized in the checkpoint's column order, whatever the act-order
        s32 = scales.astype(np.float32)
        want = (codes.astype(np.float32) - zeros[:, g_idx]) * s32[:, g_idx]
        np.testing.assert_allclose(q4.dequantize_w4(w), want, rtol=1e-6)


def test_modelopt_hf_quant_config_json(tmp_path):
    """ModelOpt exports that keep the quantization in hf_quant_config.json ({"producer", "quantization":
    {"quant_algo", ...}}) instead of config.json load the same."""
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_nvfp4_modelopt_tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    inner = {k: v for k, v in qc.items() if k not in ("producer", "quant_method")}
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": qc["producer"], "quantization": inner}))
    g = np.load(d / "golden.npz")
    model, params = load_model(d, dtype="float32", show_progress=False)
    assert isinstance(params["layers"]["w_down"], W4Linear)
    logits = np.asarray(model.forward(params, jnp.asarray(g["input_ids"][:1])))[0]
    n = g["lengths"][0]
    np.testing.assert_allclose(logits[:n], g["logits"][0, :n], atol=1e-3, rtol=1e-3)


def test_quantizing_a_quantized_checkpoint_is_an_error():
    with pytest.raises(ValueError, match="already quantized"):
        load_model(FIXTURES / "llama_awq_tiny", quantization="int4", show_progress=False)


def test_vllm_names_of_the_checkpoint_format():
    """vLLM's `quantization="gptq"` / "awq_marlin" / "fp8" ... name the checkpoint's own format:
    accepted (nothing changes) where they match it, an error naming both where they do not, and
    for an unquantized checkpoint (except "fp8": quantize at load, as vLLM does)."""
    from metrale_jax.model import checkpoint_quantization

    _, ref = load_model(FIXTURES / "llama_gptq_sym_tiny", dtype="float32", show_progress=False)
    for q in ("gptq", "gptq_marlin"):
        _, params = load_model(FIXTURES / "llama_gptq_sym_tiny", dtype="float32", quantization=q, show_progress=False)
        assert isinstance(params["layers"]["wqkv"], W4Linear)
        np.testing.assert_array_equal(params["layers"]["wqkv"].packed, ref["layers"]["wqkv"].packed)
    _, params = load_model(FIXTURES / "llama_fp8_tiny", quantization="fp8", show_progress=False)
    assert type(params["layers"]["wqkv"]).__name__ == "Fp8Linear"
    with pytest.raises(ValueError, match=r"quantization='awq_marlin' does not match .*'gptq'"):
        load_model(FIXTURES / "llama_gptq_sym_tiny", quantization="awq_marlin", show_progress=False)
    with pytest.raises(ValueError, match="is not quantized"):
        load_model(FIXTURES / "llama_tiny", quantization="gptq", show_progress=False)
    with pytest.raises(ValueError, match="must be one of"):
        load_model(FIXTURES / "llama_tiny", quantization="marlin", show_progress=False)
    assert checkpoint_quantization("fp8", None, "safetensors", "m") == "fp8"  # quantize at load
    assert checkpoint_quantization("modelopt_fp4", {"quant_method": "modelopt"}, "safetensors", "m") is None
    assert checkpoint_quantization("gguf", None, "gguf", "m.gguf") is None
    assert checkpoint_quantization("int4", None, "safetensors", "m") == "int4"
    model, half = load_model(FIXTURES / "llama_gptq_sym_tiny", dtype="half", quantization="gptq",
                             show_progress=False)
    assert half["embed"].dtype == jnp.float16 and model.dtype == "float16"  # (vLLM's "half" and "float")
    assert model.quantization == "gptq"  # (how the weights are stored: `model_config.quantization`)
    assert load_model(FIXTURES / "llama_tiny", quantization="int4", show_progress=False)[0].quantization == "int4"
    assert load_model(FIXTURES / "llama_tiny", show_progress=False)[0].quantization is None


# ---- quantize-on-load --------------------------------------------------------------------------------
def test_quantize_int4_rtn():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((30, 300)) * np.exp2(rng.uniform(-4, 4, (30, 1)))).astype(np.float32)
    w[3, 128:256] = 0.0  # an all-zero group
    q = q4.quantize_int4(w)
    assert q.scales.shape == (30, 3) and q.zeros.shape == (30, 3) and q.codes.max() <= 15
    deq = q4.dequantize_w4(q)
    assert np.all(deq[3, 128:256] == 0)
    step = np.repeat(q.scales.astype(np.float32), 128, axis=1)[:, :300]
    assert np.all(np.abs(deq - w) <= step * 0.5 + 1e-3 * step)  # round to nearest (f16 scales: ~1e-3)


def test_quantize_nvfp4():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    q = q4.quantize_nvfp4(w)
    assert q.scales.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and q.scales.shape == (8, 4)
    deq = q4.dequantize_w4(q)
    # e2m1 steps are at most 2 (between 4 and 6) in units of the block scale
    unit = np.repeat(q.scales.astype(np.float32), 16, axis=1) * q.row_scale
    assert np.all(np.abs(deq - w) <= unit * 1.0 + 0.07 * np.abs(w))
    assert 0 < np.linalg.norm(deq - w) / np.linalg.norm(w) < 0.15


def _numpy_int4(w, g=128):
    """quantize_int4's definition in numpy (float32, IEEE division)."""
    n, k = w.shape
    ng = -(-k // g)
    blk = np.pad(w, ((0, 0), (0, ng * g - k))).reshape(n, ng, g)
    lo, hi = np.minimum(blk.min(-1), 0.0), np.maximum(blk.max(-1), 0.0)
    s = ((hi - lo) / np.float32(15.0)).astype(np.float16)
    sf = np.where(s > 0, s, np.float16(1.0)).astype(np.float32)
    z = np.clip(np.round(-lo / sf), 0, 15)
    q = np.clip(np.round(blk / sf[..., None]) + z[..., None], 0, 15).astype(np.uint8)
    return q.reshape(n, -1)[:, :k], sf.astype(np.float16), z.astype(np.uint8)


def _numpy_nvfp4(w):
    """quantize_nvfp4's definition in numpy, e2m1 rounding by search over the midpoints."""
    n, k = w.shape
    amax = float(np.abs(w).max())
    gs = np.float32(amax / (6.0 * 448.0)) if amax > 0 else np.float32(1.0)
    blk = w.reshape(n, k // 16, 16)
    s = (np.abs(blk).max(-1) / np.float32(6.0) / gs).astype(ml_dtypes.float8_e4m3fn)
    sf = s.astype(np.float32) * gs
    v = blk / np.where(sf > 0, sf, 1.0)[..., None]
    mags = q4.E2M1_VALUES[:8]
    mids = (mags[:-1] + mags[1:]) / 2
    a = np.minimum(np.abs(v), 6.0)
    code = np.searchsorted(mids, a, side="left")
    code = code + ((code < 7) & (a == mids[np.minimum(code, 6)]) & (code % 2 == 1))  # ties: the even code
    return (code | ((v < 0) & (code > 0)) * 8).astype(np.uint8).reshape(n, k), s, float(gs)


@pytest.mark.parametrize("seed", range(4))
def test_quantize_on_load_matches_numpy(seed):
    """The jitted quantize-on-load equals its numpy definition bit for bit (XLA's division by a
    broadcast scale would round differently now and then without `exact_div`)."""
    rng = np.random.default_rng(seed)
    # (seed 0: 2M weights, where a division through the reciprocal rounds a few codes differently)
    n, k = (512, 4096) if seed == 0 else (int(rng.integers(1, 300)), 16 * int(rng.integers(1, 300)))
    w = (rng.standard_normal((n, k)) * np.exp2(rng.uniform(-8, 8, (n, 1)))).astype(np.float32)
    w[0, : min(k, 200)] = 0.0  # all-zero groups
    got = q4.quantize_int4(w)
    for a, b in zip((got.codes, got.scales, got.zeros), _numpy_int4(w)):
        np.testing.assert_array_equal(a, b)
    got = q4.quantize_nvfp4(w)
    codes, s, gs = _numpy_nvfp4(w)
    np.testing.assert_array_equal(got.codes, codes)
    np.testing.assert_array_equal(got.scales.view(np.uint8), s.view(np.uint8))
    assert got.row_scale == gs


def test_round_e2m1_ties_to_even():
    """e2m1 rounding (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6) at every midpoint, past the ends, and signs:
    a tie goes to the even code, -0 is code 0, beyond 6 saturates."""
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 4.9, 5.1, 6.0, 9.0, 0.0, -0.0, -1e-9, -0.3, -5.0, -7.0],
                 np.float32)
    want = [0, 2, 2, 4, 4, 6, 6, 1, 6, 7, 7, 7, 0, 0, 0, 9, 14, 15]
    np.testing.assert_array_equal(np.asarray(q4._round_e2m1(jnp.asarray(v))), want)


@pytest.mark.parametrize("quantization", ["int4", "nvfp4"])
def test_quantize_on_load(tmp_path, quantization):
    """quantization="int4" / "nvfp4" equals a dense model whose linears went through
    quantize -> dequantize in numpy (quant.w4)."""
    src = FIXTURES / "llama_tiny"
    model, q = load_model(src, dtype="float32", quantization=quantization, show_progress=False)
    assert isinstance(q["layers"]["w_down"], W4Linear) and q["layers"]["w_down"].kind == (
        "int4" if quantization == "int4" else "fp4")
    d = tmp_path / "qdq"
    shutil.copytree(src, d)
    t = load_file(d / "model.safetensors")
    quant = q4.quantize_int4 if quantization == "int4" else q4.quantize_nvfp4
    for name in t:
        if name.endswith("_proj.weight"):
            t[name] = q4.dequantize_w4(quant(t[name]))
    save_file(t, d / "model.safetensors")
    qdq_model, qdq = load_model(d, dtype="float32", show_progress=False)
    toks = jnp.asarray(np.load(src / "golden.npz")["input_ids"][2:3])
    np.testing.assert_allclose(np.asarray(model.forward(q, toks)), np.asarray(qdq_model.forward(qdq, toks)),
                               rtol=1e-4, atol=1e-4)


def test_quantize_on_load_says_what_it_left(caplog):
    """Quantize-on-load where the kernels take only part of a family (the MTP-less families take
    every linear now; Qwen2-MoE's shared expert gate and the SSMs' conv filters are not linears)
    warns with the matrices left as they were; where they would take none it is an error instead
    of a silently unquantized model (`model._quantize_on_load_report`)."""
    from metrale_jax.model import _quantize_on_load_report

    for name, quantization in (("qwen2_moe_tiny", "int4"), ("mamba2_tiny", "int4"), ("nemotron_h_tiny", "fp8"),
                               ("qwen3_next_tiny", "nvfp4")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            _, q = load_model(FIXTURES / name, dtype="float32", quantization=quantization, show_progress=False)
        assert "stay" not in caplog.text, name  # every linear taken
    assert isinstance(q["gdn"]["w_qkvz"], W4Linear) and isinstance(q["layers"]["shared_down"], W4Linear)
    dense = {"layers": {"wqkv": np.zeros((2, 64, 96)), "attn_norm": np.zeros((2, 64)), "router": np.zeros((2, 64, 8))}}
    with pytest.raises(ValueError, match=r"quantization='int4': no linear of Foo takes it .* layers\.wqkv"):
        _quantize_on_load_report(dense, "int4", "Foo", "float32")
    with caplog.at_level("WARNING"):
        _quantize_on_load_report({"layers": dict(dense["layers"], wo=W4Linear(*[None] * 5))}, "int4", "Foo", "float32")
    assert "Foo's layers.wqkv stay float32" in caplog.text and "quantized: layers.wo" in caplog.text


@pytest.mark.parametrize("name,quantization", [("qwen3_next_tiny", "fp8"), ("qwen3_next_tiny", "int4"),
                                               ("nemotron_h_tiny", "nvfp4"), ("mamba2_tiny", "fp8"),
                                               ("mamba2_tiny", "int4"), ("qwen2_moe_tiny", "fp8")])
def test_quantized_hybrid_linears_are_wired(name, quantization):
    """The hybrids' linears (Qwen3-Next's gated attention and Gated DeltaNet projections, whose
    products are regrouped from the checkpoint's per-key-head order, Nemotron-H's and Mamba-2's
    Mamba, attention and MLP linears, the shared experts) quantized at load: the model equals the
    same tree with every quantized linear dequantized and run dense (a wiring error, e.g. the
    regroup, a fused part or a transposition, is O(1) here; the kernels are others' tests)."""
    from metrale_jax.layers import moe_fp8, moe_w4
    from metrale_jax.layers.linear import Fp8Linear

    model, q = load_model(FIXTURES / name, dtype="float32", quantization=quantization, show_progress=False)
    kinds = (Fp8Linear, W4Linear)
    leaves = jax.tree.leaves(q, is_leaf=lambda w: isinstance(w, kinds))
    assert sum(isinstance(w, kinds) for w in leaves) >= 2  # (Mamba-2: in_proj and out)
    dense = jax.tree.map(lambda w: (moe_fp8 if isinstance(w, Fp8Linear) else moe_w4).dense_experts(w, jnp.float32)
                         if isinstance(w, kinds) else w, q, is_leaf=lambda w: isinstance(w, kinds))
    toks = jnp.asarray(np.load(FIXTURES / name / "golden.npz")["input_ids"][2:3])
    np.testing.assert_allclose(np.asarray(model.forward(q, toks)), np.asarray(model.forward(dense, toks)),
                               rtol=1e-4, atol=1e-4)


def test_w4_params_for_reads_the_tuned_table(monkeypatch):
    from pallas_kernels.linear import w4 as kw4

    table = {"int4_n4096_k4096_m1": dict(block_n=16, block_k=1024, num_warps=4, num_stages=4, gemv=True),
             "int4_n4096_k4096_m32": dict(block_n=64, block_k=256, num_warps=8, num_stages=3, group_partial=True)}
    monkeypatch.setattr(kw4, "_tuned_table", lambda: table)
    assert kw4.w4_params_for("int4", 1, 4096, 4096).gemv
    p8 = kw4.w4_params_for("int4", 8, 4096, 4096)  # the next measured M above (32)
    assert p8.block_n == 64 and p8.group_partial and not p8.gemv
    assert kw4.w4_params_for("int4", 64, 4096, 4096) == W4Params()  # past the measured M: defaults
    assert kw4.w4_params_for("fp4", 1, 4096, 4096) == W4Params()
    # a shape not measured takes the nearest measured shape's params (N 14,336 x K 4,096 -> 4,096 x 4,096)
    table["int4_n1024_k256_m1"] = dict(block_n=32, block_k=256, num_warps=2, num_stages=2)
    assert kw4.w4_params_for("int4", 1, 14336, 4096).gemv
    assert kw4.w4_params_for("int4", 1, 512, 128).num_warps == 2
    # ... unless this group size cannot take them (scale_tile needs a power of two dividing block_k)
    table["int4_n4096_k4096_m1"]["scale_tile"] = True
    assert kw4.w4_params_for("int4", 1, 4096, 4096, group_size=128).scale_tile
    assert kw4.w4_params_for("int4", 1, 4096, 4096, group_size=96) == W4Params()
