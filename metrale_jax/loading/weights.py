"""`WeightReader`: what a model family's weight map reads tensors through.

It checks each tensor's presence and shape against the config (clear errors naming the tensor
and file), casts to the target dtype one tensor at a time, fills preallocated stacked arrays,
shows a progress bar, and places the finished tree on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from metrale_jax.errors import LoadError, MissingTensorError, TensorShapeError, UnsupportedDtypeError
from metrale_jax.layers.linear import FP8_BLOCK, Fp8Linear

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

_NP_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


def np_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(_NP_DTYPES)}")
        return np.dtype(_NP_DTYPES[dtype])
    return np.dtype(dtype)


class WeightReader:
    """Reads HF-named tensors from a TensorSource into numpy arrays of one dtype.

    FP8 block-scaled checkpoints (`weight` float8_e4m3fn + `weight_scale_inv`): `linears` keeps
    a linear in FP8 when the checkpoint does (or everywhere with `quantize_fp8`), and `get`
    dequantizes any other FP8 tensor to the model dtype.
    """

    def __init__(self, source, dtype, origin: str = "", show_progress: bool = True, quantize_fp8: bool = False,
                 split_layers: bool = False, w4_scheme=None, quantize_w4: str | None = None):
        self.source = source
        self.dtype = np_dtype(dtype)
        self.origin = origin
        self.show_progress = show_progress
        self.split_layers = split_layers  # to_device: per-layer arrays (the GPU engine's layout)
        self.quantize_fp8 = quantize_fp8
        self.w4_scheme = w4_scheme  # quant.w4.W4Scheme of a 4-bit checkpoint (linears_w4.py)
        self.quantize_w4 = quantize_w4  # "int4" | "nvfp4": quantize the decoder linears at load
        self._names = set(source.names())
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, shape: tuple[int, ...], cast: bool = False) -> np.ndarray:
        """The tensor `name` as float32 numpy (or the target dtype if cast), checked against shape."""
        if name not in self._names:
            if self.w4_scheme is not None and name.endswith(".weight"):
                from metrale_jax.quant.w4 import READERS

                if self.has(name[: -len("weight")] + READERS[self.w4_scheme.method][0]):
                    raise UnsupportedDtypeError(
                        f"{self.origin}: {name[: -len('.weight')]} is 4-bit ({self.w4_scheme.method}); 4-bit weights "
                        "are supported in the decoder linears of Llama-family models only (not lm_head, embeddings, "
                        "experts or other families' layers)")
            raise MissingTensorError(f"tensor {name!r} is missing from checkpoint {self.origin}")
        got = tuple(self.source.shape(name))
        if got != tuple(shape):
            raise TensorShapeError(
                f"tensor {name!r} in {self.origin} has shape {got}, expected {tuple(shape)} from the config"
            )
        self.used.add(name)
        arr = np.asarray(self.source.load(name))
        if arr.dtype == FP8:
            from metrale_jax.quant.fp8 import dequantize_fp8_block

            arr = dequantize_fp8_block(arr, self._scale_of(name))
        if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)):
            raise UnsupportedDtypeError(
                f"tensor {name!r} in {self.origin} has dtype {arr.dtype}; a float type was expected"
            )
        return self.cast(arr) if cast else arr.astype(np.float32)

    def _scale_of(self, name: str) -> np.ndarray:
        scale = name + "_scale_inv"
        if scale not in self._names:
            raise MissingTensorError(f"FP8 tensor {name!r} in {self.origin} has no {scale!r}")
        self.used.add(scale)
        return np.asarray(self.source.load(scale))

    def is_fp8(self, name: str) -> bool:
        return name in self._names and np.dtype(self.source.dtype(name)) == FP8

    def fp8_weight(self, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(w8 f8[N, K], scale_inv f32[ceil(N/128), ceil(K/128)]): as stored, or quantized now."""
        from metrale_jax.quant.fp8 import check_fp8_weight, quantize_fp8_block

        if not self.is_fp8(name):
            return quantize_fp8_block(self.get(name, shape))
        got = tuple(self.source.shape(name))
        if got != tuple(shape):
            raise TensorShapeError(f"tensor {name!r} in {self.origin} has shape {got}, expected {tuple(shape)}")
        self.used.add(name)
        w8 = np.asarray(self.source.load(name))
        return w8, check_fp8_weight(w8, self._scale_of(name), name=name)

    def linears(self, num_layers: int, k: int, parts: Callable[[int], list[tuple[str, int]]], desc: str = ""):
        """One (possibly fused) linear per layer, stacked: parts(i) lists layer i's checkpoint
        weights [N_j, K] in output order. -> f[L, K, sum N_j], or an `Fp8Linear` when the
        checkpoint stores these weights in FP8 (or with quantize_fp8)."""
        if self.w4_scheme is not None or self.quantize_w4:
            from metrale_jax.loading.linears_w4 import read_w4_linears

            w4 = read_w4_linears(self, num_layers, k, parts, desc)
            if w4 is not None:
                return w4
        first = [name for name, _ in parts(0)]
        fp8 = self.quantize_fp8 or self.is_fp8(first[0])
        if fp8 and not self.quantize_fp8 and not all(self.is_fp8(n) for n in first):
            raise LoadError(f"{self.origin}: the fused weights {first} mix FP8 and non-FP8 tensors")
        sizes = [n for _, n in parts(0)]
        if not fp8:
            out = self.stacked(num_layers, (k, sum(sizes)))
            for i in self.progress(range(num_layers), desc):
                # cast, then transpose: a same-dtype strided copy (4x faster than a casting one)
                out[i] = np.concatenate([self.get(name, (n, k), cast=True) for name, n in parts(i)]).T
            return out
        padded = [math.ceil(n / FP8_BLOCK) * FP8_BLOCK for n in sizes]
        starts = np.cumsum([0] + padded[:-1]).tolist()
        w8 = np.zeros((num_layers, sum(padded), k), FP8)
        scale = np.ones((num_layers, sum(padded) // FP8_BLOCK, math.ceil(k / FP8_BLOCK)), np.float32)
        for i in self.progress(range(num_layers), desc):
            for (name, n), start in zip(parts(i), starts):
                q, s = self.fp8_weight(name, (n, k))
                w8[i, start:start + n] = q
                scale[i, start // FP8_BLOCK:start // FP8_BLOCK + s.shape[0]] = s
        return Fp8Linear(w8, scale, tuple(zip(starts, sizes)))

    def cast(self, arr: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(arr.astype(self.dtype))

    def stacked(self, n: int, shape: tuple[int, ...], name: str = "") -> np.ndarray:
        return np.empty((n,) + tuple(shape), self.dtype)

    def progress(self, it: Iterable, desc: str):
        return tqdm(it, desc=f"loading {desc}", disable=None if self.show_progress else True, leave=False)

    def to_device(self, tree):
        """Place the tree on the device as built (FP8 weights and their f32 scales keep their dtypes);
        with `split_layers`, layer-stacked leaves as per-layer arrays (`layers.stack.device_put_layers`)."""
        if self.split_layers:
            from metrale_jax.layers.stack import device_put_layers

            return device_put_layers(tree)
        return jax.tree.map(jax.device_put, tree)
