"""`sampling.filter_logits` alone over the threshold searches' `ways` (thresholds per pass + 1), per
row count: few ways read the rows more often, many ways compare more per element.

    python bench/kernels/filter_ways.py [--rows 1,64,320] [--ways 4,8,16] [--out FILE.json]

Random logits (std 3: nuclei of thousands of tokens), temperature 0.7, top_k 50 and top_p 0.9 on
every row (both searches run; the GPU always runs both). Median of 20 synchronous calls
(`bench/kernels/timing.median_seconds`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kernels.timing import median_seconds  # noqa: E402
from metrale_jax import sampling  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,64,320")
    p.add_argument("--ways", default="4,8,16")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "vocab": a.vocab,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for r in (int(x) for x in a.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((r, a.vocab)).astype(np.float32) * 3)
        fp = sampling.FilterParams(jnp.full((r,), 0.7), jnp.full((r,), 50, jnp.int32), jnp.full((r,), 0.9),
                                   jnp.zeros((r,)))
        ref = None
        for w in (int(x) for x in a.ways.split(",")):
            f = jax.jit(lambda x, fp, w=w: sampling.filter_logits(x, fp, ways=w))
            out = np.isfinite(np.asarray(f(x, fp)))
            ref = out if ref is None else ref
            ms = 1e3 * median_seconds(f, x, fp, group=1, groups=20)
            run = dict(rows=r, ways=w, passes=2 * sampling.search_passes(w), ms=ms,
                       same_kept_set=bool((out == ref).all()))
            res["runs"].append(run)
            print(json.dumps(run), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
