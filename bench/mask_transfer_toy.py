"""Does a fresh structured-output mask have to wait for the running forward? A toy of the engine's
constrained decode step (issue 20), for the next H200 call.

The engine splits a constrained step in two executables: the forward (logits) is launched first,
the host fills the grammar masks while it runs, then a small sampling executable takes the logits
and the mask. Session 18's `bench/launch_toy.py` found that a buffer fresh from `jax.device_put`
arrives only when the step already running on the device is done, so the mask's copy and the
sample's launch come after the forward instead of during it. This toy times the step period of
that loop (forward -> host work -> mask -> sample -> read the tokens -> next forward) with the mask
sent three ways:
* `same`: one mask made once and kept on the device (no transfer: the floor);
* `device_put`: `jax.device_put(mask)` each step (what the engine does);
* `pinned_host`: the mask put in pinned host memory (a host-side copy, no device stream) and moved
  to the device inside the sampling executable, when it runs.
beside the forward alone, back to back. The host work stands in for llguidance's fill (a busy wait
of `--host-ms`). `put_and_launch_ms_*`: the host's time from the mask's put to the sample's launch
returning (near zero unless the launch waits for the running forward).

    python bench/mask_transfer_toy.py [--rows 64] [--vocab 128256] [--hidden 8192] [--layers 120]
        [--host-ms 2] [--steps 40] [--out FILE.json]
    python bench/mask_transfer_toy.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def run(rows: int, vocab: int, hidden: int, layers: int, host_ms: float, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    words = -(-vocab // 32)
    key = jax.random.key(0)
    # 4 distinct matrices cycled through `layers` matmuls (each larger than the L2: re-read from HBM)
    ws = (jax.random.normal(key, (4, hidden, hidden), jnp.float32) / hidden ** 0.5).astype(jnp.bfloat16)
    emb = (jax.random.normal(jax.random.fold_in(key, 99), (vocab, hidden), jnp.float32)).astype(jnp.bfloat16)

    @jax.jit
    def forward(ws, emb, tokens):  # i32[rows] -> f32[rows, vocab]
        x = jax.lax.fori_loop(0, layers, lambda i, x: jnp.tanh(x @ ws[i % 4]), emb[tokens])
        return jnp.einsum("rh,vh->rv", x, emb, preferred_element_type=jnp.float32)

    def masked_argmax(logits, mask):  # mask i32[rows, words]: bit v % 32 of word v // 32 allows v
        v = jnp.arange(logits.shape[1], dtype=jnp.int32)
        ok = (jnp.take(mask, v // 32, axis=1) >> (v % 32)) & 1
        return jnp.argmax(jnp.where(ok == 1, logits, -jnp.inf), axis=1).astype(jnp.int32)

    sample = jax.jit(masked_argmax)
    dev_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    sample_pinned = jax.jit(lambda logits, mask: masked_argmax(logits, jax.device_put(mask, dev_sharding)),
                            in_shardings=(dev_sharding, pinned))
    rng = np.random.default_rng(0)
    masks = [rng.integers(-2 ** 31, 2 ** 31, (rows, words), dtype=np.int64).astype(np.int32) | 1 for _ in range(4)]
    tokens0 = jnp.zeros((rows,), jnp.int32)

    def busy(ms):
        t = time.perf_counter() + ms / 1e3
        while time.perf_counter() < t:
            pass

    def loop(kind: str) -> float:
        same = jax.device_put(masks[0])
        tokens = tokens0
        jax.block_until_ready(tokens)
        times, launch = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            logits = forward(ws, emb, tokens)
            busy(host_ms)  # the grammar fill, while the forward runs
            m = masks[i % len(masks)]
            t1 = time.perf_counter()
            if kind == "same":
                tokens = sample(logits, same)
            elif kind == "device_put":
                tokens = sample(logits, jax.device_put(m, dev_sharding))
            else:
                tokens = sample_pinned(logits, jax.device_put(m, pinned))
            launch.append(time.perf_counter() - t1)  # put + launch: ~0 unless it waits for the forward
            tokens.copy_to_host_async()
            np.asarray(tokens)  # the next mask needs this step's tokens
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times[steps // 4:])), 1e3 * float(np.median(launch[steps // 4:]))

    def forward_alone() -> float:
        tokens = tokens0
        jax.block_until_ready(forward(ws, emb, tokens))
        t0 = time.perf_counter()
        for _ in range(steps):
            out = forward(ws, emb, tokens)
        jax.block_until_ready(out)
        return 1e3 * (time.perf_counter() - t0) / steps

    res = dict(device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, rows=rows, vocab=vocab,
               hidden=hidden, layers=layers, host_ms=host_ms, steps=steps)
    for kind in ("same", "device_put", "pinned_host"):
        loop(kind)  # compile, warm
    res["forward_alone_ms"] = forward_alone()
    for kind in ("same", "device_put", "pinned_host", "same", "device_put", "pinned_host"):
        step, launch = loop(kind)
        res.setdefault(f"step_ms_{kind}", []).append(step)
        res.setdefault(f"put_and_launch_ms_{kind}", []).append(launch)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=120, help="matmuls per forward (~40 us each at 8192 on an H200)")
    p.add_argument("--host-ms", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes (plumbing only)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.cpu_smoke:
        a.rows, a.vocab, a.hidden, a.layers, a.host_ms, a.steps = 4, 1000, 64, 2, 0.5, 8
    res = run(a.rows, a.vocab, a.hidden, a.layers, a.host_ms, a.steps)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
