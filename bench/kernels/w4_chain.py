"""A one-row decode layer's chain of 4-bit projections, with and without warming the next one's weights.

At one row each 4-bit projection of a Llama-3-8B layer costs ~5 us that its bytes do not explain
(H200, session 31: q|k|v 8.3 us for 12.9 MB, gate|up 21.0 for 60 MB): the kernel waits for its
first loads from HBM, step after step, with HBM mostly idle. `skinny_matmul_w4(..., warm=...)`
has each program load one byte of every 32-byte sector of its share of the *next* kernel's
weights (packed codes, scales, zeros) before its own stream, so that kernel starts on L2 hits.
This times L layers of q|k|v -> o -> gate|up -> down (Llama-3-8B shapes, int4 group 128, random
codes, the kernels' tuned params, the RMSNorms, SwiGLU and residual adds in XLA between them as in
a decode layer; attention left out: o reads q's columns), in one jitted function per variant:
* `none`: no warming (what the engine runs);
* `narrow`: q|k|v warms o, down warms the next layer's q|k|v;
* `narrow_down`: also gate|up warms down;
* `all_guN`: also o warms the first N MB of gate|up (60 MB: more than L2 keeps);
and with --per-projection each projection's kernel alone, L calls on L layers' weights (`_cold`,
from HBM), the same with each call warming the next one's (`_cold_warm`), and on one layer's
(`_hot`, from L2 after the first call): what warming could at best reach;
beside the same chain in bf16 (XLA's dots, the bf16 checkpoint's step) and a torch `copy_`
(the roofline: every variant's bytes over memcpy's bandwidth).

Run (GPU machine, repo root): PYTHONPATH=. python3 bench/kernels/w4_chain.py --out DIR [--layers 16]
    --cpu-smoke: two tiny layers in interpret mode (checks the variants agree, no timing).
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
from timing import median_seconds, memcpy_seconds  # noqa: E402

from pallas_kernels.linear import skinny_matmul_w4  # noqa: E402

LLAMA = dict(h=4096, qkv=6144, inter=14336)
GROUP = 128


def _layer_weights(key, h, qkv, inter, dtype):
    """One layer's four projections: int4 (packed u8[N, K/2], f16 scales, u8 zeros), or bf16 [K, N]."""
    shapes = {"qkv": (h, qkv), "o": (h, h), "gate_up": (h, 2 * inter), "down": (inter, h)}  # (K, N)
    out = {}
    for name, (k, n) in shapes.items():
        key, a, b = jax.random.split(key, 3)
        if dtype == "int4":
            packed = jax.random.bits(a, (n, k // 2), jnp.uint8)
            scales = jax.random.uniform(b, (n, k // GROUP), jnp.float32, 0.5, 1.5) * (3.0 / k**0.5)
            scales = scales.astype(jnp.float16)
            out[name] = (packed, scales, jnp.full((n, k // GROUP), 8, jnp.uint8))
        else:
            out[name] = (jax.random.normal(a, (k, n), jnp.bfloat16) * (1.0 / k**0.5)).astype(jnp.bfloat16)
    return out


def _rms(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def chain(x, layers, *, links: dict, gu_mb: int | None, interpret: bool):
    """x bf16[1, H] through every layer; links: which projection warms which (names of the layer's order)."""
    h = x.shape[-1]
    order = ("qkv", "o", "gate_up", "down")

    def w4(v, w, k, warm=(), cap=None):
        return skinny_matmul_w4(v, *w, k=k, group_size=GROUP, kind="int4", interpret=interpret, warm=warm,
                                warm_max_bytes=cap)

    for i, lw in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None

        def warm(name, lw=lw, nxt=nxt):  # the arrays (and byte cap) this layer's `name` warms
            j = order.index(name)
            target = order[(j + 1) % 4]
            if not links.get(name):
                return (), None
            w = lw[target] if j < 3 else (nxt[target] if nxt is not None else ())
            return tuple(w), (gu_mb << 20 if target == "gate_up" and gu_mb is not None else None)

        qkv = w4(_rms(x), lw["qkv"], h, *warm("qkv"))
        x = x + w4(qkv[:, :h], lw["o"], h, *warm("o"))
        gu = w4(_rms(x), lw["gate_up"], h, *warm("gate_up"))
        g, u = jnp.split(gu, 2, axis=-1)
        act = (jax.nn.silu(g.astype(jnp.float32)).astype(g.dtype) * u)
        x = x + w4(act, lw["down"], act.shape[-1], *warm("down"))
    return x


def projection_calls(x, weights, *, k: int, interpret: bool, warm_next: bool = False):
    """One projection's kernel called once per entry of `weights` (each call's x takes a negligible
    term of the last output, so the calls stay in order and none is dead); warm_next: each call
    warms the next call's weights."""
    y = None
    for i, w in enumerate(weights):
        xi = x if y is None else x + (y[:, :1] * 1e-30).astype(x.dtype)
        nxt = tuple(weights[i + 1]) if warm_next and i + 1 < len(weights) else ()
        y = skinny_matmul_w4(xi, *w, k=k, group_size=GROUP, kind="int4", interpret=interpret, warm=nxt)
    return y


def chain_bf16(x, layers):
    h = x.shape[-1]
    for lw in layers:
        qkv = _rms(x) @ lw["qkv"]
        x = x + qkv[:, :h] @ lw["o"]
        g, u = jnp.split(_rms(x) @ lw["gate_up"], 2, axis=-1)
        x = x + (jax.nn.silu(g.astype(jnp.float32)).astype(g.dtype) * u) @ lw["down"]
    return x


VARIANTS = {  # name: (links, gate|up MB warmed by o)
    "none": ({}, None),
    "narrow": ({"qkv": True, "down": True}, None),
    "narrow_down": ({"qkv": True, "down": True, "gate_up": True}, None),
    "all_gu16": ({"qkv": True, "down": True, "gate_up": True, "o": True}, 16),
    "all_gu32": ({"qkv": True, "down": True, "gate_up": True, "o": True}, 32),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--per-projection", action="store_true",
                    help="also each projection alone, on L layers' weights (cold) and on one layer's (hot, in L2)")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    dims = dict(h=256, qkv=384, inter=512) if a.cpu_smoke else LLAMA
    layers_n = 2 if a.cpu_smoke else a.layers
    keys = jax.random.split(jax.random.key(0), layers_n + 1)
    x = jax.random.normal(keys[-1], (1, dims["h"]), jnp.bfloat16)
    w4_layers = [_layer_weights(kk, dims["h"], dims["qkv"], dims["inter"], "int4") for kk in keys[:-1]]
    bytes_per_layer = sum(sum(t.nbytes for t in w) for w in w4_layers[0].values())
    rows, outs = [], {}
    for name in a.variants.split(","):
        links, gu_mb = VARIANTS[name]
        fn = jax.jit(functools.partial(chain, links=links, gu_mb=gu_mb, interpret=a.cpu_smoke))
        outs[name] = np.asarray(fn(x, w4_layers), np.float32)
        if a.cpu_smoke:
            continue
        s = median_seconds(fn, x, w4_layers, group=10, groups=9)
        rows.append(dict(variant=name, us_per_layer=s / layers_n * 1e6, weight_bytes_per_layer=bytes_per_layer,
                         tb_s=bytes_per_layer * layers_n / s / 1e12))
        print(f"{name:12s} {rows[-1]['us_per_layer']:7.2f} us a layer  {rows[-1]['tb_s']:.2f} TB/s", flush=True)
    ref = outs["none"] if "none" in outs else next(iter(outs.values()))
    for name, o in outs.items():
        if not np.array_equal(o, ref):
            raise SystemExit(f"{name} differs from the first variant: warming changed the result")
    if a.per_projection:  # each projection alone: cold (a new layer's weights each call) and hot (layer 0's, in L2)
        for name, k in (("qkv", dims["h"]), ("o", dims["h"]), ("gate_up", dims["h"]), ("down", dims["inter"])):
            xk = jax.random.normal(keys[-1], (1, k), jnp.bfloat16)
            cold = [lw[name] for lw in w4_layers]
            for temp, ws, wn in (("cold", cold, False), ("cold_warm", cold, True),
                                 ("hot", [w4_layers[0][name]] * layers_n, False)):
                fn = jax.jit(functools.partial(projection_calls, k=k, interpret=a.cpu_smoke, warm_next=wn))
                if a.cpu_smoke:
                    fn(xk, ws)
                    continue
                s = median_seconds(fn, xk, ws, group=10, groups=9)
                nb = sum(t.nbytes for t in w4_layers[0][name])
                rows.append(dict(variant=f"{name}_{temp}", us_per_layer=s / layers_n * 1e6, weight_bytes_per_layer=nb,
                                 tb_s=nb * layers_n / s / 1e12))
                print(f"{name}_{temp:9s} {rows[-1]['us_per_layer']:7.2f} us a call  {rows[-1]['tb_s']:.2f} TB/s",
                      flush=True)
    del w4_layers
    if a.cpu_smoke:
        print("cpu smoke: variants agree")
        return
    if not a.no_bf16:
        bl = [_layer_weights(kk, dims["h"], dims["qkv"], dims["inter"], "bf16") for kk in keys[:-1]]
        fn = jax.jit(chain_bf16)
        s = median_seconds(fn, x, bl, group=10, groups=9)
        bb = sum(w.nbytes for w in bl[0].values())
        rows.append(dict(variant="bf16_xla", us_per_layer=s / layers_n * 1e6, weight_bytes_per_layer=bb,
                         tb_s=bb * layers_n / s / 1e12))
        print(f"bf16_xla     {rows[-1]['us_per_layer']:7.2f} us a layer  {rows[-1]['tb_s']:.2f} TB/s", flush=True)
        del bl
    mem = 2 * 2**31 / memcpy_seconds(2**31) / 1e12
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, jax=jax.__version__, python=platform.python_version(),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), layers=layers_n,
                memcpy_tb_s=mem)
    (a.out / "w4_chain.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# 4-bit projection chain, {layers_n} Llama-3-8B layers at one row ({meta['device']}, jax {meta['jax']}, "
             f"{meta['date']}); memcpy {mem:.2f} TB/s", "",
             "| variant | us a layer (a call for one projection) | TB/s | of memcpy |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['us_per_layer']:.2f} | {r['tb_s']:.2f} | {r['tb_s'] / mem:.2f} |" for r in rows]
    (a.out / "w4_chain.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
