"""How the decode step should walk the layers: a probe of XLA's handling of stacked weights (issue 5).

The engine's steps run `lax.scan` over layer-stacked weights. On the H200 the decode step of a
Llama-3-8B-shaped model spent 6.7 of its 13 ms in `memcpy` (128 per step: XLA copies each
layer's four weight slices out of the stacked arrays before the dots; bench/results). This
probe times the same weight stream (32 layers of qkv / o / gate_up / down at M rows, RMSNorm,
SwiGLU, residuals; no attention) walked four ways, in one process:
* scan:        `lax.scan` over the stacked weights (the engine today);
* scan_unroll: the same with `unroll=True`;
* static:      a Python loop indexing the stacked arrays with constants;
* list:        a Python loop over per-layer arrays (no slicing at all).
Each row: ms per step (best of 5 runs of 10 back-to-back calls), weight TB/s and the count of
copy-like ops in the optimized HLO, beside a torch `copy_` measured in the same run.

    PYTHONPATH=. python3 bench/kernels/layer_loop.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.kernels.timing import memcpy_seconds, time_jax  # noqa: E402

L, H, QKV, O_IN, I = 32, 4096, 6144, 4096, 14336


def rms(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * w).astype(x.dtype)


def layer(x, lp):
    h = rms(x, lp["n1"])
    qkv = h @ lp["wqkv"]
    x = x + qkv[:, :O_IN] @ lp["wo"]
    h = rms(x, lp["n2"])
    g, u = jnp.split(h @ lp["wgu"], 2, axis=-1)
    return x + (jax.nn.silu(g) * u) @ lp["wd"]


def make_weights(key):
    shapes = dict(wqkv=(L, H, QKV), wo=(L, O_IN, H), wgu=(L, H, 2 * I), wd=(L, I, H), n1=(L, H), n2=(L, H))
    keys = jax.random.split(key, len(shapes))
    return {n: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(jnp.bfloat16) + (1 if n[0] == "n" else 0)
            for (n, s), k in zip(shapes.items(), keys)}


def variants():
    def scan(x, w):
        return jax.lax.scan(lambda x, lp: (layer(x, lp), None), x, w)[0]

    def scan_unroll(x, w):
        return jax.lax.scan(lambda x, lp: (layer(x, lp), None), x, w, unroll=True)[0]

    def static(x, w):
        for i in range(L):
            x = layer(x, {k: v[i] for k, v in w.items()})
        return x

    def as_list(x, ws):
        for lp in ws:
            x = layer(x, lp)
        return x

    return dict(scan=scan, scan_unroll=scan_unroll, static=static, list=as_list)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,64")
    args = ap.parse_args()
    w = make_weights(jax.random.key(0))
    wl = [{k: v[i] for k, v in w.items()} for i in range(L)]
    wl = jax.block_until_ready(jax.tree.map(lambda a: a + 0, wl))  # distinct buffers
    nbytes = sum(v.nbytes for v in w.values())
    bw = 2 * (1 << 30) / memcpy_seconds(1 << 30) / 1e12
    rows = []
    for m in (int(s) for s in args.ms.split(",")):
        x = jax.random.normal(jax.random.key(1), (m, H), jnp.float32).astype(jnp.bfloat16)
        for name, fn in variants().items():
            f = jax.jit(fn)
            arg = wl if name == "list" else w
            t0 = time.perf_counter()
            hlo = f.lower(x, arg).compile().as_text()
            compile_s = time.perf_counter() - t0
            copies = len(re.findall(r"^\s*\S+ = \S+ (copy|dynamic-slice|slice)\(", hlo, re.M))
            fusions_with_slice = len(re.findall(r"fused_computation.*slice", hlo))
            t = time_jax(f, x, arg, iters=10, reps=5)
            r = dict(m=m, variant=name, ms=t * 1e3, weight_tb_s=nbytes / t / 1e12, frac_memcpy=nbytes / t / 1e12 / bw,
                     copy_or_slice_ops=copies, slice_fusions=fusions_with_slice, compile_s=compile_s)
            rows.append(r)
            print(json.dumps(r), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, jax=jax.__version__,
               memcpy_tb_s=bw, weight_bytes=nbytes, rows=rows)
    (out / "layer_loop.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
