"""Benchmark the gated-delta (Qwen3-Next GDN) and causal-conv1d kernels on the GPU machine.

One process: our JAX kernels, then torch baselines.
* Chunked prefill (`chunk_gated_delta_rule`) at H=16 q/k heads, HV=32 value heads, K=V=128, bf16,
  q/k l2-normalized in the kernel, T=8192 as one stream and as 4x2048 varlen: tokens/s, next to
  FLA's `chunk_gated_delta_rule` timed in the same process after a warm-up call at the same shapes
  (FLA autotunes on its first call; --fla-prune-autotune keeps <= 2 configs per FLA kernel it can
  reach to bound that on a short lease, and the results list which). A small ChunkParams sweep runs on
  1x8192; every config's output is cross-checked against the default's, and ours against FLA's.
  The WY kernel alone is timed too (the rest is the sequential scan).
* Decode step for 64 rows (pool of 256 slots, in place, donated; 16 steps inside one jit so
  dispatch is not timed): effective bandwidth over the state bytes read + written, as a fraction
  of a torch `copy_` of the same bytes measured in the same run.
* Causal conv1d at Qwen3-Next's conv width (C=8192, W=4): varlen over T=8192 and the decode update
  for 64 rows, as bandwidth over x read + y written (+ state bytes).

Writes gated_delta_<date>.json and .md to --out (rewritten after each section, so a run cut short
still leaves its figures). From the repo root:
    PYTHONPATH=. python3 bench/kernels/gated_delta.py --out DIR [--fla-prune-autotune]
--smoke runs tiny shapes in interpret mode on the CPU (no torch) to check this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.kernels.timing import memcpy_seconds, time_jax, time_torch  # noqa: E402
from pallas_kernels.conv1d import ConvParams, causal_conv1d_update, causal_conv1d_varlen  # noqa: E402
from pallas_kernels.gated_delta import (  # noqa: E402
    ChunkParams,
    RecurrentParams,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from pallas_kernels.gated_delta import chunk as chunk_mod  # noqa: E402
from pallas_kernels.gated_delta.params import chunk_key, shape_key  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
T = 8192
LAYOUTS = {"1x8192": [0, 8192], "4x2048": [0, 2048, 4096, 6144, 8192]}
FLA_RECORDED_MS = {"1x8192": 0.777, "4x2048": 1.19}  # DESIGN.md section 4, full autotune, same H200 type
ROWS, SLOTS = 64, 256
CONV_C, CONV_W = 8192, 4
INTERPRET = False
CHUNK_SWEEP = [
    ChunkParams(block_v=64, num_warps_prepare=4, num_warps_main=4, num_stages=2),
    ChunkParams(block_v=32, num_warps_prepare=4, num_warps_main=4, num_stages=2),
    ChunkParams(block_v=64, num_warps_prepare=8, num_warps_main=8, num_stages=2),
]
REC_SWEEP = [
    RecurrentParams(block_v=32, num_warps=4),
    RecurrentParams(block_v=64, num_warps=4),
    RecurrentParams(block_v=128, num_warps=8),
]
DEADLINE = float("inf")
MIN_LEFT = 40.0  # seconds left below which a section starts no new config


def log(*a):
    print(*a, flush=True)


def left():
    return DEADLINE - time.monotonic()






def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gdn_inputs(seed=0):
    """Numpy inputs shaped like Qwen3-Next's: g = -exp(A_log) * softplus(.), beta = sigmoid(.)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, K), np.float32)
    k = rng.standard_normal((T, H, K), np.float32)
    v = rng.standard_normal((T, HV, V), np.float32)
    a_log = np.log(rng.uniform(1.0, 16.0, (1, HV))).astype(np.float32)
    g = (-np.exp(a_log) * np.log1p(np.exp(rng.standard_normal((T, HV)) - 4.0))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((T, HV))))).astype(np.float32)
    return q, k, v, g, beta


def run_chunk(ins, cu, h0, params):
    q, k, v, g, beta = ins
    return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True,
                                  params=params, interpret=INTERPRET)


