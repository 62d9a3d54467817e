"""Programmatic dependent launch (PDL, Hopper) for the Mosaic GPU linear kernels.

A decode step is a chain of short kernels; each linear waits for the one before it (its x) and
then starts its weight stream from HBM cold: the memory pipeline fills while the SMs wait, and
the kernel's launch itself waits for the previous grid to drain. A kernel that calls
`griddepcontrol.wait` is launched by Mosaic GPU with the PDL attribute (`mosaic_gpu.uses_pdl`):
its CTAs may start as soon as every CTA of the kernel before has triggered its dependents (or
exited), so what comes before the wait overlaps that kernel's tail. Here that is an L2 prefetch
(TMA, `cp.async.bulk.prefetch`) of the CTA's constant operands, the weights and their scales,
which nothing before writes; x, which the kernel before writes, is read only after the wait.
Only the tiles of the pipeline's first fill are prefetched: the rest stream as before.
The kernel lets its own dependents launch after its main loop, before its epilogue (they wait for
it in turn). Dependents launched earlier sit on SMs, waiting, that this kernel's later CTAs need.

The first form (session 43) prefetched up to 128 KB a CTA and released its dependents right after the wait. On an
H100 (session 44) it made each kernel 1.4-2.9x slower in isolation, and an int4 batch-1 step with it and
`w4_promote` 3.2x slower than the default's (`bench/results/session44_2026-12-06.md`). This form (H100,
session 45, `bench/results/session45_2026-12-06.md`) is still 1.3-1.6x slower at one row and level to 1.2x at 64 rows;
int4 batch 64 through `generate` 6.84 against 6.54 ms a step. `AttentionConfig.kernel_pdl` stays off.

Neither instruction exists in Mosaic GPU's interpret mode (the CPU tests): kernels skip both there.
"""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

# A CTA prefetches at most this many bytes of its tiles: two resident CTAs on each of 132 SMs then
# hold 34 MB of the H200's 50 MB L2 (a prefetch past what L2 keeps would read HBM twice).
PDL_PREFETCH_BYTES = 128 * 1024


def prefetch_count(tiles: int, tile_bytes: int, depth: int) -> int:
    """How many of a CTA's `tiles` (in stream order, `tile_bytes` each) to prefetch: the first
    `depth` (the pipeline's steps in flight), within PDL_PREFETCH_BYTES."""
    return max(1, min(tiles, depth, PDL_PREFETCH_BYTES // tile_bytes))


def prefetch_then_wait(constant_tiles) -> None:
    """Queue an L2 prefetch of each GMEM ref of `constant_tiles` (TMA boxes: each dimension at most
    256 elements), then wait for the grid before this one."""
    for tile in constant_tiles:
        plgpu.async_prefetch(tile)
    plgpu.griddepcontrol_wait()


def release_dependents() -> None:
    """Let the next grid launch: call it after the main loop. The next grid still waits for this
    one's completion and memory before it reads this one's output."""
    plgpu.griddepcontrol_launch_dependents()
