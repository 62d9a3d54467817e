"""Skinny linear kernels (pallas_kernels/linear) against float64 numpy, in interpret mode on CPU
and compiled on the GPU (`gpu` marker).

Oracles: numpy float64 matmuls, and for FP8 a numpy dequantization written here (the HF /
DeepSeek-V3 `weight_scale_inv` rule: W = w8 * s per 128x128 block, partial last blocks).
Outputs start poisoned with NaN, so an element no program writes fails the test.
"""

import json
import math
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.linear import (
    SkinnyParams,
    skinny_matmul,
    skinny_matmul_fp8,
    skinny_matmul_fp8_reference,
    skinny_matmul_reference,
)
from pallas_kernels.linear import params as params_module
from pallas_kernels.linear.params import default_params, m_bucket, skinny_params_for
from pallas_kernels.linear.skinny_mgpu import (
    MgpuParams,
    skinny_matmul_fp8_mgpu,
    skinny_matmul_mgpu,
    skinny_matmul_w8a8_mgpu,
)

B = 128


def _np_dequant(w8, s):
    """Independent of the package: loops over the blocks."""
    n, k = w8.shape
    out = np.asarray(w8).astype(np.float64)
    for i in range(math.ceil(n / B)):
        for j in range(math.ceil(k / B)):
            out[i * B:(i + 1) * B, j * B:(j + 1) * B] *= np.float64(s[i, j])
    return out


def _bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def _fp8_weight(rng, n, k):
    """Random fp8 codes and per-block scales spanning 2**-10 .. 2**2 (every block differs)."""
    w8 = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = np.exp2(rng.uniform(-10, 2, (math.ceil(n / B), math.ceil(k / B)))).astype(np.float32)
    return w8, s


def _rel_err(got, want):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert not np.any(np.isnan(got)), "unwritten (poisoned) or NaN outputs"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _rows_rel_err(got, want):
    """Max over rows of the relative error, so one badly wrong row (e.g. x row M-1) can't hide."""
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert not np.any(np.isnan(got)), "unwritten (poisoned) or NaN outputs"
    return float(np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)))


# ---- CPU interpret mode ----------------------------------------------------------------------------
# N and K are not multiples of block_n / block_k (nor of the 128 scale block): partial last tiles.
CASES = [
    (1, SkinnyParams(block_n=32, block_k=64)),
    (1, SkinnyParams(block_n=16, block_k=128, split_k=2, gemv=True)),
    (3, SkinnyParams(block_n=16, block_k=128, num_stages=2)),
    (8, SkinnyParams(block_n=64, block_k=64, split_k=3)),
    (17, SkinnyParams(block_n=32, block_k=128)),
    (64, SkinnyParams(block_n=64, block_k=256)),
]


