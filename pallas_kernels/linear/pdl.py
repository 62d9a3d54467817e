"""Programmatic dependent launch (PDL, Hopper) for the Mosaic GPU linear kernels.

A decode step is a chain of short kernels; each linear waits for the one before it (its x) and
then starts its weight stream from HBM cold: the memory pipeline fills while the SMs wait, and
the kernel's launch itself waits for the previous grid to drain. A kernel that calls
`griddepcontrol.wait` is launched by Mosaic GPU with the PDL attribute (`mosaic_gpu.uses_pdl`):
its CTAs may start as soon as every CTA of the kernel before has triggered its dependents (or
exited), so what comes before the wait overlaps that kernel's tail. Here that is an L2 prefetch
(TMA, `cp.async.bulk.prefetch`) of the CTA's constant operands, the weights and their scales,
which nothing before writes; x, which the kernel before writes, is read only after the wait.
After the wait the kernel lets its own dependents launch (they wait for it in turn).

Neither instruction exists in Mosaic GPU's interpret mode (the CPU tests): kernels skip both there.
"""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

# A CTA prefetches at most this many bytes of its tiles: two resident CTAs on each of 132 SMs then
# hold 34 MB of the H200's 50 MB L2 (a prefetch past what L2 keeps would read HBM twice).
PDL_PREFETCH_BYTES = 128 * 1024


def prefetch_count(tiles: int, tile_bytes: int) -> int:
    """How many of a CTA's `tiles` (in stream order, `tile_bytes` each) to prefetch."""
    return max(1, min(tiles, PDL_PREFETCH_BYTES // tile_bytes))


def prefetch_then_wait(constant_tiles) -> None:
    """Queue an L2 prefetch of each GMEM ref of `constant_tiles` (TMA boxes: each dimension at most
    256 elements), wait for the grid before this one, then release the next."""
    for tile in constant_tiles:
        plgpu.async_prefetch(tile)
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()
