"""Quantized MoE experts at decode (GPU machine): one MoE layer's routed experts, FP8 and 4-bit
against bf16.

Shapes: Qwen3-30B-A3B (128 experts, top-8, H 2048, I 768) and Qwen3-Next-80B-A3B (512 experts,
top-10, H 2048, I 512), T = 1, 8, 64 tokens. Per case it times `metrale_jax.layers.moe.routed_experts`
(gate|up, SiLU, down, weighted sum) with
* bf16 experts (XLA's ragged_dot, or tokamax's when it imports: `--tokamax`);
* FP8 experts kept FP8 (`layers/moe_fp8.py`): the Pallas expert kernel (`use_kernel`) and the
  XLA gather-and-dequantize path; at T * k >= E both run dequantize + the grouped GEMM;
* with `--w4`, int4 (group 128, zero points) and NVFP4 experts kept 4-bit (`layers/moe_w4.py`):
  the Pallas expert kernel (`pallas_kernels/linear/expert_w4.py`) and the XLA gather path;
and reports the routed experts' bytes in each format / time (the bytes a decode step must read)
beside a torch `copy_` memcpy measured in the same run (the roofline: read + write over its time).
Layers rotate through distinct weight copies of >= 256 MB so HBM, not L2, is timed.

    PYTHONPATH=. python3 bench/kernels/expert_fp8.py --out DIR [--w4]   # DIR/expert_fp8.json
    PYTHONPATH=. python3 bench/kernels/expert_fp8.py --out DIR --cpu-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels.timing import median_seconds
from metrale_jax.layers.linear import Fp8Linear
from metrale_jax.layers.moe import routed_experts

CASES = {"qwen3_30b_a3b": (128, 8, 2048, 768), "qwen3_next_80b": (512, 10, 2048, 512)}  # E, k, H, I
TOKENS = (1, 8, 64)
MIN_ROTATION_BYTES = 256e6


def _fp8_experts(key, e, n, k, segments):
    w8 = jax.random.randint(key, (e, n, k), -100, 100, jnp.int32).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(jax.random.fold_in(key, 1), (e, n // 128, -(-k // 128)), jnp.float32, 1e-4, 1e-3)
    return Fp8Linear(w8, s, segments)


def _w4_experts(key, e, n, k, kind, group):
    """Random 4-bit experts [E, N, K/2] in `W4Linear`'s layout (kind "int4": group scales and zero
    points; "fp4": e4m3 scales per 16 and a row scale)."""
    from metrale_jax.layers.linear import W4Linear

    packed = jax.random.randint(key, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.uniform(jax.random.fold_in(key, 1), (e, n, k // group), jnp.float32, 0.5, 2)
    if kind == "fp4":
        return W4Linear(packed, s.astype(jnp.float8_e4m3fn), None, jnp.full((e, n), 1e-3, jnp.float32), None, k=k,
                        group_size=group, kind="fp4")
    zeros = jax.random.randint(jax.random.fold_in(key, 2), (e, n, k // group), 0, 16, jnp.int32).astype(jnp.uint8)
    return W4Linear(packed, (s * 1e-3).astype(jnp.bfloat16), zeros, None, None, k=k, group_size=group, kind="int4")


def _w4_bytes(n, k, kind, group):  # one expert matrix's packed codes and scales (and zeros)
    return n * k // 2 + n * (k // group) * (1 if kind == "fp4" else 3)


def main(argv=None):
    global CASES, TOKENS, MIN_ROTATION_BYTES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokamax", action="store_true", help="bf16 experts through tokamax's ragged_dot")
    ap.add_argument("--w4", action="store_true", help="also int4 and NVFP4 experts kept 4-bit")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode (plumbing)")
    args = ap.parse_args(argv)
    interpret = args.cpu_smoke
    if args.cpu_smoke:
        CASES, TOKENS, MIN_ROTATION_BYTES = {"tiny": (8, 2, 128, 128)}, (1, 8), 1e5
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__)
    if not args.cpu_smoke:
        from bench.kernels.timing import memcpy_seconds

        meta["memcpy_tb_s"] = 2 * 2**30 / memcpy_seconds(2**30) / 1e12  # read + write of 1 GiB
        print(f"memcpy (torch copy_, read + write): {meta['memcpy_tb_s']:.2f} TB/s", flush=True)
    rows = []
    key = jax.random.key(0)
    for name, (e, top_k, h, inter) in CASES.items():
        ip = math.ceil(inter / 128) * 128
        layer_fp8 = e * (2 * ip * h + math.ceil(h / 128) * 128 * inter)
        copies = max(2, math.ceil(MIN_ROTATION_BYTES / layer_fp8))
        fp8 = [(_fp8_experts(jax.random.fold_in(key, 2 * c), e, 2 * ip, h, ((0, inter), (ip, inter))),
                _fp8_experts(jax.random.fold_in(key, 2 * c + 1), e, math.ceil(h / 128) * 128, inter, ((0, h),)))
               for c in range(copies)]
        bf16 = [(jax.random.normal(jax.random.fold_in(key, 1000 + c), (e, h, 2 * inter), jnp.bfloat16) * 0.02,
                 jax.random.normal(jax.random.fold_in(key, 2000 + c), (e, inter, h), jnp.bfloat16) * 0.02)
                for c in range(max(2, copies // 2))]
        w4 = {}
        if args.w4:
            for kind, group in (("int4", 128), ("fp4", 16)):
                g = min(group, inter)
                nb = e * (_w4_bytes(2 * inter, h, kind, g) + _w4_bytes(h, inter, kind, g))
                w4[kind] = ([(_w4_experts(jax.random.fold_in(key, 3000 + 2 * c), e, 2 * inter, h, kind, g),
                              _w4_experts(jax.random.fold_in(key, 3001 + 2 * c), e, h, inter, kind, g))
                             for c in range(max(2, math.ceil(MIN_ROTATION_BYTES / nb)))], g)
        jax.block_until_ready((fp8, bf16, w4))
        for t in TOKENS:
            x = jax.random.normal(jax.random.fold_in(key, t), (t, h), jnp.bfloat16)
            idx = jnp.stack([jax.random.permutation(jax.random.fold_in(key, 10 * t + i), e)[:top_k]
                             for i in range(t)]).astype(jnp.int32)
            w = jnp.full((t, top_k), 1.0 / top_k, jnp.float32)
            routed = len(set(np.asarray(idx).reshape(-1).tolist()))
            step_bytes = routed * (2 * ip * h + math.ceil(h / 128) * 128 * inter)  # FP8 bytes of the routed experts
            impls = {"bf16": (bf16, dict(use_tokamax=args.tokamax))}
            marked = [tuple(dataclasses.replace(a, use_kernel=True, interpret=interpret) for a in ws) for ws in fp8]
            impls["fp8_kernel"] = (marked, {})
            impls["fp8_xla"] = (fp8, {})
            routed_bytes = {impl: step_bytes for impl in impls}
            for kind, (ws, g) in w4.items():
                impls[f"{kind}_kernel"] = ([tuple(dataclasses.replace(a, use_kernel=True, expert_kernel=True,
                                                                      interpret=interpret)
                                                  for a in pair) for pair in ws], {})
                impls[f"{kind}_xla"] = (ws, {})
                nb = routed * (_w4_bytes(2 * inter, h, kind, g) + _w4_bytes(h, inter, kind, g))
                routed_bytes.update({f"{kind}_kernel": nb, f"{kind}_xla": nb})
            routed_bytes["bf16"] = routed * 3 * h * inter * 2
            for impl, (ws, kw) in impls.items():
                step_bytes = routed_bytes[impl]
                run = jax.jit(lambda x, w, idx, ws, kw=kw: [routed_experts(x, w, idx, a, b, **kw) for a, b in ws])
                try:
                    sec = median_seconds(run, x, w, idx, ws, group=3 if interpret else 10) / len(ws)
                    tb_s = step_bytes / sec / 1e12
                    roof = tb_s / meta["memcpy_tb_s"] if "memcpy_tb_s" in meta else None
                    row = dict(case=name, tokens=t, pairs=t * top_k, experts=e, routed_experts=routed, impl=impl,
                               time_us=sec * 1e6, routed_bytes=step_bytes, routed_tb_s=tb_s, of_memcpy=roof)
                    print(f"{name} T={t:3d} {impl:12s} {sec * 1e6:9.1f} us  routed bytes {step_bytes / 1e6:.1f} MB "
                          f"-> {tb_s:.2f} TB/s" + (f" ({roof:.2f} of memcpy)" if roof else ""), flush=True)
                except Exception as ex:  # noqa: BLE001 - recorded
                    row = dict(case=name, tokens=t, impl=impl, error=f"{type(ex).__name__}: {str(ex)[:300]}")
                    print(f"{name} T={t} {impl}: FAILED {row['error']}", flush=True)
                rows.append(row)
                (out / "expert_fp8.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