@functools.partial(jax.jit, static_argnames=("params",))
def run_prepare_only(ins, cu, params):
    q, k, v, g, beta = ins
    start, length = chunk_mod.chunk_table(cu, T, 64)
    return chunk_mod.chunk_prepare(
        start, length, k.reshape(T, H * K), v.reshape(T, HV * V), g, beta, chunk=64, dk=K, dv=V, group=HV // H,
        use_qk_l2norm=True, cdtype=jnp.dtype(q.dtype), num_warps=params.num_warps_prepare, interpret=INTERPRET,
    )


def bench_chunk(results, tuned, outs, check_naive):
    from pallas_kernels.gated_delta import naive_gated_delta_rule

    q, k, v, g, beta = gdn_inputs()
    ins = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)) + (jnp.asarray(g), jnp.asarray(beta))
    rng = np.random.default_rng(1)
    timed, checks = {}, {}
    for layout, cu_list in LAYOUTS.items():
        cu = jnp.asarray(cu_list, jnp.int32)
        h0 = jnp.asarray(0.1 * rng.standard_normal((len(cu_list) - 1, HV, K, V)), jnp.float32)
        outs[layout] = dict(h0=np.asarray(h0))
        base = None
        for params in CHUNK_SWEEP:
            if left() < MIN_LEFT:
                results["errors"].append(f"chunk {layout} {params}: skipped (time budget)")
                continue
            tag = f"{layout} {params}"
            try:
                t0 = time.perf_counter()
                o, ht = run_chunk(ins, cu, h0, params)
                jax.block_until_ready(o)
                first = time.perf_counter() - t0
                sec = time_jax(functools.partial(run_chunk, ins, cu, h0, params))
                o32 = np.asarray(o.astype(jnp.float32))
                if base is None:
                    base = (o32, np.asarray(ht))
                    outs[layout].update(o=o32, ht=np.asarray(ht))
                err = (rel_l2(o32, base[0]), rel_l2(ht, base[1]))
                checks[tag] = err
                timed[(layout, params)] = sec
                log(f"chunk {tag}: {sec * 1e3:.3f} ms {T / sec / 1e6:.2f} Mtok/s (first call {first:.1f} s) "
                    f"rel-diff vs first config o/state {err[0]:.2e}/{err[1]:.2e}")
            except Exception as e:  # a config that fails to compile must not sink the run
                results["errors"].append(f"chunk {tag}: {type(e).__name__}: {str(e)[:500]}")
                log(traceback.format_exc())
        if check_naive and base is not None and left() > MIN_LEFT:
            try:
                ro, rh = naive_gated_delta_rule(*ins, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True)
                ro = np.asarray(ro.astype(jnp.float32))
                results.setdefault("chunk_vs_naive_f32", {})[layout] = dict(
                    rel_l2_o=rel_l2(base[0], ro), rel_l2_state=rel_l2(base[1], rh),
                    max_abs_o=float(np.abs(base[0] - ro).max()), max_abs_ref_o=float(np.abs(ro).max()))
                log(f"chunk {layout} vs naive f32: {results['chunk_vs_naive_f32'][layout]}")
            except Exception as e:
                results["errors"].append(f"naive check {layout}: {type(e).__name__}: {str(e)[:300]}")
    for layout, cu_list in LAYOUTS.items():  # best config per layout (B is static for the engine)
        mine = {p: sec for (lay, p), sec in timed.items() if lay == layout and max(checks[f"{lay} {p}"]) < 1e-2}
        use = min(mine, key=mine.get) if mine else None
        sec = timed.get((layout, use))
        if use is not None:
            key = chunk_key(H, HV, K, V, "bfloat16", len(cu_list) - 1)
            tuned.setdefault("chunk", {})[key] = dataclasses.asdict(use)
        row = dict(layout=layout, params=None if use is None else dataclasses.asdict(use),
                   ms=None if sec is None else sec * 1e3, mtok_s=None if sec is None else T / sec / 1e6)
        if use is not None and left() > 10:
            try:
                cu = jnp.asarray(LAYOUTS[layout], jnp.int32)
                row["prepare_ms"] = time_jax(functools.partial(run_prepare_only, ins, cu, use)) * 1e3
            except Exception as e:
                results["errors"].append(f"prepare-only {layout}: {type(e).__name__}: {str(e)[:300]}")
        results["chunk"].append(row)
    results["chunk_config_checks"] = {k: list(v) for k, v in checks.items()}
    results["chunk_sweep_ms"] = {f"{lay} {p}": s * 1e3 for (lay, p), s in timed.items()}


