"""Mosaic GPU prefill kernel (`paged_prefill_attention_mgpu`) against the float32 reference.

* CPU: the kernel runs under Mosaic GPU interpret mode (simulated SMEM, TMA, barriers, wgmma;
  uninitialized memory NaN-filled, so an output row the kernel forgets to write shows as NaN).
  The cases are small (interpret mode is slow) but cover chunk lengths 1, 15, 63, 64, 65 and 130,
  cached prefixes, ragged batches, pad tokens, GQA groups 1..16, head_dim 64 and 128, block
  sizes 16/32/64, every tuning knob, a sliding window, and race detection.
* Pools come from tests/test_paged_attention.py's builder: random values (never zeros), NaN in
  other layers, unowned blocks and slots past each stream's kv_len; block tables are random
  permutations whose unused entries point at other streams' blocks.
* `gpu`: compiled on the GPU at a larger shape, against the Triton kernel and the reference.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import paged_prefill_attention, paged_prefill_attention_reference
from pallas_kernels.paged_attention.prefill_mgpu import PrefillMgpuParams, paged_prefill_attention_mgpu
from tests.test_paged_attention import assert_close, build_pools

BF16, F32 = jnp.bfloat16, jnp.float32
P = PrefillMgpuParams

# (group, hkv, head_dim, block_size, window, params, streams [(new, cached)], pad tokens)
CASES = [
    (4, 2, 64, 16, None, P(), ((1, 0), (15, 0), (13, 50), (64, 0), (65, 63), (63, 1)), 5),
    (1, 2, 128, 32, None, P(block_k=128, num_stages=3), ((1, 0), (15, 40), (130, 0)), 3),
    (2, 1, 128, 64, None, P(block_m=128), ((100, 30), (1, 200)), 0),
    (8, 1, 64, 16, 40, P(), ((70, 20), (9, 0)), 2),
    (16, 1, 64, 16, None, P(block_m=128, block_k=128), ((20, 20), (9, 0)), 2),
    (1, 1, 64, 16, 7, P(block_k=64), ((3, 5),), 0),  # T < block_m / G: the wrapper pads q
]


def _problem(case, seed):
    g, hkv, d, bs, window, params, streams, pad = case
    rng = np.random.default_rng(seed)
    kv_lens = [n + c for n, c in streams]
    k_pool, v_pool, tables, *_ = build_pools(
        rng, kv_lens, num_layers=2, layer=1, block_size=bs, hkv=hkv, d=d, kv_dtype=BF16)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in streams])]).astype(np.int32)  # i32[B+1]
    t = int(cu[-1]) + pad
    q = jnp.asarray(rng.standard_normal((t, g * hkv, d)), BF16)  # bf16[T, Hq, D]
    return q, k_pool, v_pool, tables, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32)


def _check(out, q, k_pool, v_pool, tables, cu, kv_lens, kw, what):
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = paged_prefill_attention_reference(q, k_pool, v_pool, 1, tables, cu, kv_lens, **kw)  # f32[T, Hq, D]
    assert_close(out, ref, tol=2.5e-2, what=what)
    assert (np.asarray(out.astype(F32))[int(cu[-1]):] == 0).all(), "pad tokens must give zeros"


# CI interprets the first (every awkward length), the windowed and the padded-q cases; `slow` the rest
_CI = (0, 3, 5)


@pytest.mark.parametrize("case", [c if i in _CI else pytest.param(c, marks=pytest.mark.slow)
                                  for i, c in enumerate(CASES)],
                         ids=lambda c: f"g{c[0]}-hkv{c[1]}-d{c[2]}-bs{c[3]}-m{c[5].block_m}")
def test_prefill_mgpu_interpret(case):
    q, k_pool, v_pool, tables, cu, kv_lens = _problem(case, seed=case[0] * 10 + case[2])
    kw = dict(sm_scale=1.0 / math.sqrt(q.shape[-1]), sliding_window=case[4])
    out = paged_prefill_attention_mgpu(q, k_pool, v_pool, jnp.int32(1), tables, cu, kv_lens, params=case[5],
                                       interpret=True, _poison=True, **kw)
    _check(out, q, k_pool, v_pool, tables, cu, kv_lens, kw, "mgpu prefill")


def test_prefill_mgpu_interpret_no_races():
    """Race detection over SMEM / TMA / barriers, with a 2-deep ring that wraps several times."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc  # no public getter in 0.11.2

    case = (2, 1, 64, 16, None, P(num_stages=2), ((40, 200), (30, 0)), 1)
    q, k_pool, v_pool, tables, cu, kv_lens = _problem(case, seed=5)
    kw = dict(sm_scale=0.125)
    params = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
    out = paged_prefill_attention_mgpu(q, k_pool, v_pool, jnp.int32(1), tables, cu, kv_lens, params=case[5],
                                       interpret=params, **kw)
    out.block_until_ready()
    assert not ipc.get_races().races_found
    _check(out, q, k_pool, v_pool, tables, cu, kv_lens, kw, "mgpu prefill (race detection)")


