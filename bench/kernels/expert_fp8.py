"""FP8 MoE experts at decode (GPU machine): one MoE layer's routed experts, FP8 against bf16.

Shapes: Qwen3-30B-A3B (128 experts, top-8, H 2048, I 768) and Qwen3-Next-80B-A3B (512 experts,
top-10, H 2048, I 512), T = 1, 8, 64 tokens. Per case it times `metrale_jax.layers.moe.routed_experts`
(gate|up, SiLU, down, weighted sum) with
* bf16 experts (XLA's ragged_dot, or tokamax's when it imports: `--tokamax`);
* FP8 experts kept FP8 (`layers/moe_fp8.py`): the Pallas expert kernel (`use_kernel`) and the
  XLA gather-and-dequantize path; at T * k >= E both run dequantize + the grouped GEMM;
and reports the routed experts' FP8 bytes / time (the bytes a decode step must read).
Layers rotate through distinct weight copies of >= 256 MB so HBM, not L2, is timed.

    PYTHONPATH=. python3 bench/kernels/expert_fp8.py --out DIR          # DIR/expert_fp8.json
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


def main(argv=None):
    global CASES, TOKENS, MIN_ROTATION_BYTES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokamax", action="store_true", help="bf16 experts through tokamax's ragged_dot")
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
        jax.block_until_ready((fp8, bf16))
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
            for impl, (ws, kw) in impls.items():
                run = jax.jit(lambda x, w, idx, ws, kw=kw: [routed_experts(x, w, idx, a, b, **kw) for a, b in ws])
                try:
                    sec = median_seconds(run, x, w, idx, ws, group=3 if interpret else 10) / len(ws)
                    row = dict(case=name, tokens=t, pairs=t * top_k, experts=e, routed_experts=routed, impl=impl,
                               time_us=sec * 1e6, fp8_routed_tb_s=step_bytes / sec / 1e12)
                    print(f"{name} T={t:3d} {impl:10s} {sec * 1e6:9.1f} us  routed FP8 bytes {step_bytes / 1e6:.1f} MB "
                          f"-> {step_bytes / sec / 1e12:.2f} TB/s", flush=True)
                except Exception as ex:  # noqa: BLE001 - recorded
                    row = dict(case=name, tokens=t, impl=impl, error=f"{type(ex).__name__}: {str(ex)[:300]}")
                    print(f"{name} T={t} {impl}: FAILED {row['error']}", flush=True)
                rows.append(row)
                (out / "expert_fp8.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