def prune_fla_autotune(results):
    """Keeps <= 2 configs per autotuned FLA kernel on the forward path (num_warps 4 first, then 2/8)."""
    import importlib

    names = ["fla.ops.gated_delta_rule.chunk_fwd", "fla.ops.gated_delta_rule.wy_fast", "fla.ops.common.chunk_delta_h",
             "fla.ops.common.chunk_o", "fla.ops.utils.cumsum", "fla.modules.norm.l2norm"]
    pruned = {}
    for name in names:
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            results["errors"].append(f"FLA prune import {name}: {e}")
            continue
        for attr, top in vars(mod).items():
            obj = top  # unwrap @triton.heuristics / @triton.jit layers down to the autotuner
            for _ in range(4):
                if obj is None or isinstance(getattr(obj, "configs", None), list):
                    break
                obj = getattr(obj, "fn", None)
            configs = getattr(obj, "configs", None)
            if not isinstance(configs, list) or not configs or not hasattr(configs[0], "num_warps"):
                continue
            rank = {4: 0, 8: 1, 2: 2}
            keep = sorted(configs, key=lambda c: (rank.get(c.num_warps, 3), abs((c.num_stages or 2) - 3)))[:2]
            obj.configs = keep
            pruned[f"{name}.{attr}"] = f"{len(configs)} -> {len(keep)}"
    results["fla_autotune_pruned"] = pruned


def bench_fla(results, outs, prune):
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception as e:
        results["errors"].append(f"FLA unavailable: {e}")
        return
    import fla

    results["versions"]["fla"] = getattr(fla, "__version__", "?")
    results["fla_autotune_pruned"] = False
    if prune:
        prune_fla_autotune(results)
    dev = "cuda"
    q, k, v, g, beta = gdn_inputs()
    tt = lambda x, dt: torch.from_numpy(np.ascontiguousarray(x)).to(dev, dt)[None]
    qt, kt, vt = tt(q, torch.bfloat16), tt(k, torch.bfloat16), tt(v, torch.bfloat16)
    gt, bt = tt(g, torch.float32), tt(beta, torch.float32)
    for layout, cu_list in LAYOUTS.items():
        if left() < 30 or layout not in outs:
            results["errors"].append(f"FLA {layout}: skipped (time budget)")
            continue
        try:
            h0 = torch.from_numpy(outs[layout]["h0"]).to(dev)
            kw = {}
            if len(cu_list) > 2:
                kw = dict(cu_seqlens=torch.tensor(cu_list, device=dev, dtype=torch.long),
                          cu_seqlens_cpu=torch.tensor(cu_list, dtype=torch.long))
            fn = functools.partial(fla_chunk, qt, kt, vt, gt, bt, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, **kw)
            with torch.inference_mode():
                t0 = time.perf_counter()
                o, ht = fn()
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                sec = time_torch(fn)
            row = dict(layout=layout, ms=sec * 1e3, mtok_s=T / sec / 1e6, first_call_s=warm)
            if "o" in outs[layout]:
                row["ours_vs_fla_rel_l2_o"] = rel_l2(outs[layout]["o"], o[0].float().cpu().numpy())
                row["ours_vs_fla_rel_l2_state"] = rel_l2(outs[layout]["ht"], ht.float().cpu().numpy())
            results["fla"].append(row)
            log(f"FLA {layout}: {sec * 1e3:.3f} ms {T / sec / 1e6:.2f} Mtok/s (first call {warm:.1f} s) {row}")
        except Exception as e:
            results["errors"].append(f"FLA {layout}: {type(e).__name__}: {str(e)[:400]}")
            log(traceback.format_exc())




def _decode_steps(pool, ins, idx, params, steps):
    q, k, v, g, beta = ins

    def body(i, carry):
        o, pool = carry
        o, pool = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=idx, use_qk_l2norm=True,
                                                   params=params, interpret=INTERPRET)
        return o, pool

    o0 = jnp.zeros(v.shape, v.dtype)
    return jax.lax.fori_loop(0, steps, body, (o0, pool))


