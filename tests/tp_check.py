"""Tensor parallelism against one device, for tests/test_tensor_parallel.py.

Run in a fresh process with N simulated CPU devices (the XLA flag is process-wide):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.tp_check --tp 2 4 --family llama_tiny

For each family fixture, the same requests (greedy with logprobs and prompt logprobs, a seeded
top-p sample with a repetition penalty, a prompt longer than the token budget so it prefills in
chunks, and more requests than the KV pool holds at once so sequences are preempted) run through
`LLM.generate` on one device and on `--tp` devices; prints one JSON line per (family, tp) with
the largest logprob difference, and exits 1 when ids differ or a logprob differs by more than
`--atol`.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

FAMILIES = ("llama_tiny", "qwen3_tiny", "qwen3_moe_tiny", "qwen3_next_tiny", "nemotron_h_tiny", "mamba2_tiny")


def _config(tp: int, expert_parallel: bool, interpret_kernels: bool):
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.layers.attention import AttentionConfig

    attention = AttentionConfig(use_pallas=True, interpret=True) if interpret_kernels else None
    return EngineConfig(dtype="float32", max_model_len=96, block_size=8, num_kv_blocks=20, max_num_seqs=4,
                        max_num_batched_tokens=32, decode_buckets=(4,), prefill_buckets=(32,), max_prefill_streams=2,
                        max_logprobs=3, show_progress=False, compilation_cache_dir=None, attention=attention,
                        tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)


def _requests(vocab: int):
    from metrale_jax.sampling import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, n).tolist() for n in (5, 70, 17, 33, 9)]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, logprobs=1),  # 70 + 20 tokens: chunked prefill
              SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=5, max_tokens=16, logprobs=1),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1),
              SamplingParams(temperature=1.0, top_k=8, seed=9, max_tokens=24, logprobs=1)]
    return [{"prompt_token_ids": p} for p in prompts], params


def _run(family: str, tp: int, expert_parallel: bool, interpret_kernels: bool):
    from metrale_jax import LLM, load_model
    from metrale_jax.engine.engine import LLMEngine
    from tests.conftest import FIXTURES

    model, params = load_model(FIXTURES / family, dtype="float32", show_progress=False)
    eng = LLMEngine(model, params, _config(tp, expert_parallel, interpret_kernels))
    prompts, sps = _requests(int(model.cfg.vocab_size))
    outs = LLM.from_engine(eng).generate(prompts, sps, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
        plp = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] if o.prompt_logprobs else []
        res.append((c.token_ids, np.asarray(lps + plp)))
    return res, eng.stats()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[2])
    ap.add_argument("--family", action="append", default=None)
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--interpret-kernels", action="store_true", help="the Pallas kernels (interpret mode)")
    ap.add_argument("--atol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    ok = True
    for fam in args.family or FAMILIES:
        want, _ = _run(fam, 1, False, args.interpret_kernels)
        for tp in args.tp:
            got, stats = _run(fam, tp, args.expert_parallel, args.interpret_kernels)
            same_ids = all(g[0] == w[0] for g, w in zip(got, want))
            diff = max(float(np.max(np.abs(g[1] - w[1]), initial=0.0)) for g, w in zip(got, want))
            print(json.dumps(dict(family=fam, tp=tp, same_ids=same_ids, max_logprob_diff=diff,
                                  preemptions=getattr(stats, "num_preemptions", None))), flush=True)
            ok &= same_ids and diff <= args.atol
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
