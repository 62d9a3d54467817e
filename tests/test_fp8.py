"""FP8 e4m3 128x128 block format (metrale_jax.quant.fp8) against an independent numpy model.

The model below follows the DeepSeek-V3 / HF `weight_scale_inv` convention (DeepSeek-V3
`inference/kernel.py` `weight_dequant`: y = w8 * s per 128x128 block) and rounds to e4m3 by hand
(exponent / mantissa arithmetic, round half to even), without ml_dtypes' cast.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from metrale_jax.errors import CorruptCheckpointError, TensorShapeError, UnsupportedDtypeError
from metrale_jax.quant import (
    check_fp8_quantization_config,
    check_fp8_weight,
    dequantize_fp8_block,
    fp8_scale_shape,
    quantize_fp8_block,
)

B = 128


def _round_e4m3(v):
    """f64 array of values already in [-448, 448] -> nearest float8_e4m3fn value (ties to even), as f64."""
    a = np.abs(v)
    _, ex = np.frexp(a)  # a = mant * 2**ex, mant in [0.5, 1)
    e = np.maximum(ex - 1, -6)  # floor(log2 a), clamped at the subnormal exponent (min normal 2**-6)
    step = np.exp2(e - 3.0)  # 3 mantissa bits
    q = np.round(a / step) * step  # np.round: half to even
    return np.sign(v) * q


def _independent_quantize(w):
    n, k = w.shape
    nb, kb = math.ceil(n / B), math.ceil(k / B)
    q = np.zeros((n, k), np.float64)
    s = np.zeros((nb, kb), np.float32)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * B:(i + 1) * B, j * B:(j + 1) * B]
            amax = np.float32(np.max(np.abs(blk)))
            sc = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
            s[i, j] = sc
            scaled = (blk / sc).astype(np.float32).astype(np.float64)
            q[i * B:(i + 1) * B, j * B:(j + 1) * B] = _round_e4m3(np.clip(scaled, -448.0, 448.0))
    return q, s


def _independent_dequantize(q, s):
    out = np.empty(q.shape, np.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * B:(i + 1) * B, j * B:(j + 1) * B] = q[i * B:(i + 1) * B, j * B:(j + 1) * B] * np.float64(s[i, j])
    return out


def _random_weight(rng, n, k):
    """Rows and columns on very different scales, so every block gets its own scale."""
    w = rng.standard_normal((n, k)) * np.exp2(rng.uniform(-6, 6, (n, 1))) * np.exp2(rng.uniform(-3, 3, (1, k)))
    return w.astype(np.float32)


@pytest.mark.parametrize("shape", [(200, 300), (1, 5), (129, 257), (256, 128)])
def test_quantize_matches_independent_model(shape):
    rng = np.random.default_rng(sum(shape))
    w = _random_weight(rng, *shape)
    w8, s = quantize_fp8_block(w)
    assert w8.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and w8.shape == shape
    assert s.dtype == np.float32
    assert s.shape == fp8_scale_shape(shape) == (math.ceil(shape[0] / B), math.ceil(shape[1] / B))
    q_ref, s_ref = _independent_quantize(w)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(w8.astype(np.float64), q_ref)
    # Each block's largest element maps to +-448 (the block scale is amax / 448).
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            assert np.max(np.abs(w8[i * B:(i + 1) * B, j * B:(j + 1) * B].astype(np.float32))) == 448.0


@pytest.mark.parametrize("shape", [(200, 300), (129, 257)])
def test_round_trip_error_bound(shape):
    rng = np.random.default_rng(7)
    w = _random_weight(rng, *shape)
    w8, s = quantize_fp8_block(w)
    deq = dequantize_fp8_block(w8, s)
    assert deq.dtype == np.float32 and deq.shape == shape
    s_full = np.repeat(np.repeat(s, B, 0), B, 1)[: shape[0], : shape[1]].astype(np.float64)
    err = np.abs(deq.astype(np.float64) - w)
    # e4m3: half an ulp is 2**-4 relative for normals, 2**-10 * scale in the subnormal range.
    bound = np.maximum(np.abs(w) * 2.0**-4, s_full * 2.0**-10) * (1 + 1e-6)
    assert np.all(err <= bound)
    assert np.max(err / np.maximum(np.abs(w), 1e-30)) > 1e-3  # it really is quantized


def test_dequantize_matches_independent_model_with_bf16_scales():
    rng = np.random.default_rng(3)
    n, k = 300, 200
    w8 = (rng.standard_normal((n, k)) * 40).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = np.exp2(rng.uniform(-12, 2, fp8_scale_shape((n, k)))).astype(ml_dtypes.bfloat16)
    got = dequantize_fp8_block(w8, s)
    want = _independent_dequantize(w8.astype(np.float64), s.astype(np.float32))
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_zero_block_gets_unit_scale():
    w = np.ones((130, 260), np.float32)
    w[:128, 128:256] = 0.0
    w8, s = quantize_fp8_block(w)
    assert s[0, 1] == 1.0 and np.all(w8[:128, 128:256].astype(np.float32) == 0)
    np.testing.assert_array_equal(dequantize_fp8_block(w8, s), w)


def test_quantize_rejects_bad_input():
    with pytest.raises(TensorShapeError):
        quantize_fp8_block(np.ones((4, 4, 4), np.float32))
    with pytest.raises(ValueError):
        quantize_fp8_block(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(UnsupportedDtypeError):
        quantize_fp8_block(np.ones((4, 4), np.float32), block=(64, 64))


def test_check_fp8_weight_errors():
    w8 = np.zeros((200, 300), ml_dtypes.float8_e4m3fn)
    good = np.ones((2, 3), np.float32)
    assert check_fp8_weight(w8, good).dtype == np.float32
    with pytest.raises(TensorShapeError):
        check_fp8_weight(w8, np.ones((2, 2), np.float32))
    with pytest.raises(TensorShapeError):
        check_fp8_weight(w8, np.ones((3, 2), np.float32))  # transposed scales
    with pytest.raises(UnsupportedDtypeError):
        check_fp8_weight(w8, good.astype(ml_dtypes.float8_e8m0fnu))  # MX-style e8m0 scales
    with pytest.raises(UnsupportedDtypeError):
        check_fp8_weight(w8, good.astype(np.float16))
    with pytest.raises(UnsupportedDtypeError):
        check_fp8_weight(w8.astype(ml_dtypes.float8_e5m2), good)
    with pytest.raises(UnsupportedDtypeError):
        check_fp8_weight(w8, np.ones((4, 5), np.float32), block=(64, 64))
    with pytest.raises(CorruptCheckpointError):
        check_fp8_weight(w8, -good)
    with pytest.raises(CorruptCheckpointError):
        check_fp8_weight(w8, np.full((2, 3), np.inf, np.float32))


def test_quantization_config():
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    check_fp8_quantization_config(qc)
    check_fp8_quantization_config({k: v for k, v in qc.items() if k != "weight_block_size"})  # per tensor
    for bad in (
        {**qc, "weight_block_size": [64, 64]},
        {**qc, "quant_method": "awq"},
        {**qc, "fmt": "e5m2"},
    ):
        with pytest.raises(UnsupportedDtypeError):
            check_fp8_quantization_config(bad)
