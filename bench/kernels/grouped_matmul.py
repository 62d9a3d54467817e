"""Benchmark the MoE grouped GEMM on one GPU (issue 6): tokamax's `ragged_dot` (Mosaic GPU, its
heuristic config and a few explicit ones), `jax.lax.ragged_dot` (XLA), jax's bundled
`ragged_dot_mgpu` example kernel, and a dense bf16 matmul of the same FLOPs (the ceiling).

Our own Mosaic GPU grouped GEMM (pallas_kernels/grouped_matmul) lost every case to tokamax on the
H200 on 2026-11-29 and was removed; bench/results/grouped_matmul_2026-11-29.md has that run and
names the commit that still has the kernel.

Cases (bf16 in, f32 accumulation; group sizes drawn like a top-k router's: uneven, a few empty):
* prefill_e64:    M=8192 rows, K=2048, N=768, 64 groups;
* decode_gate_up: M=512 rows (64 tokens x top-8), 128 experts, K=2048, N=1536 (Qwen3-30B-A3B);
* decode_down:    M=512, 128 experts, K=768, N=2048.
Per impl: time (median of groups of back-to-back calls), TFLOP/s (2*M*K*N), TB/s over the bytes
that must move (x, the weights of non-empty groups, the output) and, when torch is there, that as
a fraction of a torch `copy_` measured in the same run; and the max error against ragged_dot in f32.
The dense matmul reads one weight matrix, not one per group, so its TB/s (counted over the grouped
bytes) can pass memcpy: it is a FLOP ceiling only.

On the GPU machine, from the repo root (tokamax is optional: carry its wheels and those of qwix,
einshape, jaxtyping, wadler_lindig, immutabledict, tensorboardx, pydantic and flax if missing;
xprof, which tokamax imports only for its own profiler, is stubbed here when absent):
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/kernels/grouped_matmul.py --out DIR
`--smoke` runs tiny shapes on the CPU, XLA ragged_dot only (tokamax may be absent), to check this
script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import traceback
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.kernels.timing import median_seconds  # noqa: E402

CASES = {  # name: (M, K, N, E)
    "prefill_e64": (8192, 2048, 768, 64),
    "decode_gate_up": (512, 2048, 1536, 128),
    "decode_down": (512, 768, 2048, 128),
}
SMOKE_CASES = {"smoke_prefill": (200, 128, 128, 4), "smoke_decode": (64, 64, 128, 8)}
# Explicit tokamax configs tried after its heuristic one: (block_m, block_n, block_k, stages, persistent).
TOKAMAX_CONFIGS = ((128, 128, 64, 4, False), (128, 128, 64, 4, True), (64, 128, 64, 6, False), (64, 128, 128, 4, True))
# Summary columns: impl-name prefix -> column (the best row of each per case).
FAMILIES = {"tokamax": "tokamax", "jax ragged_dot_mgpu": "jax ragged_dot_mgpu",
            "xla ragged_dot": "XLA ragged_dot", "dense bf16 matmul": "dense bf16 (ceiling)"}
SMOKE = False


def log(*a):
    print(*a, flush=True)


def time_fn(fn, *args):
    """Median seconds per call over 7 groups of 10 back-to-back calls (one call in --smoke)."""
    return median_seconds(fn, *args, group=1, groups=1) if SMOKE else median_seconds(fn, *args)


def router_sizes(rng, m, e):
    """Group sizes summing to m as a top-k router makes them: skewed, with ~1/16 empty experts."""
    weights = rng.gamma(0.7, size=e)
    weights[rng.choice(e, max(1, e // 16), replace=False)] = 0.0
    sizes = rng.multinomial(m, weights / weights.sum())
    return sizes.astype(np.int32)


def memcpy_tb_s():
    """torch copy_ of 2 GiB bf16 (read + write counted), the bandwidth ceiling; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    n = 2**30
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(ts) / 1e12


