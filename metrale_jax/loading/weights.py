"""`WeightReader`: what a model family's weight map reads tensors through.

It checks each tensor's presence and shape against the config (clear errors naming the tensor
and file), casts to the target dtype one tensor at a time, fills preallocated stacked arrays,
shows a progress bar, and places the finished tree on the device.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

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


_BAND_ROWS = 256  # rows of a checkpoint weight per transposition task


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="metrale-load")


def transpose_into(dst: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """dst[K, sum n_j] = concatenate(parts).T for checkpoint weights parts[j] [n_j, K] (cast to
    dst's dtype), in bands of 256 rows on a thread pool (numpy copies release the GIL). Loading
    is mostly these transpositions: numpy's strided copy of a whole `w.T` runs at 0.3 GB/s for
    2-byte elements; in bands, 2.4-2.7 GB/s on the dev box's 2 cores (bf16 weights of 1024 to
    128256 rows by 4096 or 14336; bands of 128 or 512 rows ran at 1.2-2.5 GB/s)."""
    jobs, col = [], 0
    for p in parts:
        if p.ndim != 2 or p.shape[1] != dst.shape[0]:
            raise ValueError(f"a part of shape {p.shape} does not transpose into {dst.shape}")
        jobs += [(dst[:, col + r:col + min(r + _BAND_ROWS, p.shape[0])], p[r:r + _BAND_ROWS])
                 for r in range(0, p.shape[0], _BAND_ROWS)]
        col += p.shape[0]
    if dst.ndim != 2 or col != dst.shape[1]:
        raise ValueError(f"parts of {col} rows do not fill {dst.shape}")

    def band(job):
        job[0][...] = job[1].T

    if len(jobs) == 1:
        band(jobs[0])
    else:
        list(_pool().map(band, jobs))


class LayerStack:
    """One layer-stacked parameter f[n, *shape], filled one layer at a time (`stack[i] = ...`,
    `stack[i, j, a:b] = ...`, layers in order) and streamed: when layer i + 1 begins, layer i goes
    to the device through `place(names, array)` and its host buffer is dropped, so the host never
    holds more than one layer of it. `names`: the parameter's tree-path keys (the tensor-parallel
    rules place by them); `WeightReader.to_device` checks them against the tree it is given."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype, names: tuple[str, ...], place, fill=None):
        self.shape = (n,) + tuple(shape)
        self.dtype = np.dtype(dtype)
        self.names = names
        self._place, self._fill = place, fill
        self.parts: list = []  # the device arrays of the finished layers
        self._buf: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __setitem__(self, idx, value) -> None:
        i, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        self.layer(i)[rest if rest else ...] = value

    def layer(self, i: int) -> np.ndarray:
        """Layer i's host buffer, to be written in place (the layers in order, as with `stack[i] = ...`)."""
        if self._buf is not None and i == len(self.parts) + 1:
            self._flush()
        if i != len(self.parts):
            raise RuntimeError(f"{'/'.join(self.names)}: layer {i} written out of order (at layer "
                               f"{len(self.parts)}; a weight map must fill the layers in order)")
        if self._buf is None:
            self._buf = (np.empty(self.shape[1:], self.dtype) if self._fill is None
                         else np.full(self.shape[1:], self._fill, self.dtype))
        return self._buf

    def _flush(self) -> None:
        self.parts.append(self._place(self.names, self._buf))
        self._buf = None

    def repeated(self, n: int) -> LayerStack:
        """A finished stack of `n` layers, each a device copy of this one-layer stack's layer."""
        (one,) = self.finish()
        out = LayerStack(n, self.shape[1:], self.dtype, self.names, self._place)
        out.parts = [one] + [jax.numpy.copy(one) for _ in range(n - 1)]
        return out

    def finish(self) -> list:
        """The per-layer device arrays, once every layer was written."""
        if self._buf is not None:
            self._flush()
        if len(self.parts) != self.shape[0]:
            raise RuntimeError(f"{'/'.join(self.names)}: {len(self.parts)} of {self.shape[0]} layers written")
        return self.parts


