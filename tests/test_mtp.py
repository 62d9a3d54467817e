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
