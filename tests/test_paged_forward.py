"""The paged forward (KV pools, chunked prefill, decode rows) against the dense forward.

Random weights, awkward lengths, permuted non-contiguous block tables, padded rows, tokens and
streams. The dense forward itself is checked against transformers in test_forward.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import random_model
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.layers.stack import Unstacked, split_layers
from tests._paged import Layout

NUM_BLOCKS = 64

CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], rope_scaling=dict(rope_type="llama3", factor=8.0,
                  low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)),
    # yarn: cos and sin scaled by its attention factor, in the fused RoPE + K/V write too
    "llama_yarn": dict(architectures=["LlamaForCausalLM"], rope_scaling=dict(rope_type="yarn", factor=4.0,
                       original_max_position_embeddings=16)),
    "mistral_swa": dict(architectures=["MistralForCausalLM"], sliding_window=5),  # the attention kernels' window
    "qwen2": dict(architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=24),
    # Mixtral: the experts are the MLP's intermediate_size wide; a window in its config is used
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=6),
    # a head_dim that is not a power of two (80, 96 in some checkpoints): the Pallas attention
    # kernels do not take it, so attention runs XLA's reference beside the Pallas RoPE + K/V write
    "llama_hd20": dict(architectures=["LlamaForCausalLM"], head_dim=20),
}


def _cfg(extra):
    base = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1000.0,
                max_position_embeddings=256)
    return {**base, **extra}


ATTN = {
    "reference": AttentionConfig(),
    "pallas-interpret": AttentionConfig(use_pallas=True, interpret=True),
    "pallas-gpu": AttentionConfig(use_pallas=True),
}
# (slow: the reference paths of the families with a pallas-interpret case below; their reference
# attention also runs against transformers' goldens in tests/test_engine_models.py, yarn on Qwen3)
_SLOW_REFERENCE = ("llama", "qwen3", "mistral_swa", "llama_yarn")
CASES = [pytest.param(f, "reference", marks=pytest.mark.slow) if f in _SLOW_REFERENCE else (f, "reference")
         for f in sorted(CONFIGS)] + [
    ("qwen3", "pallas-interpret"),  # q/k norm: RoPE in XLA, the Pallas K/V write
    ("llama", "pallas-interpret"),  # RoPE + K/V write fused (rope_and_write_kv), llama3 RoPE scaling
    ("llama_yarn", "pallas-interpret"),
    ("mistral_swa", "pallas-interpret"),
    ("llama_hd20", "pallas-interpret"),
    pytest.param("qwen2", "pallas-interpret", marks=pytest.mark.slow),  # the same with q/k/v biases
    *[pytest.param(f, "pallas-gpu", marks=pytest.mark.gpu) for f in sorted(CONFIGS)],
]


@pytest.mark.parametrize("family,impl", CASES)
def test_paged_matches_dense(family, impl):
    """The engine's paged path (reference attention, or the Pallas kernels) against the dense forward."""
    with jax.default_matmul_precision("highest"):  # on GPU, XLA's f32 default is TF32
        _check_paged(family, impl, 2e-3 if impl == "pallas-gpu" else 2e-4)


def _check_paged(family, impl, tol):
    model, params = random_model(_cfg(CONFIGS[family]), dtype="float32", seed=1)
    rng = np.random.default_rng(0)
    lens = [6, 17, 33]
    seqs = [rng.integers(0, 97, n).astype(np.int32) for n in lens]
    # Dense reference, one sequence at a time.
    ref = [np.asarray(model.forward(params, jnp.asarray(s)[None]))[0] for s in seqs]

    lay = Layout(3, num_blocks=NUM_BLOCKS, block_size=4, max_blocks=16)
    state = model.init_state(NUM_BLOCKS, lay.bs)
    # Poison the pools: a read of anything not written shows up as a wrong logit.
    state = jax.tree.map(lambda a: jnp.full_like(a, 1e4) if a.ndim == 5 else a, state)
    attn = ATTN[impl]
    step = jax.jit(model.forward_paged, static_argnums=(5,))

    def logits_of(hidden):
        return np.asarray(model.compute_logits(params, hidden))

    # Step 1: prefill 5 of seq 0, 9 of seq 1, 20 of seq 2 (34 tokens, padded to 40; 4 stream slots).
    chunks = [(0, 0, 5), (1, 0, 9), (2, 0, 20)]
    pmd = lay.prefill(chunks, 40, 4)
    toks = np.zeros(40, np.int32)
    toks[:34] = np.concatenate([seqs[0][:5], seqs[1][:9], seqs[2][:20]])
    state, hidden = step(params, state, jnp.asarray(toks), None, pmd, attn)
    lg = logits_of(hidden)
    np.testing.assert_allclose(lg[:5], ref[0][:5], rtol=tol, atol=tol)
    np.testing.assert_allclose(lg[5:14], ref[1][:9], rtol=tol, atol=tol)
    np.testing.assert_allclose(lg[14:34], ref[2][:20], rtol=tol, atol=tol)

    # Step 2 (mixed): decode seq 0 at position 5 (plus a pad row), prefill the rest of 1 and 2.
    dmd = lay.decode([(0, 5)], 2)
    pmd = lay.prefill([(1, 9, 8), (2, 20, 13)], 24, 4)
    toks = np.zeros(2 + 24, np.int32)
    toks[0] = seqs[0][5]
    toks[2:2 + 21] = np.concatenate([seqs[1][9:], seqs[2][20:]])
    state, hidden = step(params, state, jnp.asarray(toks), dmd, pmd, attn)
    lg = logits_of(hidden)
    np.testing.assert_allclose(lg[0], ref[0][5], rtol=tol, atol=tol)
    np.testing.assert_allclose(lg[2:10], ref[1][9:], rtol=tol, atol=tol)
    np.testing.assert_allclose(lg[10:23], ref[2][20:], rtol=tol, atol=tol)
    assert np.isfinite(lg[:23]).all()

    # Step 3 (decode only, padded rows): one fresh token for seq 2, against a dense run.
    extra = np.int32(rng.integers(0, 97))
    full = np.concatenate([seqs[2], [extra]]).astype(np.int32)
    want = np.asarray(model.forward(params, jnp.asarray(full)[None]))[0][-1]
    dmd = lay.decode([(2, 33)], 4)
    toks = np.array([extra, 0, 0, 0], np.int32)
    state, hidden = step(params, state, jnp.asarray(toks), dmd, None, attn)
    np.testing.assert_allclose(logits_of(hidden)[0], want, rtol=tol, atol=tol)


