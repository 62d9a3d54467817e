"""FP8 e4m3 weights with 128x128 block scales, in the HF / DeepSeek-V3 `weight_scale_inv` format
(and the per-tensor and per-channel FP8 of other checkpoints, read into it or dequantized).

The format (DeepSeek-V3 `inference/kernel.py` `weight_dequant`, and HF transformers'
`finegrained_fp8` integration, used by Qwen3-*-FP8 checkpoints):
* `weight` float8_e4m3fn[N, K] (the torch Linear layout: out_features x in_features);
* `weight_scale_inv` f32 (or bf16) [ceil(N/128), ceil(K/128)];
* W[n, k] ~= float(weight[n, k]) * weight_scale_inv[n // 128, k // 128]. The last row / column
  of blocks may be partial (N or K not a multiple of 128).
* config.json: `quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic", ...}`.

Other FP8 checkpoints store `weight_scale` (a multiplier too) beside `weight`:
* `quant_method: "fp8"` without weight_block_size: one scale per tensor ([] or [1]);
* compressed-tensors `float-quantized` (llm-compressor's FP8, e.g. the FP8-dynamic checkpoints):
  strategy "tensor" ([1]), "block" ([ceil(N/128), ceil(K/128)], block_structure [128, 128]) or
  "channel" ([N, 1]);
* NVIDIA ModelOpt (`quant_method: "modelopt"`), quant_algo "FP8" (per tensor) or
  "FP8_PER_CHANNEL_PER_TOKEN" (per channel, [N] or [N, 1]);
* FBGEMM's FP8 (`quant_method: "fbgemm_fp8"`, e.g. Meta's Llama-3.1-405B-FP8): per channel
  ([N, 1]), with an `input_scale_ub` (an activation clamp, not read).
Their activation schemes (dynamic per token, static input_scale) are not used: activations stay
bf16 or take this engine's own per-row scales.
A per-tensor scale is a block scale repeated over every block, so those weights stay FP8 like
block-scaled ones (`fp8_block_scales`); per-channel scales are not block scales, so linears and
MoE experts keep those codes with block scales of 1 and multiply the product's columns by the
channel scales (`layers.linear.Fp8Linear.col_scale`); any other FP8 weight is dequantized at load
(`dequantize_fp8`) and runs dense.

The functions here run at load time on the host (numpy), but for `quantize_fp8_block`'s
arithmetic, jitted on JAX's default device (numpy took 3.6 s for one 4,096 x 14,336 matrix on the
dev box, XLA's CPU backend 0.37 s, with the same bytes). The device kernels live in
`pallas_kernels/linear`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from metrale_jax.errors import CorruptCheckpointError, TensorShapeError, UnsupportedDtypeError

FP8_BLOCK: tuple[int, int] = (128, 128)
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")  # ModelOpt's FP8 quant_algos: per tensor, per channel


def _check_block(block) -> tuple[int, int]:
    try:
        blk = tuple(int(b) for b in block)
    except TypeError as e:
        raise UnsupportedDtypeError(f"FP8 weight_block_size {block!r} must be [128, 128]") from e
    if blk != FP8_BLOCK:
        raise UnsupportedDtypeError(
            f"FP8 weight_block_size {list(blk)} is not supported; only {list(FP8_BLOCK)} (the "
            "DeepSeek-V3 / Qwen3 FP8 format) is"
        )
    return blk


def fp8_scale_shape(weight_shape, block=FP8_BLOCK) -> tuple[int, int]:
    """Shape of `weight_scale_inv` for a weight [N, K]: (ceil(N / 128), ceil(K / 128))."""
    bn, bk = _check_block(block)
    if len(weight_shape) != 2:
        raise TensorShapeError(f"FP8 block-scaled weights must be 2-D [N, K]; got shape {tuple(weight_shape)}")
    n, k = (int(d) for d in weight_shape)
    return math.ceil(n / bn), math.ceil(k / bk)


def _expand_scales(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """scale f32[nb, kb] -> f32[N, K], each scale repeated over its (possibly partial) block."""
    bn, bk = block
    full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)
    return full[: shape[0], : shape[1]]


def exact_div(a: jax.Array, b) -> jax.Array:
    """a / b (b broadcast to a's shape) with IEEE division, as numpy divides: XLA rewrites a
    division by a constant or a broadcast value into a multiplication by its reciprocal, and
    (a / b) / c into a / (b * c), each an ulp off now and then, which flips the rounding of a
    quantized code; the barrier hides both operands from those rewrites (the quantize-on-load
    functions stay bit-identical to their numpy definitions)."""
    a, b = jax.lax.optimization_barrier((a, jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)))
    return a / b


@jax.jit
def _quantize_fp8(w):
    """f32[N, K] -> (e4m3[N, K], scale_inv f32[nb, kb], all finite bool[]): `quantize_fp8_block`."""
    n, k = w.shape
    (bn, bk), nb, kb = FP8_BLOCK, -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])
    amax = jnp.abs(jnp.pad(w, ((0, nb * bn - n), (0, kb * bk - k))).reshape(nb, bn, kb, bk)).max(axis=(1, 3))
    scale_inv = jnp.where(amax > 0, exact_div(amax, FP8_E4M3_MAX), jnp.float32(1.0))
    full = jnp.repeat(jnp.repeat(scale_inv, bn, axis=0), bk, axis=1)[:n, :k]
    # float8_e4m3fn has no inf: an overflow would give NaN, hence the clip
    q = jnp.clip(exact_div(w, full), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, scale_inv, jnp.all(jnp.isfinite(w))


def quantize_fp8_block(w, block=FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Quantizes w f32[N, K] to (w8 float8_e4m3fn[N, K], scale_inv f32[ceil(N/128), ceil(K/128)]).

    Per 128x128 block: scale_inv = amax(|block|) / 448 (1.0 for an all-zero block), and
    w8 = round_to_nearest_even(clip(w / scale_inv, -448, 448)), so w ~= w8 * scale_inv and the
    largest element of each block maps to +-448. Partial last blocks are scaled by their own amax.
    Any float dtype is accepted (computed in float32); non-finite values raise ValueError.
    """
    _check_block(block)
    w = np.asarray(w)
    if w.ndim != 2:
        raise TensorShapeError(f"quantize_fp8_block expects a 2-D weight [N, K]; got shape {w.shape}")
    if not (np.issubdtype(w.dtype, np.floating) or w.dtype == ml_dtypes.bfloat16):
        raise UnsupportedDtypeError(f"quantize_fp8_block expects a float weight; got {w.dtype}")
    q, scale_inv, finite = _quantize_fp8(jnp.asarray(w, jnp.float32))
    if not bool(finite):
        raise ValueError("quantize_fp8_block: weight holds NaN or inf")
    return np.asarray(q), np.asarray(scale_inv)


def check_fp8_weight(w8, scale_inv, *, block=FP8_BLOCK, name: str = "weight") -> np.ndarray:
    """Validates an FP8 block-scaled weight and returns its scales as f32[ceil(N/128), ceil(K/128)].

    Raises UnsupportedDtypeError for a weight that is not float8_e4m3fn, a scale dtype other than
    float32 / bfloat16 (for example float8_e8m0fnu, the MX format's scales) or a block size other
    than [128, 128]; TensorShapeError for a scale of the wrong shape; CorruptCheckpointError for
    scales that are not finite and positive.
    """
    blk = _check_block(block)
    w_dtype = np.dtype(getattr(w8, "dtype", None))
    if w_dtype != FP8_DTYPE:
        raise UnsupportedDtypeError(f"{name}: FP8 weights must be float8_e4m3fn; got {w_dtype}")
    s_dtype = np.dtype(getattr(scale_inv, "dtype", None))
    if s_dtype not in SCALE_DTYPES:
        raise UnsupportedDtypeError(
            f"{name}_scale_inv: scale dtype {s_dtype} is not supported (float32 or bfloat16 only)"
        )
    want = fp8_scale_shape(w8.shape, blk)
    if tuple(scale_inv.shape) != want:
        raise TensorShapeError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not match weight {tuple(w8.shape)} with "
            f"{list(blk)} blocks; expected {want}"
        )
    s = np.asarray(scale_inv).astype(np.float32)
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise CorruptCheckpointError(f"{name}_scale_inv: scales must be finite and > 0")
    return s


