"""4-bit tensor-core GEMM (`pallas_kernels/linear/w4_mgpu.py`) at decode batch sizes (GPU machine).

Llama-3-8B projections, M in {8, 16, 32, 64} (and prefill sizes: --ms 256,1024), int4 group 128
(float16 scales, uint8 zeros) or with --kind fp4 NVFP4 (groups of 16, e4m3 scales, a global
scale per row), on weights rotating through >= 256 MB of copies (HBM, not L2),
beside: XLA's bf16 dot on a bf16 W (what a bf16 checkpoint runs: the issue's bar is 4-bit >= 1.0x
bf16 at batch 64), the Triton 4-bit kernel with its tuned table (`skinny_matmul_w4`, the engine's
path before this kernel; above 64 rows XLA's dequantize-then-dot, the engine's earlier prefill
path) and a torch `copy_` (the roofline). Each kernel's output on copy 0 is checked against a
float32 dot on the dequantized weight. Results: DIR/w4_mgpu.json and w4_mgpu.md.

    PYTHONPATH=. python3 bench/kernels/w4_mgpu.py --out DIR [--ms 16,64] [--shapes qkv,o] [--kind fp4] [--only REGEX]

(--only: the variants whose names match, beside bf16 and the Triton kernel; at M = 1 the Triton
kernel is the one-row half2 path the engine runs.)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from w4 import MIN_ROTATION_BYTES, SHAPES, _dequant_dot, _memcpy, _time_interleaved, _weights, shape_args  # noqa: E402

from pallas_kernels.linear import skinny_matmul_w4, skinny_matmul_w4_reference  # noqa: E402
from pallas_kernels.linear.w4_mgpu import (  # noqa: E402
    W4MgpuParams,
    skinny_matmul_w4_mgpu,
    w4_mgpu_params_for,
    w4_mgpu_scales,
)

GROUPS = {"int4": 128, "fp4": 16}


def _variants(m, n, k, kind):
    auto = w4_mgpu_params_for(m, n, k, GROUPS[kind])
    out = {"auto": auto}
    if m > 64:  # prefill: x's rows in tiles of block_m (a grid axis)
        for bm, d in ((64, 4), (128, 2), (128, 3), (128, 4), (256, 2)):
            p = dataclasses.replace(auto, block_m=bm, max_concurrent_steps=d)
            if p != auto:  # (the defaults' tile is `auto` already)
                out[f"bm{bm}_d{d}"] = p
        out["auto_overlap"] = dataclasses.replace(auto, overlap=True)
        if kind == "int4":
            out["bm128_wgs2"] = dataclasses.replace(auto, compute_wgs=2)
        return out
    if kind == "fp4":  # (no signed upcast, no second compute warpgroup)
        for d in (2, 3, 4):
            for s in sorted({1, 2, 4, auto.split_k}):
                out[f"d{d}_s{s}"] = W4MgpuParams(max_concurrent_steps=d, split_k=s)
        out["auto_chunks2"] = dataclasses.replace(auto, chunks=2)
        out["auto_overlap"] = dataclasses.replace(auto, overlap=True)
        out["auto_overlap_chunks2"] = dataclasses.replace(auto, overlap=True, chunks=2)
        return out
    for d in (2, 3, 4, 8):  # (2-3: less shared memory per CTA, more CTAs per SM; not yet run)
        for s in sorted({1, 2, 4, auto.split_k}):
            out[f"d{d}_s{s}"] = W4MgpuParams(max_concurrent_steps=d, split_k=s)
    out["auto_smem"] = dataclasses.replace(auto, a_smem=True)
    out["auto_signed_upcast"] = dataclasses.replace(auto, signed_upcast=True)
    out["auto_chunks2"] = dataclasses.replace(auto, chunks=2)  # (not yet run)
    out["auto_overlap"] = dataclasses.replace(auto, overlap=True)  # (not yet run)
    out["auto_overlap_chunks2"] = dataclasses.replace(auto, overlap=True, chunks=2)  # (not yet run)
    for s in (1, 2, 4):  # two compute warpgroups, 128 rows a CTA (not yet run)
        out[f"wgs2_s{s}"] = W4MgpuParams(split_k=s, compute_wgs=2)
    # promote (session 43): the codes upcast to bf16 exactly, products scaled in f32 afterwards; with
    # programmatic dependent launch (here each weight copy's kernel follows the previous copy's)
    out["promote"] = dataclasses.replace(auto, promote=True)
    out["promote_pdl"] = dataclasses.replace(auto, promote=True, pdl=True)
    out["auto_pdl"] = dataclasses.replace(auto, pdl=True)
    for d in (2, 4, 6):
        for s in (1, 2, 4, 8):
            out[f"promote_d{d}_s{s}"] = W4MgpuParams(max_concurrent_steps=d, split_k=s, promote=True)
    return out


def main(argv=None):
    args, out_dir = shape_args(__doc__, argv, "8,16,32,64", kind=True, only=True)
    kind, group = args.kind, GROUPS[args.kind]
    memcpy = _memcpy()
    rows, table = [], []
    key = jax.random.key(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        packed_bytes = n * k // 2
        copies = max(2, int(MIN_ROTATION_BYTES // packed_bytes) + 1)
        ws = _weights(key, n, k, kind, group, copies)
        # (int4: zeros folded into the kernel's scales; fp4: the global row scale passed beside them)
        ks = [(p, w4_mgpu_scales(s, z)) if kind == "int4" else (p, w4_mgpu_scales(s), z) for p, s, z in ws]
        bf_copies = max(2, int(MIN_ROTATION_BYTES // (2 * n * k)) + 1)
        wb = [(jax.random.normal(jax.random.fold_in(key, 100 + i), (n, k), jnp.bfloat16) * 0.02,)
              for i in range(bf_copies)]
        jax.block_until_ready(ks)
        for m in map(int, args.ms.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            ref = np.asarray(skinny_matmul_w4_reference(x, *ws[0], k=k, group_size=group, kind=kind))
            res = {"shape": name, "k": k, "n": n, "m": m}
            if m <= 64:  # the streaming kernel's dot path
                w4_old = lambda x, p, s, z, k=k: skinny_matmul_w4(x, p, s, z, k=k, group_size=group, kind=kind)  # noqa: E731
            else:  # the engine's prefill path before this kernel took it: XLA's dequantize-then-dot
                w4_old = lambda x, p, s, z, k=k: _dequant_dot(x, p, s, z, k=k, group_size=group, kind=kind)  # noqa: E731
            cells = {"bf16": (lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))), x, wb),
                     "triton_w4": (w4_old, x, ws)}
            for vname, params in _variants(m, n, k, kind).items():
                if args.only and not re.search(args.only, vname):
                    continue
                cells[f"mgpu_{vname}"] = (lambda x, p, s, *rs, params=params: skinny_matmul_w4_mgpu(
                    x, p, s, *rs, group_size=group, kind=kind, params=params), x, ks)
            for cname, r in _time_interleaved(cells).items():
                if isinstance(r, Exception):  # (a variant that does not compile is reported)
                    res[f"{cname}_error"] = f"{type(r).__name__}: {str(r)[:300]}"
                    print(name, m, cname, res[f"{cname}_error"], flush=True)
                    continue
                res[f"{cname}_us"] = r[0] * 1e6
                if cname != "bf16":
                    res[f"{cname}_err"] = float(np.abs(np.asarray(r[1], np.float32) - ref).max() / np.abs(ref).max())
            timed = {kk[5:-3]: v for kk, v in res.items() if kk.startswith("mgpu_") and kk.endswith("_us")}
            best = min(timed.values(), default=None)
            res["mgpu_best_us"] = best
            res["mgpu_best_variant"] = min(timed, key=timed.get) if timed else None
            res["packed_TBps_best"] = packed_bytes / (best * 1e-6) / 1e12 if best else None
            rows.append(res)
            line = (f"| {name} | {m} | {res['bf16_us']:.1f} | {res['triton_w4_us']:.1f} | "
                    f"{res.get('mgpu_auto_us', float('nan')):.1f} | {best or float('nan'):.1f} | "
                    f"{res['bf16_us'] / best if best else float('nan'):.2f}x | "
                    f"{res['packed_TBps_best'] or float('nan'):.2f} | {res.get('mgpu_auto_err', float('nan')):.1e} | "
                    f"{res['mgpu_best_variant']} |")
            table.append(line)
            print(line, {kk: round(v, 1) for kk, v in res.items() if kk.endswith("_us")}, flush=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "platform": platform.platform(),
            "memcpy_TBps": memcpy / 1e12, "kind": kind, "group_size": group}
    (out_dir / "w4_mgpu.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    head = ("| shape | M | bf16 XLA (us) | Triton w4 (us) | mgpu auto (us) | mgpu best (us) | best vs bf16 | "
            "packed TB/s | auto rel err | best variant |\n|---|---|---|---|---|---|---|---|---|---|\n")
    (out_dir / "w4_mgpu.md").write_text(f"{meta}\n\n{head}" + "\n".join(table) + "\n")
    print(head + "\n".join(table))


if __name__ == "__main__":
    main()
