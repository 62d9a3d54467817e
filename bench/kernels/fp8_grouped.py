"""FP8 MoE experts at prefill sizes (GPU machine): the grouped GEMM with the weights kept FP8.

The engine's FP8 experts (`layers/moe_fp8.py`) run steps with more (token, expert) pairs than the
decode kernel takes by dequantizing the layer's experts to bf16 and calling tokamax's bf16
grouped GEMM: ~5 bytes moved per expert weight per step. tokamax 0.0.17 has a Hopper kernel
that takes the weights as a qwix `QArray` and dequantizes in registers
(`pallas_mosaic_gpu_kernel_sm90_quant.py`: scales one per output column and K block, the weights
upcast to the scales' dtype). Mosaic GPU upcasts FP8 e4m3 only to f16 (lowering on the CPU
refused bf16, session 28), so this bench's candidate (`fp8_tokamax`) gives it
* the FP8 weights as stored ([E, N_pad, K], tokamax's transposed-RHS layout: no copy), with the
  128 x 128 block scales repeated per output row, times one power of two per tensor, in f16;
* x in f16, each row times a power of two so that |x| < 1, and the power of two of the weights
  chosen so that |x * w| summed over K stays below 2^15 (no f16 overflow in the output);
* the f16 output times both powers of two back in f32.
Against, per Qwen3 MoE shape (gate|up and down of one layer) and tokens T (pairs T * top-k):
`dense`, the engine's path (dequantize + tokamax bf16), and `bf16`, tokamax on bf16 experts (a
bf16 checkpoint). Each candidate's output is checked against `dense` (relative error).

    PYTHONPATH=. python3 bench/kernels/fp8_grouped.py --out DIR [--tokens 64,256,1024]
    PYTHONPATH=. python3 bench/kernels/fp8_grouped.py --out DIR --cpu-smoke   # tokamax's XLA path
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels.expert_fp8 import CASES, _fp8_experts
from bench.kernels.timing import median_seconds
from metrale_jax.layers.linear import Fp8Linear
from metrale_jax.layers.moe import grouped_matmul
from metrale_jax.layers.moe_fp8 import dense_experts

TOKENS = "64,256,1024"


def fp8_grouped_tokamax(x, w: Fp8Linear, sizes, implementation="mosaic"):
    """x bf16[M, K] (rows sorted by expert), w `Fp8Linear` [E, N_pad, K], sizes i32[E] -> f32[M, N_pad]
    through tokamax's quantized ragged_dot (module docstring)."""
    import qwix
    import tokamax
    from tokamax._src.ops.ragged_dot import base

    e, n_pad, k = w.w8.shape
    s = jnp.repeat(w.scale_inv, 128, axis=-2)[:, :n_pad, :]  # f32[E, N_pad, K / 128]
    # |x| < 1 and |w * s * 2^-ew| <= 2^15 / K: every output |y| < 2^15 (f16 holds it)
    ew = jnp.ceil(jnp.log2(448.0 * jnp.max(s) * k / 2.0**15))
    # given as [E, K, N] (tokamax's default numbers; its kernel transposes back to [E, N, K], the
    # two transposes cancel): its sm90 heuristics read the K block off the scales' tile along axis 1,
    # which in the [E, N, K] layout is N's (1): block_k 1, "No possible swizzle" (H200, session 30)
    q = qwix.QArray(w.w8.mT, (s * jnp.exp2(-ew)).astype(jnp.float16).mT, qtype=jnp.float8_e4m3fn)
    xf = x.astype(jnp.float32)
    ax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    ex = jnp.where(ax > 0, jnp.floor(jnp.log2(jnp.maximum(ax, 1e-30))) + 1, 0.0)  # f32[M, 1]: |x| * 2^-ex < 1
    m = x.shape[0]
    pad = -m % 8 if m > 8 else 0  # (tokamax's TMA tiling: M <= 8 or a multiple of 8, as `moe.py` pads)
    x16 = jnp.pad((xf * jnp.exp2(-ex)).astype(jnp.float16), ((0, pad), (0, 0)))
    sizes = sizes.at[-1].add(pad)
    y = tokamax.ragged_dot_general(x16, q, sizes, base.DEFAULT_RAGGED_DOT_DIM_NUMS,
                                   implementation=implementation)[:m]
    return y.astype(jnp.float32) * jnp.exp2(ex + ew)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, tokamax's XLA implementation")
    args = ap.parse_args(argv)
    cases, tokens, impl = CASES, [int(t) for t in args.tokens.split(",")], "mosaic"
    if args.cpu_smoke:
        cases, tokens, impl = {"tiny": (8, 2, 256, 256)}, [8, 24], "xla"
    tk = not args.cpu_smoke  # the engine's tokamax bf16 grouped GEMM (XLA's ragged_dot on the CPU)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__)
    rows = []
    key = jax.random.key(0)
    for name, (e, top_k, h, inter) in cases.items():
        for proj, (n, k) in {"gate_up": (2 * inter, h), "down": (h, inter)}.items():
            n_pad = math.ceil(n / 128) * 128
            w = _fp8_experts(jax.random.fold_in(key, n), e, n_pad, k, ((0, n_pad),))
            wd = dense_experts(w, jnp.bfloat16)  # [E, K, N]
            for t in tokens:
                p = t * top_k
                flat = jnp.sort(jax.random.randint(jax.random.fold_in(key, t), (p,), 0, e))
                sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
                x = jax.random.normal(jax.random.fold_in(key, 7 * t), (p, k), jnp.bfloat16)
                cands = {  # name: (function, its arguments)
                    "dense": (jax.jit(lambda x, w, sizes: grouped_matmul(x, dense_experts(w, x.dtype), sizes, tk)),
                              (x, w, sizes)),
                    "fp8_tokamax": (jax.jit(lambda x, w, sizes: fp8_grouped_tokamax(x, w, sizes, impl)), (x, w, sizes)),
                    "bf16": (jax.jit(lambda x, wd, sizes: grouped_matmul(x, wd, sizes, tk)), (x, wd, sizes)),
                }
                ref = None
                for cname, (fn, fargs) in cands.items():
                    row = dict(case=name, proj=proj, tokens=t, pairs=p, impl=cname)
                    try:
                        y = np.asarray(fn(*fargs), np.float32)
                        ref = y if ref is None else ref
                        row["rel_err_vs_dense"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                        sec = median_seconds(fn, *fargs, group=3 if args.cpu_smoke else 10)
                        row["time_us"] = sec * 1e6
                        print(f"{name} {proj:7s} T={t:5d} {cname:12s} {sec * 1e6:9.1f} us  "
                              f"err {row['rel_err_vs_dense']:.1e}", flush=True)
                    except Exception as ex:  # noqa: BLE001 - recorded
                        row["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
                        print(f"{name} {proj} T={t} {cname}: FAILED {row['error']}", flush=True)
                    rows.append(row)
                    (out / "fp8_grouped.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
