"""Tensor parallelism on simulated CPU devices: every family through `LLM.generate` at TP=2 and
TP=4 gives the ids and logprobs of one device (tests/tp_check.py, in subprocesses: the device
count is a process-wide XLA flag), and the placement rules shard what they say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from metrale_jax.parallel import Sharder, make_mesh, param_dim
from tests.conftest import CPU_TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str, devices: int = 4) -> list[dict]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")  # (after conftest's CPU test flags)
    r = subprocess.run([sys.executable, "-m", "tests.tp_check", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0, (lines, r.stderr[-3000:])
    return lines


@pytest.mark.parametrize("plan", ["ci", pytest.param("full", marks=pytest.mark.slow)])
def test_every_family_matches_one_device(plan):
    # greedy and seeded ids equal, logprobs and prompt logprobs within 1e-4; chunked prefill and
    # preemption; TP=4 with the KV heads split and replicated; expert parallel; Pallas kernels;
    # loading streamed to the shards
    from tests.tp_check import CI_PLAN, PLAN

    lines = _check("--plan", plan)
    want = CI_PLAN if plan == "ci" else PLAN
    assert {(x["family"], x["variant"]) for x in lines} == {(f, v) for f, vs in want.items() for v in vs}
    assert all(x["same_ids"] and x["preemptions"] > 0 for x in lines)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (both `slow`, ~60 s each on 2 cores, for CI time: CI keeps the single-process check above)
@pytest.mark.parametrize("family,spec", [pytest.param("mamba2_tiny", False, marks=pytest.mark.slow),  # swap preemption
                                         pytest.param("qwen3_next_tiny", True, marks=pytest.mark.slow)])
def test_two_processes_match_one(family, spec, tmp_path):
    from tests.tp_check import run_family

    port, env = _free_port(), dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = CPU_TEST_XLA_FLAGS  # one device per process (conftest's flags only)
    cmd = [sys.executable, "-m", "tests.mh_check", "--port", str(port), "--family", family]
    if spec:  # speculative decoding, drafts from the one-device outputs: verify steps followed too
        want, _ = run_family(family, 1, False, False)
        (tmp_path / "refs.json").write_text(json.dumps([ids for ids, _ in want]))
        cmd += ["--spec-refs", str(tmp_path / "refs.json")]
    cmd += ["--process-id"]
    log = tmp_path / "follower.log"  # a file, not a pipe: a full pipe would stall the follower, then the leader
    with open(log, "w") as f:
        follower = subprocess.Popen(cmd + ["1"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            leader = subprocess.run(cmd + ["0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            assert follower.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            follower.kill()
    assert leader.returncode == 0, leader.stderr[-3000:]
    lines = [json.loads(x) for x in leader.stdout.splitlines() if x.startswith("{")]
    want, _ = run_family(family, 1, False, False)
    assert lines[-1]["swaps"] > 0 or spec
    assert len(lines) - 1 == len(want)
    for got, (ids, lps) in zip(lines, want):
        assert got["ids"] == ids
        np.testing.assert_allclose(got["logprobs"], lps, atol=1e-4)


def test_rules():
    assert param_dim("wqkv", 3, False) == -1 and param_dim("wo", 3, False) == -2
    assert param_dim("experts_down", 4, True) == -3 and param_dim("experts_down", 4, False) == -2
    assert param_dim("attn_norm", 2, False) is None and param_dim("router", 3, False) is None
    mesh = make_mesh(1)
    sh = Sharder(mesh)
    x = np.zeros((3, 64, 96), np.float32)
    path = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey("wqkv"))
    assert sh.param_sharding(path, x).spec == P(None, None, "tp")
    # 4-bit linears: [N, K]-major arrays, split along N (column-parallel) or K (row-parallel)
    for parent, leaf, ndim, spec in [
            ("wqkv", "packed", 3, P(None, "tp", None)), ("wo", "packed", 3, P(None, None, "tp")),
            ("w_down", "scales", 3, P(None, None, "tp")), ("wo", "perm", 2, P(None, "tp")), ("wqkv", "perm", 2, P()),
            ("w_gate_up", "row_scale", 2, P(None, "tp")), ("w_down", "row_scale", 2, P()),
            ("wo", "kernel_scales", 4, P(None, None, "tp", None)), ("router", "packed", 3, P())]:
        path = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(parent), jax.tree_util.GetAttrKey(leaf))
        assert sh.param_sharding(path, np.zeros((2,) * ndim)).spec == spec, (parent, leaf)
    # 4-bit experts [L, E, N, K/2]: like their dense twins, or by expert under expert parallelism
    ep = Sharder(mesh, expert_parallel=True)
    for parent, leaf, ndim, spec, ep_spec in [
            ("experts_gate_up", "packed", 4, P(None, None, "tp", None), P(None, "tp", None, None)),
            ("experts_down", "packed", 4, P(None, None, None, "tp"), P(None, "tp", None, None)),
            ("experts_down", "zeros", 4, P(None, None, None, "tp"), P(None, "tp", None, None)),
            ("experts_gate_up", "row_scale", 3, P(None, None, "tp"), P(None, "tp", None)),
            ("experts_down", "perm", 3, P(None, None, "tp"), P(None, "tp", None)),
            ("experts_gate_up", "perm", 3, P(), P(None, "tp", None))]:
        path = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(parent), jax.tree_util.GetAttrKey(leaf))
        assert sh.param_sharding(path, np.zeros((2,) * ndim)).spec == spec, (parent, leaf)
        assert ep.param_sharding(path, np.zeros((2,) * ndim)).spec == ep_spec, (parent, leaf, "ep")
    with pytest.raises(ValueError, match="needs that many devices"):
        make_mesh(len(jax.devices()) + 1)


def test_streamed_loading_holds_one_layer_on_the_host():
    """With a sharder the loader sends each layer to the devices as soon as it is read: the host's
    peak (numpy allocations, tracemalloc) stays a small fraction of the parameters, where the
    plain load holds all of them; the parameters are the same."""
    import tracemalloc

    from metrale_jax.model import random_model

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=1024,
               num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="float32")
    peaks, trees = [], []
    for sharder in (None, Sharder(make_mesh(1))):
        tracemalloc.start()
        try:
            _, params = random_model(cfg, sharder=sharder)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        trees.append(params)
    total = sum(x.nbytes for x in jax.tree.leaves(trees[0]))
    assert peaks[0] > total and peaks[1] < 0.35 * total, (peaks, total)
    for a, b in zip(jax.tree.leaves(trees[0]), jax.tree.leaves(trees[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
