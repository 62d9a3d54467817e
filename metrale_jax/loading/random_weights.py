"""Random weights of a real architecture's shapes, for GPU benchmarks and kernel wiring tests.

`RandomWeightReader` stands in for `WeightReader`: the family's own weight map asks it for each
tensor by name and shape, so random models exercise the same loading code as real ones. Norm
weights are drawn around 1 and everything else around 0 with std `scale`. Tensors over
`tile_above` elements repeat one random tile (the numbers don't matter for timing, and drawing
8 billion normals would take minutes). With `repeat_layers`, for multi-GB benchmark models, every
tensor of one shape is one draw and a stacked linear repeats its first layer (reading and casting
billions of elements on the host took minutes on the GPU machine); the layers still live in
distinct memory, so a step reads every byte, but a layer mix-up would go unseen: tests keep it off.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np

from metrale_jax.layers.linear import Fp8Linear, W4Linear
from metrale_jax.loading.weights import LayerStack, WeightReader

_TILE = 1_048_573  # a prime near 2**20


class _NoSource:
    def names(self):
        return []


class RandomWeightReader(WeightReader):
    def __init__(self, dtype, seed: int = 0, scale: float = 0.2, tile_above: int = 1 << 24, show_progress=False,
                 repeat_layers: bool = False, quantize_fp8: bool = False, split_layers: bool = False,
                 quantize_w4: str | None = None, sharder=None):
        super().__init__(_NoSource(), dtype, origin="<random>", show_progress=show_progress,
                         quantize_fp8=quantize_fp8, split_layers=split_layers, quantize_w4=quantize_w4,
                         sharder=sharder)
        self.seed = seed
        self.scale = scale
        self.tile_above = tile_above
        self.repeat_layers = repeat_layers
        # (shape, is_norm) -> read-only draw; ("fp8", shape) -> its (w8, scale_inv) (repeat_layers)
        self._drawn: dict[tuple, object] = {}

    def has(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: tuple[int, ...], cast: bool = False) -> np.ndarray:
        if self.repeat_layers:
            key = (tuple(shape), "norm" in name)
            if key not in self._drawn:
                self._drawn[key] = self._draw(name, shape)
                self._drawn[key].setflags(write=False)
            arr = self._drawn[key]
            return self.cast(arr) if cast else arr
        arr = self._draw(name, shape)
        return self.cast(arr) if cast else arr

    def _per_shape(self, kind: str, shape, make):
        """make(), once per (kind, shape) with `repeat_layers` (the MoE experts of a layer, quantized
        one by one, would take minutes otherwise), else every call."""
        if not self.repeat_layers:
            return make()
        key = (kind, tuple(shape))
        if key not in self._drawn:
            self._drawn[key] = make()
        return self._drawn[key]

    def fp8_weight(self, name: str, shape: tuple[int, int]):
        """As `WeightReader.fp8_weight` (quantized now: nothing here is FP8), once per shape."""
        return self._per_shape("fp8", shape, lambda: super(RandomWeightReader, self).fp8_weight(name, shape))

    def w4_quantized(self, name: str, shape: tuple[int, int]):
        """As `WeightReader.w4_quantized`, once per shape."""
        return self._per_shape("w4", shape, lambda: super(RandomWeightReader, self).w4_quantized(name, shape))

    def linears(self, num_layers: int, k: int, parts, desc: str = "", key: str = ""):
        if not self.repeat_layers:
            return super().linears(num_layers, k, parts, desc, key)
        one = super().linears(1, k, parts, desc, key)

        def repeat(a):  # streamed (a sharder): copies of the one layer on the device
            return a.repeated(num_layers) if isinstance(a, LayerStack) else np.repeat(a, num_layers, 0)

        if isinstance(one, Fp8Linear):
            return Fp8Linear(repeat(one.w8), repeat(one.scale_inv), one.segments)
        if isinstance(one, W4Linear):
            return jax.tree.map(repeat, one)
        return repeat(one)

    def _draw(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        n = int(np.prod(shape))
        if n > self.tile_above:
            # a prime-length tile: repeating it never lines rows up (with 2**20 values, every
            # 256th row of a 4096-wide matrix was the same, and random models' logits tied exactly)
            tile = rng.standard_normal(_TILE, dtype=np.float32)
            arr = np.resize(tile, n).reshape(shape)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32)
        base = 1.0 if "norm" in name else 0.0
        return (base + self.scale * arr).astype(np.float32)
