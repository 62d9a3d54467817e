"""On the GPU: the Pallas paged-attention kernels inside the paged forward, against the XLA
reference path, on SmolLM2- and Qwen3-shaped models with random weights.

float32: the same greedy ids and logits within 1e-3; bfloat16: logits within bf16 tolerance.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import random_model
from metrale_jax.layers.attention import AttentionConfig
from tests._paged import Layout

SHAPES = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, head_dim=128,
                       num_key_value_heads=8, rope_theta=1000000.0, tie_word_embeddings=True),
}


def _greedy(model, params, attn, prompt, steps, block_size=16):
    lay = Layout(1, num_blocks=64, block_size=block_size, max_blocks=16, seed=5)
    state = model.init_state(64, block_size)
    step = jax.jit(model.forward_paged, static_argnums=(5,), donate_argnums=(1,))
    n = len(prompt)
    state, hidden = step(params, state, jnp.asarray(prompt), None, lay.prefill([(0, 0, n)], n, 1), attn)
    logits = [np.asarray(model.compute_logits(params, hidden[n - 1:n]))[0]]
    ids = [int(np.argmax(logits[-1]))]
    for i in range(steps - 1):
        dmd = lay.decode([(0, n + i)], 1)
        state, hidden = step(params, state, jnp.asarray([ids[-1]], jnp.int32), dmd, None, attn)
        logits.append(np.asarray(model.compute_logits(params, hidden))[0])
        ids.append(int(np.argmax(logits[-1])))
    return ids, np.stack(logits)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_attention_in_engine_path(shape, dtype):
    cfg = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, **SHAPES[shape]}
    model, params = random_model(cfg, dtype=dtype, seed=0, scale=0.2)
    prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], 77).astype(np.int32)
    with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
        ref_ids, ref = _greedy(model, params, AttentionConfig(), prompt, 12)
        ids, got = _greedy(model, params, AttentionConfig(use_pallas=True), prompt, 12)
    if dtype == "float32":
        assert ids == ref_ids
        np.testing.assert_allclose(got, ref, atol=1e-3, rtol=1e-3)
    else:
        # bf16 error compounds over 30 random layers: hold the kernels to the reference path's own
        # bf16 error against float32 on the same (bf16-rounded) weights, on the first step's logits.
        f32_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
        f32_model = dataclasses.replace(model, dtype="float32")
        with jax.default_matmul_precision("highest"):
            _, exact = _greedy(f32_model, f32_params, AttentionConfig(), prompt, 1)

        def rel(a):
            return np.linalg.norm(a[0] - exact[0]) / np.linalg.norm(exact[0])

        assert rel(got) <= 1.5 * rel(ref) + 1e-3, (rel(got), rel(ref))
