"""8-bit integer weights (GPTQ 8-bit, compressed-tensors W8A16 and W8A8-INT8): read and dequantized
at load, to run dense in the model dtype.

There is no int8 kernel here: these checkpoints load and give the model's outputs, with the
memory and speed of the dense model (`WeightReader.get` dequantizes them, and the load warns
once, naming them, as for the 4-bit weights no 4-bit kernel takes). Every format below is
W = (q - z) * s in float32, per group of `group_size` input columns (or per output channel, or
per tensor):

* GPTQ (`quant_method: "gptq"`, `bits: 8`): `qweight` i32[ceil(K/4), N], code k of column n in
  bits 8*(k % 4) of word k // 4; `qzeros` i32[n_groups, ceil(N/4)] packed along N the same way,
  holding zero - 1 (`checkpoint_format: "gptq"`) or the zero (`"gptq_v2"`); `scales`
  [n_groups, N]; `g_idx` i32[K], the group of each input column (act-order shuffles it).
* compressed-tensors `pack-quantized` with 8-bit int weights (llm-compressor's W8A16):
  `weight_packed` i32[N, ceil(K/4)], element k in byte k of the row's little-endian words, stored
  as value + 128; `weight_scale` [N, n_groups] or [N, 1]; asymmetric: `weight_zero_point`
  i32[ceil(N/4), n_groups], packed along N, + 128; optional `weight_g_idx`.
* compressed-tensors `int-quantized` (W8A8-INT8, e.g. llm-compressor's SmoothQuant + GPTQ
  checkpoints): `weight` int8[N, K]; `weight_scale` [N, 1] (channel), [1] or [] (tensor) or
  [N, n_groups] (group); asymmetric: `weight_zero_point` shaped like the scale. Their activation
  quantization is not applied: activations stay in the model dtype (closer to the unquantized
  model than an int8 GEMM; `input_scale` is not read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from metrale_jax.errors import TensorShapeError, UnsupportedDtypeError
from metrale_jax.quant import w4 as q4


@dataclass(frozen=True)
class Int8Scheme:
    """What quantization_config says about 8-bit integer weights (`parse_int8_config`).

    method: "gptq" | "ct-packed" (compressed-tensors pack-quantized) | "ct-int" (int-quantized).
    group_size: input columns per scale (None: from the tensors' shapes).
    gptq_v1: GPTQ stores zero - 1 (checkpoint_format "gptq").
    group_sizes: config groups with different group sizes: the sizes declared (`quant.w4.ct_scales`).
    """

    method: str
    group_size: int | None = None
    gptq_v1: bool = True
    group_sizes: tuple[int, ...] = ()
    label: ClassVar[str] = "8-bit integer"  # (in the load's warning)


def _err(msg: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(f"quantization_config: {msg}")


def parse_int8_config(qc: Mapping) -> Int8Scheme | None:
    """The 8-bit integer scheme of a quantization_config, None if it is not one (4-bit and FP8
    configs are parsed elsewhere). UnsupportedDtypeError for an 8-bit variant we cannot read."""
    if not isinstance(qc, Mapping):
        return None
    method = qc.get("quant_method")
    if method == "gptq" and qc.get("bits") == 8:
        return Int8Scheme("gptq", q4.parse_group(qc.get("group_size", 128), "GPTQ"), gptq_v1=q4.gptq_v1(qc))
    if method != "compressed-tensors":
        return None
    groups = (qc.get("config_groups") or {}).items()
    fmts = {g.get("format", qc.get("format")) for _, g in groups}
    eight = [name for name, g in groups if (g.get("weights") or {}).get("num_bits") == 8
             and (g.get("weights") or {}).get("type", "int") == "int"]
    if "int-quantized" not in fmts and not eight:
        return None
    if len(fmts) > 1 or (fmts == {"pack-quantized"} and len(eight) != len(groups)):
        raise _err(f"compressed-tensors config_groups mixing formats or bit widths ({sorted(fmts)}) "
                   "are not supported")
    sizes = set()
    for name, g in groups:
        w = g.get("weights") or {}
        if w.get("type", "int") != "int" or not 2 <= int(w.get("num_bits", 8)) <= 8:
            raise _err(f"compressed-tensors {name}: {w.get('num_bits')}-bit {w.get('type')!r} "
                       "weights are not supported in int-quantized / 8-bit pack-quantized form")
        if w.get("dynamic"):
            raise _err(f"compressed-tensors {name}: dynamic weight quantization is not supported")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "group"):
            raise _err(f"compressed-tensors {name}: int weight strategy {strategy!r} is not "
                       "supported ('tensor', 'channel' or 'group')")
        sizes.add(q4.parse_group(w.get("group_size"), "compressed-tensors") if strategy == "group" else None)
    return Int8Scheme("ct-int" if fmts == {"int-quantized"} else "ct-packed",
                      next(iter(sizes)) if len(sizes) == 1 else None,
                      group_sizes=tuple(sorted(x for x in sizes if x is not None)))


def dequantize_groups(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, g: int,
                      g_idx: np.ndarray | None = None) -> np.ndarray:
    """q [N, K] (integers), scale / zero [N, n_groups] -> W f32[N, K] = (q - zero) * scale of each
    column's group: columns gi*g.. (or g_idx[K] the group of each column: GPTQ's act-order); in
    bands of rows on the loading threads (numpy's arithmetic releases the GIL: a 14,336 x 4,096
    matrix took 0.4-1.1 s in one thread on the dev box)."""
    from metrale_jax.loading.weights import _BAND_ROWS, _pool

    n, k = q.shape
    out = np.empty((n, k), np.float32)
    s = scale.astype(np.float32)
    z = None if zero is None else zero.astype(np.float32)

    def per_column(a: np.ndarray) -> np.ndarray:  # [rows, n_groups] -> broadcastable to [rows, K]
        if a.shape[1] == 1:
            return a
        return a[:, g_idx] if g_idx is not None else np.repeat(a, g, axis=1)[:, :k]

    def band(r0: int) -> None:
        r = slice(r0, min(r0 + _BAND_ROWS, n))
        w = out[r]
        w[...] = q[r]
        if z is not None:
            w -= per_column(z[r])
        w *= per_column(s[r])

    list(_pool().map(band, range(0, n, _BAND_ROWS)))
    return out


def _group_index(load, name: str, k: int, g: int) -> np.ndarray | None:
    """The act-order group of each column (`name`: GPTQ's g_idx), checked as the 4-bit readers check
    it (`quant.w4.act_order`); None when absent or trivial."""
    if not load.has(name):
        return None
    g_idx = load(name)
    return None if q4.act_order(g_idx, k, g, name) is None else np.asarray(g_idx, np.int64)


def read_gptq8(load, prefix: str, n: int, k: int, scheme: Int8Scheme) -> np.ndarray:
    g = scheme.group_size or k
    ng = -(-k // g)
    qw = q4.u32_words(load(prefix + "qweight"), prefix + "qweight")
    q4.check_shape(qw, (-(-k // 4), n), prefix + "qweight")
    qz = q4.u32_words(load(prefix + "qzeros"), prefix + "qzeros")
    q4.check_shape(qz, (ng, -(-n // 4)), prefix + "qzeros")
    zeros = q4.word_bytes(qz, n).T.astype(np.int32) + (1 if scheme.gptq_v1 else 0)  # [N, ng]
    s = q4.int_scales(load(prefix + "scales"), prefix + "scales")
    q4.check_shape(s, (ng, n), prefix + "scales")
    codes = q4.word_bytes(np.ascontiguousarray(qw.T), k)  # u8[N, K] (words along K, transposed)
    return dequantize_groups(codes, s.T, zeros, g, _group_index(load, prefix + "g_idx", k, g))


def read_ct_packed8(load, prefix: str, n: int, k: int, scheme: Int8Scheme) -> np.ndarray:
    shape = tuple(int(d) for d in np.asarray(load(prefix + "weight_shape")).reshape(-1))
    if shape != (n, k):
        raise TensorShapeError(f"{prefix}weight_shape: {shape}, expected {(n, k)} from the config")
    words = q4.u32_words(load(prefix + "weight_packed"), prefix + "weight_packed")
    q4.check_shape(words, (n, -(-k // 4)), prefix + "weight_packed")
    s, g = q4.ct_scales(load, prefix, n, k, scheme.group_size, scheme.group_sizes)
    zeros = None
    if load.has(prefix + "weight_zero_point"):
        zp = q4.u32_words(load(prefix + "weight_zero_point"), prefix + "weight_zero_point")
        q4.check_shape(zp, (-(-n // 4), s.shape[1]), prefix + "weight_zero_point")
        zeros = q4.word_bytes(np.ascontiguousarray(zp.T), n).T.astype(np.int32) - 128  # [N, ng]
    codes = q4.word_bytes(words, k).astype(np.int32) - 128  # the signed values
    return dequantize_groups(codes, s, zeros, g, _group_index(load, prefix + "weight_g_idx", k, g))


def read_ct_int8(load, prefix: str, n: int, k: int, scheme: Int8Scheme) -> np.ndarray:
    q = np.asarray(load(prefix + "weight"))
    if q.dtype != np.int8:
        raise UnsupportedDtypeError(f"{prefix}weight: int-quantized weights must be int8; got {q.dtype}")
    q4.check_shape(q, (n, k), prefix + "weight")
    s, g = q4.ct_scales(load, prefix, n, k, scheme.group_size, scheme.group_sizes)
    zeros = None
    if load.has(prefix + "weight_zero_point"):
        z = np.asarray(load(prefix + "weight_zero_point"))
        if not np.issubdtype(z.dtype, np.integer):
            raise UnsupportedDtypeError(f"{prefix}weight_zero_point: integer zero points expected; got {z.dtype}")
        if z.size == 1 or z.shape == (n,):
            z = z.reshape(-1, 1)
        if z.shape != s.shape and z.shape != (1, 1):
            raise TensorShapeError(f"{prefix}weight_zero_point: shape {z.shape} does not match the scales {s.shape}")
        zeros = np.broadcast_to(z, s.shape).astype(np.int32)
    return dequantize_groups(q, s, zeros, g)


# the tensor whose presence marks a module as quantized (a `weight` of dtype int8 for "ct-int"), and the reader
READERS = {
    "gptq": ("qweight", read_gptq8),
    "ct-packed": ("weight_packed", read_ct_packed8),
    "ct-int": ("weight_scale", read_ct_int8),
}

__all__ = ["Int8Scheme", "parse_int8_config", "READERS"]