def test_unrolled_layers_match_scan():
    """AttentionConfig.unroll_layers computes the same step as the rolled scan, on layer-stacked
    params and on params split per layer (`split_layers`, the engine's GPU form), and the dense
    forward takes the split tree too."""
    model, params = random_model(_cfg(CONFIGS["qwen3"]), dtype="float32", seed=2)
    split = split_layers(jax.tree.map(lambda a: a, params))  # new containers: `params` stays stacked
    assert isinstance(split["layers"]["wqkv"], Unstacked) and len(split["layers"]["wqkv"]) == 2
    assert not isinstance(params["layers"]["wqkv"], Unstacked)
    np.testing.assert_array_equal(np.asarray(split["layers"]["wo"].parts[1]), np.asarray(params["layers"]["wo"][1]))
    lay = Layout(1, num_blocks=NUM_BLOCKS, block_size=4, max_blocks=16)
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 97, 9).astype(np.int32))
    pmd = lay.prefill([(0, 0, 9)], 9, 1)
    outs = []
    for p, unroll in ((params, False), (params, True), (split, True), (split, False)):
        state = model.init_state(NUM_BLOCKS, lay.bs)
        _, hidden = jax.jit(model.forward_paged, static_argnums=(5,))(
            p, state, toks, None, pmd, AttentionConfig(unroll_layers=unroll))
        outs.append(np.asarray(hidden))
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-5)
    pos = jnp.arange(9, dtype=jnp.int32)[None]
    dense = [np.asarray(jax.jit(model.forward)(p, toks[None], pos, jnp.array([9], jnp.int32))) for p in (params, split)]
    np.testing.assert_allclose(dense[1], dense[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_mosaic_prefill_in_the_step(impl):
    """bf16, head_dim 64, block size 16: the step with the Mosaic GPU prefill kernel
    (`AttentionConfig.mosaic_prefill`, the GPU default) against the XLA reference step, over a
    prefill of unaligned ragged chunks (stream starts 0, 5, 14) and a mixed step with cached
    prefixes, on poisoned pools; logits within bf16 tolerance, the same greedy ids where they are well separated."""
    from pallas_kernels.paged_attention import prefill_mgpu

    cfg = _cfg({**CONFIGS["qwen3"], "hidden_size": 128, "num_attention_heads": 4, "head_dim": 64})
    model, params = random_model(cfg, dtype="bfloat16", seed=3)
    lay = Layout(3, num_blocks=16, block_size=16, max_blocks=4)
    fast = AttentionConfig(use_pallas=True, interpret=impl == "interpret", mosaic_prefill=True)
    step = jax.jit(model.forward_paged, static_argnums=(5,))
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 97, n).astype(np.int32) for n in (9, 30, 40)]
    q = jnp.zeros((8, 4, 64), jnp.bfloat16)
    pools = model.init_state(16, 16).kv.k
    assert prefill_mgpu.supports(q, pools, pools)  # the kernel really runs
    states = {}
    for name, attn in (("ref", AttentionConfig()), ("mosaic", fast)):
        state = model.init_state(16, lay.bs)
        state = jax.tree.map(lambda a: jnp.full_like(a, 1e4) if a.ndim == 5 else a, state)
        toks = np.zeros(48, np.int32)
        toks[:5 + 9 + 20] = np.concatenate([seqs[0][:5], seqs[1][:9], seqs[2][:20]])
        state, h1 = step(params, state, jnp.asarray(toks), None, lay.prefill([(0, 0, 5), (1, 0, 9), (2, 0, 20)],
                                                                             48, 4), attn)
        toks = np.zeros(2 + 48, np.int32)
        toks[0] = seqs[0][5]
        toks[2:2 + 21 + 20] = np.concatenate([seqs[1][9:], seqs[2][20:]])
        state, h2 = step(params, state, jnp.asarray(toks), lay.decode([(0, 5)], 2),
                         lay.prefill([(1, 9, 21), (2, 20, 20)], 48, 4), attn)
        states[name] = [np.asarray(model.compute_logits(params, h), np.float32) for h in (h1[:34], h2[2:43])]
    for ref, got in zip(states["ref"], states["mosaic"]):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=0, atol=0.05 * np.abs(ref).max())
        top2 = np.sort(ref, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.1 * np.abs(ref).max()  # rows whose greedy id is well separated
        assert clear.sum() >= len(ref) // 4
        np.testing.assert_array_equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
