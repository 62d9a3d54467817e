"""Top logprobs of a decode step (GPU machine): the sampler's `_top_logprobs` (top 20 of a
128,256-token row, as `EngineConfig.max_logprobs`' default asks every step) over chunk sizes and
round sizes, beside `jax.lax.top_k` on whole rows (JAX's bundled op) and `torch.topk`.

Each variant runs on `COPIES` distinct f32[R, V] arrays inside one executable (so the device time,
not the dispatch, is timed), at R = 1 and 64; us per row-set = wall time / COPIES, median of 7
groups. Every variant's ids and values are checked against `lax.top_k` on copy 0.

    PYTHONPATH=. python3 bench/kernels/top_k.py --out DIR         # DIR/top_k.json, top_k.md
    PYTHONPATH=. python3 bench/kernels/top_k.py --out DIR --cpu-smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import median_seconds, time_torch  # noqa: E402

from metrale_jax.sampling import _top_logprobs, top_k_plan  # noqa: E402

COPIES = 8
K = 20
CHUNKS = (0, 256, 512, 1024, 2048)
ROUNDS = (8, 16, 20)


def _many(fn):
    @jax.jit
    def run(xs):  # f32[COPIES, R, V] -> the last copy's result plus a checksum of all
        outs = [fn(xs[i]) for i in range(xs.shape[0])]
        return outs[0], sum(jnp.sum(o[1]) for o in outs)
    return run


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="V = 8,192, R = 1 / 4, two chunk sizes")
    args = ap.parse_args(argv)
    vocab, rows_list, chunks = (8192, (1, 4), (0, 1024)) if args.cpu_smoke else (128256, (1, 64), CHUNKS)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, python=platform.python_version(),
                vocab=vocab, k=K, copies=COPIES)
    print(json.dumps(meta), flush=True)
    results = []
    for r in rows_list:
        # log-softmax of random logits: what the sampler reads (ties are rare, as with real logits)
        xs = jax.nn.log_softmax(jax.random.normal(jax.random.key(r), (COPIES, r, vocab), jnp.float32) * 3, axis=-1)
        ref_v, ref_i = jax.lax.top_k(xs[0], K)
        plan = top_k_plan(r, K, cpu=args.cpu_smoke)
        variants = {"lax.top_k": lambda x: jax.lax.top_k(x, K)[::-1],
                    f"default: chunk={plan[0]} round={plan[1]}": functools.partial(_top_logprobs, k=K, chunk=plan[0],
                                                                                  round_=plan[1])}
        for c in chunks:
            for rd in ROUNDS:
                if c and (rd > c or c * 2 >= vocab):
                    continue
                variants[f"chunk={c} round={rd}"] = functools.partial(_top_logprobs, k=K, chunk=c, round_=rd)
        for name, fn in variants.items():
            run = _many(fn)
            (ids, vals), _ = run(xs)
            ok = bool(np.array_equal(np.asarray(ids), np.asarray(ref_i))
                      and np.array_equal(np.asarray(vals), np.asarray(ref_v)))
            t = median_seconds(run, xs) / COPIES
            results.append(dict(rows=r, variant=name, us=t * 1e6, exact=ok))
            print(f"R={r:3d} {name:24s} {t * 1e6:8.1f} us  {'exact' if ok else 'MISMATCH'}", flush=True)
        if not args.cpu_smoke:
            import torch

            tx = torch.from_numpy(np.asarray(xs[0])).cuda()
            t = time_torch(functools.partial(torch.topk, tx, K, dim=-1))
            results.append(dict(rows=r, variant="torch.topk", us=t * 1e6, exact=None))
            print(f"R={r:3d} {'torch.topk':24s} {t * 1e6:8.1f} us", flush=True)
    (out / "top_k.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# Top-{K} logprobs of f32[R, {vocab}], {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             "| variant | " + " | ".join(f"R={r} (us)" for r in rows_list) + " |",
             "|---|" + "---|" * len(rows_list)]
    for name in dict.fromkeys(x["variant"] for x in results):
        cells = [next((f"{x['us']:.1f}" + ("" if x["exact"] in (True, None) else " (wrong)")
                       for x in results if x["variant"] == name and x["rows"] == r), "") for r in rows_list]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "top_k.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