def import_tokamax():
    """tokamax's ragged_dot, or the reason it is unusable. tokamax imports xprof (its profiler,
    a 32 MB wheel with a large dependency tree) at import time only for benchmarking helpers; a
    stub stands in when xprof is missing."""
    try:
        import xprof  # noqa: F401
    except ImportError:
        stub = types.ModuleType("xprof.cli.tools.get_kernel_stats_tool")
        stub.compute_kernel_stats = lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("xprof stub"))
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = stub
        sys.modules["xprof.cli.tools.get_kernel_stats_tool"] = stub
    try:
        import tokamax

        return tokamax, getattr(tokamax, "__version__", "?")
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def bench_case(name, m, k, n, e, results, memcpy, tokamax):
    rng = np.random.default_rng(0)
    sizes = router_sizes(rng, m, e)
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes)
    flops = 2 * m * k * n
    nbytes = (m * k + int((sizes > 0).sum()) * k * n + m * n) * 2
    shape = dict(m=m, k=k, n=n, e=e, nonempty_groups=int((sizes > 0).sum()), max_group=int(sizes.max()))
    ref = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(x, w, gs)
    scale = float(jnp.max(jnp.abs(ref)))

    def run(impl, fn, params=None, check=True):
        rec = dict(case=name, impl=impl, params=params, **shape)
        try:
            out = fn(x, w, gs)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / scale if check else float("nan")
            t = time_fn(fn, x, w, gs)
            rec.update(time_us=t * 1e6, tflop_s=flops / t / 1e12, tb_s=nbytes / t / 1e12)
            if check:
                rec["max_rel_err"] = err
            if memcpy:
                rec["frac_memcpy"] = nbytes / t / 1e12 / memcpy
            log(f"  {name:15s} {impl:34s} {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOP/s "
                f"{nbytes / t / 1e12:5.2f} TB/s err {err:.1e} {params or ''}")
        except Exception as ex:  # one failing variant must not end the run
            rec["error"] = f"{type(ex).__name__}: {str(ex)[:600]}"
            log(f"  {name} {impl} FAILED {rec['error'][:300]}")
            traceback.print_exc(limit=2)
        results.append(rec)

    run("xla ragged_dot", jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)))
    run("xla ragged_dot(f32 out)", jax.jit(
        lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)))
    if SMOKE:
        return
    w0 = w[0]
    run("dense bf16 matmul", jax.jit(lambda x, w, gs: jnp.dot(x, w0)), check=False)  # same FLOPs, one matrix
    if tokamax is not None:  # its heuristic config, then a few explicit ones
        run("tokamax mosaic", jax.jit(lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic")))
        try:
            from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as tk

            for bm, bn, bk, stages, persistent in TOKAMAX_CONFIGS:
                cfg = tk.Config(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, split_k=1,
                                persistent=persistent)
                op = tk.PallasMosaicGpuRaggedDot(config=cfg)
                run(f"tokamax {bm}x{bn}x{bk}/{stages}{' persistent' if persistent else ''}",
                    jax.jit(lambda x, w, gs, op=op: op(x, w, group_sizes=gs)),
                    params=dict(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, persistent=persistent))
        except Exception as ex:
            log(f"  tokamax configs unavailable: {type(ex).__name__}: {ex}")
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        for bm, bn in ((128, 128), (64, 128)):
            run(f"jax ragged_dot_mgpu {bm}x{bn}", jax.jit(lambda x, w, gs, bm=bm, bn=bn: ragged_dot_mgpu.ragged_dot(
                x, w, group_sizes=gs, block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=4,
                grid_block_n=1)))
    except ImportError as ex:
        log(f"  bundled ragged_dot_mgpu unavailable: {ex}")


def best_per_family(rows):
    """{case: {column: (time_us, impl)}}: the fastest successful row of each impl family."""
    best = {}
    for r in rows:
        if "error" in r:
            continue
        for prefix, col in FAMILIES.items():
            if r["impl"].startswith(prefix):
                cur = best.setdefault(r["case"], {}).get(col)
                if cur is None or r["time_us"] < cur[0]:
                    best[r["case"]][col] = (r["time_us"], r["impl"])
    return best


def markdown(res) -> str:
    lines = [f"# Grouped GEMM ({res['device']}, {res['date']})", "",
             f"versions: {res['versions']}; memcpy {res.get('memcpy_tb_s')} TB/s; tokamax: {res['tokamax']}", "",
             "Best per impl (us):", "", "| case | " + " | ".join(FAMILIES.values()) + " |",
             "|---|" + "---|" * len(FAMILIES)]
    for case, cols in best_per_family(res["rows"]).items():
        cells = [f"{cols[c][0]:.1f} ({cols[c][1]})" if c in cols else "" for c in FAMILIES.values()]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += ["", "| case | impl | us | TFLOP/s | TB/s | frac memcpy | err | params |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | failed: {r['error'][:120]} | | | | | |")
            continue
        frac = f"{r['frac_memcpy']:.2f}" if "frac_memcpy" in r else ""
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
        lines.append(f"| {r['case']} | {r['impl']} | {r['time_us']:.1f} | {r['tflop_s']:.1f} | {r['tb_s']:.2f} | "
                     f"{frac} | {err} | {r['params'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    global SMOKE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, XLA ragged_dot only, on the CPU: checks the script")
    ap.add_argument("--smoke-cases", default=",".join(SMOKE_CASES))
    args = ap.parse_args(argv)
    SMOKE = args.smoke
    if args.smoke:
        cases = {c: SMOKE_CASES[c] for c in args.smoke_cases.split(",")}
    else:
        cases = {c: CASES[c] for c in args.cases.split(",")}
    if args.smoke and args.out == "bench/results":  # a smoke run must not overwrite the GPU results
        args.out = tempfile.mkdtemp(prefix="smoke_")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    tokamax, tok_info = (None, "skipped (smoke)") if args.smoke else import_tokamax()
    res = dict(device=jax.devices()[0].device_kind, date=date, argv=sys.argv[1:] if argv is None else argv,
               versions=dict(jax=jax.__version__), tokamax=tok_info if tokamax is None else f"tokamax {tok_info}",
               memcpy_tb_s=None if args.smoke else memcpy_tb_s(), rows=[], errors=[])
    log(f"device {res['device']}, tokamax: {res['tokamax']}, memcpy {res['memcpy_tb_s']} TB/s")
    stamp = f"grouped_matmul_{date}" + ("_smoke" if args.smoke else "")
    for name, (m, k, n, e) in cases.items():
        try:
            bench_case(name, m, k, n, e, res["rows"], res["memcpy_tb_s"], tokamax)
        except Exception as ex:
            res["errors"].append(f"{name}: {type(ex).__name__}: {str(ex)[:400]}")
            log(traceback.format_exc())
        (out / f"{stamp}.json").write_text(json.dumps(res, indent=1, default=str))
        (out / f"{stamp}.md").write_text(markdown(res))
    log(markdown(res))


if __name__ == "__main__":
    main()