def dequantize_fp8_block(w8, scale_inv, block=FP8_BLOCK) -> np.ndarray:
    """w8 float8_e4m3fn[N, K], scale_inv f32|bf16[ceil(N/128), ceil(K/128)] -> f32[N, K] = w8 * scale_inv."""
    blk = _check_block(block)
    s = check_fp8_weight(w8, scale_inv, block=blk)
    w8 = np.asarray(w8)
    return w8.astype(np.float32) * _expand_scales(s, w8.shape, blk)


def _scale_values(scale, name: str) -> np.ndarray:
    """A stored FP8 scale (float32 / bfloat16 / float16) as f32 of its shape, checked finite and > 0."""
    s_dtype = np.dtype(getattr(scale, "dtype", None))
    if s_dtype not in SCALE_DTYPES + (np.dtype(np.float16),):
        raise UnsupportedDtypeError(f"{name}: scale dtype {s_dtype} is not supported (float32, bfloat16, float16)")
    s = np.asarray(scale).astype(np.float32)
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise CorruptCheckpointError(f"{name}: scales must be finite and > 0")
    return s


def fp8_block_scales(w_shape, scale, *, name: str = "weight") -> np.ndarray | None:
    """An FP8 weight's stored scale (module docstring: block [ceil(N/128), ceil(K/128)], tensor
    [] / [1], or channel [N, 1] / [N]) as checked block scales f32[ceil(N/128), ceil(K/128)];
    None for a per-channel scale (not a block scale)."""
    want = fp8_scale_shape(w_shape)
    shape = tuple(np.shape(scale))
    s = _scale_values(scale, name)
    if shape == want:
        return s
    if s.size == 1:
        return np.full(want, s.reshape(()), np.float32)
    if shape in ((int(w_shape[0]), 1), (int(w_shape[0]),)):
        return None
    raise TensorShapeError(f"{name}: scale shape {shape} fits weight {tuple(w_shape)} neither as 128x128 block "
                           f"scales {want}, one scale per tensor, nor one per output channel ([N] or [N, 1])")