def bench_decode(results, tuned):
    state_bytes = ROWS * HV * K * V * 4
    if INTERPRET:
        copy_sec = 1.0
    else:
        copy_sec = memcpy_seconds(state_bytes)
        big = 1 << 31
        big_sec = memcpy_seconds(big)
        results["memcpy"] += [dict(bytes=state_bytes, ms=copy_sec * 1e3, tb_s=2 * state_bytes / copy_sec / 1e12),
                              dict(bytes=big, ms=big_sec * 1e3, tb_s=2 * big / big_sec / 1e12)]
        log(f"memcpy {state_bytes / 2**20:.0f} MiB: {2 * state_bytes / copy_sec / 1e12:.2f} TB/s; "
            f"2 GiB: {2 * big / big_sec / 1e12:.2f} TB/s")
    key = jax.random.PRNGKey(3)
    ks = jax.random.split(key, 7)
    idx = jax.random.permutation(ks[0], SLOTS)[:ROWS].astype(jnp.int32)
    ins = (jax.random.normal(ks[1], (ROWS, H, K), jnp.bfloat16), jax.random.normal(ks[2], (ROWS, H, K), jnp.bfloat16),
           jax.random.normal(ks[3], (ROWS, HV, V), jnp.bfloat16),
           -jax.nn.softplus(jax.random.normal(ks[4], (ROWS, HV), jnp.float32)),
           jax.nn.sigmoid(jax.random.normal(ks[5], (ROWS, HV), jnp.float32)))
    steps = 16 if not INTERPRET else 2
    best = None
    for params in REC_SWEEP:
        if left() < 25:
            results["errors"].append(f"decode {params}: skipped (time budget)")
            continue
        try:
            fn = jax.jit(functools.partial(_decode_steps, ins=ins, idx=idx, params=params, steps=steps),
                         donate_argnums=0)
            pool = jax.random.normal(ks[6], (SLOTS, HV, K, V), jnp.float32) * 0.1
            o, pool = fn(pool)
            jax.block_until_ready(pool)
            sec = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(5):
                    o, pool = fn(pool)
                jax.block_until_ready(pool)
                sec = min(sec, (time.perf_counter() - t0) / (5 * steps))
            moved = 2 * state_bytes
            row = dict(rows=ROWS, params=dataclasses.asdict(params), us=sec * 1e6, tb_s=moved / sec / 1e12,
                       frac_of_memcpy=copy_sec / sec)
            results["decode"].append(row)
            log(f"decode {params}: {sec * 1e6:.1f} us/step {moved / sec / 1e12:.2f} TB/s = "
                f"{copy_sec / sec:.1%} of memcpy")
            if best is None or sec < best[1]:
                best = (params, sec)
            del pool
        except Exception as e:
            results["errors"].append(f"decode {params}: {type(e).__name__}: {str(e)[:500]}")
            log(traceback.format_exc())
    if best is not None and left() > 15:
        try:  # cross-check without the in-jit loop: one donated call per step (includes dispatch)
            fn = jax.jit(functools.partial(_decode_steps, ins=ins, idx=idx, params=best[0], steps=1),
                         donate_argnums=0)
            pool = jax.random.normal(ks[6], (SLOTS, HV, K, V), jnp.float32) * 0.1
            o, pool = fn(pool)
            jax.block_until_ready(pool)
            t0 = time.perf_counter()
            for _ in range(50):
                o, pool = fn(pool)
            jax.block_until_ready(pool)
            sec = (time.perf_counter() - t0) / 50
            results["decode_single_call_us"] = sec * 1e6
            log(f"decode one call per step {best[0]}: {sec * 1e6:.1f} us/step (with dispatch)")
            del pool
        except Exception as e:
            results["errors"].append(f"decode single-call: {type(e).__name__}: {str(e)[:300]}")
    if best is not None:
        tuned.setdefault("recurrent", {})[shape_key(H, HV, K, V, "bfloat16")] = dataclasses.asdict(best[0])


