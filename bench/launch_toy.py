"""Why does launching a step block the host? A toy step (a few ms of GEMMs over donated state, a
small packed input, a small output) launched back to back with its input sent different ways.

    python bench/launch_toy.py [--ms 4] [--calls 40] [--out FILE.json]

`bench/launch_cost.py` (H200, session 16) found the engine's decode launch returning after
0.8 ms when it gets the same input buffers every call and after 4.1 ms (most of the device step)
with fresh ones from `jax.device_put`: the host then waits for the previous step instead of
running ahead. This toy separates the suspects: fresh inputs (device_put of numpy), the output's
`copy_to_host_async`, the number of arguments, CUDA graphs, and inputs kept in pinned host memory
(the step copies them in itself). Per variant: median host time of a launch and wall time per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=float, default=4.0, help="rough device time per step to aim for")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    dim = 8192 if gpu else 256
    # one layer reads 2 x dim^2 bf16 (256 MiB on the GPU, ~67 us at 4 TB/s); the layers are
    # separate arrays walked by a Python loop, as the engine's on the GPU (a `lax.scan` is an XLA
    # while loop, which the GPU runs from the host: every call then waits for the last; session
    # 16's first run of this toy measured exactly that, 13.5 ms per launch in every variant)
    layers = max(1, int(a.ms * 1e-3 / (2 * dim * dim * 2 / 4e12))) if gpu else 4
    w = [jax.device_put(jnp.full((2, dim, dim), 1e-3, jnp.bfloat16), dev) for _ in range(layers)]
    small = [jax.device_put(jnp.zeros((8,), jnp.float32), dev) for _ in range(200)]

    def body(w, h, ibuf, extra):
        def layer(h, wl):
            return jnp.tanh(h @ wl[0]) @ wl[1].T + h, None

        h = h + ibuf[:, :dim].astype(jnp.bfloat16) * 1e-3  # [8, dim]
        for wl in w:
            h, _ = layer(h, wl)
        for s in extra:
            h = h + s[0].astype(h.dtype)
        return h, jnp.argmax(h, axis=-1).astype(jnp.int32)

    def step(w, h, ibuf, *extra):
        return body(w, h, ibuf, extra)

    def step_out(w, h, ibuf, obuf):  # the output written into a donated buffer: every address stays
        h, o = body(w, h, ibuf, ())
        return h, obuf.at[:].set(o)

    def step_pinned(w, h, ibuf):  # ibuf in pinned host memory: the step copies it to the device
        return body(w, h, jax.device_put(ibuf, jax.memory.Space.Device), ())

    h0 = jnp.zeros((8, dim), jnp.bfloat16)
    ib = np.arange(8 * (dim + 256), dtype=np.int32).reshape(8, dim + 256) % 7
    fn = jax.jit(step, donate_argnums=(1,))
    res = {"device": dev.device_kind, "jax": jax.__version__, "layers": layers,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}

    def run(name, call, make_input, d2h: bool, idle: bool = False):
        h = jnp.zeros_like(h0)
        x = make_input()
        h, o = call(h, x)  # compile / warm
        jax.block_until_ready(h)
        launch = []
        t0 = time.perf_counter()
        for _ in range(a.calls):
            xi = make_input() if make_input is not None else x
            if idle:  # the device idle at the launch (each call waited for)
                jax.block_until_ready((h, xi))
            t = time.perf_counter()
            h, o = call(h, xi)
            launch.append(time.perf_counter() - t)
            if d2h:
                o.copy_to_host_async()
        jax.block_until_ready(h)
        wall = (time.perf_counter() - t0) / a.calls
        r = dict(variant=name, launch_ms_median=1e3 * float(np.median(launch[3:])), wall_ms_per_call=1e3 * wall)
        res["runs"].append(r)
        print(json.dumps(r), flush=True)

    fresh = lambda: jax.device_put(ib, dev)  # noqa: E731
    same_x = fresh()
    run("same input", lambda h, x: fn(w, h, x), lambda: same_x, False)
    run("fresh input (device_put of numpy)", lambda h, x: fn(w, h, x), fresh, False)
    run("same input + copy_to_host_async of the output", lambda h, x: fn(w, h, x), lambda: same_x, True)
    run("fresh input + copy_to_host_async", lambda h, x: fn(w, h, x), fresh, True)
    run("same input, 200 more arguments", lambda h, x: fn(w, h, x, *small), lambda: same_x, False)
    run("fresh input, 200 more arguments", lambda h, x: fn(w, h, x, *small), fresh, False)
    # is it the command buffer's update when an address changes? every input and output at a fixed
    # address (the output written into a donated buffer), against fresh inputs / outputs, device idle
    fo = jax.jit(step_out, donate_argnums=(1, 3))
    ob = [jnp.zeros((8,), jnp.int32)]

    def call_out(h, x):
        h, ob[0] = fo(w, h, x, ob[0])
        return h, ob[0]

    run("same input, output in a donated buffer", call_out, lambda: same_x, False)
    run("fresh input, output in a donated buffer", call_out, fresh, False)
    run("same input, output in a donated buffer, device idle", call_out, lambda: same_x, False, idle=True)
    run("same input, device idle", lambda h, x: fn(w, h, x), lambda: same_x, False, idle=True)
    run("fresh input, device idle", lambda h, x: fn(w, h, x), fresh, False, idle=True)
    pool = [fresh() for _ in range(4)]
    it = iter(range(10**9))
    run("4 input buffers made once, rotated", lambda h, x: fn(w, h, x), lambda: pool[next(it) % 4], False)
    if gpu:
        try:
            pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
            fp = jax.jit(step_pinned, donate_argnums=(1,))
            run("fresh input in pinned host memory", lambda h, x: fp(w, h, x),
                lambda: jax.device_put(ib, pinned), False)
        except Exception as e:  # noqa: BLE001 - a variant this jax does not take: say so, go on
            res["runs"].append(dict(variant="pinned host input", error=f"{type(e).__name__}: {e}"[:300]))
        try:  # numpy -> pinned host array (a host copy) -> device (a DMA from pinned memory), then the step
            pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
            on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
            def run_put_timed(name, call, put):  # `run`, plus the median host time of each input's put
                puts = []

                def make():
                    t = time.perf_counter()
                    x = put()
                    puts.append(time.perf_counter() - t)
                    return x
                run(name, call, make, False)
                res["runs"][-1]["put_ms_median"] = 1e3 * float(np.median(puts[3:]))

            run_put_timed("fresh input staged through pinned host memory", lambda h, x: fn(w, h, x),
                          lambda: jax.device_put(jax.device_put(ib, pinned), on_dev))
            run_put_timed("fresh input in pinned host memory (put timed)", lambda h, x: fp(w, h, x),
                          lambda: jax.device_put(ib, pinned))
        except Exception as e:  # noqa: BLE001
            res["runs"].append(dict(variant="staged through pinned host", error=f"{type(e).__name__}: {e}"[:300]))

        def awaited():  # the transfer waited for before the launch: does the copy itself wait for the device?
            x = fresh()
            t = time.perf_counter()
            x.block_until_ready()
            waits.append(time.perf_counter() - t)
            return x
        waits = []
        run("fresh input, transfer awaited before the launch", lambda h, x: fn(w, h, x), awaited, False)
        res["runs"][-1]["transfer_wait_ms_median"] = 1e3 * float(np.median(waits[3:]))
        try:
            nocb = fn.lower(w, h0, same_x).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
            run("fresh input, no command buffers", lambda h, x: nocb(w, h, x), fresh, False)
        except Exception as e:  # noqa: BLE001
            res["runs"].append(dict(variant="no command buffers", error=f"{type(e).__name__}: {e}"[:300]))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
