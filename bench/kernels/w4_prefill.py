"""int4 prefill linears (GPU machine): the engine's dequantize-then-dot against bf16, and the
dequantized weight materialized first.

Session 27 saw int4 prefill steps take ~24 ms against bf16's ~7 ms in `generate` (64 prompts:
time to first token 0.38 against 0.11 s). The engine's prefill path (`layers/linear_w4.py`,
more than 64 rows) dequantizes the packed weight in XLA and runs one dot; XLA may fuse the
dequantization into the GEMM's operand and redo it for every output tile. This times, per
Llama-3-8B projection and M in {256, 1024, 4096}:
* `bf16`: XLA's dot on a bf16 W (what a bf16 checkpoint runs);
* `fused`: the engine's path as written (`w4._dequant_dot`: dequantize, then one einsum, one jit);
* `barrier`: the same with `lax.optimization_barrier` on the dequantized weight, so XLA writes it
  once and the dot reads it (cost: one bf16 copy of the weight per call).
Weights rotate through >= 256 MB of copies. Results: DIR/w4_prefill.json and .md.

    PYTHONPATH=. python3 bench/kernels/w4_prefill.py --out DIR [--ms 256,4096] [--shapes gate_up]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from w4 import MIN_ROTATION_BYTES, SHAPES, _dequant_dot, _time, _weights, shape_args  # noqa: E402

from pallas_kernels.linear import dequantize_w4_reference  # noqa: E402

GROUP = 128


def _dot(x, w):
    return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _barrier(x, packed, scales, zeros, *, k):
    w = dequantize_w4_reference(packed, scales, zeros, k=k, group_size=GROUP, kind="int4").astype(jnp.bfloat16)
    return _dot(x, jax.lax.optimization_barrier(w))


def main(argv=None):
    args, out_dir = shape_args(__doc__, argv, "256,1024,4096")
    key = jax.random.key(0)
    rows, table = [], []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ws = _weights(key, n, k, "int4", GROUP, max(2, int(MIN_ROTATION_BYTES // (n * k // 2)) + 1))
        wb = [(jax.random.normal(jax.random.fold_in(key, 100 + i), (n, k), jnp.bfloat16) * 0.02,)
              for i in range(max(2, int(MIN_ROTATION_BYTES // (2 * n * k)) + 1))]
        for m in map(int, args.ms.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            res = {"shape": name, "k": k, "n": n, "m": m}
            res["bf16_us"] = _time(_dot, x, wb)[0] * 1e6
            t_f, y_f = _time(lambda x, p, s, z, k=k: _dequant_dot(x, p, s, z, k=k, group_size=GROUP, kind="int4"),
                             x, ws)
            t_b, y_b = _time(lambda x, p, s, z, k=k: _barrier(x, p, s, z, k=k), x, ws)
            res["fused_us"], res["barrier_us"] = t_f * 1e6, t_b * 1e6
            res["same_output"] = bool(np.allclose(np.asarray(y_f, np.float32), np.asarray(y_b, np.float32),
                                                  rtol=2e-2, atol=1e-2))
            rows.append(res)
            line = (f"| {name} | {m} | {res['bf16_us']:.0f} | {res['fused_us']:.0f} | {res['barrier_us']:.0f} | "
                    f"{res['same_output']} |")
            table.append(line)
            print(line, flush=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "group_size": GROUP}
    (out_dir / "w4_prefill.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    head = ("| shape | M | bf16 (us) | fused dequant+dot (us) | barrier (us) | same output |\n"
            "|---|---|---|---|---|---|\n")
    (out_dir / "w4_prefill.md").write_text(f"{meta}\n\n{head}" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
