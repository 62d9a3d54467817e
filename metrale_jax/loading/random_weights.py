"""Random weights of a real architecture's shapes, for GPU benchmarks and kernel wiring tests.

`RandomWeightReader` stands in for `WeightReader`: the family's own weight map asks it for each
tensor by name and shape, so random models exercise the same loading code as real ones. Norm
weights are drawn around 1 and everything else around 0 with std `scale`. Tensors over
`tile_above` elements repeat one random tile (the numbers don't matter for timing, and drawing
8 billion normals would take minutes).
"""

from __future__ import annotations

import zlib

import numpy as np

from metrale_jax.loading.weights import WeightReader


class _NoSource:
    def names(self):
        return []


class RandomWeightReader(WeightReader):
    def __init__(self, dtype, seed: int = 0, scale: float = 0.2, tile_above: int = 1 << 24, show_progress=False):
        super().__init__(_NoSource(), dtype, origin="<random>", show_progress=show_progress)
        self.seed = seed
        self.scale = scale
        self.tile_above = tile_above

    def has(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: tuple[int, ...], cast: bool = False) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        n = int(np.prod(shape))
        if n > self.tile_above:
            tile = rng.standard_normal(1 << 20, dtype=np.float32)
            arr = np.resize(tile, n).reshape(shape)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32)
        base = 1.0 if "norm" in name else 0.0
        arr = base + self.scale * arr
        return self.cast(arr) if cast else arr