def bench_conv(results):
    if left() < MIN_LEFT / 2:
        results["errors"].append("conv: skipped (time budget)")
        return
    try:
        key = jax.random.PRNGKey(5)
        ks = jax.random.split(key, 4)
        x = jax.random.normal(ks[0], (T, CONV_C), jnp.bfloat16)
        w = jax.random.normal(ks[1], (CONV_C, CONV_W), jnp.bfloat16)
        for layout, cu_list in LAYOUTS.items():
            cu = jnp.asarray(cu_list, jnp.int32)
            s0 = jax.random.normal(ks[2], (len(cu_list) - 1, CONV_C, CONV_W - 1), jnp.float32)
            fn = jax.jit(lambda x, s0, cu=cu: causal_conv1d_varlen(x, w, None, cu_seqlens=cu, initial_state=s0,
                                                                   params=ConvParams(block_t=64, block_c=256),
                                                                   interpret=INTERPRET))
            sec = time_jax(fn, x, s0)
            moved = 2 * x.size * 2
            results["conv"].append(dict(kind="varlen", layout=layout, us=sec * 1e6, tb_s=moved / sec / 1e12))
            log(f"conv varlen {layout}: {sec * 1e6:.1f} us {moved / sec / 1e12:.2f} TB/s (x read + y written)")
        xs = x[:ROWS]
        st = jax.random.normal(ks[3], (ROWS, CONV_C, CONV_W - 1), jnp.float32)
        fn = jax.jit(lambda xs, st: causal_conv1d_update(xs, st, w, None, interpret=INTERPRET))
        sec = time_jax(fn, xs, st, iters=50)
        moved = 2 * xs.size * 2 + 2 * st.size * 4
        results["conv"].append(dict(kind="update", rows=ROWS, us=sec * 1e6, tb_s=moved / sec / 1e12))
        log(f"conv update {ROWS} rows: {sec * 1e6:.1f} us {moved / sec / 1e12:.2f} TB/s (incl. dispatch)")
    except Exception as e:
        results["errors"].append(f"conv: {type(e).__name__}: {str(e)[:400]}")
        log(traceback.format_exc())


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(results):
    v = results["versions"]
    fla = {r["layout"]: r for r in results["fla"]}
    lines = [
        f"# Gated DeltaNet kernels on {results['device']} ({results['date']})",
        "",
        f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, torch {v.get('torch')}, triton {v.get('triton')}, "
        f"fla {v.get('fla', '-')}. FLA autotune pruned: {bool(results.get('fla_autotune_pruned'))}.",
        "",
        f"## Chunked prefill (H={H}, HV={HV}, K=V={K}, bf16, q/k l2norm in kernel, T={T})",
        "",
        "| layout | ours ms | ours Mtok/s | WY kernel ms | FLA ms (this run) | FLA ms (DESIGN.md) | ours / FLA speed "
        "(this run) | (recorded) | rel L2 vs FLA o / state | params |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["chunk"]:
        f = fla.get(r["layout"], {})
        rec = FLA_RECORDED_MS.get(r["layout"])
        ratio = f"{f['ms'] / r['ms']:.2f}x" if f and r["ms"] else "-"
        ratio_rec = f"{rec / r['ms']:.2f}x" if rec and r["ms"] else "-"
        errs = f"{fmt(f.get('ours_vs_fla_rel_l2_o'), '.1e')} / {fmt(f.get('ours_vs_fla_rel_l2_state'), '.1e')}"
        lines.append(
            f"| {r['layout']} | {fmt(r['ms'], '.3f')} | {fmt(r['mtok_s'], '.2f')} | "
            f"{fmt(r.get('prepare_ms'), '.3f')} | "
            f"{fmt(f.get('ms'), '.3f')} | {rec} | {ratio} | {ratio_rec} | {errs} | {r['params']} |"
        )
    for lay, r in results.get("chunk_vs_naive_f32", {}).items():
        lines.append(f"\n{lay} vs the f32 naive reference: rel L2 o {r['rel_l2_o']:.1e}, state {r['rel_l2_state']:.1e}")
    if any(r.get("source") for r in results["fla"]):
        lines.append("\nFLA figures: " + ", ".join(f"{r['layout']} {r['ms']:.3f} ms ({r.get('source', 'this run')})"
                                               for r in results["fla"]))
    lines += ["", "Sweep (ms): " + ", ".join(f"{k}: {v:.3f}" for k, v in results.get("chunk_sweep_ms", {}).items()),
              "", f"## Decode step ({ROWS} rows, pool of {SLOTS} slots, in place; state f32[{HV},{K},{V}] per row)", "",
              "| params | us/step | TB/s (state read + write) | fraction of memcpy |", "|---|---|---|---|"]
    for r in results["decode"]:
        lines.append(f"| {r['params']} | {r['us']:.1f} | {r['tb_s']:.2f} | {r['frac_of_memcpy']:.1%} |")
    if results.get("decode_single_call_us") is not None:
        lines += ["", f"Best config, one jitted donated call per step: {results['decode_single_call_us']:.1f} us/step "
                  "(includes dispatch; the table runs 16 steps per call)."]
    lines += ["", "memcpy (torch copy_, read + write): "
              + ", ".join(f"{m['bytes'] / 2**20:.0f} MiB {m['tb_s']:.2f} TB/s" for m in results["memcpy"]),
              "", f"## Causal conv1d (C={CONV_C}, W={CONV_W}, bf16)", "", "| kind | us | TB/s |", "|---|---|---|"]
    for r in results["conv"]:
        lines.append(f"| {r['kind']} {r.get('layout', r.get('rows'))} | {r['us']:.1f} | {r['tb_s']:.2f} |")
    if results["errors"]:
        lines += ["", "## Errors / skipped", ""] + [f"- {e}" for e in results["errors"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--fla-prune-autotune", action="store_true")
    ap.add_argument("--skip-fla", action="store_true")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop starting new work after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, no torch: checks the script")
    ap.add_argument("--sections", default="chunk,decode,fla,conv")
    ap.add_argument("--chunk-configs", default=None,
                    help="comma list of block_v/num_warps_prepare/num_warps_main/num_stages, e.g. 32/4/4/2,16/4/4/2")
    ap.add_argument("--check-naive", action="store_true", help="also compare the prefill against the f32 naive")
    ap.add_argument("--min-left-s", type=float, default=40.0)
    ap.add_argument("--fla-ms", default=None, help="FLA figures from an earlier run, e.g. 1x8192=1.37,4x2048=1.338")
    args = ap.parse_args()
    global DEADLINE, MIN_LEFT, CHUNK_SWEEP
    MIN_LEFT = args.min_left_s
    if args.chunk_configs:
        CHUNK_SWEEP = [ChunkParams(*map(int, c.split("/"))) for c in args.chunk_configs.split(",")]
    DEADLINE = time.monotonic() + args.budget_s
    if args.smoke and args.out == "bench/results":  # a smoke run must not overwrite the GPU results
        args.out = tempfile.mkdtemp(prefix="smoke_")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        global H, HV, K, V, T, LAYOUTS, INTERPRET, REC_SWEEP, ROWS, SLOTS, CONV_C
        H, HV, K, V, T, INTERPRET, ROWS, SLOTS, CONV_C = 1, 2, 16, 32, 128, True, 3, 5, 32
        LAYOUTS = {"1x128": [0, 128], "4x32": [0, 32, 64, 96, 128]}
        CHUNK_SWEEP = [ChunkParams(block_v=32), ChunkParams(block_v=16)]
        REC_SWEEP = REC_SWEEP[:1]
        args.skip_fla = True
        torch = triton = type("NoTorch", (), {"__version__": "-"})
    else:
        import torch
        import triton
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    results = dict(
        device=jax.devices()[0].device_kind, date=date, argv=sys.argv[1:],
        versions=dict(jax=jax.__version__, jaxlib=getattr(jax.lib, "__version__", "?"), torch=torch.__version__,
                      triton=triton.__version__),
        chunk=[], fla=[], decode=[], conv=[], memcpy=[], errors=[],
    )
    tuned: dict = {}
    outs: dict = {}
    stem = out / f"gated_delta_{date}"

    def save():
        results["tuned"] = {k: v for k, v in tuned.items() if not k.startswith("_")}
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        stem.with_suffix(".md").write_text(markdown(results))

    if args.fla_ms:
        for item in args.fla_ms.split(","):
            lay, ms = item.split("=")
            results["fla"].append(dict(layout=lay, ms=float(ms), mtok_s=T / float(ms) / 1e3, source="earlier run"))
    sections = dict(chunk=lambda: bench_chunk(results, tuned, outs, args.check_naive),
                    decode=lambda: bench_decode(results, tuned),
                    fla=lambda: None if args.skip_fla else bench_fla(results, outs, args.fla_prune_autotune),
                    conv=lambda: bench_conv(results))
    for name in args.sections.split(","):
        section = sections[name]
        try:
            section()
        except Exception as e:
            results["errors"].append(f"{type(e).__name__}: {str(e)[:400]}")
            log(traceback.format_exc())
        save()
    log(markdown(results))


if __name__ == "__main__":
    main()
