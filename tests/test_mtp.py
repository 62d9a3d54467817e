"""The Qwen3-Next MTP head (models/mtp.py) against its float32 reference: vLLM's definition
assembled from transformers' layers (tests/fixtures/make_mtp_fixture.py), on a tiny Qwen3-Next
with `mtp.*` tensors. A stub (or a wrong concat order, norm, position or layer) cannot match."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_engine_mtp_drafts_match_dense_reference(monkeypatch):
    """`speculative_config={"method": "mtp"}` through the engine: greedy outputs are the dense
    reference's argmax at every position, and every draft the engine verifies is the argmax chain
    of the dense reference
    (the dense forward's hidden states, validated against transformers by the family tests, and
    the dense MTP head validated above): draft 1 from (h[i], tok[i+1]) at the last accepted
    position i, draft j + 1 from (the head's previous output, draft j) at i + j. Prompts end in
    the middle of prefill chunks and cross blocks; one runs into max_model_len (fewer drafts,
    lookahead cut at the end of the block table). A prompt's prefill drafts the first token."""
    import jax.numpy as jnp

    from metrale_jax.engine import spec_decode
    from metrale_jax.engine.compile import CompileCounter
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.models.mtp import qwen3_next_mtp_hidden
    from metrale_jax.models.qwen3_next import compute_logits, forward_hidden
    from metrale_jax.sampling import SamplingParams
    from tests.test_engine_hybrid import HYBRID_CONFIG
    from tests.test_spec_decode import _oracle

    k = 3
    model, params = load_model(PATH, dtype="float32", show_progress=False, mtp=True)
    eng = LLMEngine(model, params, HYBRID_CONFIG.replace(
        speculative_config={"method": "mtp", "num_speculative_tokens": k}))
    assert eng.state.model.kv.k.shape[0] == model.num_attention_layers + 1  # the head's own KV layer
    rng = np.random.default_rng(5)
    v, mml = model.cfg.vocab_size, eng.config.max_model_len
    prompts = [rng.integers(3, v, n).tolist() for n in (1, 15, 30)] + [rng.integers(3, v, mml - 9).tolist()]
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 14, 17, 9)]
    seen = []  # (tokens, the MTP head's drafts after them)
    draft, oracle = spec_decode.draft_tokens, None

    def record(seq, n, spec):
        d = draft(seq, n, spec)
        if d:
            seen.append((list(seq.token_ids), d))
        return oracle(seq, n, spec) if oracle is not None else d

    monkeypatch.setattr(spec_decode, "draft_tokens", record)
    with CompileCounter() as cc:
        ref = [o.outputs[0].token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        st = eng.stats()
        assert st.spec_num_drafts > 10 and st.spec_draft_tokens == sum(len(d) for _, d in seen)
        assert any(len(d) < k for _, d in seen)  # the rows near max_model_len drafted fewer
        # a prefill drafts its stream's first token (no lookahead to chain at): where the step after
        # it has no prefill chunks (the last prompt to finish), it verifies that one draft, checked
        # against the dense chain below like the others
        first = [d for p, r in zip(prompts, ref) for toks, d in seen if toks == p + r[:1]]
        assert first and all(len(d) == 1 for d in first), first
        # the oracle's drafts verified (each accepted length 0..k occurs), the head's still recorded:
        # the head then drafts from every window position
        oracle = _oracle([p + r for p, r in zip(prompts, ref)], v)
        before = (st.spec_draft_tokens, st.spec_accepted_tokens)
        got = [o.outputs[0].token_ids for o in eng.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        assert got == ref
        st = eng.stats()
        assert 0 < st.spec_accepted_tokens - before[1] < st.spec_draft_tokens - before[0]
    assert cc.lowerings == 0 and cc.backend_compiles == 0
    assert st.kv_blocks_free == st.kv_blocks_total
    # the dense reference: the full sequences' hidden states, then the head, chained per draft
    seqs = [p + r for p, r in zip(prompts, ref)]
    t = max(map(len, seqs))
    pad = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        pad[i, :len(s)] = s
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), pad.shape)
    hid = np.asarray(forward_hidden(model.cfg, params, jnp.asarray(pad), pos, jnp.asarray([len(s) for s in seqs])))
    # greedy: every generated token is the dense logits' argmax after its prefix (or a near tie)
    target = np.asarray(compute_logits(model.cfg, params, jnp.asarray(hid)))
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        for j in range(len(p) - 1, len(s) - 1):
            row = target[i, j]
            assert row.max() - row[s[j + 1]] < 1e-4, (i, j)
    m = len(seen)
    nxt, h_in = np.zeros((m, t), np.int32), np.zeros((m, t, hid.shape[-1]), np.float32)
    length = np.array([len(toks) - 1 for toks, _ in seen], np.int32)  # items 0..L-2: (h[i], tok[i+1])
    for r, (toks, _) in enumerate(seen):
        s = next(i for i, q in enumerate(seqs) if q[:len(toks)] == toks)
        nxt[r, :len(toks) - 1] = toks[1:]
        h_in[r, :len(toks) - 1] = hid[s, :len(toks) - 1]
    mtp_pos = np.broadcast_to(np.arange(t, dtype=np.int32), nxt.shape)
    rows = np.arange(m)
    mismatches = 0
    for j in range(k):
        y = np.asarray(qwen3_next_mtp_hidden(model.cfg, params, params["mtp"], jnp.asarray(nxt), jnp.asarray(h_in),
                                             mtp_pos, jnp.asarray(length), j))
        last = y[rows, length - 1]
        logits = np.asarray(compute_logits(model.cfg, params, jnp.asarray(last)))
        want = logits.argmax(-1)
        for r, (_, d) in enumerate(seen):
            if j < len(d) and d[j] != want[r]:  # only a near tie may flip
                assert logits[r, want[r]] - logits[r, d[j]] < 1e-4, (r, j, d, want[r])
                mismatches += 1
        # chain: the item at the next position reads this draft and the head's own output
        nxt[rows, length] = want
        h_in[rows, length] = last
        length = length + 1
    assert mismatches <= 1


