"""Walking the layer stack: `lax.scan`, or a Python loop over static layer slices.

Parameters are stacked on a leading layer axis. `lax.scan` compiles one layer body, but on the
GPU XLA copies each iteration's weight slices out of the stacked arrays before the dots: on the
H200 a Llama-3-8B decode step spent 6.7 of its 13 ms in those copies, and the same weight stream
ran 10.9 ms scanned against 3.9 ms with constant slices, which XLA folds into the dots
(bench/kernels/layer_loop.py, bench/results/layer_loop.md). `unroll=True` walks the layers in
Python with constant indices instead: the engine's GPU default. Compile time grows with depth
(the probe: 3.0 s against 1.7 s for 32 layers), so the CPU default stays the scan.

Give per-layer scalars (layer kinds, counters) as numpy: under the Python loop they stay numpy
(static: `switch` becomes a Python call and `take_layer` a constant slice), under the scan
`lax.scan` traces them. The same body serves both.
"""

from __future__ import annotations

import jax
import numpy as np


def scan_layers(body, carry, xs, unroll: bool):
    """carry after `body(carry, xs[i]) -> (carry, None)` for each layer i.

    xs: a pytree of arrays stacked on axis 0 (jax or numpy). unroll: Python loop with static
    slices (numpy leaves stay numpy) instead of `lax.scan`.
    """
    if not unroll:
        return jax.lax.scan(body, carry, xs)[0]
    n = jax.tree.leaves(xs)[0].shape[0]
    for i in range(n):
        carry, _ = body(carry, take_layer(xs, i))
    return carry


def take_layer(tree, i):
    """Layer i of a tree of layer-stacked arrays (a constant slice when i is static)."""
    return jax.tree.map(lambda a: a[i], tree)


def switch(index, branches, *args):
    """`branches[index](*args)`: a Python call when index is static, else `lax.switch`."""
    if isinstance(index, (int, np.integer)):
        return branches[int(index)](*args)
    return jax.lax.switch(index, branches, *args)
