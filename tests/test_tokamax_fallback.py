"""tokamax's availability, its fallback and its log filter (metrale_jax/layers/moe.py), on the CPU
with fake tokamax modules: one without `ragged_dot` (as on the H200 with pydantic missing), one
whose import fails inside, and a working fake package on disk that records how it is called and
logs an absl warning per call, as tokamax 0.0.17 does on an autotuning-cache miss."""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging

from metrale_jax.layers import moe


def _forget_tokamax():
    for name in [n for n in sys.modules if n == "tokamax" or n.startswith("tokamax.")]:
        del sys.modules[name]
    moe._load_tokamax.cache_clear()
    moe._tokamax_grouped_matmul.clear_cache()  # its traces hold the tokamax of the test before
    absl_log = logging.getLogger("absl")
    for f in [f for f in absl_log.filters if isinstance(f, moe._TokamaxLogFilter)]:
        absl_log.removeFilter(f)


@pytest.fixture(autouse=True)
def fresh():
    _forget_tokamax()
    yield
    _forget_tokamax()


def _gmm_case(m, k=24, n=40, g=5, seed=0, dtype=jnp.bfloat16):
    """x [m, k], w [g, k, n] in `dtype` (bf16: what tokamax takes), sizes i32[g] summing to m,
    uneven with an empty group."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, m + 1, g - 1))
    cuts[1] = cuts[0]  # group 1 empty
    sizes = np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes)


def _numpy_gmm(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for gi, s in enumerate(np.asarray(sizes)):
        out[start:start + s] = x[start:start + s] @ w[gi]
        start += s
    return out


def _moe_warnings(caplog):
    return [r for r in caplog.records if r.name == "metrale_jax.layers.moe" and r.levelno >= logging.WARNING]


def _check_falls_back_once(caplog, reason: str):
    with caplog.at_level(logging.WARNING):
        assert not moe.tokamax_available()
        assert not moe.tokamax_available()
        x, w, sizes = _gmm_case(m=13)
        f = jax.jit(moe.grouped_matmul, static_argnames="use_tokamax")
        got = np.asarray(f(x, w, sizes, use_tokamax=True))
        got2 = np.asarray(moe.grouped_matmul(x[:9], w, sizes.at[-1].add(-4), use_tokamax=True))
    np.testing.assert_allclose(got, _numpy_gmm(x, w, sizes), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got2, _numpy_gmm(x[:9], w, sizes.at[-1].add(-4)), rtol=1e-5, atol=1e-4)
    warned = _moe_warnings(caplog)
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert reason in warned[0].getMessage() and "jax.lax.ragged_dot" in warned[0].getMessage()


def test_module_without_ragged_dot_falls_back_with_one_warning(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", types.ModuleType("tokamax"))
    _check_falls_back_once(caplog, "has no attribute 'ragged_dot'")


class _BrokenFinder(importlib.abc.MetaPathFinder):
    """Finds `tokamax` and fails its import inside, as a missing dependency does."""

    def find_spec(self, name, path=None, target=None):
        if name == "tokamax" or name.startswith("tokamax."):
            raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")
        return None


def test_import_error_inside_tokamax_falls_back_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder(), *sys.meta_path])
    _check_falls_back_once(caplog, "No module named 'pydantic'")


_FAKE_INIT = '''
from absl import logging
import jax
import jax.numpy as jnp

CALLS = []


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, *, implementation=None):
    CALLS.append(dict(lhs=lhs.shape, rhs=rhs.shape, preferred_element_type=preferred_element_type,
                      implementation=implementation))
    logging.warning("Autotuning cache miss for %s on %s with key %s", "op", "cpu", lhs.shape)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
'''

_FAKE_MOSAIC = '''
import dataclasses

HEURISTIC = "block 64x64x128, 2 stages"
BINDS = []


@dataclasses.dataclass(frozen=True)
class _Bound:
    heuristics_config: str


@dataclasses.dataclass(frozen=True)
class PallasMosaicGpuRaggedDot:
    config: object = None

    def bind(self, lhs, rhs, *, group_sizes, preferred_element_type=None):
        BINDS.append((lhs.shape, rhs.shape, group_sizes.shape, preferred_element_type))
        return _Bound(HEURISTIC)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)
'''


@pytest.fixture
def fake_tokamax(tmp_path, monkeypatch):
    pkg = tmp_path / "tokamax"
    (pkg / "_src" / "ops" / "ragged_dot").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_FAKE_INIT))
    for sub in ("_src", "_src/ops", "_src/ops/ragged_dot"):
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "_src" / "ops" / "ragged_dot" / "pallas_mosaic_gpu.py").write_text(textwrap.dedent(_FAKE_MOSAIC))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return pkg


@pytest.mark.parametrize("m", [5, 8, 10, 37])
def test_working_tokamax_gets_padded_rows_and_a_fixed_config(fake_tokamax, caplog, m):
    """M <= 8 goes as is, other M padded to a multiple of 8; the op carries the heuristic config."""
    x, w, sizes = _gmm_case(m=m, seed=m)
    with caplog.at_level(logging.WARNING):
        assert moe.tokamax_available()
        got = np.asarray(jax.jit(moe.grouped_matmul, static_argnames="use_tokamax")(x, w, sizes, use_tokamax=True))
    np.testing.assert_allclose(got, _numpy_gmm(x, w, sizes), rtol=1e-5, atol=1e-4)
    tk = sys.modules["tokamax"]
    mosaic = sys.modules["tokamax._src.ops.ragged_dot.pallas_mosaic_gpu"]
    rows = m if m <= 8 else -(-m // 8) * 8
    (call,) = tk.CALLS
    assert call["lhs"] == (rows, 24) and call["rhs"] == (5, 24, 40)
    assert call["preferred_element_type"] == jnp.float32
    (op,) = call["implementation"]
    assert op.config == mosaic.HEURISTIC  # bound explicitly: tokamax has nothing to look up or tune
    assert mosaic.BINDS == [((rows, 24), (5, 24, 40), (5,), jnp.float32)]
    assert _moe_warnings(caplog) == []


def test_repeated_tokamax_log_lines_shown_once(fake_tokamax, caplog):
    """tokamax's per-call warning passes once; absl warnings from elsewhere and tokamax errors pass
    every time."""
    with caplog.at_level(logging.INFO):
        assert moe.tokamax_available()
        for m in range(9, 57, 8):  # six shapes: six traces of the jitted tokamax call
            moe.grouped_matmul(*_gmm_case(m=m), use_tokamax=True)
        for _ in range(3):
            absl_logging.warning("not from tokamax")
        tk = sys.modules["tokamax"]
        for _ in range(2):
            tk.logging.error("tokamax error %d", 1)
    msgs = [r.getMessage() for r in caplog.records if r.name == "absl"]
    assert len(sys.modules["tokamax"].CALLS) == 6
    assert sum(s.startswith("Autotuning cache miss") for s in msgs) == 1
    assert msgs.count("not from tokamax") == 3
    assert msgs.count("tokamax error 1") == 2


def test_without_use_tokamax_tokamax_is_not_imported(fake_tokamax):
    x, w, sizes = _gmm_case(m=12)
    got = np.asarray(moe.grouped_matmul(x, w, sizes, use_tokamax=False))
    np.testing.assert_allclose(got, _numpy_gmm(x, w, sizes), rtol=1e-5, atol=1e-4)
    assert "tokamax" not in sys.modules


def test_float32_operands_never_reach_tokamax(fake_tokamax):
    """tokamax takes bf16/f16 only (a float32 MoE model failed on the H200): f32 goes to XLA."""
    x, w, sizes = _gmm_case(m=12, dtype=jnp.float32)
    got = np.asarray(moe.grouped_matmul(x, w, sizes, use_tokamax=True))
    np.testing.assert_allclose(got, _numpy_gmm(x, w, sizes), rtol=1e-5, atol=1e-4)
    assert "tokamax" not in sys.modules or not sys.modules["tokamax"].CALLS


def test_moe_layers_share_one_traced_tokamax_call(fake_tokamax):
    """Three MoE layers in one step trace tokamax once per GEMM shape (gate_up, down), not per
    layer: the kernel is lowered and compiled once per step (start-up, see moe.py)."""
    rng = np.random.default_rng(3)
    t, h, inter, e, k = 11, 16, 12, 6, 2
    bf16 = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((t, h)), bf16)
    wr = jnp.asarray(rng.standard_normal((h, e)), bf16)
    wgu = jnp.asarray(rng.standard_normal((e, h, 2 * inter)) / 4, bf16)
    wd = jnp.asarray(rng.standard_normal((e, inter, h)) / 4, bf16)

    def three_layers(x, use_tokamax):
        for _ in range(3):
            w, idx = moe.softmax_topk_router(x, wr, k, True)
            x = x + moe.routed_experts(x, w, idx, wgu, wd, use_tokamax=use_tokamax)
        return x

    f = jax.jit(three_layers, static_argnames="use_tokamax")
    got, want = np.asarray(f(x, use_tokamax=True)), np.asarray(f(x, use_tokamax=False))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [c["rhs"] for c in sys.modules["tokamax"].CALLS] == [(e, h, 2 * inter), (e, inter, h)]
