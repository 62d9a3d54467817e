"""Grouped GEMM (pallas_kernels/grouped_matmul) against `jax.lax.ragged_dot` and a float64 numpy
loop, in Mosaic GPU interpret mode on the CPU and compiled on the GPU (`gpu` marker).

Oracles: XLA's `jax.lax.ragged_dot` (f32 accumulation) and a numpy float64 loop over groups
written here. Interpret mode starts buffers as NaN, so an output row no tile writes fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import (
    GroupedMatmulParams,
    grouped_matmul,
    grouped_matmul_params_for,
    grouped_matmul_reference,
    task_table,
)
from pallas_kernels.grouped_matmul.kernel import num_tasks_bound

P = GroupedMatmulParams


def _np_grouped(x, w, sizes):
    """float64 oracle: consecutive row ranges times their group's matrix; other rows zero."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    r = 0
    for g, s in enumerate(sizes):
        s = min(int(s), x.shape[0] - r)
        out[r:r + s] = x[r:r + s] @ w[g]
        r += s
    return out


def _inputs(seed, m, k, n, sizes):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w, jnp.asarray(sizes, jnp.int32)


def _check(y, x, w, sizes, tol):
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert not np.isnan(got).any(), "unwritten (NaN) output rows"
    want = _np_grouped(x, w, sizes)
    used = min(int(np.sum(sizes)), x.shape[0])
    assert np.all(got[used:] == 0), "rows past sum(group_sizes) must be exactly zero"
    err = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-6)
    assert err[:used].max() < tol, (err.max(), int(err.argmax()))
    rd = jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(got, np.asarray(rd), rtol=tol, atol=tol * np.abs(want).max())


# ---- Mosaic GPU interpret mode on the CPU ----------------------------------------------------------
# Group sizes: zeros, groups smaller than a tile, groups straddling tiles, sums below M (padded rows
# must be zero). M is no multiple of 8 or of the tile; K and N are no multiples of 64 (padded).
CASES = [
    # (m, k, n, sizes, params)
    (150, 200, 72, [150], P(block_m=64, block_n=64, block_k=64, num_stages=2)),
    (97, 130, 100, [1], P(block_m=64, block_n=64, block_k=64, num_stages=3)),  # 96 zero rows
    (203, 136, 130, [0, 67, 5, 64], P(block_m=64, block_n=64, block_k=64, num_stages=2, grid_minor="m")),
    (261, 72, 64, [9, 0, 0, 70, 1, 63, 64, 3, 30], P(block_m=128, block_n=128, block_k=64, num_stages=2)),
    (200, 192, 192, [0, 13, 0, 100, 0, 2, 0, 50, 0], P(block_m=192, block_n=192, block_k=128, num_stages=2)),
]