@pytest.mark.parametrize("m,params", CASES)
def test_bf16_interpret(m, params):
    rng = np.random.default_rng(m)
    n, k = 200, 330
    x, w = _bf16(rng, (m, k)), _bf16(rng, (n, k), 0.05)
    y = skinny_matmul(x, w, params=params, interpret=True, _poison=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert _rows_rel_err(y, want) < 8e-3  # bf16 output rounding (2**-9 relative)
    np.testing.assert_allclose(np.asarray(skinny_matmul_reference(x, w)), want, rtol=1e-5, atol=1e-5)


FP8_CASES = [
    (1, SkinnyParams(block_n=32, block_k=128)),
    (3, SkinnyParams(block_n=64, block_k=256, fp8_scale_on_x=False)),  # 2nd step's 2nd sub-block lies past K
    (8, SkinnyParams(block_n=16, block_k=128, split_k=2, fp8_scale_on_x=False)),
    (17, SkinnyParams(block_n=128, block_k=128)),
    (64, SkinnyParams(block_n=32, block_k=256, split_k=2)),
    (1, SkinnyParams(block_n=64, block_k=256, fp8_f16_dot=True)),
    (1, SkinnyParams(block_n=32, block_k=256, gemv=True)),
    (1, SkinnyParams(block_n=64, block_k=128, split_k=2, gemv=True)),
    (3, SkinnyParams(block_n=32, block_k=128, gemv=True)),  # gemv only applies at M = 1
    (17, SkinnyParams(block_n=32, block_k=128, split_k=2, fp8_f16_dot=True)),
]


@pytest.mark.parametrize("m,params", FP8_CASES)
def test_fp8_interpret(m, params):
    rng = np.random.default_rng(100 + m)
    n, k = 300, 333  # 3 x 3 scale blocks, the last ones partial
    x = _bf16(rng, (m, k))
    w8, s = _fp8_weight(rng, n, k)
    y = skinny_matmul_fp8(x, jnp.asarray(w8), jnp.asarray(s), params=params, interpret=True, _poison=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    want = np.asarray(x, np.float64) @ _np_dequant(w8, s).T
    assert _rows_rel_err(y, want) < 8e-3
    ref = skinny_matmul_fp8_reference(x, jnp.asarray(w8), jnp.asarray(s))
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_fp8_f16_dot_keeps_large_activations():
    """x * s far past f16's range (65504) and tiny rows: the per-row power-of-two keeps both."""
    rng = np.random.default_rng(9)
    m, n, k = 3, 160, 300
    x = np.asarray(rng.standard_normal((m, k)), np.float32)
    x[0] *= 3e4  # |x * s| up to ~5e5
    x[2] *= 1e-6
    x = jnp.asarray(x, jnp.bfloat16)
    w8, s = _fp8_weight(rng, n, k)
    want = np.asarray(x, np.float64) @ _np_dequant(w8, s).T
    y = skinny_matmul_fp8(x, jnp.asarray(w8), jnp.asarray(s), params=SkinnyParams(block_n=32, block_k=128,
                          fp8_f16_dot=True), interpret=True, _poison=True)
    assert _rows_rel_err(y, want) < 8e-3


def test_fp8_bf16_scales_and_default_params():
    rng = np.random.default_rng(5)
    m, n, k = 2, 150, 140
    x = _bf16(rng, (m, k))
    w8, s = _fp8_weight(rng, n, k)
    s16 = s.astype(ml_dtypes.bfloat16)
    y = skinny_matmul_fp8(x, jnp.asarray(w8), jnp.asarray(s16), interpret=True, _poison=True)
    want = np.asarray(x, np.float64) @ _np_dequant(w8, s16.astype(np.float32)).T
    assert _rows_rel_err(y, want) < 8e-3


# Mosaic GPU twin, in Mosaic GPU interpret mode (TMA, barriers and wgmma simulated on the CPU).
# TMA tiles need K % 64 (bf16) / 128 (fp8) and N % 8; N and K are not multiples of the blocks here.
MGPU_CASES = [
    (1, 200, 320, MgpuParams(block_n=32, block_k=128, max_concurrent_steps=2)),
    (17, 136, 640, MgpuParams(block_n=64, block_k=256, split_k=2)),
]


@pytest.mark.parametrize("m,n,k,params", MGPU_CASES)
def test_bf16_mgpu_interpret(m, n, k, params):
    rng = np.random.default_rng(200 + m)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (n, k), 0.05)
    y = skinny_matmul_mgpu(x, w, params=params, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    assert _rows_rel_err(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T) < 8e-3


@pytest.mark.parametrize("m,n,k,params", [
    (3, 200, 384, MgpuParams(block_n=64, block_k=128)),
    (64, 136, 640, MgpuParams(block_n=128, block_k=128, split_k=2)),
])
def test_fp8_mgpu_interpret(m, n, k, params):
    rng = np.random.default_rng(300 + m)
    x = _bf16(rng, (m, k))
    w8, s = _fp8_weight(rng, n, k)
    y = skinny_matmul_fp8_mgpu(x, jnp.asarray(w8), jnp.asarray(s), params=params, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    assert _rows_rel_err(y, np.asarray(x, np.float64) @ _np_dequant(w8, s).T) < 8e-3


def _np_quantize_rows(x):
    """x's rows rounded to FP8 e4m3 per 128-column group scaled to its absolute max / 448 (the
    W8A8 activation scheme), back in float64; independent of the package (ml_dtypes rounding)."""
    g = np.asarray(x.astype(jnp.float32)).reshape(x.shape[0], -1, B)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-12))
    q = (g * (np.float32(448.0) / amax)).astype(ml_dtypes.float8_e4m3fn)  # float32 products, RNE to e4m3
    return (q.astype(np.float64) * (amax.astype(np.float64) / 448.0)).reshape(x.shape)


@pytest.mark.parametrize("m,n,k,params", [
    (3, 200, 384, MgpuParams(block_n=64, block_k=128)),
    (64, 136, 640, MgpuParams(block_n=128, block_k=128, split_k=2)),
    (17, 264, 256, MgpuParams(block_n=64, block_k=128, split_k=3)),  # a split past K's 2 steps
    (12, 200, 384, MgpuParams(block_n=64, block_k=128, stack_terms=True)),  # both terms in one tile
    (29, 136, 640, MgpuParams(block_n=128, block_k=128, split_k=2, stack_terms=True)),
    (64, 136, 640, MgpuParams(128, 256, 3, split_k=2)),  # two groups a step, 5 in all
    (3, 200, 384, MgpuParams(block_n=64, block_k=256, stack_terms=True)),
])
def test_w8a8_mgpu_interpret(m, n, k, params):
    """FP8 x FP8 wgmma with x as two FP8 terms quantized per row and 128-column group: equal to
    the product of x and the dequantized W up to bf16 rounding, where one FP8 term (the numpy
    rounding of x) is not; rows past M never leak in (M = 3, 17)."""
    rng = np.random.default_rng(400 + m)
    x = _bf16(rng, (m, k))
    x = x.at[0, :128].multiply(50.0)  # one group far larger than the others: its own scale
    w8, s = _fp8_weight(rng, n, k)
    y = skinny_matmul_w8a8_mgpu(x, jnp.asarray(w8), jnp.asarray(s), params=params, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    w = _np_dequant(w8, s)
    want = np.asarray(x, np.float64) @ w.T
    assert _rows_rel_err(y, want) < 8e-3
    assert _rows_rel_err(jnp.asarray(_np_quantize_rows(x) @ w.T, jnp.float32), want) > 1.5e-2  # one term


def test_quantize_rows_fp8_two_terms():
    """x / scale = hi + lo per row and 128-column group, to ~2**-8 of the group's largest value
    (one term: ~2**-4), compiled by XLA. The H200's XLA once folded f32(f8(y)) back into y, which
    zeroed lo; the CPU's does not, so `test_mgpu_gpu` checks the W8A8 kernel against exact x there."""
    from pallas_kernels.linear.skinny_mgpu import quantize_rows_fp8

    rng = np.random.default_rng(3)
    x = _bf16(rng, (5, 384))
    x = x.at[1, 128:256].multiply(1e-3).at[2, :128].set(0.0)  # a tiny group, an all-zero group
    (hi, lo), sx = jax.jit(quantize_rows_fp8)(x)
    assert hi.dtype == lo.dtype == jnp.float8_e4m3fn and sx.shape == (3, 64) and not np.any(np.asarray(sx)[:, 5:])
    s = np.repeat(np.asarray(sx)[:, :5].T, B, axis=1).astype(np.float64)  # [5, 384]
    xf = np.asarray(x, np.float64)
    amax = np.repeat(np.abs(xf).reshape(5, 3, B).max(-1), B, axis=1)
    one = np.asarray(hi, np.float64) * s
    two = (np.asarray(hi, np.float64) + np.asarray(lo, np.float64)) * s
    assert np.max(np.abs(two - xf) / np.maximum(amax, 1e-30)) < 2.0**-8
    assert np.max(np.abs(one - xf) / np.maximum(amax, 1e-30)) > 2.0**-6
    assert not np.any(two[2, :128])


@pytest.mark.parametrize("m,k,w8a8,kernel", [
    (5, 256, True, "skinny_matmul_fp8"), (24, 256, True, "skinny_matmul_w8a8_mgpu"),
    (12, 160, True, "skinny_matmul_fp8"), (24, 160, True, None),
    (12, 256, False, "skinny_matmul_fp8"), (24, 256, False, None)])  # no wgmma (not Hopper)
def test_fp8_linear_picks_its_kernel(m, k, w8a8, kernel):
    """`layers.linear.linear` on a marked fused FP8 weight (two parts, each padded to 128 rows):
    up to 8 rows the W8A16 kernel, 9-64 the W8A8 one where K is whole 128-column groups (and the
    weights are marked for it), else the W8A16 kernel up to 16 rows and XLA beyond; each equals the
    numpy product of x and the output columns of the parts alone, up to bf16 rounding."""
    import dataclasses

    from metrale_jax.layers.linear import Fp8Linear, linear, use_fp8_kernel

    rng = np.random.default_rng(m + k)
    w8, s = _fp8_weight(rng, 384, k)
    w = Fp8Linear(jnp.asarray(w8), jnp.asarray(s), segments=((0, 160), (256, 100)))
    w = use_fp8_kernel(w, interpret=True, w8a8=w8a8)
    x = _bf16(rng, (1, m, k))
    jaxpr = str(jax.make_jaxpr(linear)(x, w))
    for name in ("skinny_matmul_fp8", "skinny_matmul_w8a8_mgpu"):
        assert (f"name={name}" in jaxpr) == (name == kernel), name
    cols = np.r_[0:160, 256:356]
    want = np.asarray(x[0], np.float64) @ _np_dequant(w8, s)[cols].T
    assert _rows_rel_err(linear(x, w)[0], want) < 8e-3
    plain = linear(x, dataclasses.replace(w, use_kernel=False))  # XLA dequantize-and-dot
    assert _rows_rel_err(plain[0], want) < 8e-3


def test_fp8_linear_rows_do_not_depend_on_the_batch():
    """One row's output is the same, up to bf16 rounding, whether it runs alone (W8A16 kernel),
    among 5 (W8A16) or 24 rows (the W8A8 kernel, x in two FP8 terms) or 100 (XLA). With one FP8
    term x's rounding would show (checked to be far above the tolerance, so the test can fail):
    the H200's FP8 acceptance run of session 31 found greedy tokens that changed with the batch."""
    from metrale_jax.layers.linear import Fp8Linear, linear, use_fp8_kernel

    rng = np.random.default_rng(7)
    w8, s = _fp8_weight(rng, 256, 256)
    w = use_fp8_kernel(Fp8Linear(jnp.asarray(w8), jnp.asarray(s), segments=((0, 256),)), interpret=True)
    x = _bf16(rng, (100, 256))
    wd = _np_dequant(w8, s)
    want = np.asarray(x[:1], np.float64) @ wd.T
    assert _rows_rel_err(jnp.asarray(_np_quantize_rows(x[:1]) @ wd.T, jnp.float32), want) > 2e-2  # one term
    jaxprs = ""
    for m in (1, 5, 24, 100):
        assert _rows_rel_err(linear(x[:m], w)[:1], want) < 6e-3, m  # bf16 output rounding (0.2-0.3%)
        jaxprs += str(jax.make_jaxpr(linear)(x[:m], w))
    assert "skinny_matmul_w8a8_mgpu" in jaxprs and "skinny_matmul_fp8" in jaxprs


def test_w8a8_params_for_the_llama3_8b_projections():
    """The tiles the H200 sweep picked (bench/results/linear_fp8_batch_2026-12-05_s35.md)."""
    from pallas_kernels.linear.skinny_mgpu import w8a8_params_for

    got = {name: w8a8_params_for(n, k) for name, n, k in
           [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]}
    assert [(p.block_n, p.split_k) for p in got.values()] == [(128, 2), (64, 2), (128, 1), (64, 2)]
    assert all(p.block_k == 256 and p.stack_terms for p in got.values())


def test_mgpu_bad_inputs():
    x = jnp.ones((2, 784), jnp.bfloat16)  # K = 784: rejected on the H200 by the 64-element tiling
    with pytest.raises(ValueError, match="multiple of 64"):
        skinny_matmul_mgpu(x, jnp.ones((32, 784), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        skinny_matmul_fp8_mgpu(
            jnp.ones((2, 320), jnp.bfloat16), jnp.ones((32, 320), jnp.float8_e4m3fn), jnp.ones((1, 3), jnp.float32),
            interpret=True,
        )
    with pytest.raises(ValueError, match="block_n"):
        skinny_matmul_fp8_mgpu(
            jnp.ones((2, 128), jnp.bfloat16), jnp.ones((32, 128), jnp.float8_e4m3fn), jnp.ones((1, 1), jnp.float32),
            params=MgpuParams(block_n=32), interpret=True,
        )
    with pytest.raises(ValueError):
        MgpuParams(block_k=100)


def test_bad_inputs():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w = jnp.ones((32, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="K"):
        skinny_matmul(x, jnp.ones((64, 32), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="m="):
        skinny_matmul(jnp.ones((65, 64), jnp.bfloat16), w, interpret=True)
    with pytest.raises(ValueError, match="bfloat16"):
        skinny_matmul(x.astype(jnp.float32), w, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        skinny_matmul(x, w.astype(jnp.float8_e4m3fn), interpret=True)
    w8 = w.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv"):
        skinny_matmul_fp8(x, w8, jnp.ones((2, 1), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        skinny_matmul_fp8(x, w8, jnp.ones((1, 1), jnp.float32), params=SkinnyParams(block_n=256), interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        skinny_matmul_fp8(x, w8, jnp.ones((1, 1), jnp.float32), params=SkinnyParams(block_k=64), interpret=True)
    with pytest.raises(ValueError):
        SkinnyParams(block_n=48)


def test_params_lookup():
    assert m_bucket(1) == 16 and m_bucket(17) == 32 and m_bucket(64) == 64
    for m in (1, 8, 32, 64):
        for n, k in ((6144, 4096), (4096, 14336), (28672, 4096)):
            default_params(m, n, k, True).check_fp8()
            p = skinny_params_for(m, n, k, jnp.float8_e4m3fn)
            p.check_fp8()
            assert isinstance(skinny_params_for(m, n, k, jnp.bfloat16), SkinnyParams)
    # measured rows take their entry, rows in between the next measured one above
    table = json.loads((Path(params_module.__file__).with_name("tuned_params.json")).read_text())
    for m, entry in ((16, 16), (12, 16), (64, 64), (40, 64)):
        want = SkinnyParams(**table[f"float8_e4m3fn_n28672_k4096_m{entry}"])
        assert skinny_params_for(m, 28672, 4096, jnp.float8_e4m3fn) == want
    # past the largest measured row bucket the heuristic, not a tile sized for fewer rows (the FP8
    # 8-row entry of N=28672 asked for 463 KB of shared memory at 64 rows on the H200)
    small = {k: v for k, v in table.items() if k.endswith(("_m1", "_m8"))}
    with mock.patch.object(params_module, "_tuned_table", lambda: small):
        assert skinny_params_for(64, 28672, 4096, jnp.float8_e4m3fn) == default_params(64, 28672, 4096, True)
        assert skinny_params_for(8, 28672, 4096, jnp.float8_e4m3fn) == SkinnyParams(
            **table["float8_e4m3fn_n28672_k4096_m8"])


# ---- Triton lowering for an H200, checked on the CPU machine -------------------------------------
def test_lowers_for_h200():
    """Cross-lowers the kernels to Triton IR at Llama-3-8B shapes (catches unsupported ops without a
    GPU; the Triton->PTX step still needs the GPU run)."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    )
    sds = jax.ShapeDtypeStruct
    with jax.sharding.use_abstract_mesh(mesh):
        for m, n, k in ((1, 6144, 4096), (64, 4096, 14336)):
            low = skinny_matmul.trace(sds((m, k), jnp.bfloat16), sds((n, k), jnp.bfloat16)).lower(
                lowering_platforms=("cuda",)
            )
            assert "__gpu$xla.gpu.triton" in low.as_text()
            low = skinny_matmul_fp8.trace(
                sds((m, k), jnp.bfloat16), sds((n, k), jnp.float8_e4m3fn), sds((n // B, k // B), jnp.float32),
                params=SkinnyParams(block_n=64, block_k=256, split_k=2, fp8_f16_dot=m == 1, gemv=m == 1),
            ).lower(lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in low.as_text()
            # Mosaic GPU: lowering runs layout inference and the TMA checks.
            skinny_matmul_mgpu.trace(
                sds((m, k), jnp.bfloat16), sds((n, k), jnp.bfloat16), params=MgpuParams(block_n=32, split_k=2)
            ).lower(lowering_platforms=("cuda",))
            skinny_matmul_fp8_mgpu.trace(
                sds((m, k), jnp.bfloat16), sds((n, k), jnp.float8_e4m3fn), sds((n // B, k // B), jnp.float32)
            ).lower(lowering_platforms=("cuda",))
        # FP8 x FP8 wgmma; rows that are not whole 8-row TMA tiles (12, 20: decode buckets of a
        # max_num_seqs of 20, verify steps of 4 rows with 2 drafts each) and x's terms stacked
        for m, n, k, p in ((1, 6144, 4096, MgpuParams(block_n=64)), (64, 4096, 14336, MgpuParams(block_n=64)),
                           (64, 4096, 14336, MgpuParams(block_n=128, split_k=2)),
                           (12, 6144, 4096, MgpuParams(block_n=64)), (20, 4096, 14336, MgpuParams(128, split_k=2)),
                           (1, 6144, 4096, MgpuParams(block_n=64, stack_terms=True)),
                           (12, 6144, 4096, MgpuParams(block_n=64, stack_terms=True)),
                           (32, 4096, 14336, MgpuParams(block_n=128, split_k=2, stack_terms=True)),
                           # two 128-column groups a step (block_k 256), K of an odd number of groups
                           (64, 4096, 14336, MgpuParams(64, 256, 4)), (12, 256, 384, MgpuParams(64, 256)),
                           (16, 6144, 4096, MgpuParams(128, 256, 4, split_k=2, stack_terms=True))):
            skinny_matmul_w8a8_mgpu.trace(
                sds((m, k), jnp.bfloat16), sds((n, k), jnp.float8_e4m3fn), sds((n // B, k // B), jnp.float32),
                params=p,
            ).lower(lowering_platforms=("cuda",))


# ---- compiled on the GPU ---------------------------------------------------------------------------
GPU_SHAPES = [(1, 6144, 4096), (8, 4096, 14336), (17, 1000, 777), (64, 28672, 4096), (3, 300, 333)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_bf16_gpu(m, n, k):
    rng = np.random.default_rng(m + n)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (n, k), 0.05)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    y = skinny_matmul(x, w, _poison=True)
    assert _rows_rel_err(y, want) < 8e-3
    y = skinny_matmul(x, w, params=SkinnyParams(block_n=64, block_k=128, split_k=3), _poison=True)
    assert _rows_rel_err(y, want) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_fp8_gpu(m, n, k):
    rng = np.random.default_rng(m + n + 1)
    x = _bf16(rng, (m, k))
    w8, s = _fp8_weight(rng, n, k)
    want = np.asarray(x, np.float64) @ _np_dequant(w8, s).T
    y = skinny_matmul_fp8(x, jnp.asarray(w8), jnp.asarray(s), _poison=True)
    assert _rows_rel_err(y, want) < 8e-3
    for p in (SkinnyParams(block_n=16, split_k=2, fp8_scale_on_x=False),
              SkinnyParams(block_n=64, block_k=256, num_stages=3, fp8_f16_dot=True),  # M=64 fits 3 stages
              SkinnyParams(block_n=16, block_k=512, split_k=2, num_stages=2, gemv=True)):  # gemv at M=1, else dot
        y = skinny_matmul_fp8(x, jnp.asarray(w8), jnp.asarray(s), params=p, _poison=True)
        assert _rows_rel_err(y, want) < 8e-3, p


MGPU_GPU_SHAPES = [(1, 6144, 4096), (8, 4096, 14336), (64, 28672, 4096)]
# Shapes the Mosaic twin does not tile (M past 8 and not a multiple of 8, N not a multiple of 64):
# a clear ValueError, seen on the H200 (2026-11-29).
MGPU_GPU_UNSUPPORTED = [(17, 1000, 640), (3, 304, 384)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", MGPU_GPU_UNSUPPORTED)
def test_mgpu_gpu_unsupported_shape_raises(m, n, k):
    rng = np.random.default_rng(m + n)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (n, k), 0.05)
    with pytest.raises(ValueError):
        jax.block_until_ready(skinny_matmul_mgpu(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [12, 20, 32])
def test_w8a8_gpu_any_rows_and_stacked_terms(m):
    """W8A8 at rows that are not whole 8-row TMA tiles (padded; they failed to lower before), with
    x's two terms stacked in one tile (`MgpuParams.stack_terms`) and with two groups a step
    (block_k 256), against exact x; x * 3 is computed in the same executable, just before the kernel,
    so a PDL kernel that read x before its grid-dependency wait would read a stale or half-written x."""
    rng = np.random.default_rng(m)
    n, k = 4096, 4096
    x = _bf16(rng, (m, k))
    w8, s = _fp8_weight(rng, n, k)
    want = np.asarray(x * 3, np.float64) @ _np_dequant(w8, s).T
    for p in (None, MgpuParams(stack_terms=True), MgpuParams(block_n=128, split_k=2, stack_terms=True),
              MgpuParams(block_k=256), MgpuParams(block_n=128, block_k=256, split_k=2, stack_terms=True),
              # programmatic dependent launch (x * 3 is written by the XLA kernel just before)
              MgpuParams(block_n=128, block_k=256, split_k=2, stack_terms=True, pdl=True),
              MgpuParams(block_n=64, block_k=256, split_k=2, pdl=True)):
        y = jax.jit(lambda x, p=p: skinny_matmul_w8a8_mgpu(x * 3, jnp.asarray(w8), jnp.asarray(s), params=p))(x)
        assert y.shape == (m, n) and _rows_rel_err(y, want) < 8e-3, p


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", MGPU_GPU_SHAPES)
def test_mgpu_gpu(m, n, k):
    rng = np.random.default_rng(m + n + 2)
    x, w = _bf16(rng, (m, k)), _bf16(rng, (n, k), 0.05)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert _rows_rel_err(skinny_matmul_mgpu(x, w), want) < 8e-3
    assert _rows_rel_err(skinny_matmul_mgpu(x, w, params=MgpuParams(block_n=32, split_k=2)), want) < 8e-3
    w8, s = _fp8_weight(rng, n, k)
    want = np.asarray(x, np.float64) @ _np_dequant(w8, s).T
    assert _rows_rel_err(skinny_matmul_fp8_mgpu(x, jnp.asarray(w8), jnp.asarray(s)), want) < 8e-3
    y = skinny_matmul_fp8_mgpu(x, jnp.asarray(w8), jnp.asarray(s), params=MgpuParams(split_k=3))
    assert _rows_rel_err(y, want) < 8e-3
    if k % B == 0:  # W8A8 (FP8 x FP8 wgmma, x in two FP8 terms): K whole 128-column groups
        assert _rows_rel_err(skinny_matmul_w8a8_mgpu(x, jnp.asarray(w8), jnp.asarray(s)), want) < 8e-3
        y = skinny_matmul_w8a8_mgpu(x, jnp.asarray(w8), jnp.asarray(s), params=MgpuParams(block_n=128, split_k=2))
        assert _rows_rel_err(y, want) < 8e-3
