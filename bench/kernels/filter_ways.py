"""`sampling.filter_logits` alone over the threshold searches' `ways` (thresholds per pass + 1), per
row count: few ways read the rows more often, many ways compare more per element; each with the
searches counting through XLA's reductions and through the Pallas kernel (`CountKernel`).

    python bench/kernels/filter_ways.py [--rows 1,64,320] [--ways 4,8,16] [--out FILE.json]

Random logits (std 3: nuclei of thousands of tokens), temperature 0.7, top_k 50 and top_p 0.9 on
every row (both searches run; the GPU always runs both). Median of 20 synchronous calls
(`bench/kernels/timing.median_seconds`). Then one counting pass alone (15 thresholds, counts and
masses) in XLA's two forms and the kernel's, with its bytes over a torch `copy_` in the same run.
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
            for kernel in (None, sampling.CountKernel(interpret=_cpu())):
                f = jax.jit(lambda x, fp, w=w, kernel=kernel: sampling.filter_logits(x, fp, ways=w,
                                                                                   count_kernel=kernel))
                out = np.isfinite(np.asarray(f(x, fp)))
                ref = out if ref is None else ref
                ms = 1e3 * median_seconds(f, x, fp, group=1, groups=20)
                run = dict(rows=r, ways=w, count_kernel=kernel is not None, passes=2 * sampling.search_passes(w),
                           ms=ms, same_kept_set=bool((out == ref).all()))
                res["runs"].append(run)
                print(json.dumps(run), flush=True)
        res.setdefault("count_pass", []).extend(_count_pass(x))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def _cpu() -> bool:
    return jax.devices()[0].platform == "cpu"  # (the kernel then runs interpreted)


def _count_pass(x) -> list[dict]:
    """One pass of 15 thresholds over x f32[R, V]: counts and masses, XLA variadic / per threshold / kernel."""
    r, v = x.shape
    th = jnp.sort(x[:, :: max(1, v // 15)][:, :15], axis=1)
    w = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    try:
        from bench.kernels.timing import memcpy_seconds

        copy_gbs = 2 * 2**30 / memcpy_seconds(2**30) / 1e9
    except Exception:  # noqa: BLE001 - no torch / no GPU: no roofline column
        copy_gbs = None
    out = []
    for weighted in (False, True):
        nbytes = r * v * 4 * (2 if weighted else 1)
        for form in ("variadic", "per threshold", "kernel"):
            kern = sampling.CountKernel(interpret=_cpu()) if form == "kernel" else None
            f = jax.jit(lambda x, th, w, form=form, kern=kern, weighted=weighted: sampling._sums_ge(
                x, th, w if weighted else None, variadic=form == "variadic", kernel=kern))
            us = 1e6 * median_seconds(f, x, th, w, group=5, groups=9)
            run = dict(rows=r, weighted=weighted, form=form, us=us, gb_s=nbytes / us / 1e3,
                       of_copy=None if copy_gbs is None else nbytes / us / 1e3 / copy_gbs)
            print(json.dumps(run), flush=True)
            out.append(run)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
