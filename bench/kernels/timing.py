"""Timing helpers shared by the kernel benchmarks (run them from the repo root, PYTHONPATH=.)."""

from __future__ import annotations

import statistics
import time

import jax


def time_jax(fn, *args, iters=10, reps=3):
    """Seconds per call: compile + warm-up, then the best of `reps` runs of `iters` back-to-back calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def median_seconds(fn, *args, group=10, groups=7, warmup=2):
    """Seconds per call: the median over `groups` groups of `group` back-to-back calls (after
    `warmup` calls), each group closed by block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(group):
            out = fn(*args)
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / group)
    return statistics.median(per)


def time_torch(fn, iters=10, reps=3):
    """Seconds per call of a torch CUDA op, by CUDA events, best of `reps` runs of `iters` calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


def memcpy_seconds(nbytes, iters=20):
    """Seconds for a device-to-device torch `copy_` of `nbytes` (the bandwidth ceiling: count the
    bytes read plus written, 2 * nbytes, over this time)."""
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    return time_torch(lambda: b.copy_(a), iters=iters)
