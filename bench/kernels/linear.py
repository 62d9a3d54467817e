"""Skinny-GEMM benchmark on the GPU machine: Llama-3-8B projections at decode batch sizes.

For each projection (K -> N) and M in {1, 8, 32, 64} it times, on weights that rotate through
distinct copies totalling >= 256 MB (over 4x the H200's 60 MB L2, so HBM is timed, not L2):
* XLA's dot with W [N, K] and with W [K, N];
* cuBLAS through torch (`F.linear` with W [N, K], `x @ W` with W [K, N]), in a CUDA graph;
* the Pallas kernels of pallas_kernels/linear: Triton-lowered and Mosaic GPU, bf16 and FP8
  (128x128 block scales), each over a small sweep of tuning parameters;
next to a torch `copy_` of 2 GiB (read + write bytes) measured in the same run.
Effective weight bandwidth = weight bytes / time. Each kernel's output on one copy is checked
against a float32 XLA dot (relative Frobenius error).

Run (on the GPU machine, from the repo root):
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/kernels/linear.py --out DIR
Writes DIR/linear.json, DIR/linear.md and DIR/tuned_params.json (best Triton params per shape).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import argparse  # noqa: E402
import concurrent.futures
import dataclasses
import datetime
import gc
import json
import math
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.linear import SkinnyParams, skinny_matmul, skinny_matmul_fp8
from pallas_kernels.linear.params import tuned_key
from pallas_kernels.linear.skinny_mgpu import (
    STACK_MAX_M,
    MgpuParams,
    skinny_matmul_fp8_mgpu,
    skinny_matmul_mgpu,
    skinny_matmul_w8a8_mgpu,
)

SHAPES = {  # name: (K, N), Llama-3-8B
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
MS = (1, 8, 32, 64)
FP8_MS = (1, 8)
MIN_ROTATION_BYTES = 256e6

TRITON_SMALL = [SkinnyParams(16, 512, 1, 4, 4), SkinnyParams(32, 256, 1, 4, 4), SkinnyParams(64, 256, 1, 4, 4)]
TRITON_LARGE = [SkinnyParams(32, 256, 1, 4, 3), SkinnyParams(64, 256, 1, 4, 3), SkinnyParams(128, 128, 1, 8, 3)]
TRITON_FP8 = [SkinnyParams(32, 256, 1, 4, 4), SkinnyParams(64, 256, 1, 4, 4), SkinnyParams(64, 512, 1, 4, 3),
              SkinnyParams(32, 256, 1, 4, 4, fp8_scale_on_x=False)]
# --fp8: M = 1 only, no Mosaic twin, and this FP8 sweep around the 2026-11-30 runs' picks: the
# CUDA-core gemv with narrow tiles (more programs), long K steps and split-K, beside the dot
TRITON_FP8_WIDE = [SkinnyParams(32, 256, 1, 4, 4)] + [
    SkinnyParams(bn, bk, sk, w, st, gemv=True)
    for bn, bk, sk, w, st in ((16, 1024, 1, 4, 4), (16, 1024, 2, 4, 4), (16, 1024, 4, 4, 4), (16, 2048, 1, 4, 3),
                              (16, 2048, 2, 4, 3), (16, 512, 2, 4, 4), (16, 512, 1, 4, 6), (16, 1024, 1, 8, 4),
                              (32, 512, 1, 4, 4), (32, 1024, 2, 4, 3))]
# --fp8-batch: M = 16, 32, 64 (the issue-19 gap: a 64-row FP8 step ran 2.2x slower than bf16 on
# XLA's dequantize-and-dot); tiles for 16-64 rows (block_n must divide 128 for FP8)
TRITON_FP8_BATCH = [SkinnyParams(bn, bk, sk, w, st) for bn, bk, sk, w, st in (
    (32, 256, 1, 4, 3), (64, 256, 1, 4, 3), (64, 128, 1, 4, 4), (128, 128, 1, 8, 3), (128, 256, 1, 8, 3),
    (64, 256, 2, 4, 3), (128, 128, 2, 8, 3), (64, 512, 1, 8, 3))]
TRITON_GEMV = [SkinnyParams(32, 512, 1, 4, 4, gemv=True), SkinnyParams(64, 512, 1, 8, 3, gemv=True)]
MGPU_BF16 = [MgpuParams(32, 128, 6), MgpuParams(64, 256, 3)]
MGPU_FP8 = [MgpuParams(64, 128, 6), MgpuParams(64, 128, 6, split_k=2)]
# W8A8 (FP8 x FP8 wgmma, x as two FP8 terms quantized per row and 128-column group)
MGPU_W8A8 = [MgpuParams(64, 128, 6), MgpuParams(128, 128, 4), MgpuParams(64, 128, 6, split_k=2),
             MgpuParams(128, 128, 4, split_k=2)]
# two 128-column groups a step (the first's scaling beside the second's wgmma; shared memory holds 4
# steps of 64-row tiles, 3 of 128-row ones), and x's two terms stacked in one tile (up to 32 rows)
MGPU_W8A8 += [MgpuParams(64, 256, 4), MgpuParams(128, 256, 3), MgpuParams(64, 256, 4, split_k=2),
              MgpuParams(128, 256, 3, split_k=2)]
MGPU_W8A8 += [dataclasses.replace(p, stack_terms=True) for p in MGPU_W8A8]


def _p(p) -> str:
    if isinstance(p, SkinnyParams):
        tag = "".join(t for t, on in (("_scale-acc", not p.fp8_scale_on_x), ("_f16", p.fp8_f16_dot),
                                      ("_gemv", p.gemv)) if on)
        return f"bn{p.block_n}_bk{p.block_k}_s{p.split_k}_w{p.num_warps}_st{p.num_stages}{tag}"
    return f"bn{p.block_n}_bk{p.block_k}_st{p.max_concurrent_steps}_s{p.split_k}{'_stack' if p.stack_terms else ''}"


def _xla_nk(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def _xla_kn(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _many(fn):
    """One executable applying fn(x, w_i, *extra_i) to every weight copy (no Python between launches)."""
    inner = jax.jit(fn)

    def run(x, ws, extras):
        return [inner(x, w, *e) for w, e in zip(ws, extras)]

    return jax.jit(run)


def _time_jax(compiled, x, ws, extras, target_s=0.02, groups=5):
    jax.block_until_ready(compiled(x, ws, extras))
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(x, ws, extras))
    one = time.perf_counter() - t0
    reps = max(1, min(100, int(target_s / max(one, 1e-6))))
    ts = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = compiled(x, ws, extras)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / (reps * len(ws)))
    return float(np.median(ts)), float(np.min(ts))


def _time_torch(torch, op, x, ws, target_s=0.02, groups=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for w in ws:
                op(x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            op(x, w)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    reps = max(1, min(100, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(groups):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3 / (reps * len(ws)))
    return float(np.median(ts)), float(np.min(ts))


def _memcpy(torch):
    n = 2**30  # 2 GiB of bf16
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * n / float(np.median(ts))  # read + write bytes / s


class _FakeTorch:
    """Stands in for torch in --cpu-smoke runs (every torch measurement then fails and is recorded)."""

    __version__ = "none"
    version = type("v", (), {"cuda": None})

    def __getattr__(self, name):
        raise RuntimeError("torch is not used in --cpu-smoke runs")


def _cpu_smoke():
    global SHAPES, MS, FP8_MS, MIN_ROTATION_BYTES, TRITON_SMALL, TRITON_LARGE, TRITON_FP8, MGPU_BF16, MGPU_FP8
    global MGPU_W8A8
    global skinny_matmul, skinny_matmul_fp8, skinny_matmul_mgpu, skinny_matmul_fp8_mgpu, skinny_matmul_w8a8_mgpu
    global _memcpy
    import functools

    SHAPES = {"a": (256, 192), "b": (384, 128)}
    MS, FP8_MS, MIN_ROTATION_BYTES = (1, 32), (1,), 2e5
    TRITON_SMALL, TRITON_LARGE, TRITON_FP8 = TRITON_SMALL[:1], TRITON_LARGE[:1], TRITON_FP8[:1]
    MGPU_BF16, MGPU_FP8, MGPU_W8A8 = MGPU_BF16[:1], MGPU_FP8[1:], MGPU_W8A8[:1]
    skinny_matmul = functools.partial(skinny_matmul, interpret=True)
    skinny_matmul_fp8 = functools.partial(skinny_matmul_fp8, interpret=True)
    skinny_matmul_mgpu = functools.partial(skinny_matmul_mgpu, interpret=True)
    skinny_matmul_fp8_mgpu = functools.partial(skinny_matmul_fp8_mgpu, interpret=True)
    skinny_matmul_w8a8_mgpu = functools.partial(skinny_matmul_w8a8_mgpu, interpret=True)
    _memcpy = lambda torch: 1e12  # noqa: E731


def _jobs(m, weights):
    """(shape, impl, params, fn(x, w, *extra), weight copies, extras per copy) for one M."""
    jobs = []
    for name in SHAPES:
        wd = weights[name]
        no_extra = [()] * len(wd["nk"])
        jobs.append((name, "xla_nk", None, _xla_nk, wd["nk"], no_extra))
        jobs.append((name, "xla_kn", None, _xla_kn, wd["kn"], no_extra))
        for p in (TRITON_SMALL + TRITON_GEMV * (m == 1) if m <= 8 else TRITON_LARGE):
            jobs.append((name, "triton", p, lambda x, w, p=p: skinny_matmul(x, w, params=p), wd["nk"], no_extra))
        for p in (MGPU_BF16 if m <= 8 else MGPU_BF16[:1]):
            jobs.append((name, "mgpu", p, lambda x, w, p=p: skinny_matmul_mgpu(x, w, params=p), wd["nk"], no_extra))
        if m in FP8_MS:
            ex8 = [(s,) for s in wd["s8"]]
            for p in (p for p in TRITON_FP8 if m == 1 or not p.gemv):
                jobs.append((name, "triton_fp8", p, lambda x, w, s, p=p: skinny_matmul_fp8(x, w, s, params=p),
                             wd["w8"], ex8))
            for p in MGPU_FP8:
                jobs.append((name, "mgpu_fp8", p, lambda x, w, s, p=p: skinny_matmul_fp8_mgpu(x, w, s, params=p),
                             wd["w8"], ex8))
            for p in (p for p in MGPU_W8A8 if m <= STACK_MAX_M or not p.stack_terms):  # x quantized in the call
                jobs.append((name, "mgpu_w8a8_fp8", p,
                             lambda x, w, s, p=p: skinny_matmul_w8a8_mgpu(x, w, s, params=p), wd["w8"], ex8))
    return jobs


def _measure(job, exe, m, x_by_k, weights, refs, memcpy):
    name, impl, p, _, ws, extras = job
    k, n = SHAPES[name]
    x = x_by_k[k]
    fp8 = impl.endswith("fp8")
    wbytes = n * k * (1 if fp8 else 2)
    row = dict(shape=name, K=k, N=n, M=m, impl=impl, params=None if p is None else _p(p),
               params_dict=None if p is None else p.__dict__, weight_bytes=wbytes, copies=len(ws))
    try:
        if isinstance(exe, Exception):
            raise exe
        y = exe(x, ws, extras)[0]
        if (name, fp8) not in refs:  # f32 oracle on copy 0 (xla_kn's copy 0 is nk[0].T)
            if fp8:
                sc = jnp.repeat(jnp.repeat(extras[0][0], 128, 0), 128, 1)[:n, :k]
                wf = ws[0].astype(jnp.float32) * sc
            else:
                wf = weights[name]["nk"][0].astype(jnp.float32)
            refs[(name, fp8)] = jnp.dot(x.astype(jnp.float32), wf.T, precision=jax.lax.Precision.HIGHEST)
        ref = refs[(name, fp8)]
        err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        med, best = _time_jax(exe, x, ws, extras)
        row.update(rel_err=err, time_us=med * 1e6, best_us=best * 1e6, tb_s=wbytes / med / 1e12,
                   frac_memcpy=wbytes / med / memcpy)
        print(f"  {name:8s} M={m:2d} {impl:10s} {row['params'] or '':28s} {med * 1e6:8.2f} us "
              f"{row['tb_s']:5.2f} TB/s ({row['frac_memcpy']:.0%}) err {err:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001 - recorded in the results
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(f"  {name} M={m} {impl} {row['params']}: FAILED {row['error'][:300]}", flush=True)
    return row


def _measure_torch(torch, name, k, n, m, x, wd, memcpy):
    """cuBLAS through torch on the same buffers (DLPack, no copy)."""
    rows = []
    for impl, ws, op in (
        ("torch_nk", wd["nk"], lambda x, w: torch.nn.functional.linear(x, w)),
        ("torch_kn", wd["kn"], lambda x, w: x @ w),
    ):
        row = dict(shape=name, K=k, N=n, M=m, impl=impl, params=None, weight_bytes=n * k * 2, copies=len(ws))
        try:
            xt = torch.from_dlpack(x)
            wt = [torch.from_dlpack(w) for w in ws]
            med, best = _time_torch(torch, op, xt, wt)
            row.update(time_us=med * 1e6, best_us=best * 1e6, tb_s=n * k * 2 / med / 1e12,
                       frac_memcpy=n * k * 2 / med / memcpy)
            print(f"  {name:8s} M={m:2d} {impl:10s} {'':28s} {med * 1e6:8.2f} us {row['tb_s']:5.2f} TB/s "
                  f"({row['frac_memcpy']:.0%})", flush=True)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  {name} M={m} {impl}: FAILED {row['error'][:200]}", flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop starting new cells after this")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode, no torch (plumbing check)")
    ap.add_argument("--fp8", action="store_true", help="M = 1 only; the wide FP8 sweep; no Mosaic twin")
    ap.add_argument("--fp8-batch", action="store_true",
                    help="M = 16, 32, 64: FP8 tiles for batched decode beside bf16 (then raise "
                         "layers.linear.KERNEL_MAX_M where the FP8 kernel wins)")
    args = ap.parse_args(argv)
    if args.fp8:
        global MS, FP8_MS, TRITON_FP8, TRITON_GEMV, MGPU_BF16, MGPU_FP8, MGPU_W8A8
        MS, FP8_MS, TRITON_FP8, TRITON_GEMV, MGPU_BF16, MGPU_FP8 = (1,), (1,), TRITON_FP8_WIDE, [], [], []
        MGPU_W8A8 = []
    if args.fp8_batch:
        global TRITON_SMALL
        MS, FP8_MS, TRITON_FP8, TRITON_SMALL = (16, 32, 64), (16, 32, 64), TRITON_FP8_BATCH, TRITON_LARGE
    if args.cpu_smoke:
        _cpu_smoke()
    t_start = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch = _FakeTorch() if args.cpu_smoke else __import__("torch")

    dev = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_torch": torch.version.cuda,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    memcpy = _memcpy(torch)
    meta["memcpy_tb_s"] = memcpy / 1e12
    print(json.dumps(meta), flush=True)

    key = jax.random.key(0)
    weights = {}
    for name, (k, n) in SHAPES.items():
        c16 = max(2, math.ceil(MIN_ROTATION_BYTES / (n * k * 2)))
        c8 = max(2, math.ceil(MIN_ROTATION_BYTES / (n * k)))
        ks = jax.random.split(jax.random.fold_in(key, n * 7 + k), c16 + c8)
        w_nk = [(jax.random.normal(ks[i], (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16) for i in range(c16)]
        w_kn = [jnp.asarray(w.T) for w in w_nk]
        w8 = [jnp.clip(jax.random.normal(ks[c16 + i], (n, k), jnp.float32) * 100, -448, 448).astype(jnp.float8_e4m3fn)
              for i in range(c8)]
        s8 = [jax.random.uniform(jax.random.fold_in(ks[c16 + i], 1), (-(-n // 128), -(-k // 128)), jnp.float32,
                                 1e-4, 1e-3) for i in range(c8)]
        weights[name] = dict(nk=w_nk, kn=w_kn, w8=w8, s8=s8)
        jax.block_until_ready(weights[name])
        print(f"{name}: K={k} N={n}: {c16} bf16 copies ({c16 * n * k * 2 / 1e6:.0f} MB), {c8} fp8 copies "
              f"({c8 * n * k / 1e6:.0f} MB)", flush=True)

    rows = []
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)

    def save():
        (out / "linear.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    for m in MS:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget reached; skipping M={m}", flush=True)
            continue
        x_by_k = {k: jax.random.normal(jax.random.fold_in(key, 1000 + m + k), (m, k), jnp.float32).astype(jnp.bfloat16)
                  for k in {k for k, _ in SHAPES.values()}}
        jobs = _jobs(m, weights)
        # Lower on this thread (Python), compile on the pool (XLA / Triton / ptxas release the GIL).
        t0 = time.perf_counter()
        futs = []
        for job in jobs:
            name, _, _, fn, ws, extras = job
            try:
                lowered = _many(fn).lower(x_by_k[SHAPES[name][0]], ws, extras)
                futs.append((job, pool.submit(lowered.compile)))
            except Exception as e:  # noqa: BLE001 - recorded in the results
                futs.append((job, e))
        compiled = []
        for job, f in futs:
            try:
                compiled.append((job, f if isinstance(f, Exception) else f.result()))
            except Exception as e:  # noqa: BLE001
                compiled.append((job, e))
        print(f"M={m}: lowered+compiled {len(jobs)} executables in {time.perf_counter() - t0:.1f}s", flush=True)
        refs = {}
        # Mosaic GPU last: a kernel fault there would poison the CUDA context for what follows.
        for job, exe in compiled:
            if not job[1].startswith("mgpu"):
                rows.append(_measure(job, exe, m, x_by_k, weights, refs, memcpy))
                save()
        for name, (k, n) in SHAPES.items():
            rows.extend(_measure_torch(torch, name, k, n, m, x_by_k[k], weights[name], memcpy))
        save()
        for job, exe in compiled:
            if job[1].startswith("mgpu"):
                rows.append(_measure(job, exe, m, x_by_k, weights, refs, memcpy))
                save()
        del compiled, futs
        gc.collect()

    meta["wall_s"] = time.perf_counter() - t_start
    save()
    tuned = {}
    for r in rows:
        if r["impl"] not in ("triton", "triton_fp8") or "time_us" not in r or r["rel_err"] > 1e-2:
            continue
        key_ = tuned_key(r["M"], r["N"], r["K"], "float8_e4m3fn" if r["impl"] == "triton_fp8" else "bfloat16")
        if key_ not in tuned or r["time_us"] < tuned[key_][0]:
            tuned[key_] = (r["time_us"], r["params_dict"])
    (out / "tuned_params.json").write_text(json.dumps({k: v[1] for k, v in sorted(tuned.items())}, indent=1))
    (out / "linear.md").write_text(summary(meta, rows))
    print(summary(meta, rows), flush=True)
    return 0


def summary(meta, rows) -> str:
    """Markdown: best time per implementation family, per shape and M."""
    fams = ["xla_nk", "xla_kn", "torch_nk", "torch_kn", "triton", "mgpu", "triton_fp8", "mgpu_fp8", "mgpu_w8a8_fp8"]
    best = {}
    for r in rows:
        if "time_us" not in r or r.get("rel_err", 0) > 1e-2:
            continue
        kk = (r["shape"], r["M"], r["impl"])
        if kk not in best or r["time_us"] < best[kk]["time_us"]:
            best[kk] = r
    lines = [
        f"# Skinny GEMM, Llama-3-8B projections ({meta['device']}, {meta['date']})",
        "",
        f"jax {meta['jax']}, torch {meta['torch']}, triton {meta.get('triton', '?')}; memcpy (torch copy_, 2 GiB, "
        f"read+write) **{meta['memcpy_tb_s']:.2f} TB/s**. Cells: µs per call / effective weight TB/s "
        "(weight bytes / time; FP8 counts its 1-byte weights). Weights rotate through >= 256 MB of copies.",
        "",
        "| shape (K->N) | M | " + " | ".join(fams) + " |",
        "|---|---|" + "---|" * len(fams),
    ]
    for name, (k, n) in SHAPES.items():
        for m in MS:
            cells = []
            for f in fams:
                r = best.get((name, m, f))
                cells.append("" if r is None else f"{r['time_us']:.1f} / {r['tb_s']:.2f}")
            lines.append(f"| {name} {k}->{n} | {m} | " + " | ".join(cells) + " |")
    lines += ["", "FP8 vs bf16 at M=1 (best kernel of each; tokens/s ratio = bf16 time / fp8 time):", ""]
    tot16 = tot8 = 0.0
    for name in SHAPES:
        b16 = [best[(name, 1, f)]["time_us"] for f in ("triton", "mgpu") if (name, 1, f) in best]
        b8 = [best[(name, 1, f)]["time_us"] for f in ("triton_fp8", "mgpu_fp8", "mgpu_w8a8_fp8")
              if (name, 1, f) in best]
        if b16 and b8:
            tot16 += min(b16)
            tot8 += min(b8)
            lines.append(f"- {name}: bf16 {min(b16):.1f} µs, fp8 {min(b8):.1f} µs, ratio {min(b16) / min(b8):.2f}x")
    if tot8:
        lines.append(f"- one layer's four projections: bf16 {tot16:.1f} µs, fp8 {tot8:.1f} µs, "
                     f"ratio **{tot16 / tot8:.2f}x**")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", f"{len(failed)} configurations failed; first errors:", ""]
        lines += [f"- {r['shape']} M={r['M']} {r['impl']} {r['params']}: {r['error'][:160]}" for r in failed[:6]]
    bad = [r for r in rows if r.get("rel_err", 0) > 1e-2]
    if bad:
        lines += ["", "Wrong results (rel err > 1e-2): " + ", ".join(
            f"{r['shape']} M={r['M']} {r['impl']} {r['params']} ({r['rel_err']:.1e})" for r in bad[:8])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