@functools.cache
def _int_readers(dense: bool) -> dict:
    """method -> (the tensor marking a module quantized, its reader): of the formats read dense
    (`quant.int8`, `quant.bnb`), or of the 4-bit ones (`quant.w4`)."""
    from metrale_jax.quant import bnb, int8, w4

    return {**int8.READERS, **bnb.READERS} if dense else w4.READERS


class WeightReader:
    """Reads HF-named tensors from a TensorSource into numpy arrays of one dtype.

    FP8 block-scaled checkpoints (`weight` float8_e4m3fn + `weight_scale_inv`): `linears` keeps
    a linear in FP8 when the checkpoint does (or everywhere with `quantize_fp8`), and `get`
    dequantizes any other FP8 tensor to the model dtype.
    """

    def __init__(self, source, dtype, origin: str = "", show_progress: bool = True, quantize_fp8: bool = False,
                 split_layers: bool = False, w4_scheme=None, quantize_w4: str | None = None, sharder=None,
                 dense_scheme=None):
        self.source = source
        self.dtype = np_dtype(dtype)
        self.origin = origin
        self.show_progress = show_progress
        self.split_layers = split_layers  # to_device: per-layer arrays (the GPU engine's layout)
        self.quantize_fp8 = quantize_fp8
        self.w4_scheme = w4_scheme  # quant.w4.W4Scheme of a 4-bit checkpoint (linears_w4.py)
        # quant.int8.Int8Scheme / quant.bnb.BnbScheme: a format no kernel here runs (`get` dequantizes it)
        self.dense_scheme = dense_scheme
        self.quantize_w4 = quantize_w4  # "int4" | "nvfp4": quantize the decoder linears at load
        # parallel.Sharder: stream layer-stacked parameters to their shards a layer at a time
        # (`LayerStack`; named `stacked`/`linears` calls) instead of building them on the host
        self.sharder = sharder
        self._names = set(source.names()) if source is not None else set()
        self.used: set[str] = set()
        self.dequantized: list[str] = []  # quantized (4-bit, 8-bit, FP8) weights loaded dense: `get`

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, shape: tuple[int, ...], cast: bool = False) -> np.ndarray:
        """The tensor `name` as float32 numpy (or the target dtype if cast), checked against shape."""
        if name not in self._names or self._dense_marker(name):  # (an int8 / packed `weight` beside its scales)
            arr = self._dequantized_int(name, shape)
            return self.cast(arr) if cast else arr
        got = tuple(self.source.shape(name))
        if got != tuple(shape):
            raise TensorShapeError(
                f"tensor {name!r} in {self.origin} has shape {got}, expected {tuple(shape)} from the config"
            )
        self.used.add(name)
        arr = np.asarray(self.source.load(name))
        if arr.dtype == FP8:
            from metrale_jax.quant.fp8 import dequantize_fp8

            arr = dequantize_fp8(arr, self._scale_of(name), name=name)
            self.dequantized.append(name[: -len(".weight")] if name.endswith(".weight") else name)
        if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)):
            raise UnsupportedDtypeError(
                f"tensor {name!r} in {self.origin} has dtype {arr.dtype}; a float type was expected"
            )
        return self.cast(arr) if cast else arr.astype(np.float32)

    def _dense_marker(self, name: str) -> bool:
        """Whether `name` is a quantized weight stored under its own name (int8, bitsandbytes' packed
        bytes, ModelOpt NVFP4's packed codes), beside the tensor that marks it quantized."""
        scheme = self.dense_scheme or self.w4_scheme
        if scheme is None or not name.endswith(".weight"):
            return False
        return self.has(name[: -len("weight")] + _int_readers(self.dense_scheme is not None)[scheme.method][0])

    def _dequantized_int(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """f32 `shape` of a quantized weight read dense: any weight of a format no kernel here runs
        (8-bit integers, bitsandbytes: `dense_scheme`), or a 4-bit one no 4-bit kernel reads
        (lm_head, MoE experts, other families' layers, a linear quantized in some layers only);
        named in `dequantized`. MissingTensorError if the checkpoint has no such weight."""
        from metrale_jax.quant import w4

        scheme = self.dense_scheme or self.w4_scheme
        readers = _int_readers(self.dense_scheme is not None)
        marker, read = readers[scheme.method] if scheme is not None else (None, None)
        prefix = name[: -len("weight")] if name.endswith(".weight") else None
        if marker is None or prefix is None or not self.has(prefix + marker):
            quantized = f" (nor its {scheme.method} tensor {prefix + marker!r})" if marker and prefix else ""
            raise MissingTensorError(f"tensor {name!r}{quantized} is missing from checkpoint {self.origin}")
        if len(shape) != 2:
            raise UnsupportedDtypeError(f"{self.origin}: {name} is quantized ({scheme.method}) but is read as a "
                                        f"{len(shape)}-D tensor {tuple(shape)}; quantized weights must be matrices")
        from metrale_jax.loading.linears_w4 import TensorLoader

        self.dequantized.append(name[: -len(".weight")])
        out = read(TensorLoader(self), prefix, shape[0], shape[1], scheme)
        return out if self.dense_scheme is not None else w4.dequantize_w4(out)

    def _scale_name(self, name: str) -> str:
        """The scale tensor of FP8 weight `name`: `<name>_scale_inv` (block FP8) or `<module>.weight_scale`
        (per-tensor FP8, compressed-tensors; `quant.fp8`)."""
        for scale in (name + "_scale_inv", name[: -len("weight")] + "weight_scale"):
            if scale in self._names:
                return scale
        raise MissingTensorError(f"FP8 tensor {name!r} in {self.origin} has no {name + '_scale_inv'!r} or "
                                 "weight_scale")

    def _scale_of(self, name: str) -> np.ndarray:
        scale = self._scale_name(name)
        self.used.add(scale)
        return np.asarray(self.source.load(scale))

    def fp8_kind(self, name: str) -> str | None:
        """"block" for an FP8 weight with block scales or one per tensor, "channel" for one with a
        scale per output channel ([N] or [N, 1]; `quant.fp8`), None for any other tensor."""
        if name not in self._names or np.dtype(self.source.dtype(name)) != FP8:
            return None
        n = self.source.shape(name)[0]
        return "channel" if n > 1 and tuple(self.source.shape(self._scale_name(name))) in ((n, 1), (n,)) else "block"

    def is_fp8(self, name: str) -> bool:
        """Whether `name` is an FP8 weight with block scales (or one per tensor): what the FP8
        experts take (`loading/experts.py`); linears take per-channel ones too (`linears`)."""
        return self.fp8_kind(name) == "block"

    def _fp8_codes(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """The stored codes f8[N, K] of FP8 weight `name`, checked against shape."""
        got = tuple(self.source.shape(name))
        if got != tuple(shape):
            raise TensorShapeError(f"tensor {name!r} in {self.origin} has shape {got}, expected {tuple(shape)}")
        self.used.add(name)
        w8 = np.asarray(self.source.load(name))
        if w8.dtype != FP8:
            raise UnsupportedDtypeError(f"{name}: FP8 weights must be float8_e4m3fn; got {w8.dtype}")
        return w8

    def fp8_weight(self, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(w8 f8[N, K], scale_inv f32[ceil(N/128), ceil(K/128)]): as stored, or quantized now."""
        from metrale_jax.quant.fp8 import fp8_block_scales, quantize_fp8_block

        if not self.is_fp8(name):
            return quantize_fp8_block(self.get(name, shape))
        w8 = self._fp8_codes(name, shape)
        return w8, fp8_block_scales(w8.shape, self._scale_of(name), name=self._scale_name(name))

    def fp8_channel_weight(self, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(w8 f8[N, K], scale f32[N]) of a per-channel FP8 weight (`fp8_kind` "channel")."""
        from metrale_jax.quant.fp8 import fp8_channel_scales

        w8 = self._fp8_codes(name, shape)
        return w8, fp8_channel_scales(self._scale_of(name), shape[0], name=self._scale_name(name))

    def w4_quantized(self, name: str, shape: tuple[int, int]):
        """`quant.w4.W4Weight` of dense weight `name` [N, K] quantized now (`quantize_w4`: "int4" | "nvfp4")."""
        from metrale_jax.quant import w4 as q4

        w = self.get(name, shape)
        return q4.quantize_int4(w) if self.quantize_w4 == "int4" else q4.quantize_nvfp4(w)

    def fp8_stack(self, num_layers: int, lead: tuple[int, ...], k: int, sizes: list[int], key: str, mode: str,
                  names: Callable[..., list[str]], desc: str = "") -> Fp8Linear:
        """An `Fp8Linear` [L, *lead, N_pad, K] (lead: e.g. the experts) of FP8 weights: names(i, *j)
        lists layer i's (and index j's) weights [sizes[p], K] in output order, each padded to whole
        128-row blocks. mode: "block" (stored with block or per-tensor scales), "channel" (stored
        with per-channel scales: the codes, block scales 1, the scales as `col_scale`) or
        "quantize" (quantized now where not stored in FP8). key: its name in the parameter tree."""
        padded = [math.ceil(n / FP8_BLOCK) * FP8_BLOCK for n in sizes]
        starts = np.cumsum([0] + padded[:-1]).tolist()
        w8 = self.stacked(num_layers, (*lead, sum(padded), k), (key, "w8"), dtype=FP8, fill=0)
        scale = self.stacked(num_layers, (*lead, sum(padded) // FP8_BLOCK, math.ceil(k / FP8_BLOCK)),
                             (key, "scale_inv"), dtype=np.float32, fill=1)
        col = None
        if mode == "channel":
            col = self.stacked(num_layers, (*lead, sum(padded)), (key, "col_scale"), dtype=np.float32, fill=1)
        for i in self.progress(range(num_layers), desc):
            for j in itertools.product(*map(range, lead)):
                for name, n, start in zip(names(i, *j), sizes, starts):
                    at, rows, block = (i, *j), slice(start, start + n), start // FP8_BLOCK
                    if mode == "channel":
                        w8[(*at, rows)], col[(*at, rows)] = self.fp8_channel_weight(name, (n, k))
                        scale[(*at, block)] = 1.0  # (a write: a streamed `LayerStack` places written layers)
                        continue
                    q, s = self.fp8_weight(name, (n, k))
                    w8[(*at, rows)] = q
                    scale[(*at, slice(block, block + s.shape[0]))] = s
        return Fp8Linear(w8, scale, tuple(zip(starts, sizes)), col_scale=col)

    def linears(self, num_layers: int, k: int, parts: Callable[[int], list[tuple[str, int]]], desc: str = "",
                key: str = ""):
        """One (possibly fused) linear per layer, stacked: parts(i) lists layer i's checkpoint
        weights [N_j, K] in output order. -> f[L, K, sum N_j], or an `Fp8Linear` when the
        checkpoint stores these weights in FP8 (or with quantize_fp8). key: its name in the
        parameter tree (for the tensor-parallel placement while streaming). Per-channel FP8 parts
        stay FP8 too: their codes with block scales of 1 and the channel scales as `col_scale`."""
        if self.w4_scheme is not None or self.quantize_w4:
            from metrale_jax.loading.linears_w4 import read_w4_linears

            w4 = read_w4_linears(self, num_layers, k, parts, desc)
            if w4 is not None:
                return w4
        first = [name for name, _ in parts(0)]
        kinds = {self.fp8_kind(n) for n in first}
        if not self.quantize_fp8 and None in kinds and len(kinds) > 1:
            raise LoadError(f"{self.origin}: the fused weights {first} mix FP8 and non-FP8 tensors")
        # (block and per-channel parts: None, dense, `get` dequantizes)
        mode = "quantize" if self.quantize_fp8 else kinds.pop() if len(kinds) == 1 else None
        sizes = [n for _, n in parts(0)]
        if mode is None:
            out = self.stacked(num_layers, (k, sum(sizes)), key)
            for i in self.progress(range(num_layers), desc):
                # cast, then transpose: a same-dtype strided copy (4x faster than a casting one)
                self.put_t(out, i, *[self.get(name, (n, k), cast=True) for name, n in parts(i)])
            return out
        return self.fp8_stack(num_layers, (), k, sizes, key, mode, lambda i: [name for name, _ in parts(i)], desc)

    def cast(self, arr: np.ndarray) -> np.ndarray:
        """arr in the model dtype, contiguous (arr itself, maybe a read-only view, if it already is)."""
        return np.ascontiguousarray(arr.astype(self.dtype, copy=False))

    @staticmethod
    def put_t(stack, idx, *parts: np.ndarray) -> None:
        """stack[idx] = concatenate(parts).T for checkpoint weights [n_j, K] (`transpose_into`);
        stack: a host stack from `stacked` (a numpy array or a `LayerStack`), idx: a layer or
        (layer, expert, ...)."""
        i, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        dst = stack.layer(i) if isinstance(stack, LayerStack) else stack[i]
        transpose_into(dst[rest] if rest else dst, parts)

    @staticmethod
    def transposed(arr: np.ndarray) -> np.ndarray:
        """A new contiguous arr.T of a 2-D checkpoint weight (`transpose_into`)."""
        out = np.empty(arr.shape[::-1], arr.dtype)
        transpose_into(out, [arr])
        return out

    def stacks(self, n: int, **shapes: tuple[int, ...]) -> dict:
        """{name: self.stacked(n, shape, name)} for each name=shape: a weight map's stacked parameters."""
        return {name: self.stacked(n, shape, name) for name, shape in shapes.items()}

    def stacked(self, n: int, shape: tuple[int, ...], name: str | tuple[str, ...] = "", dtype=None, fill=None):
        """f[n, *shape] of the model dtype (or `dtype`) for a weight map to fill layer by layer:
        a host array (uninitialized unless `fill`), or, with a sharder or `split_layers`, a
        `LayerStack` that streams each finished layer to the device (to its shards), so the host
        holds one layer of it and the copies overlap the reading of the next layer.
        name: the parameter's key in the tree (a tuple for nested keys, e.g. ("wqkv", "w8"))."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if self.sharder is not None or self.split_layers:
            return LayerStack(n, shape, dtype, (name,) if isinstance(name, str) else tuple(name), self._put, fill)
        if fill is None:
            return np.empty((n,) + tuple(shape), dtype)
        return np.full((n,) + tuple(shape), fill, dtype)

    def _put(self, names: tuple[str, ...], x):
        """One array on the device: on its tensor-parallel shards with a sharder (placed by its names)."""
        return self.sharder.put(names, x) if self.sharder is not None else jax.device_put(x)

    def progress(self, it: Iterable, desc: str):
        return tqdm(it, desc=f"loading {desc}", disable=None if self.show_progress else True, leave=False)

    def to_device(self, tree):
        """Place the tree on the device as built (FP8 weights and their f32 scales keep their dtypes);
        with `split_layers`, layer-stacked leaves as per-layer arrays (`layers.stack.Unstacked`);
        with a sharder, every leaf on its shards (`LayerStack`s are there already)."""
        if self.sharder is None and not self.split_layers:
            return jax.tree.map(jax.device_put, tree)
        from metrale_jax.layers.stack import GLOBAL_KEYS, Unstacked

        def place(path, x):
            names = tuple(str(getattr(k, "key", getattr(k, "name", ""))) for k in path)
            keys = tuple(n for n in names if n)
            if isinstance(x, LayerStack):
                if x.names[-1] != keys[-1] or (len(x.names) > 1 and x.names[-2] != keys[-2]):
                    raise RuntimeError(f"a weight map named {'/'.join(x.names)} the parameter it put at "
                                       f"{'/'.join(keys)} (a bug: its tensor-parallel placement would be wrong)")
                parts = x.finish()
            elif keys[0] in GLOBAL_KEYS:
                return self._put(keys, x)
            else:  # a layer-stacked leaf built on the host (4-bit linears)
                parts = [self._put(keys, np.asarray(x)[i]) for i in range(x.shape[0])]
            if self.split_layers:
                return Unstacked(parts)
            stacked = self.sharder.sharding_for(keys, (len(parts),) + parts[0].shape)
            return jax.jit(lambda *p: jax.numpy.stack(p), out_shardings=stacked)(*parts)

        return jax.tree_util.tree_map_with_path(place, tree, is_leaf=lambda x: isinstance(x, LayerStack))
