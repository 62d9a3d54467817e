"""The sampler alone, jitted: the sort-and-`lax.cond` sampler of a baseline git revision against the
current branch-free one (`metrale_jax.sampling.sample`), on random logits, per variant and size.

    python bench/sampling_cpu.py [--baseline-rev 1ce9bbd] [--rows 1,8,64] [--vocab 49152,128256]
                                 [--repeats 5] [--out bench/results/sampling_cpu_<date>] [--baseline-file F]

Variants: greedy; temperature 0.7 + top_p 0.9; temperature 0.7 + top_k 50; greedy + logprobs=5.
Every call uses max_logprobs=20, as the engine's steps do. Times are medians of `--repeats` calls
after a warm-up; it runs on whatever JAX's default backend is (named "cpu" for where CI and the
CPU bars live; on a GPU machine it times the GPU). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from metrale_jax import sampling  # noqa: E402
from metrale_jax.metadata_builder import BuilderConfig, RowSampling, sampling_only  # noqa: E402

MAX_LOGPROBS = 20
VARIANTS = {
    "greedy": dict(),
    "t0.7 top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "t0.7 top_k 50": dict(temperature=0.7, top_k=50),
    "logprobs 5": dict(logprobs=True),
}


def baseline_module(rev: str, path: str | None = None) -> types.ModuleType:
    """metrale_jax/sampling.py as of git revision `rev` (or the file `path`: where the checkout
    has no git history, e.g. the GPU machine's copy), loaded as a module."""
    src = Path(path).read_text() if path else subprocess.run(
        ["git", "show", f"{rev}:metrale_jax/sampling.py"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType(f"sampling_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:metrale_jax/sampling.py", "exec"), mod.__dict__)
    return mod


def passes(variant: str, ways: int) -> tuple[str, str]:
    """(baseline, current) reductions over [R, V] by design, K = 20."""
    p = sampling.search_passes(ways)
    rounds = math.ceil(MAX_LOGPROBS / 16)
    # current: log-softmax 2, greedy argmax 1, filter max 1 + top-k search p + top-k mass 1 +
    # top-p search p, Gumbel argmax 1, rank 1, top logprobs `rounds` TopK reads (+ masked copies)
    new = f"{2 + 1 + 1 + p + 1 + p + 1 + 1 + rounds} (2 x {p}-pass searches, {rounds} TopK k<=16)"
    old = {
        "greedy": "3",
        "t0.7 top_p 0.9": "5 + sort(V) + softmax/cumsum 3",
        "t0.7 top_k 50": "5 + sort(V) + softmax/cumsum 3",
        "logprobs 5": "4 + TopK k=20 (a sort on XLA GPU)",
    }[variant]
    return old, new


def median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-rev", default="1ce9bbd")
    ap.add_argument("--baseline-file", default=None, help="the baseline's sampling.py (instead of git show)")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--vocab", default="49152,128256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ways = sampling.default_search_ways()
    old_mod = baseline_module(args.baseline_rev, args.baseline_file)
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"sampling_cpu_{date}"
    out.parent.mkdir(parents=True, exist_ok=True)

    impls = {
        "baseline": jax.jit(functools.partial(old_mod.sample, max_logprobs=MAX_LOGPROBS)),
        "current": jax.jit(functools.partial(sampling.sample, max_logprobs=MAX_LOGPROBS)),
    }
    results = []
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}; baseline {args.baseline_rev}; "
          f"search: {ways} ways, {sampling.search_passes(ways)} passes; max_logprobs {MAX_LOGPROBS}", flush=True)
    print(f"{'V':>7} {'R':>3} {'variant':<15} {'baseline ms':>12} {'current ms':>11} {'ratio':>6}", flush=True)
    for v in (int(a) for a in args.vocab.split(",")):
        cfg = BuilderConfig(block_size=4, max_blocks_per_seq=4, vocab_size=v, max_suppress_ids=1)
        ps = sampling.init_penalty_state(0, v)
        for r in (int(a) for a in args.rows.split(",")):
            x = jnp.asarray((np.random.default_rng(0).standard_normal((r, v)) * 3).astype(np.float32))
            for name, rs in VARIANTS.items():
                rows = [RowSampling(seed=sampling.seed_words(7, i), out_index=3, **rs) for i in range(r)]
                smd = sampling_only(cfg, rows)
                t = {k: median_time(f, x, smd, ps, repeats=args.repeats) for k, f in impls.items()}
                old_p, new_p = passes(name, ways)
                results.append(dict(vocab=v, rows=r, variant=name, baseline_ms=t["baseline"] * 1e3,
                                    current_ms=t["current"] * 1e3, baseline_passes=old_p, current_passes=new_p))
                print(f"{v:>7} {r:>3} {name:<15} {t['baseline'] * 1e3:>12.2f} {t['current'] * 1e3:>11.2f} "
                      f"{t['current'] / t['baseline']:>6.2f}", flush=True)
    meta = dict(date=date, backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                jax=jax.__version__, baseline_rev=args.baseline_rev, ways=ways,
                passes_per_search=sampling.search_passes(ways), max_logprobs=MAX_LOGPROBS, repeats=args.repeats)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# Sampler alone: baseline {args.baseline_rev} (sort + lax.cond) vs branch-free, {date}", "",
             f"{meta['backend']} ({meta['device']}), jax {meta['jax']}; search {ways} ways = "
             f"{meta['passes_per_search']} passes per threshold; max_logprobs {MAX_LOGPROBS}; median of "
             f"{args.repeats} calls. Reductions over [R, V] by design in the last two columns.", "",
             "| V | R | variant | baseline ms | current ms | current/baseline | baseline passes | current passes |",
             "|---|---|---|---|---|---|---|---|"]
    for e in results:
        lines.append(f"| {e['vocab']} | {e['rows']} | {e['variant']} | {e['baseline_ms']:.2f} | "
                     f"{e['current_ms']:.2f} | {e['current_ms'] / e['baseline_ms']:.2f} | {e['baseline_passes']} | "
                     f"{e['current_passes']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
