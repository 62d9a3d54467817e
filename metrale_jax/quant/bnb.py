"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`: NF4 / FP4 4-bit and LLM.int8 8-bit, as
transformers saves them), read and dequantized at load, to run dense in the model dtype.

Their 4-bit codes are table lookups (NF4's 16 normal quantiles), not the affine codes of the
4-bit kernels here, so like the 8-bit integer formats (`quant/int8.py`) they load dense, with one
warning naming them. The layouts, as bitsandbytes' `Params4bit` / `Int8Params` serialize them:
* 4-bit: `weight` u8[ceil(N*K/2), 1] (or the same bytes viewed as the `bnb_4bit_quant_storage`
  dtype): the weight flattened row-major, element 2i in the HIGH nibble of byte i, 2i + 1 in the
  low; `weight.quant_map` f32[16] the code table; `weight.absmax` one scale per `blocksize`
  elements, f32, or with double quantization u8 codes of `weight.nested_quant_map` f32[256]
  times `weight.nested_absmax` f32 (one per `nested_blocksize` scales) plus `nested_offset`;
  `weight.quant_state.bitsandbytes__nf4` (or `__fp4`) the JSON of the rest (quant_type,
  blocksize, shape, nested_blocksize, nested_offset, dtypes) as u8 bytes.
  W.flat[i] = quant_map[code_i] * absmax[i // blocksize].
* 8-bit (LLM.int8): `weight` int8[N, K] and `SCB` f32[N], each row's absolute maximum:
  W = weight * SCB / 127. (Its outlier decomposition at inference is not applied.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from metrale_jax.errors import CorruptCheckpointError, TensorShapeError, UnsupportedDtypeError
from metrale_jax.quant.int8 import dequantize_groups


@dataclass(frozen=True)
class BnbScheme:
    """method: "bnb4" (NF4 / FP4) or "bnb8" (LLM.int8)."""

    method: str
    group_size: int | None = None  # (unused: the block size is in each weight's quant state)
    label: ClassVar[str] = "bitsandbytes"  # (in the load's warning)


def parse_bnb_config(qc: Mapping) -> BnbScheme | None:
    """The bitsandbytes scheme of a quantization_config, None if it is not bitsandbytes."""
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "bitsandbytes":
        return None
    four = qc.get("load_in_4bit", qc.get("_load_in_4bit"))
    eight = qc.get("load_in_8bit", qc.get("_load_in_8bit"))
    if bool(four) == bool(eight):
        raise UnsupportedDtypeError("quantization_config: bitsandbytes needs exactly one of load_in_4bit and "
                                    f"load_in_8bit; got {four=}, {eight=}")
    return BnbScheme("bnb4" if four else "bnb8")


def _block_scales(values: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
    """values f32[>= n] times scales[i // block] for i < n -> f32[n]."""
    out = values[:n].astype(np.float32)
    full = n // block * block
    out[:full].reshape(-1, block)[...] *= scales[: full // block, None]
    if full < n:
        out[full:] *= scales[full // block]
    return out


def read_bnb4(load, prefix: str, n: int, k: int, scheme: BnbScheme) -> np.ndarray:
    name = prefix + "weight"
    states = [s for s in ("nf4", "fp4") if load.has(f"{name}.quant_state.bitsandbytes__{s}")]
    if len(states) != 1:
        raise CorruptCheckpointError(f"{name}: one quant_state.bitsandbytes__nf4 or __fp4 expected; found {states}")
    try:
        qs = json.loads(bytes(np.asarray(load(f"{name}.quant_state.bitsandbytes__{states[0]}"), np.uint8)))
    except ValueError as e:
        raise CorruptCheckpointError(f"{name}: quant_state is not JSON: {e}") from None
    if tuple(qs.get("shape") or ()) != (n, k):
        raise TensorShapeError(f"{name}: bitsandbytes shape {qs.get('shape')}, expected {(n, k)} from the config")
    block = int(qs["blocksize"])
    size = n * k
    packed = np.ascontiguousarray(load(name)).view(np.uint8).reshape(-1)
    if packed.size != -(-size // 2):
        raise TensorShapeError(f"{name}: {packed.size} bytes of 4-bit codes, expected {-(-size // 2)}")
    table = np.asarray(load(f"{name}.quant_map"), np.float32).reshape(-1)
    if table.size != 16:
        raise TensorShapeError(f"{name}.quant_map: {table.size} values, expected 16")
    nb = -(-size // block)
    absmax = np.asarray(load(f"{name}.absmax"))
    if load.has(f"{name}.nested_absmax"):  # double quantization: the scales are 8-bit codes themselves
        nested = np.asarray(load(f"{name}.nested_quant_map"), np.float32).reshape(-1)
        codes = absmax.reshape(-1).astype(np.int64)
        absmax = _block_scales(nested[codes], np.asarray(load(f"{name}.nested_absmax"), np.float32).reshape(-1),
                               int(qs["nested_blocksize"]), codes.size) + np.float32(qs["nested_offset"])
    absmax = np.asarray(absmax, np.float32).reshape(-1)
    if absmax.size != nb:
        raise TensorShapeError(f"{name}.absmax: {absmax.size} scales, expected {nb} (blocks of {block})")
    from metrale_jax.loading.weights import _pool

    out = np.empty(size, np.float32)
    step = block * 4096  # elements a band (whole blocks, even): bands on the loading threads

    def band(e0: int) -> None:
        e1 = min(e0 + step, size)
        b = packed[e0 // 2:(e1 + 1) // 2]
        codes = np.empty(2 * b.size, np.uint8)
        codes[0::2], codes[1::2] = b >> 4, b & 15
        out[e0:e1] = _block_scales(table[codes[: e1 - e0]], absmax[e0 // block:], block, e1 - e0)

    list(_pool().map(band, range(0, size, step)))
    return out.reshape(n, k)


def read_bnb8(load, prefix: str, n: int, k: int, scheme: BnbScheme) -> np.ndarray:
    q = np.asarray(load(prefix + "weight"))
    if q.dtype != np.int8 or q.shape != (n, k):
        raise UnsupportedDtypeError(f"{prefix}weight: LLM.int8 weights must be int8[{n}, {k}]; got {q.dtype}{q.shape}")
    scb = np.asarray(load(prefix + "SCB"), np.float32).reshape(-1)
    if scb.size != n:
        raise TensorShapeError(f"{prefix}SCB: {scb.size} row scales, expected {n}")
    return dequantize_groups(q, (scb / np.float32(127.0))[:, None], None, k)


# the tensor whose presence marks a module as quantized (beside its integer `weight`), and the reader
READERS = {
    "bnb4": ("weight.absmax", read_bnb4),
    "bnb8": ("SCB", read_bnb8),
}

__all__ = ["BnbScheme", "parse_bnb_config", "READERS"]
