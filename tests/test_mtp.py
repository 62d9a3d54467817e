"""The Qwen3-Next MTP head (models/mtp.py) against its float32 reference: vLLM's definition
assembled from transformers' layers (tests/fixtures/make_mtp_fixture.py), on a tiny Qwen3-Next
with `mtp.*` tensors. A stub (or a wrong concat order, norm, position or layer) cannot match."""

from __future__ import annotations

import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.loading.checkpoint import open_checkpoint
from metrale_jax.loading.weights import WeightReader
from metrale_jax.model import load_model
from metrale_jax.models import family_for
from metrale_jax.models.mtp import load_qwen3_next_mtp, qwen3_next_mtp_logits
from tests.conftest import FIXTURES

PATH = FIXTURES / "qwen3_next_mtp_tiny"


def test_qwen3_next_mtp_logits_match_reference():
    model, params = load_model(PATH, dtype="float32", show_progress=False)  # the main loader skips mtp.*
    assert "mtp" not in params
    ckpt = open_checkpoint(PATH)
    try:
        cfg = family_for(ModelConfig.from_hf(ckpt.config).architecture)[1].adapt_config(
            ModelConfig.from_hf(ckpt.config))
        mtp = load_qwen3_next_mtp(cfg, WeightReader(ckpt.tensors, "float32", show_progress=False))
    finally:
        ckpt.close()
    g = dict(np.load(PATH / "golden.npz"))
    tokens, hidden = g["tokens"], g["hidden"]
    b, t = tokens.shape
    pos = np.broadcast_to(np.arange(t - 1, dtype=np.int32), (b, t - 1))
    got = np.asarray(qwen3_next_mtp_logits(model.cfg, params, mtp, tokens[:, 1:], hidden[:, :-1], pos,
                                           np.full((b,), t - 1, np.int32)))
    ref = g["mtp_logits"]
    assert ref.std() > 0.5  # not a degenerate reference
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # h[i + 1] beside tok[i + 1] (the other pairing) moves the logits far past the tolerance
    off = np.asarray(qwen3_next_mtp_logits(model.cfg, params, mtp, tokens[:, 1:], hidden[:, 1:], pos,
                                           np.full((b,), t - 1, np.int32)))
    assert np.abs(off - ref).max() > 1e-2


def test_qwen3_next_mtp_paged_matches_reference():
    """The paged MTP head (what the engine's steps will run: K/V in a pool layer of its own, read
    through permuted block tables) over a prompt in two chunks, then its last position as a decode
    row, gives the reference logits: the K/V of earlier steps is its context."""
    import jax
    import jax.numpy as jnp

    from metrale_jax.cache.kv import init_kv_cache
    from metrale_jax.models.mtp import qwen3_next_mtp_paged
    from tests._paged import Layout

    mtp_step = jax.jit(qwen3_next_mtp_paged, static_argnums=(0, 4))  # (op by op it took 28 s)

    model, params = load_model(PATH, dtype="float32", show_progress=False)
    ckpt = open_checkpoint(PATH)
    try:
        mtp = load_qwen3_next_mtp(model.cfg, WeightReader(ckpt.tensors, "float32", show_progress=False))
    finally:
        ckpt.close()
    g = dict(np.load(PATH / "golden.npz"))
    tokens, hidden, ref = g["tokens"], g["hidden"], g["mtp_logits"]
    b, t = tokens.shape
    n = t - 1  # positions 0 .. t-2 have a next token
    c = model.cfg
    lay = Layout(b, num_blocks=64, block_size=4, max_blocks=16, seed=7)
    kv = init_kv_cache(2, 64, 4, c.num_kv_heads, c.head_dim, jnp.float32)  # the MTP layer is layer 1
    split = n // 2 + 1  # an awkward first chunk: not a block multiple
    got = np.zeros((b, n, ref.shape[-1]), np.float32)
    for lo, hi in ((0, split), (split, n - 1)):  # two prefill chunks of every sequence
        pmd = lay.prefill([(s, lo, hi - lo) for s in range(b)], t_bucket=b * (hi - lo) + 3, b_bucket=b + 1)
        tok = np.concatenate([tokens[s, lo + 1:hi + 1] for s in range(b)] + [np.zeros(3, np.int32)])
        hid = np.concatenate([hidden[s, lo:hi] for s in range(b)] + [np.zeros((3, hidden.shape[-1]), np.float32)])
        kv, logits = mtp_step(c, params, mtp, kv, 1, jnp.asarray(tok), jnp.asarray(hid), None, pmd)
        got[:, lo:hi] = np.asarray(logits)[:b * (hi - lo)].reshape(b, hi - lo, -1)
    dmd = lay.decode([(s, n - 1) for s in range(b)], n_bucket=b + 1)  # the last position, as decode rows
    kv, logits = mtp_step(c, params, mtp, kv, 1, jnp.asarray(np.append(tokens[:, n], 0)),
                          jnp.asarray(np.concatenate([hidden[:, n - 1], np.zeros_like(hidden[:1, 0])])), dmd, None)
    got[:, n - 1] = np.asarray(logits)[:b]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    assert not np.asarray(kv.k[0]).any()  # layer 0 (the target's) untouched