def test_mtp_needs_a_head():
    """method "mtp" on a model without an MTP head: a clear error at load and at engine start."""
    import pytest

    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.engine.spec_decode import SpeculativeConfig
    from tests.test_engine_hybrid import HYBRID_CONFIG

    assert SpeculativeConfig("qwen3_next_mtp", 2).method == "mtp"  # vLLM's per-model name
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        load_model(FIXTURES / "llama_tiny", dtype="float32", show_progress=False, mtp=True)
    model, params = load_model(PATH, dtype="float32", show_progress=False)  # mtp.* not read
    with pytest.raises(ValueError, match="method='ngram'"):
        LLMEngine(model, params, HYBRID_CONFIG.replace(speculative_config={"method": "mtp"}))


def test_mtp_head_in_per_layer_arrays():
    """`load_model(..., mtp=True, split_layers=True)` (the GPU engine's layout): only the head's
    layer-stacked subtrees become per-layer arrays (fc and the norms stay whole), with the same
    logits as the stacked head."""
    from metrale_jax.layers.stack import Unstacked
    from metrale_jax.models.mtp import qwen3_next_mtp_logits

    model, stacked = load_model(PATH, dtype="float32", show_progress=False, mtp=True)
    _, split = load_model(PATH, dtype="float32", show_progress=False, mtp=True, split_layers=True)
    head = split["mtp"]
    assert isinstance(head["layers"]["in_norm"], Unstacked) and isinstance(head["attn"]["wo"], Unstacked)
    assert split["mtp"]["fc"].shape == stacked["mtp"]["fc"].shape
    g = dict(np.load(PATH / "golden.npz"))
    tokens, hidden = g["tokens"], g["hidden"]
    b, t = tokens.shape
    pos = np.broadcast_to(np.arange(t - 1, dtype=np.int32), (b, t - 1))
    got = [np.asarray(qwen3_next_mtp_logits(model.cfg, p, p["mtp"], tokens[:, 1:], hidden[:, :-1], pos,
                                            np.full((b,), t - 1, np.int32))) for p in (stacked, split)]
    np.testing.assert_allclose(got[1], got[0], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_engine_mtp_drafts_with_pallas_kernels_interpreted(monkeypatch):
    """The GPU path of the MTP drafter (Pallas KV write into the head's own KV layer, Pallas
    prefill / decode attention over it, per-layer arrays, the Python layer loop), interpreted on
    the CPU: greedy outputs equal plain decoding and the drafts equal the XLA path's."""
    from metrale_jax.engine import spec_decode
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.layers.attention import AttentionConfig
    from metrale_jax.sampling import SamplingParams
    from tests.test_engine_hybrid import HYBRID_CONFIG

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 21)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    draft = spec_decode.draft_tokens
    runs = []
    for att in (AttentionConfig(), AttentionConfig(use_pallas=True, interpret=True, unroll_layers=True)):
        seen = []

        def record(seq, n, s, seen=seen):
            d = draft(seq, n, s)
            seen.append((len(seq.token_ids), tuple(d)))
            return d

        monkeypatch.setattr(spec_decode, "draft_tokens", record)
        model, params = load_model(PATH, dtype="float32", show_progress=False, mtp=True,
                                   split_layers=att.unroll_layers)
        eng = LLMEngine(model, params, HYBRID_CONFIG.replace(attention=att, speculative_config=spec))
        outs = eng.generate([{"prompt_token_ids": p} for p in prompts], sp)
        runs.append(([o.outputs[0].token_ids for o in outs], seen))
    assert runs[0][0] == runs[1][0]
    assert len(runs[0][1]) == len(runs[1][1]) and any(d for _, d in runs[0][1])
    assert sum(a != b for a, b in zip(runs[0][1], runs[1][1])) <= 1  # a near tie may flip one
