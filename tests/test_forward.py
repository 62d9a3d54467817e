"""The dense forward against transformers: tiny random checkpoints and the real SmolLM2 GGUF."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import load_model
from tests.conftest import FIXTURES

TINY = ["llama_tiny", "llama_tied_sharded", "qwen2_tiny", "qwen3_tiny", "qwen3_yarn_tiny", "mistral_swa_tiny",
        "llama_bias_tiny", "qwen3_moe_tiny", "qwen2_moe_tiny", "mixtral_tiny", "qwen3_next_tiny", "nemotron_h_tiny",
        "mamba2_tiny"]


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    model, params = load_model(FIXTURES / request.param, dtype="float32", show_progress=False)
    return request.param, model, params, dict(np.load(FIXTURES / request.param / "golden.npz"))


def test_logits_batched_with_padding(tiny):
    """Lengths 1, 7 and 64 in one right-padded batch; each row matches transformers run alone."""
    name, model, params, g = tiny
    logits = np.asarray(jax.jit(model.forward)(params, jnp.asarray(g["input_ids"]), None, jnp.asarray(g["lengths"])))
    for b, n in enumerate(g["lengths"]):
        np.testing.assert_allclose(logits[b, :n], g["logits"][b, :n], rtol=1e-4, atol=1e-4, err_msg=name)


def test_greedy_matches_transformers(tiny):
    """Greedy decoding by repeated dense forwards (padded to one shape) reproduces generate()."""
    name, model, params, g = tiny
    prompt, want = list(g["greedy_prompt"]), list(g["greedy_ids"])
    total = len(prompt) + len(want)
    fwd = jax.jit(model.forward)
    ids = prompt[:]
    buf = np.zeros((1, total), np.int32)
    for _ in want:
        buf[0, : len(ids)] = ids
        lg = fwd(params, jnp.asarray(buf), None, jnp.asarray([len(ids)], jnp.int32))
        ids.append(int(jnp.argmax(lg[0, len(ids) - 1])))
    assert ids[len(prompt):] == want, name
    buf[0] = ids
    full = np.asarray(fwd(params, jnp.asarray(buf), None, None))[0]
    np.testing.assert_allclose(full, g["greedy_logits"], rtol=1e-4, atol=1e-4)


def test_positions_are_used(tiny):
    """RoPE is relative: a uniform shift of positions keeps the logits, a stretch changes them.
    Nemotron-H and Mamba-2 apply no positional embedding: positions change nothing."""
    name, model, params, g = tiny
    toks = jnp.asarray(g["input_ids"][2:3])
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    base = np.asarray(model.forward(params, toks))
    shifted = np.asarray(model.forward(params, toks, positions=pos + 5))
    stretched = np.asarray(model.forward(params, toks, positions=pos * 3))
    np.testing.assert_allclose(shifted, base, rtol=1e-3, atol=1e-3)
    if name.startswith(("nemotron_h", "mamba2")):
        np.testing.assert_allclose(stretched, base, rtol=1e-5, atol=1e-5)
    else:
        assert not np.allclose(stretched[0, 1:], base[0, 1:], atol=1e-3)


# ---- the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from metrale_jax.loading.hub import resolve_model

    golden = json.loads((FIXTURES / "smollm2_golden.json").read_text())
    model, params = load_model(resolve_model("smollm2-135m-instruct"), dtype="float32", show_progress=False)
    return model, params, golden


@pytest.mark.slow  # (test_engine_models' twin runs the same golden through the engine)
def test_smollm2_greedy_and_logprobs(smollm2):
    model, params, golden = smollm2
    cases = golden["cases"]
    assert len(cases) >= 2
    width = max(len(c["prompt_token_ids"]) + len(c["greedy_ids"]) for c in cases)
    fwd = jax.jit(model.forward)
    seqs = [list(c["prompt_token_ids"]) for c in cases]
    # Prompt logprobs: float32 log-softmax of the logits, from one pass over the prompts.
    buf = np.zeros((len(cases), width), np.int32)
    for b, s in enumerate(seqs):
        buf[b, : len(s)] = s
    lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
    lp = jax.nn.log_softmax(fwd(params, jnp.asarray(buf), None, lens), axis=-1)
    for b, c in enumerate(cases):
        ids = c["prompt_token_ids"]
        got = [float(lp[b, t - 1, ids[t]]) for t in range(1, len(ids))]
        np.testing.assert_allclose(got, c["prompt_logprobs"][1:], atol=1e-3, err_msg=c["name"])
    # Greedy: every case advances one token per batched forward.
    gen_lp = [[] for _ in cases]
    for _ in range(len(cases[0]["greedy_ids"])):
        for b, s in enumerate(seqs):
            buf[b, : len(s)] = s
        lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
        lg = fwd(params, jnp.asarray(buf), None, lens)
        for b, s in enumerate(seqs):
            row = jax.nn.log_softmax(lg[b, len(s) - 1])
            tok = int(jnp.argmax(row))
            gen_lp[b].append(float(row[tok]))
            s.append(tok)
    for b, c in enumerate(cases):
        got = seqs[b][len(c["prompt_token_ids"]):]
        assert got[:24] == c["greedy_ids"][:24], c["name"]
        assert got == c["greedy_ids"], c["name"]
        np.testing.assert_allclose(gen_lp[b], c["generated_logprobs"], atol=1e-3, err_msg=c["name"])


def test_nemotron_h_hub_config_dialect(tmp_path):
    """The hub form (hybrid_override_pattern, torch_dtype, bare Infinity) loads the same model."""
    import shutil

    src = FIXTURES / "nemotron_h_tiny"
    d = tmp_path / "hub"
    shutil.copytree(src, d)
    shutil.copy(src / "config_hub_form.json", d / "config.json")
    g = np.load(src / "golden.npz")
    model, params = load_model(d, dtype="float32", show_progress=False)
    assert model.cfg.get("pattern") == "M*M-ME"
    logits = np.asarray(model.forward(params, jnp.asarray(g["input_ids"][1:2, :7])))
    np.testing.assert_allclose(logits[0], g["logits"][1, :7], rtol=1e-4, atol=1e-4)
