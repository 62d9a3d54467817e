"""Decode speed as users see it (issue 15): the wall clock of `LLM.generate`, default
`EngineConfig`, for greedy and for temperature 0.7 + top_p 0.9, at several batch sizes.

The decode step is (time of max_tokens=1+N) - (time of max_tokens=1), divided by N: prefill and
start-up cancel out. Prompts are random token ids (ignore_eos, so the lengths hold).

    python bench/generate_speed.py                                   # SmolLM2-135M f32 on the CPU
    python bench/generate_speed.py --shape llama3-8b --batches 1,8,64  # random bf16 weights (GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shape", default=None, help="random weights of a named shape instead of --model")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import jax
    import numpy as np

    from metrale_jax import LLM, LLMEngine, SamplingParams, load_model, random_model
    from metrale_jax.engine.bench import shape_config
    from metrale_jax.engine.config import EngineConfig

    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    if a.shape:
        model, params = random_model(shape_config(a.shape, a.num_layers), dtype=dtype, repeat_layers=True,
                                     split_layers=on_gpu)
    else:
        model, params = load_model(a.model, dtype=dtype, show_progress=False, split_layers=on_gpu)
    batches = [int(b) for b in a.batches.split(",")]
    cfg = EngineConfig(dtype=dtype, max_model_len=max(512, a.prompt_len + a.steps + 8),
                       max_num_seqs=max(batches) if not on_gpu else None, show_progress=False)
    llm = LLM.from_engine(LLMEngine(model, params, cfg))
    rng = np.random.default_rng(0)
    res = {"model": a.shape or a.model, "dtype": dtype, "device": str(jax.devices()[0].device_kind),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, model.cfg.vocab_size - 1, a.prompt_len).tolist()}
                   for _ in range(b)]
        for name, kw in (("greedy", dict(temperature=0)), ("top_p", dict(temperature=0.7, top_p=0.9, seed=1))):
            def wall(n, prompts=prompts, kw=kw):
                t = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, **kw))
                return time.perf_counter() - t

            wall(1 + a.steps)  # warm
            t1 = min(wall(1) for _ in range(a.repeats))
            tn = min(wall(1 + a.steps) for _ in range(a.repeats))
            step = (tn - t1) / a.steps
            res["runs"].append(dict(batch=b, sampling=name, step_ms=1e3 * step, tok_s=b / step))
            print(f"batch {b:3d} {name:7s} {1e3 * step:8.2f} ms per decode step ({b / step:9.1f} tok/s)", flush=True)
    for b in batches:
        g, t = (next(r for r in res["runs"] if r["batch"] == b and r["sampling"] == s) for s in ("greedy", "top_p"))
        print(f"batch {b:3d}: top_p costs {100 * (t['step_ms'] / g['step_ms'] - 1):+.1f}% over greedy")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