@pytest.mark.parametrize("m,k,n,sizes,params", CASES)
def test_interpret(m, k, n, sizes, params):
    x, w, gs = _inputs(m + k, m, k, n, sizes)
    y = grouped_matmul(x, w, gs, params=params, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    _check(y, x, w, sizes, tol=1e-2)  # bf16 output rounding (2**-9 relative)


def test_interpret_f32_out_default_params_and_races():
    """float32 output (as the MoE layer asks), params from the table/heuristic, race detection."""
    sizes = [40, 0, 3, 77, 8]
    x, w, gs = _inputs(7, 136, 128, 128, sizes)
    y = grouped_matmul(
        x, w, gs, preferred_element_type=jnp.float32, interpret=plgpu.InterpretGPUParams(detect_races=True)
    )
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # private: the race detector's state

    assert not gpu_callbacks.get_races().races_found
    assert y.dtype == jnp.float32
    _check(y, x, w, sizes, tol=1e-5)


def test_interpret_group_sizes_past_m_and_traced():
    """sum(group_sizes) > M cuts off at M (as ragged_dot); group_sizes traced under jit."""
    sizes = [50, 30, 100]
    x, w, gs = _inputs(3, 120, 64, 64, sizes)
    params = P(block_m=64, block_n=64, num_stages=2)
    f = jax.jit(lambda x, w, gs: grouped_matmul(x, w, gs, params=params, interpret=True))
    _check(f(x, w, gs), x, w, sizes, tol=1e-2)
    sizes2 = [0, 120, 0]
    _check(f(x, w, jnp.asarray(sizes2, jnp.int32)), x, w, sizes2, tol=1e-2)


def test_reference():
    sizes = [3, 0, 20, 5]
    x, w, gs = _inputs(11, 31, 40, 24, sizes)
    ref = grouped_matmul_reference(x, w, gs)
    assert ref.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ref), _np_grouped(x, w, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_m", [64, 128, 192])
def test_task_table_covers_each_row_once(block_m):
    """Random and adversarial group sizes: every row [0, M) is owned by exactly one task, of the
    right group, within its tile; the static task bound is never exceeded. (One shape per
    block_m, so the table compiles once: trailing groups are empty, rows past the sum are pad.)"""
    e, m = 140, 2 * 192 * 140
    table = jax.jit(task_table, static_argnums=(1, 2))
    rng = np.random.default_rng(block_m)
    trials = [np.full(64, 62), np.full(130, 1), np.full(9, 70), np.zeros(3, int), np.full(140, 58)]
    for _ in range(30):
        k = int(rng.integers(1, e + 1))
        trials.append(rng.integers(0, 2 * block_m, k) * (rng.random(k) < 0.7))
    for sizes in trials:
        sizes = np.pad(sizes, (0, e - len(sizes)))
        assert sizes.sum() <= m
        t = np.asarray(table(jnp.asarray(sizes, jnp.int32), m, block_m))
        assert t.shape == (4, num_tasks_bound(m, e, block_m))
        group_of_row = np.repeat(np.arange(e + 1), np.append(sizes, m - sizes.sum()))
        owner = np.zeros(m, int)
        for g, row0, off, rows in t.T:
            if rows == 0:
                continue
            assert row0 % 8 == 0 and 0 <= off and off + rows <= block_m
            owner[row0 + off:row0 + off + rows] += 1
            assert np.all(group_of_row[row0 + off:row0 + off + rows] == g)
        assert np.all(owner == 1)


def test_bad_inputs():
    x = jnp.ones((16, 64), jnp.bfloat16)
    w = jnp.ones((2, 64, 64), jnp.bfloat16)
    gs = jnp.array([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="w \\[E, K, N\\]"):
        grouped_matmul(x, jnp.ones((2, 32, 64), jnp.bfloat16), gs, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, jnp.array([8, 8, 0], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="16-bit"):
        grouped_matmul(x.astype(jnp.float32), w, gs, interpret=True)
    with pytest.raises(ValueError, match="preferred_element_type"):
        grouped_matmul(x, w, gs, preferred_element_type=jnp.int32, interpret=True)
    with pytest.raises(ValueError, match="shared memory"):
        grouped_matmul(x, w, gs, params=P(block_m=192, block_n=256, block_k=128, num_stages=4), interpret=True)
    for bad in (dict(block_m=32), dict(block_n=72), dict(block_k=96), dict(num_stages=1), dict(grid_minor="k")):
        with pytest.raises(ValueError):
            P(**bad)


def test_params_lookup():
    for m, k, n, e in ((8192, 2048, 768, 64), (512, 2048, 1536, 128), (512, 768, 2048, 128), (100, 64, 64, 3)):
        for out in (jnp.bfloat16, jnp.float32):
            p = grouped_matmul_params_for(m, k, n, e, jnp.bfloat16, out)
            assert p.smem_bytes(2, jnp.dtype(out).itemsize) <= 232448


# ---- lowering for an H200, checked on the CPU machine ----------------------------------------------
def test_lowers_for_h200():
    """Cross-lowers to a Mosaic GPU module for an H200 (layout inference, TMA tiling and the
    shared-memory budget are checked here; the PTX step still needs the GPU)."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    )
    sds = jax.ShapeDtypeStruct
    cases = [
        (8192, 2048, 768, 64, None, None),
        (512, 2048, 1536, 128, None, jnp.float32),
        (512, 768, 2048, 128, P(block_m=64, block_n=256, block_k=64, num_stages=4, grid_minor="m"), None),
        (8192, 2048, 768, 64, P(block_m=192, block_n=192, block_k=64, num_stages=4), None),
        (300, 200, 48, 5, P(block_m=128, block_n=64, block_k=128, num_stages=3), jnp.float32),
    ]
    with jax.sharding.use_abstract_mesh(mesh):
        for m, k, n, e, params, out in cases:
            low = grouped_matmul.trace(
                sds((m, k), jnp.bfloat16), sds((e, k, n), jnp.bfloat16), sds((e,), jnp.int32),
                params=params, preferred_element_type=out,
            ).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in low.as_text()


# ---- compiled on the GPU ---------------------------------------------------------------------------
def _moe_sizes(rng, m, e):
    """Group sizes as a top-k router makes them: uneven, some zero."""
    counts = np.bincount(rng.integers(0, e, m) ** 2 // e, minlength=e)[:e]
    counts[rng.integers(0, e, max(1, e // 8))] = 0
    return counts


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,e", [(8192, 2048, 768, 64), (512, 2048, 1536, 128), (512, 768, 2048, 128),
                                     (1000, 200, 300, 9), (64, 2048, 1536, 128)])
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_gpu(m, k, n, e, out):
    rng = np.random.default_rng(m + e)
    sizes = _moe_sizes(rng, m - 17, e)  # 17 padded rows
    x, w, gs = _inputs(m, m, k, n, sizes)
    want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    for params in (None, P(block_m=64, block_n=64, block_k=128, num_stages=3, grid_minor="m")):
        y = grouped_matmul(x, w, gs, params=params, preferred_element_type=out)
        got = np.asarray(y.astype(jnp.float32))
        assert np.all(got[int(sizes.sum()):] == 0)
        tol = 1e-2 if out == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(got, np.asarray(want), rtol=tol, atol=tol * float(jnp.abs(want).max()))


def test_bench_script_smoke(tmp_path):
    """bench/kernels/grouped_matmul.py --smoke (one tiny case, interpret mode) runs and reports."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "bench" / "kernels" / "grouped_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_matmul", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--smoke", "--smoke-cases", "smoke_decode", "--out", str(tmp_path)])
    (res,) = [json.loads(p.read_text()) for p in tmp_path.glob("grouped_matmul_*_smoke.json")]
    ok = {r["impl"]: r for r in res["rows"] if "error" not in r}
    assert {"ours", "ours(best)", "ours(f32 out)", "xla ragged_dot", "dense bf16 matmul"} <= set(ok)
    assert ok["ours"]["max_rel_err"] < 2e-2 and ok["ours(f32 out)"]["max_rel_err"] < 1e-5
    assert res["tuned"] and not res["errors"]
