"""A one-row decode layer's chain of 4-bit projections, and each projection alone, cold and hot.

At one row each 4-bit projection of a Llama-3-8B layer costs ~5 us that its bytes do not explain
(H200, session 31: q|k|v 8.3 us for 12.9 MB, gate|up 21.0 for 60 MB). This times L layers of
q|k|v -> o -> gate|up -> down (Llama-3-8B shapes, int4 group 128 or with --kind fp4 NVFP4, random
codes, the kernels' tuned params, the RMSNorms, SwiGLU and residual adds in XLA between them as in a
decode layer; attention left out: o reads q's columns) beside the same chain in bf16 (XLA's dots)
and a torch `copy_` (the roofline); with --per-projection each projection's kernel alone, L calls on L layers' weights
(`_cold`, from HBM) and on one layer's (`_hot`: from L2 after the first call, all but gate|up fit).
Where hot is no faster than cold, the kernel's time is spent on the SMs, not waiting for HBM.

Session 46 (H100) also timed a `warm=` input of the kernel (each program loaded one byte of each
32-byte sector of the next projection's weights before its own stream, so the next launch would
start on L2 hits): the chain got slower (69.2 us a layer without, 70.7-87.3 with), and hot was at
most 1.2x faster than cold (`bench/results/w4_chain_h100_2026-12-06_s46_call*`); it was removed.

--ncu: each projection's kernel twice on one layer's weights and nothing else (run under Nsight
Compute, `bench/gpu_session.sh ncu4`); with --sweep FIELDS, twice for the table's pick and for each
one-row half2 entry of bench/kernels/w4.py's SWEEP with FIELDS changed from their defaults (as its
--only), the launch order written to DIR/ncu_order.json. --ncu-table CSV... then joins the durations
Nsight Compute measured (`--page raw --csv`, gpu__time_duration.sum: each launch from cold caches,
~1% apart between repeats in session 46 where the CUDA-event sweep of bench/kernels/w4.py spread
10-60%) with that order: DIR/ncu_sweep.md, .json and tuned_w4.json (each projection's fastest,
where it beats the table's pick by 3%: for `gpu_session.sh`'s merge_w4_table).

Run (GPU machine, repo root): PYTHONPATH=. python3 bench/kernels/w4_chain.py --out DIR [--layers 16]
    --cpu-smoke: two tiny layers in interpret mode (no timing).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import median_seconds, memcpy_seconds  # noqa: E402
from w4 import KINDS as GROUPS  # noqa: E402  (kind: group size)
from w4 import sweep_with  # noqa: E402

from pallas_kernels.linear import W4Params, skinny_matmul_w4  # noqa: E402
from pallas_kernels.linear.w4 import w4_params_for, w4_tuned_key  # noqa: E402

LLAMA = dict(h=4096, qkv=6144, inter=14336)


def projection_shapes(h, qkv, inter) -> dict[str, tuple[int, int]]:
    """A decode layer's four projections: name -> (K, N)."""
    return {"qkv": (h, qkv), "o": (h, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def _layer_weights(key, h, qkv, inter, dtype):
    """One layer's four projections: int4 (packed u8[N, K/2], f16 scales, u8 zeros), fp4 (packed
    u8[N, K/2], e4m3 scales, f32 row scales), or bf16 [K, N]."""
    out = {}
    for name, (k, n) in projection_shapes(h, qkv, inter).items():
        key, a, b = jax.random.split(key, 3)
        if dtype == "int4":
            packed = jax.random.bits(a, (n, k // 2), jnp.uint8)
            scales = jax.random.uniform(b, (n, k // GROUPS[dtype]), jnp.float32, 0.5, 1.5) * (3.0 / k**0.5)
            out[name] = (packed, scales.astype(jnp.float16), jnp.full((n, k // GROUPS[dtype]), 8, jnp.uint8))
        elif dtype == "fp4":
            packed = jax.random.bits(a, (n, k // 2), jnp.uint8)
            scales = jax.random.uniform(b, (n, k // GROUPS[dtype]), jnp.float32, 0.5, 4).astype(jnp.float8_e4m3fn)
            out[name] = (packed, scales, jnp.full((n,), 0.3 / k**0.5, jnp.float32))
        else:
            out[name] = (jax.random.normal(a, (k, n), jnp.bfloat16) * (1.0 / k**0.5)).astype(jnp.bfloat16)
    return out


def _rms(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def _kind(w) -> str:
    """A projection's 4-bit kind, from its third array: int4's zeros are u8, NVFP4's row scales f32."""
    return "fp4" if w[2].dtype == jnp.float32 else "int4"


def _w4(x, w, k: int, interpret: bool, params: W4Params | None = None):
    kind = _kind(w)
    return skinny_matmul_w4(x, *w, k=k, group_size=GROUPS[kind], kind=kind, interpret=interpret, params=params)


def chain(x, layers, *, interpret: bool):
    """x bf16[1, H] through every layer's four 4-bit projections (a decode layer without attention)."""
    h = x.shape[-1]
    for lw in layers:
        qkv = _w4(_rms(x), lw["qkv"], h, interpret)
        x = x + _w4(qkv[:, :h], lw["o"], h, interpret)
        g, u = jnp.split(_w4(_rms(x), lw["gate_up"], h, interpret), 2, axis=-1)
        act = jax.nn.silu(g.astype(jnp.float32)).astype(g.dtype) * u
        x = x + _w4(act, lw["down"], act.shape[-1], interpret)
    return x


def projection_calls(x, weights, *, k: int, interpret: bool):
    """One projection's kernel called once per entry of `weights` (each call's x takes a negligible
    term of the last output, so the calls stay in order and none is dead)."""
    y = None
    for w in weights:
        y = _w4(x if y is None else x + (y[:, :1] * 1e-30).astype(x.dtype), w, k, interpret)
    return y


def chain_bf16(x, layers):
    h = x.shape[-1]
    for lw in layers:
        qkv = _rms(x) @ lw["qkv"]
        x = x + qkv[:, :h] @ lw["o"]
        g, u = jnp.split(_rms(x) @ lw["gate_up"], 2, axis=-1)
        x = x + (jax.nn.silu(g.astype(jnp.float32)).astype(g.dtype) * u) @ lw["down"]
    return x


def _sweep_variants(fields: str, k: int, kind: str) -> list[W4Params]:
    """bench/kernels/w4.py's one-row half2 SWEEP entries with `fields` changed from their defaults that take K."""
    from pallas_kernels.linear.w4 import _params_fit

    fit = [p for p in sweep_with(fields) if p.half2 and p.gemv and _params_fit(p, 1, k, GROUPS[kind]) is None]
    return list(dict.fromkeys(fit))  # (W4Params are hashable: duplicates dropped, order kept)


def _ncu_launches(a, w4_layers, keys, projections):
    """Each projection's kernel twice per variant (the table's pick first); the order to DIR/ncu_order.json,
    written before the launches (a crash part-way leaves fewer durations than entries: `ncu_table` keeps
    the launches that ran)."""
    import concurrent.futures

    order = []
    for name, k in projections:
        if a.projection and name not in a.projection.split(","):
            continue
        n = w4_layers[0][name][0].shape[0]
        table = w4_params_for(a.kind, 1, n, k, GROUPS[a.kind])
        variants = [table] + ([p for p in _sweep_variants(a.sweep, k, a.kind) if p != table] if a.sweep else [])
        if a.params:
            variants = [W4Params(**json.loads(a.params))]
        if a.cpu_smoke:  # (interpret-mode compiles are slow: the plumbing only)
            variants = variants[:3]
        order += [dict(projection=name, kind=a.kind, n=n, k=k, table=p == table, params=dataclasses.asdict(p))
                  for p in variants for _ in range(2)]
        (a.out / "ncu_order.json").write_text(json.dumps(order, indent=1))
        xk = jax.random.normal(keys[-1], (1, k), jnp.bfloat16)
        w = w4_layers[0][name]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # (XLA and Triton compile outside the GIL)
            fns = list(pool.map(lambda p, k=k, w=w, xk=xk: jax.jit(functools.partial(
                _w4, k=k, interpret=a.cpu_smoke, params=p)).lower(xk, w).compile(), variants))
        for fn in fns:
            for _ in range(2):
                jax.block_until_ready(fn(xk, w))
    print(f"ncu: {len(order)} launches")


def _ncu_durations(csv_path: pathlib.Path) -> list[dict]:
    """Nsight Compute's raw CSV (`--page raw --csv`, gpu__time_duration.sum, and where collected
    sm__cycles_active.avg and sm__cycles_elapsed.avg) -> each launch's {us, sm_active: the SMs' mean
    busy fraction of the kernel's cycles (below 1: SMs idle at the start, in the tail, or without a
    program), or None}, in order."""
    import csv

    lines = list(csv.reader(csv_path.read_text().splitlines()))
    head = next(i for i, r in enumerate(lines) if "gpu__time_duration.sum" in r)
    col = lines[head].index("gpu__time_duration.sum")
    # (the launches were already filtered by name, `ncu -k`; a name column, where there is one, is checked)
    name_col = next((i for i, h in enumerate(lines[head]) if h in ("Kernel Name", "Function Name")), None)
    body = lines[head + 1:]
    unit = body[0][col] if body and not body[0][0] else "nsecond"  # (a units row has no launch ID)
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
    num = lambda r, c: float(r[c].replace(",", ""))  # noqa: E731
    active, elapsed = (lines[head].index(m) if m in lines[head] else None
                       for m in ("sm__cycles_active.avg", "sm__cycles_elapsed.avg"))
    return [dict(us=num(r, col) * scale, sm_active=num(r, active) / num(r, elapsed) if active and elapsed else None)
            for r in body if r and r[0] and (name_col is None or "skinny_matmul_w4" in r[name_col])]


def ncu_table(csv_paths: list[pathlib.Path], out: pathlib.Path) -> list[dict]:
    """Nsight Compute's durations (each CSV with the `_ncu_launches` order beside it, ncu_order.json) ->
    rows (projection, params, us: the faster of the two launches), DIR/ncu_sweep.md and .json, and
    DIR/tuned_w4.json (each projection's fastest where 3% faster than the table's pick) and
    tuned_w4_nosplit.json (the same among split_k = 1: the durations leave out split-K's XLA sum)."""
    order, us = [], []
    for csv_path in csv_paths:
        o = json.loads((csv_path.parent / "ncu_order.json").read_text())
        t = _ncu_durations(csv_path)
        if len(t) > len(o):
            raise SystemExit(f"{len(t)} durations for {len(o)} launches in {csv_path.parent}")
        if len(t) < len(o):  # (the process died part-way: the launches before it still count)
            print(f"{csv_path}: {len(t)} durations for {len(o)} launches; the first {len(t)} kept")
        order += o[:len(t)]
        us += t
    best: dict = {}
    for o, t in zip(order, us):
        key = (o["projection"], json.dumps(o["params"], sort_keys=True))
        prev = best.get(key)
        if prev is None or t["us"] < prev["us"]:
            best[key] = dict(o, **t)
    rows = sorted(best.values(), key=lambda r: (r["projection"], r["us"]))
    tuned, nosplit = {}, {}
    lines_md = ["| projection | us | packed TB/s | of the table's | SM active | params (changed from W4Params()) |",
                "|---|---|---|---|---|---|"]
    default = dataclasses.asdict(W4Params())
    for proj in dict.fromkeys(r["projection"] for r in rows):
        mine = [r for r in rows if r["projection"] == proj]
        table = next((r for r in mine if r["table"]), None)
        if table is None:  # (its launches never ran)
            continue
        for picks, pool in ((tuned, mine), (nosplit, [r for r in mine if r["params"]["split_k"] == 1])):
            if pool and pool[0]["us"] < 0.97 * table["us"]:
                picks[w4_tuned_key(pool[0].get("kind", "int4"), 1, pool[0]["n"], pool[0]["k"])] = pool[0]["params"]
        for r in mine:
            changed = {f: v for f, v in r["params"].items() if v != default[f]}
            lines_md.append(f"| {proj}{' (table)' if r['table'] else ''} | {r['us']:.2f} | "
                            f"{r['n'] * r['k'] / 2 / r['us'] / 1e6:.2f} | {r['us'] / table['us']:.3f} | "
                            f"{'-' if r['sm_active'] is None else format(r['sm_active'], '.2f')} | {changed} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ncu_sweep.json").write_text(json.dumps(rows, indent=1))
    (out / "ncu_sweep.md").write_text("\n".join(lines_md) + "\n\n(split_k > 1: the XLA sum of the partials is not "
                                      "counted)\n")
    (out / "tuned_w4.json").write_text(json.dumps(tuned, indent=1))
    (out / "tuned_w4_nosplit.json").write_text(json.dumps(nosplit, indent=1))
    print("\n".join(lines_md))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--per-projection", action="store_true",
                    help="also each projection alone, on L layers' weights (cold) and on one layer's (hot, in L2)")
    ap.add_argument("--ncu", action="store_true", help="only each projection's kernel twice (for Nsight Compute)")
    ap.add_argument("--params", default="", help="W4Params fields as JSON for every projection (default: the table's)")
    ap.add_argument("--sweep", default="", help="with --ncu: also the SWEEP entries with these fields changed")
    ap.add_argument("--kind", choices=tuple(GROUPS), default="int4", help="the 4-bit format (fp4: NVFP4)")
    ap.add_argument("--projection", default="", help="with --ncu: only these projections (qkv,o,gate_up,down)")
    ap.add_argument("--ncu-table", type=pathlib.Path, nargs="+",
                    help="Nsight Compute's raw CSVs, each beside its ncu_order.json: tabulate, nothing else")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.ncu_table:
        ncu_table(a.ncu_table, a.out)
        return
    dims = dict(h=256, qkv=384, inter=512) if a.cpu_smoke else LLAMA
    layers_n = 1 if a.ncu else 2 if a.cpu_smoke else a.layers
    keys = jax.random.split(jax.random.key(0), layers_n + 1)
    w4_layers = [_layer_weights(kk, dims["h"], dims["qkv"], dims["inter"], a.kind) for kk in keys[:-1]]
    projections = tuple((name, k) for name, (k, _) in projection_shapes(**dims).items())
    if a.ncu:
        _ncu_launches(a, w4_layers, keys, projections)
        return
    x = jax.random.normal(keys[-1], (1, dims["h"]), jnp.bfloat16)
    fn = jax.jit(functools.partial(chain, interpret=a.cpu_smoke))
    y = fn(x, w4_layers)
    if not bool(jnp.all(jnp.isfinite(y.astype(jnp.float32)))):
        raise SystemExit(f"the {a.kind} chain's output is not finite")
    rows = []

    def row(variant, seconds, nbytes, calls, what="a layer"):
        rows.append(dict(variant=variant, us=seconds / calls * 1e6, weight_bytes=nbytes,
                         tb_s=nbytes * calls / seconds / 1e12))
        print(f"{variant:16s} {rows[-1]['us']:7.2f} us {what}  {rows[-1]['tb_s']:.2f} TB/s", flush=True)

    if not a.cpu_smoke:
        row(f"{a.kind}_chain", median_seconds(fn, x, w4_layers, group=10, groups=9),
            sum(sum(t.nbytes for t in w) for w in w4_layers[0].values()), layers_n)
    if a.per_projection:  # each projection alone: cold (a new layer's weights each call) and hot (layer 0's, in L2)
        for name, k in projections:
            xk = jax.random.normal(keys[-1], (1, k), jnp.bfloat16)
            fn = jax.jit(functools.partial(projection_calls, k=k, interpret=a.cpu_smoke))
            for temp, ws in (("cold", [lw[name] for lw in w4_layers]), ("hot", [w4_layers[0][name]] * layers_n)):
                if a.cpu_smoke:
                    fn(xk, ws)
                    continue
                row(f"{name}_{temp}", median_seconds(fn, xk, ws, group=10, groups=9),
                    sum(t.nbytes for t in w4_layers[0][name]), layers_n, "a call")
    del w4_layers
    if a.cpu_smoke:
        print("cpu smoke: ran")
        return
    if not a.no_bf16:
        bl = [_layer_weights(kk, dims["h"], dims["qkv"], dims["inter"], "bf16") for kk in keys[:-1]]
        row("bf16_xla_chain", median_seconds(jax.jit(chain_bf16), x, bl, group=10, groups=9),
            sum(w.nbytes for w in bl[0].values()), layers_n)
        del bl
    mem = 2 * 2**31 / memcpy_seconds(2**31) / 1e12
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, jax=jax.__version__, python=platform.python_version(),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), layers=layers_n,
                memcpy_tb_s=mem)
    (a.out / "w4_chain.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# 4-bit projections at one row, {layers_n} Llama-3-8B layers ({meta['device']}, jax {meta['jax']}, "
             f"{meta['date']}); memcpy {mem:.2f} TB/s", "",
             "| variant | us a layer (a call for one projection) | TB/s | of memcpy |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['us']:.2f} | {r['tb_s']:.2f} | {r['tb_s'] / mem:.2f} |" for r in rows]
    (a.out / "w4_chain.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
