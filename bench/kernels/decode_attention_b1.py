"""Decode attention at batch 1 as a decode step runs it: 32 layers in one executable.

At one row the paged decode kernel reads a few hundred keys and takes ~5.4 us a layer on an H100
(session 49's int4 profile: 172 us of a 2.64 ms step), plus the XLA combine of its splits: latency,
not bandwidth. This times a chain of `--layers` calls (layer i of a stacked pool, each query
being the output before, as the layers of a step follow one another) for the params the table or
heuristic picks and for a sweep of `DecodeParams` (block_k, splits, warps, stages; or `--only` a
list; each with more than one split also with its splits merged in the kernel, `tickets`),
beside the same chain through the XLA gather reference (`paged_decode_attention_reference`,
the peer) and an empty chain (`tie_only`: the executable alone). Llama-3-8B heads (32 / 8, D 128),
pages of 16, bf16; contexts and max_ctx (the engine's max_model_len) as given. All variants are
compiled first, then timed round-robin `--rounds` times (the fastest round kept): timed one after
another, the same kernel read 5.4 and 12.4 us a layer in two cases (H100, session 51).
Session 51 (H100): at ctx 128 one split takes 3.8-4.4 us a layer, every split variant 5.4-6.9 (the
combine); at ctx 2048 one split 34 us against 11.3 for 16 splits.

    PYTHONPATH=. python3 bench/kernels/decode_attention_b1.py --out DIR [--ctx 128,2048] [--max-ctx 512,4096]
    --cpu-smoke: two layers, tiny sweep, interpret mode (checks the script, no timing)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import median_seconds  # noqa: E402

from pallas_kernels.paged_attention import (  # noqa: E402
    DecodeParams,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pallas_kernels.paged_attention.params import decode_params_for  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def sweep(max_ctx: int, only: list[DecodeParams]) -> list[DecodeParams]:
    if only:
        return [p for p in only if p.num_splits * p.block_k <= max_ctx]
    out = []
    for bk, ns, nw, st in itertools.product((32, 64, 128), (1, 2, 4, 16), (1, 2, 4), (1, 3)):
        if ns * bk <= max_ctx:
            out.append(DecodeParams(block_k=bk, num_splits=ns, num_warps=nw, num_stages=st))
    return out


def make(layers: int, ctx: int, max_ctx: int, seed: int = 0):
    """q bf16[1, HQ, D], pools [layers, NB, BS, HKV, D] (pages permuted), tables i32[1, max_ctx / BS], lens i32[1]."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    mb = max_ctx // BS
    nb = mb + 5
    shape = (layers, nb, BS, HKV, D)
    kp = jax.random.normal(k1, shape, jnp.bfloat16)
    vp = jax.random.normal(k2, shape, jnp.bfloat16)
    tables = jax.random.permutation(k3, nb)[:mb].reshape(1, mb).astype(jnp.int32)
    q = jax.random.normal(k4, (1, HQ, D), jnp.bfloat16)
    return q, kp, vp, tables, jnp.array([ctx], jnp.int32)


def chain_fn(attend, layers: int, merged: bool = False):
    """q -> the output of `layers` calls, each on layer i with the output before as its query (merged:
    `attend` takes and returns the split merge's tickets too, threaded from call to call)."""

    def run(q, kp, vp, tables, lens):
        tickets = jnp.zeros((HKV, 1), jnp.int32)
        for i in range(layers):
            if merged:
                q, tickets = attend(q, kp, vp, jnp.int32(i), tables, lens, tickets)
            else:
                q = attend(q, kp, vp, jnp.int32(i), tables, lens)
            q = q.astype(jnp.bfloat16)  # (the next layer's query)
        return q

    return jax.jit(run)


