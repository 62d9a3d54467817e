"""Start-up of the default engine (issue 14): from the `LLMEngine(...)` call until every default
bucket has run once, cold (empty caches), warm (JAX's persistent cache and our executable cache)
and warm with JAX's cache alone (the path before the executable cache), each in a fresh
process, plus the time to first token of a 5-token prompt and where the time goes (engine
phases and JAX's own compile events).

    python bench/startup.py --shape llama3-8b --out bench/results/startup_<date>.json
    python bench/startup.py --shape llama3-8b --generate 64   # also the batch-64 mixed-traffic run

`--generate B` then runs B prompts of 512 random ids, greedy, max_tokens 129 (the issue's crash
case) through `LLM.generate` in the warm child, and reports its wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(args) -> None:
    import jax

    events: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def on(event, duration, **kw):
        events[event] += duration
        counts[event] += 1

    jax.monitoring.register_event_duration_secs_listener(on)
    from metrale_jax.engine.bench import shape_config
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.llm import LLM
    from metrale_jax.model import random_model
    from metrale_jax.sampling import SamplingParams

    t0 = time.perf_counter()
    # per-layer arrays, as LLM(...) loads them for the GPU's layer loop
    model, params = random_model(shape_config(args.shape, args.num_layers), dtype="bfloat16", repeat_layers=True,
                                 split_layers=jax.devices()[0].platform == "gpu")
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    cfg = EngineConfig(dtype="bfloat16", max_model_len=2048, compilation_cache_dir=args.cache_dir)
    t1 = time.perf_counter()
    eng = LLMEngine(model, params, cfg)
    ready_s = time.perf_counter() - t1
    llm = LLM.from_engine(eng)
    t2 = time.perf_counter()
    llm.generate([{"prompt_token_ids": [11, 12, 13, 14, 15]}], SamplingParams(temperature=0, max_tokens=1))
    ttft = time.perf_counter() - t2
    res = dict(load_s=load_s, ready_s=ready_s, first_token_s=ttft, phases=eng.startup_phases,
               executables=eng.compiler.num_executables, cache_hits=eng.compiler.cache_hits,
               cache_misses=eng.compiler.cache_misses, cache_unsaved=eng.compiler.cache_unsaved,
               buckets=[str(b) for b in eng.compiler.buckets],
               jax_events={k: round(v, 3) for k, v in sorted(events.items(), key=lambda kv: -kv[1])[:14]},
               jax_event_counts={k: counts[k] for k in sorted(events, key=lambda k: -events[k])[:14]})
    if args.generate:
        import numpy as np

        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(3, model.cfg.vocab_size - 1, 512).tolist()}
                   for _ in range(args.generate)]
        runs = {}
        for name, sp in (("greedy", SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)),
                         ("top_p", SamplingParams(temperature=0.7, top_p=0.9, max_tokens=129, ignore_eos=True))):
            t3 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            runs[name] = dict(wall_s=time.perf_counter() - t3,
                              tokens=sum(len(o.outputs[0].token_ids) for o in outs))
        res["generate"] = runs
        res["stats"] = vars(eng.stats())
    print("STARTUP " + json.dumps(res), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--generate", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--runs", default="cold,warm,warm_jax_cache_only", help="which of the three start-ups to run")
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    base = [sys.executable, __file__, "--child", "--shape", args.shape]
    if args.num_layers:
        base += ["--num-layers", str(args.num_layers)]
    out = {"shape": args.shape, "num_layers": args.num_layers,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    cache = tempfile.mkdtemp(prefix="metrale_startup_")
    gen = ["--generate", str(args.generate)] if args.generate else []
    runs = [(label, extra) for label, extra in (("cold", []), ("warm", gen), ("warm_jax_cache_only", []))
            if label in args.runs.split(",")]
    for label, extra in runs:
        if label == "warm_jax_cache_only":
            shutil.rmtree(os.path.join(cache, "metrale_executables"), ignore_errors=True)
        t = time.perf_counter()
        proc = subprocess.run(base + ["--cache-dir", cache] + extra, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("STARTUP ")]
        out[label] = json.loads(line[-1][8:]) if line else {"error": proc.stderr[-3000:]}
        out[label]["process_s"] = time.perf_counter() - t
        r = out[label]
        nan = float("nan")
        print(f"{label:22s} ready {r.get('ready_s', nan):7.1f} s  first token {r.get('first_token_s', nan):6.2f} s"
              f"  load {r.get('load_s', nan):6.1f} s  phases {r.get('phases')}  hits {r.get('cache_hits')}", flush=True)
        misses = r.get("cache_misses") or {}
        if r.get("cache_unsaved") or (misses and (label != "cold" or set(misses.values()) != {"absent"})):
            print(f"  executable cache misses {r.get('cache_misses')}  not saved {r.get('cache_unsaved')}")
        if "error" in r:
            print(r["error"][-1500:])
        if "generate" in r:
            print("  generate:", r["generate"])
    shutil.rmtree(cache, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