def test_prefill_mgpu_traced_layer():
    """`layer` traced inside a lax.scan, as in the engine's layer loop (pools hold layer 1 only)."""
    case = (4, 1, 64, 16, None, P(), ((17, 30),), 0)
    q, k_pool, v_pool, tables, cu, kv_lens = _problem(case, seed=9)

    def body(c, layer):
        return c, paged_prefill_attention_mgpu(q, k_pool, v_pool, layer, tables, cu, kv_lens, sm_scale=0.125,
                                               interpret=True)

    _, outs = jax.lax.scan(body, 0, jnp.array([1, 1], jnp.int32))
    for i in range(2):
        _check(outs[i], q, k_pool, v_pool, tables, cu, kv_lens, dict(sm_scale=0.125), f"scan step {i}")


def test_prefill_mgpu_rejects_unsupported():
    t, tables, cu, kvl = 4, jnp.zeros((1, 2), jnp.int32), jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32)
    pool = jnp.ones((1, 4, 16, 2, 64), BF16)
    call = lambda q, kp, **kw: paged_prefill_attention_mgpu(q, kp, kp, 0, tables, cu, kvl, sm_scale=1.0, **kw)
    with pytest.raises(ValueError, match="bfloat16"):
        call(jnp.ones((t, 4, 64), F32), pool)
    with pytest.raises(ValueError, match="bfloat16"):
        call(jnp.ones((t, 4, 64), BF16), pool.astype(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="head_dim"):
        call(jnp.ones((t, 4, 256), BF16), jnp.ones((1, 4, 16, 2, 256), BF16))
    with pytest.raises(ValueError, match="group"):
        call(jnp.ones((t, 6, 64), BF16), pool)  # group 3
    with pytest.raises(ValueError, match="group"):
        call(jnp.ones((t, 32, 64), BF16), pool, params=P(block_m=64))  # group 16 needs block_m 128
    with pytest.raises(ValueError, match="block_size"):
        call(jnp.ones((t, 4, 64), BF16), jnp.ones((1, 4, 8, 2, 64), BF16))
    with pytest.raises(ValueError, match="block_k"):
        P(block_k=32)


# Warp-specialized variant (2 compute warpgroups + 1 TMA warpgroup). GPU interpret mode runs each
# warpgroup's blocking barrier waits inside host callbacks; with 2 host cores XLA's callback threads
# were all blocked by two of the three warpgroups and the interpreter deadlocked (observed here on
# multi-step cases; single-step cases passed), so this runs only with enough host cores.
WS_CASES = [
    (4, 2, 64, 16, None, P(num_compute_wgs=2), ((1, 0), (15, 0), (13, 50), (64, 0), (65, 63), (63, 1)), 5),
    (2, 1, 128, 32, 50, P(num_compute_wgs=2, block_k=128, num_stages=3), ((70, 200), (5, 0)), 3),
]


@pytest.mark.skipif((os.cpu_count() or 1) < 8, reason="GPU interpret mode with 3 warpgroups needs more host threads")
@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: f"g{c[0]}-d{c[2]}-bs{c[3]}")
def test_prefill_mgpu_interpret_warp_specialized(case):
    test_prefill_mgpu_interpret(case)


# ---- GPU (compiled) -------------------------------------------------------------------------------
GPU_PARAMS = [P(), P(p_in_smem=True), P(block_k=128), P(num_stages=3), P(block_m=128), P(block_m=128, block_k=128),
              P(num_compute_wgs=2), P(num_compute_wgs=2, block_k=128), P(num_compute_wgs=2, num_stages=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("params", GPU_PARAMS, ids=lambda p: f"m{p.block_m}-k{p.block_k}-s{p.num_stages}-"
                         f"{'psmem' if p.p_in_smem else 'preg'}-wg{p.num_compute_wgs}")
def test_prefill_mgpu_gpu(params):
    """Bigger ragged problem, compiled: Hq 32 / Hkv 8, D 128, bs 16; vs the Triton kernel and the reference."""
    streams = ((512, 1024), (1, 0), (300, 77), (65, 2000), (1000, 0))
    case = (4, 8, 128, 16, None, params, streams, 19)
    q, k_pool, v_pool, tables, cu, kv_lens = _problem(case, seed=11)
    kw = dict(sm_scale=1.0 / math.sqrt(128))
    out = paged_prefill_attention_mgpu(q, k_pool, v_pool, jnp.int32(1), tables, cu, kv_lens, params=params, **kw)
    _check(out, q, k_pool, v_pool, tables, cu, kv_lens, kw, "mgpu prefill (gpu)")
    tri = paged_prefill_attention(q, k_pool, v_pool, jnp.int32(1), tables, cu, kv_lens, **kw)
    assert_close(out, np.asarray(tri.astype(F32)), tol=2.5e-2, what="mgpu vs triton")