def prepare(case: dict, args: tuple, label: str, attend, params=None, ref_out=None, merged=False):
    """Compile the chain of case["layers"] calls of `attend` and check layer 0 against ref_out: a row, the
    chain (None where it failed) and layer 0's output f32."""
    row = dict(case, impl=label, params=None if params is None else params.__dict__)
    try:
        out = chain_fn(attend, 1, merged)(*args).astype(jnp.float32)  # (layer 0 alone: the check)
        row["max_rel_err"] = None if ref_out is None else float(
            jnp.max(jnp.abs(out - ref_out)) / jnp.max(jnp.abs(ref_out)))
        fn = chain_fn(attend, case["layers"], merged)
        jax.block_until_ready(fn(*args))
        return row, fn, out
    except Exception as e:  # one failing variant must not end the run
        row["error"] = repr(e)[:500]
        print(f"{case} {label} {params}: FAILED {repr(e)[:200]}", flush=True)
        return row, None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ctx", default="128,2048")
    ap.add_argument("--max-ctx", default="512,4096")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="variants 'block_k,splits,warps,stages;...' instead of the sweep")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    only = [DecodeParams(*map(int, v.split(","))) for v in a.only.split(";") if v]
    interpret = a.cpu_smoke
    layers = 2 if a.cpu_smoke else a.layers
    deadline = time.time() + a.budget_s
    env = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), jax=jax.__version__,
               device=str(jax.devices()[0].device_kind), python=platform.python_version())
    print(env, flush=True)
    sm = 1.0 / math.sqrt(D)
    rows = []
    for max_ctx in (int(v) for v in a.max_ctx.split(",")):
        for ctx in (int(v) for v in a.ctx.split(",")):
            if ctx > max_ctx:
                continue
            args = make(layers, ctx, max_ctx)
            case = dict(ctx=ctx, max_ctx=max_ctx, layers=layers)

            ref = prepare(case, args, "xla_ref", lambda q, kp, vp, i, t, n: paged_decode_attention_reference(
                q, kp, vp, i, t, n, sm_scale=sm))
            entries = [ref, prepare(case, args, "tie_only", lambda q, kp, vp, i, t, n: q)]
            default = decode_params_for(1, HQ, HKV, D, BS, jnp.bfloat16, max_ctx)
            variants = [("default", default)] + [("sweep", p) for p in sweep(max_ctx, only) if p != default]
            if a.cpu_smoke:
                variants = variants[:3]
            for label, p in variants:
                if time.time() > deadline:
                    print("(budget: sweep cut short)", flush=True)
                    break
                entries.append(prepare(case, args, label, lambda q, kp, vp, i, t, n, p=p: paged_decode_attention(
                    q, kp, vp, i, t, n, sm_scale=sm, params=p, interpret=interpret), p, ref[2]))
                if p.num_splits > 1:  # the same params, the splits merged in the kernel
                    entries.append(prepare(case, args, f"{label}_merged", lambda q, kp, vp, i, t, n, tk, p=p: (
                        paged_decode_attention(q, kp, vp, i, t, n, sm_scale=sm, params=p, tickets=tk,
                                               interpret=interpret)), p, ref[2], merged=True))
            # timed round-robin, `rounds` times, the fastest round's median kept (the GPU's clocks and
            # the host drift between variants timed one after another: session 51's first sweep read the
            # same kernel 5.4 and 12.4 us a layer in two cases)
            times = [[] for _ in entries]
            for _ in range(0 if a.cpu_smoke else a.rounds):
                for e, ts in zip(entries, times):
                    if e[1] is not None:
                        ts.append(median_seconds(e[1], *args, group=20) / layers * 1e6)
            for (row, _, _), ts in zip(entries, times):
                if ts:
                    row.update(us_per_layer=min(ts), us_rounds=ts)
                rows.append(row)
                print(f"ctx {ctx:5d} max_ctx {max_ctx:5d} {row['impl']:10s} {row['params']}: "
                      f"{row.get('us_per_layer', '-')} us a layer, err {row.get('max_rel_err')}", flush=True)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_b1.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [f"# decode attention, batch 1, {layers}-layer chain, {env['device']}, {env['date']}", "",
             "| ctx | max_ctx | default (us/layer) | default merged in the kernel | best (us/layer) | best params | "
             "xla ref | tie only |", "|---|---|---|---|---|---|---|---|"]
    for key, grp in itertools.groupby(rows, key=lambda r: (r["ctx"], r["max_ctx"])):
        grp = [r for r in grp if r.get("us_per_layer") is not None]
        by = {r["impl"]: r for r in grp}
        ours = [r for r in grp if r["impl"] not in ("xla_ref", "tie_only") and (r["max_rel_err"] or 0) < 3e-2]
        if not ours or "default" not in by:
            continue
        best = min(ours, key=lambda r: r["us_per_layer"])
        nan = {"us_per_layer": float("nan")}
        lines.append(f"| {key[0]} | {key[1]} | {by['default']['us_per_layer']:.2f} | "
                     f"{by.get('default_merged', nan)['us_per_layer']:.2f} | {best['us_per_layer']:.2f} | "
                     f"{best['impl']} {best['params']} | {by.get('xla_ref', nan)['us_per_layer']:.2f} | "
                     f"{by.get('tie_only', nan)['us_per_layer']:.2f} |")
    (out / "decode_attention_b1.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
