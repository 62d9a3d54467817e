"""FP8 MoE experts at prefill sizes (GPU machine): the grouped GEMM with the weights kept FP8.

The engine's FP8 experts (`layers/moe_fp8.py`) run steps with more (token, expert) pairs than the
decode kernel takes through a grouped GEMM: since session 30 tokamax's Hopper kernel for
quantized weights (`moe_fp8.fp8_grouped_matmul`, `fp8_tokamax` here: the FP8 weights read as
stored and upcast in registers, x and the block scales in f16 scaled by powers of two so that
nothing overflows, see `moe_fp8.f16_operands`), before it every expert dequantized to bf16 and
tokamax's bf16 grouped GEMM (`dense` here: ~5 bytes moved per expert weight per step).
Against, per Qwen3 MoE shape (gate|up and down of one layer) and tokens T (pairs T * top-k):
`dense` (dequantize + tokamax bf16) and `bf16`, tokamax on bf16 experts (a
bf16 checkpoint). Each candidate's output is checked against `dense` (relative error).

`--dense` (session 31): dense FP8 linears at prefill sizes (Llama-3-8B projections) through the
same tokamax kernel, one group (`fp8_tokamax`), against XLA's dequantize-and-dot (`xla_dequant`,
what `layers/linear.py` runs past 64 rows) and XLA's bf16 dot (`bf16`, a bf16 checkpoint). On the
H200 tokamax won only at 128 rows and lost at 576 and 2,048 (up to 1.9x slower), so the engine
keeps XLA's path (`fp8_dense_h200_2026-12-04_s31_call6.json`).

    PYTHONPATH=. python3 bench/kernels/fp8_grouped.py --out DIR [--tokens 64,256,1024]
    PYTHONPATH=. python3 bench/kernels/fp8_grouped.py --out DIR --dense [--tokens 128,576,2048]
    PYTHONPATH=. python3 bench/kernels/fp8_grouped.py --out DIR --cpu-smoke   # plumbing (XLA's ragged_dot)
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
from metrale_jax.layers.moe import grouped_matmul
from metrale_jax.layers.moe_fp8 import dense_experts, fp8_grouped_matmul

TOKENS = "64,256,1024"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, XLA's ragged_dot (plumbing only)")
    ap.add_argument("--dense", action="store_true", help="dense FP8 linears (Llama-3-8B projections), GPU only")
    args = ap.parse_args(argv)
    if args.dense:
        return _dense(args)
    cases, tokens = CASES, [int(t) for t in args.tokens.split(",")]
    if args.cpu_smoke:
        cases, tokens = {"tiny": (8, 2, 256, 256)}, [8, 24]
    tk = not args.cpu_smoke  # the engine's tokamax bf16 grouped GEMM (XLA's ragged_dot on the CPU)
    out, meta = _out_and_meta(args)
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
                    "fp8_tokamax": (jax.jit(lambda x, w, sizes: fp8_grouped_matmul(x, w, sizes, tk)), (x, w, sizes)),
                    "bf16": (jax.jit(lambda x, wd, sizes: grouped_matmul(x, wd, sizes, tk)), (x, wd, sizes)),
                }
                _time_candidates(cands, dict(case=name, proj=proj, tokens=t, pairs=p), 3 if args.cpu_smoke else 10,
                                 rows, "rel_err_vs_dense", out / "fp8_grouped.json", meta)


def _out_and_meta(args) -> tuple[pathlib.Path, dict]:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    return out, dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                     device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__)


def _time_candidates(cands: dict, base: dict, group: int, rows: list, err_key: str, path: pathlib.Path,
                     meta: dict) -> None:
    """Time each candidate {name: (jitted function, its arguments)}, its output checked against the
    first one's (relative error under `err_key`); a row each (`base` plus impl, time or error) into
    `rows`, all of them written to `path` (with `meta`) after each."""
    ref = None
    for cname, (fn, fargs) in cands.items():
        row = dict(base, impl=cname)
        label = " ".join(f"{v}" for v in base.values())
        try:
            y = np.asarray(fn(*fargs), np.float32)
            ref = y if ref is None else ref
            row[err_key] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            row["time_us"] = median_seconds(fn, *fargs, group=group) * 1e6
            print(f"{label} {cname:12s} {row['time_us']:9.1f} us  err {row[err_key]:.1e}", flush=True)
        except Exception as ex:  # noqa: BLE001 - recorded
            row["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
            print(f"{label} {cname}: FAILED {row['error']}", flush=True)
        rows.append(row)
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


DENSE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def _dense(args) -> None:
    from metrale_jax.layers.linear import Fp8Linear, dequantize
    from metrale_jax.layers.moe_fp8 import _tokamax_fp8_grouped_matmul

    def tokamax_fp8_matmul(x, w8, scale_inv):  # one group: x bf16[M, K], w8 [N, K] -> f32[M, N]
        return _tokamax_fp8_grouped_matmul(x, w8[None], scale_inv[None], jnp.full((1,), x.shape[0], jnp.int32))

    out, meta = _out_and_meta(args)
    rows, key = [], jax.random.key(1)
    tokens = [int(t) for t in (args.tokens if args.tokens != TOKENS else "128,576,2048").split(",")]
    for name, (n, k) in DENSE.items():
        w = _fp8_experts(jax.random.fold_in(key, n + k), 1, n, k, ((0, n),))
        w = Fp8Linear(w.w8[0], w.scale_inv[0], ((0, n),))
        wb = dequantize(w, jnp.bfloat16)  # [N, K]
        for t in tokens:
            x = jax.random.normal(jax.random.fold_in(key, t), (t, k), jnp.bfloat16)
            cands = {
                "xla_dequant": (jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, dequantize(w, x.dtype),
                                                                preferred_element_type=jnp.float32)), (x, w)),
                "fp8_tokamax": (jax.jit(lambda x, w: tokamax_fp8_matmul(x, w.w8, w.scale_inv)), (x, w)),
                "bf16": (jax.jit(lambda x, wb: jnp.einsum("mk,nk->mn", x, wb, preferred_element_type=jnp.float32)),
                         (x, wb)),
            }
            _time_candidates(cands, dict(case="llama3_8b", proj=name, tokens=t), 10, rows,
                             "rel_err_vs_xla_dequant", out / "fp8_dense.json", meta)


if __name__ == "__main__":
    main()
