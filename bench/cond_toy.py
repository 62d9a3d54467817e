"""Can a step skip work under `lax.cond` on the GPU without the host waiting for the predicate?

    python bench/cond_toy.py [--ms 4] [--rows 320] [--calls 40] [--out FILE.json]

The sampler runs its filters, random draw and top logprobs for every row on the GPU (no
`lax.cond`: XLA ran a conditional from the host, which copied the predicate back and waited for
it, so the next step could not be queued: session 4). A verify step's 320 rows paid ~3.8 ms of
sampler for greedy rows that need none of it (H200, session 14). CUDA 12.4+ graphs have
conditional nodes, and XLA can put a conditional into its command buffer
(`xla_gpu_enable_command_buffer` with CONDITIONAL), which would evaluate the predicate on the
device. This toy step (a few ms of GEMMs, logits f32[rows, 128256], then a light or heavy
"sampler" under `lax.cond` on a device flag) is launched back to back, per variant: median host
time of a launch (does it wait for the device?) and wall time per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CMDBUF = "xla_gpu_enable_command_buffer"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=float, default=4.0, help="rough device time of the GEMMs per step")
    p.add_argument("--rows", type=int, default=320)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    dim, vocab = (4096, 128256) if gpu else (128, 1000)
    layers = max(1, int(a.ms * 1e-3 / (2 * dim * dim * 2 / 4e12))) if gpu else 2
    w = [jax.device_put(jnp.full((2, dim, dim), 1e-3, jnp.bfloat16), dev) for _ in range(layers)]
    lm = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((dim, vocab)) * 0.02, jnp.bfloat16), dev)

    def heavy(x):  # ~ the threshold searches: 16 counting passes over [R, V]
        t = jnp.max(x, axis=-1, keepdims=True)
        acc = jnp.zeros(x.shape[0], jnp.int32)
        for j in range(16):
            acc = acc + jnp.sum(x >= t - 0.01 * (j + 1), axis=-1, dtype=jnp.int32)
        return jnp.argmax(x, axis=-1).astype(jnp.int32) + (acc < 0)

    def light(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def forward(w, h, lm):
        for wl in w:
            h = jnp.tanh(h @ wl[0]) @ wl[1].T + h
        return h, jnp.einsum("rd,dv->rv", h, lm, preferred_element_type=jnp.float32)

    def step_cond(w, h, lm, flag):
        h, x = forward(w, h, lm)
        return h, jax.lax.cond(flag[0] > 0, heavy, light, x)

    def step_heavy(w, h, lm, flag):
        h, x = forward(w, h, lm)
        return h, heavy(x)

    def step_light(w, h, lm, flag):
        h, x = forward(w, h, lm)
        return h, light(x)

    h0 = jnp.zeros((a.rows, dim), jnp.bfloat16)
    res = {"device": dev.device_kind, "jax": jax.__version__, "layers": layers, "rows": a.rows, "vocab": vocab,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}

    def run(name, fn, options, flag_value):
        flag = jax.device_put(np.array([flag_value], np.int32), dev)
        try:
            exe = jax.jit(fn, donate_argnums=(1,)).lower(w, h0, lm, flag).compile(compiler_options=options)
        except Exception as e:  # noqa: BLE001 - an option this XLA does not take: recorded
            res["runs"].append(dict(variant=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(name, "error", str(e)[:200], flush=True)
            return
        h = jnp.zeros_like(h0)
        for _ in range(3):
            h, tok = exe(w, h, lm, flag)
        jax.block_until_ready((h, tok))
        # alone: latency of one step, waited for
        t = time.perf_counter()
        h, tok = exe(w, h, lm, flag)
        jax.block_until_ready(tok)
        alone = time.perf_counter() - t
        launch = []
        t0 = time.perf_counter()
        for _ in range(a.calls):
            t = time.perf_counter()
            h, tok = exe(w, h, lm, flag)
            tok.copy_to_host_async()
            launch.append(time.perf_counter() - t)
        jax.block_until_ready((h, tok))
        wall = (time.perf_counter() - t0) / a.calls
        r = dict(variant=name, launch_ms_median=1e3 * float(np.median(launch)), wall_ms_per_call=1e3 * wall,
                 alone_ms=1e3 * alone)
        res["runs"].append(r)
        print(json.dumps(r), flush=True)

    from metrale_jax.engine.compile import COMMAND_BUFFER_WITH_CONDITIONALS as both

    run("no cond, light", step_light, None, 0)
    run("no cond, heavy", step_heavy, None, 0)
    run("cond, default options, light taken", step_cond, None, 0)
    run("cond, default options, heavy taken", step_cond, None, 1)
    run("cond, conditional command buffers, light taken", step_cond, {CMDBUF: both}, 0)
    run("cond, conditional command buffers, heavy taken", step_cond, {CMDBUF: both}, 1)
    run("no cond, light, no command buffers", step_light, {CMDBUF: ""}, 0)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