def fp8_channel_scales(scale, n: int, *, name: str = "weight_scale") -> np.ndarray:
    """A per-channel FP8 scale ([N] or [N, 1], float32 / bfloat16 / float16) checked -> f32[N]."""
    if tuple(np.shape(scale)) not in ((n, 1), (n,)):
        raise TensorShapeError(f"{name}: shape {tuple(np.shape(scale))}, expected per-channel [{n}] or [{n}, 1]")
    return _scale_values(scale, name).reshape(n)


def dequantize_fp8(w8, scale, *, name: str = "weight") -> np.ndarray:
    """w8 float8_e4m3fn[N, K] times its stored scale (block, tensor or channel: `fp8_block_scales`) -> f32[N, K]."""
    blocks = fp8_block_scales(np.shape(w8), scale, name=name)
    if blocks is not None:
        return dequantize_fp8_block(w8, blocks)
    if np.dtype(w8.dtype) != FP8_DTYPE:
        raise UnsupportedDtypeError(f"{name}: FP8 weights must be float8_e4m3fn; got {w8.dtype}")
    return np.asarray(w8).astype(np.float32) * fp8_channel_scales(scale, w8.shape[0], name=name)[:, None]


def _ct_fp8_group(name: str, g: Mapping) -> None:
    w = g.get("weights") or {}
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise UnsupportedDtypeError(f"compressed-tensors {name}: float-quantized weights must be 8-bit floats; got "
                                    f"{w.get('num_bits')}-bit {w.get('type')!r}")
    if w.get("dynamic"):
        raise UnsupportedDtypeError(f"compressed-tensors {name}: dynamic weight quantization is not supported")
    strategy = w.get("strategy")
    if strategy == "block":
        _check_block(w.get("block_structure"))
    elif strategy not in ("tensor", "channel"):
        raise UnsupportedDtypeError(f"compressed-tensors {name}: FP8 weight strategy {strategy!r} is not supported "
                                    "('tensor', 'channel' or 'block')")


def check_fp8_quantization_config(qc: Mapping) -> None:
    """Validates config.json's `quantization_config` for FP8 weights.

    Accepted: quant_method "fp8" with fmt (if given) "e4m3" and weight_block_size [128, 128] or none
    (per tensor); compressed-tensors "float-quantized" with 8-bit float weights per tensor, per
    channel or in [128, 128] blocks; ModelOpt's `MODELOPT_FP8`. Any activation scheme (activations
    are not read as FP8 from the checkpoint). Anything else raises UnsupportedDtypeError.
    """
    if not isinstance(qc, Mapping):
        raise UnsupportedDtypeError(f"quantization_config must be a mapping; got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fbgemm_fp8":  # per-channel weights (the scales' shapes say so: `WeightReader.fp8_kind`)
        return
    if method == "modelopt":
        algo = qc.get("quantization", qc).get("quant_algo")
        if algo not in MODELOPT_FP8:
            raise UnsupportedDtypeError(f"ModelOpt quant_algo {algo!r} is not supported")
        return
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not groups:
            raise UnsupportedDtypeError("quantization_config: compressed-tensors config has no config_groups")
        for name, g in groups.items():
            fmt = g.get("format", qc.get("format"))
            if fmt != "float-quantized":
                raise UnsupportedDtypeError(
                    f"compressed-tensors format {fmt!r} ({name}) is not supported ('float-quantized' FP8, "
                    "'pack-quantized' W4A16 or 'nvfp4-pack-quantized')")
            _ct_fp8_group(name, g)
        return
    if method != "fp8":
        raise UnsupportedDtypeError(
            f"quantization_config.quant_method {method!r} is not supported ('fp8', 'fbgemm_fp8', 'gptq', 'awq', "
            "'compressed-tensors', 'modelopt')")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedDtypeError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    if qc.get("weight_block_size") is not None:
        _check_block(qc["weight_block_size"])
