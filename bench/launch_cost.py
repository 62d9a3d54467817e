"""The host's cost of launching one step executable, apart from the device's: the default engine's
decode forward and verify executables, called back to back on padding inputs, with fresh input
buffers every call (as the engine sends them) and with the same device buffers every call.

    python bench/launch_cost.py [--shape llama3-8b] [--num-layers N] [--calls 50] [--out FILE.json]

Per variant: the median time a call takes to return (the launch: argument handling, the command
buffer's update and launch) and the wall time per call over the run (the device's pace when the
host keeps up). The verify profiles of session 14 showed ~2.8 ms of host time per launch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _record(runs: list, run: dict) -> None:
    runs.append(run)
    print(json.dumps(run), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import numpy as np

    from metrale_jax import LLMEngine, random_model
    from metrale_jax.engine.bench import shape_config
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.metadata_builder import build_step, pack

    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = "bfloat16" if on_gpu else "float32"
    model, params = random_model(shape_config(a.shape, a.num_layers), dtype=dtype, repeat_layers=True,
                                 split_layers=on_gpu)
    eng = LLMEngine(model, params, EngineConfig(dtype=dtype, max_model_len=2048, show_progress=False,
                                                speculative_config={"method": "ngram", "num_speculative_tokens": 4}))
    comp = eng.compiler
    res = {"shape": a.shape, "num_layers": a.num_layers, "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "arguments": len(jax.tree.leaves((eng.params, eng.state))) + 4,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for bucket in [b for b in comp.buckets if b.kind in ("decode", "verify") and b.num_seqs in (1, 64)]:
        _, ibuf, fbuf = pack(eng.builder, build_step(eng.builder, bucket, [], []))
        for stable in (False, True):
            dev = comp.put(ibuf, fbuf)
            prev = comp.zero_tokens()
            launch = []
            t0 = time.perf_counter()
            for _ in range(a.calls):
                d = dev if stable else comp.put(ibuf, fbuf)
                t = time.perf_counter()
                if comp.has_split(bucket):
                    eng.state, logits, plp = comp.run_forward(bucket, eng.params, eng.state, d, prev)
                else:
                    eng.state, out, _ = comp.run(bucket, eng.params, eng.state, d, prev)
                launch.append(time.perf_counter() - t)
            jax.block_until_ready(eng.state)
            wall = (time.perf_counter() - t0) / a.calls
            _record(res["runs"], dict(bucket=str(bucket), inputs="same buffers" if stable else "fresh buffers",
                                      launch_ms_median=1e3 * float(np.median(launch[5:])), wall_ms_per_call=1e3 * wall))
    # a verify step is read before the next is built (synchronous): its latency, call to samples on
    # the host, and the time the call takes to return, as the engine compiles it; compiled without
    # CUDA graphs (XLA then launches the kernels one by one and the first starts at once, instead of
    # after the whole graph's launch: session 14's batch-1 verify profile showed ~2.7 ms idle before
    # the first kernel); and, for 64 rows, with the threshold searches' per-threshold reductions
    # instead of the variadic one (a batch-64 verify call returned only once the step was done,
    # session 15: which part holds the host is not known)
    from metrale_jax import sampling

    res["sync_latency"] = []
    variants = (("engine", None, None), ("no command buffers", {"xla_gpu_enable_command_buffer": ""}, None),
                ("no variadic reduction", {}, 10**9))
    for bucket in [b for b in comp.buckets if b.kind == "verify" and b.num_seqs in (1, 64)]:
        _, ibuf, fbuf = pack(eng.builder, build_step(eng.builder, bucket, [], []))
        for name, opts, min_rows in variants:
            if min_rows is not None and bucket.num_sample_rows < sampling.VARIADIC_MIN_ROWS:
                continue
            keep = sampling.VARIADIC_MIN_ROWS
            try:
                if min_rows is not None:
                    sampling.VARIADIC_MIN_ROWS = min_rows
                    jax.clear_caches()  # (the constant is read when the step is traced)
                exe = comp.executables[bucket] if opts is None else comp.lower(
                    bucket, eng.params, eng.state).compile(compiler_options=opts)
            except Exception as e:  # noqa: BLE001 - an option this XLA does not take: say so, go on
                _record(res["sync_latency"], dict(bucket=str(bucket), variant=name, error=f"{type(e).__name__}: {e}"))
                continue
            finally:
                sampling.VARIADIC_MIN_ROWS = keep
            prev, mask = comp.zero_tokens(), comp.no_mask(bucket.num_sample_rows)
            lat, ret = [], []
            for _ in range(a.calls):
                d = comp.put(ibuf, fbuf)
                t = time.perf_counter()
                eng.state, out, _ = exe(eng.params, eng.state, *d, prev, mask)
                ret.append(time.perf_counter() - t)
                np.asarray(out.token_ids)
                lat.append(time.perf_counter() - t)
            _record(res["sync_latency"], dict(bucket=str(bucket), variant=name,
                                              latency_ms_median=1e3 * float(np.median(lat[5:])),
                                              returns_ms_median=1e3 * float(np.median(ret[5:]))))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
