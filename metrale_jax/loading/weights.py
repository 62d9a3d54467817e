"""`WeightReader`: what a model family's weight map reads tensors through.

It checks each tensor's presence and shape against the config (clear errors naming the tensor
and file), casts to the target dtype one tensor at a time, fills preallocated stacked arrays,
shows a progress bar, and places the finished tree on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from metrale_jax.errors import MissingTensorError, TensorShapeError, UnsupportedDtypeError

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
    """Reads HF-named tensors from a TensorSource into numpy arrays of one dtype."""

    def __init__(self, source, dtype, origin: str = "", show_progress: bool = True):
        self.source = source
        self.dtype = np_dtype(dtype)
        self.origin = origin
        self.show_progress = show_progress
        self._names = set(source.names())
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, shape: tuple[int, ...], cast: bool = False) -> np.ndarray:
        """The tensor `name` as float32 numpy (or the target dtype if cast), checked against shape."""
        if name not in self._names:
            raise MissingTensorError(f"tensor {name!r} is missing from checkpoint {self.origin}")
        got = tuple(self.source.shape(name))
        if got != tuple(shape):
            raise TensorShapeError(
                f"tensor {name!r} in {self.origin} has shape {got}, expected {tuple(shape)} from the config"
            )
        self.used.add(name)
        arr = np.asarray(self.source.load(name))
        if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)):
            raise UnsupportedDtypeError(
                f"tensor {name!r} in {self.origin} has dtype {arr.dtype}; a float type was expected"
            )
        return self.cast(arr) if cast else arr.astype(np.float32)

    def cast(self, arr: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(arr.astype(self.dtype))

    def stacked(self, n: int, shape: tuple[int, ...], name: str = "") -> np.ndarray:
        return np.empty((n,) + tuple(shape), self.dtype)

    def progress(self, it: Iterable, desc: str):
        return tqdm(it, desc=f"loading {desc}", disable=not self.show_progress, leave=False)

    def to_device(self, tree):
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a, self.dtype) if a.dtype != self.dtype else a), tree)
