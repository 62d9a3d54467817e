"""Start-up: the packed step inputs' alignment, the executable cache (a warm start loads every
step without tracing or compiling, and gives the same tokens), and the warm-up run of every
step on padding inputs, which must leave the state untouched."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import metrale_jax.engine.compile as compile_mod
from metrale_jax import load_model
from metrale_jax.engine.compile import CompilationManager, CompileCounter
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.metadata_builder import (
    ALIGN,
    BuilderConfig,
    DecodeRow,
    PrefillChunk,
    RowSampling,
    StepBucket,
    build_step,
    pack,
    packed_layout,
    unpack,
)
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES

CFG = EngineConfig(
    dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=48, max_num_seqs=4, max_num_batched_tokens=16,
    decode_buckets=(4,), prefill_buckets=(16,), max_prefill_streams=2, max_logprobs=3, show_progress=False,
)


@pytest.mark.parametrize("bucket", [StepBucket("decode", num_seqs=3),
                                    StepBucket("prefill", num_tokens=13, num_streams=3),
                                    StepBucket("mixed", num_seqs=5, num_tokens=7, num_streams=2)])
def test_packed_layout_aligned_and_round_trips(bucket):
    cfg = BuilderConfig(block_size=4, max_blocks_per_seq=5, vocab_size=97, max_suppress_ids=3)
    layout = packed_layout(cfg, bucket)
    # every leaf starts on a 256-byte boundary (the Mosaic GPU call rejects anything else)
    assert all(off % ALIGN == 0 for _, off, _, _ in layout.entries)
    rng = np.random.default_rng(0)
    rs = RowSampling(temperature=0.7, top_k=5, top_p=0.9, seed=(1, 2, 3), suppress_ids=(4, 5), logprobs=True)
    rows = [DecodeRow(int(rng.integers(97)), p, [3, 1, 4], rs, ssm_slot=2) for p in (0, 5, 11)][: bucket.num_seqs]
    chunks = [PrefillChunk(rng.integers(0, 97, n).tolist(), s, [2, 0, 1, 4], rs, pen_row=1)
              for n, s in ((4, 0), (3, 9))][: bucket.num_streams] if bucket.kind != "decode" else []
    inputs = build_step(cfg, bucket, rows, chunks)
    _, ibuf, fbuf = pack(cfg, inputs)
    assert ibuf.shape == (layout.num_i32,) and fbuf.shape == (layout.num_f32,)
    got = jax.tree.leaves(unpack(layout, jnp.asarray(ibuf), jnp.asarray(fbuf)))
    want = jax.tree.leaves((inputs.dmd, inputs.pmd, inputs.tokens, inputs.smd))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _engine(path, cache_dir, **kw):
    model, params = load_model(FIXTURES / path, dtype="float32", show_progress=False)
    with CompileCounter() as cc:
        eng = LLMEngine(model, params, dataclasses.replace(CFG, compilation_cache_dir=str(cache_dir), **kw))
    return eng, cc


def _run(eng):
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    outs = eng.generate([[1, 2, 3], list(range(5, 30))], [sp, SamplingParams(temperature=0.8, seed=3, max_tokens=6)])
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]


@pytest.fixture
def exe_cache_here(monkeypatch, tmp_path):
    """The executable cache on this platform too, in this test's own directory (JAX keeps the
    first persistent cache dir of the process, and that one outlives the run). On the CPU the
    loaded executables cannot run (compile.EXE_CACHE_PLATFORMS), so the CPU tests check loading,
    keys and misses; the GPU test also runs them."""
    monkeypatch.setattr(compile_mod, "EXE_CACHE_PLATFORMS", (jax.devices()[0].platform,))
    monkeypatch.setattr(compile_mod, "executable_cache_dir", lambda: str(tmp_path / "executables"))


def test_warm_start_loads_every_step_without_tracing(tmp_path, exe_cache_here):
    on_gpu = jax.devices()[0].platform == "gpu"
    eng, cc = _engine("llama_tiny", tmp_path, warm_up=on_gpu)
    n = eng.compiler.num_executables + len(eng.compiler.swap_executables)
    assert eng.compiler.cache_hits == 0 and cc.lowerings >= n
    assert len(eng.compiler.cache_misses) == n and set(eng.compiler.cache_misses.values()) == {"absent"}
    assert eng.compiler.cache_unsaved == {}
    cold = _run(eng) if on_gpu else None
    eng2, cc2 = _engine("llama_tiny", tmp_path, warm_up=on_gpu)
    assert eng2.compiler.cache_hits == n
    assert cc2.lowerings == 0 and cc2.backend_compiles == 0
    if on_gpu:
        assert _run(eng2) == cold
    # another step config is another key: nothing stale is loaded
    eng3, cc3 = _engine("llama_tiny", tmp_path, max_logprobs=2, warm_up=on_gpu)
    assert eng3.compiler.cache_hits == 0 and cc3.lowerings >= n
    # engine settings the steps do not depend on keep the key
    eng4, cc4 = _engine("llama_tiny", tmp_path, warm_up=on_gpu, seed=7, show_progress=True, swap_space_gb=1.0)
    assert eng4.compiler.cache_hits == n and cc4.lowerings == 0


def test_broken_cache_entry_is_a_miss(tmp_path, exe_cache_here):
    eng, _ = _engine("llama_tiny", tmp_path, max_logprobs=1)  # (JAX keeps the first cache dir of the process)
    n = eng.compiler.num_executables + len(eng.compiler.swap_executables)
    keys = [eng.compiler._key(("forward", b) if b.kind == "decode" else b, eng.params, eng.state)
            for b in eng.compiler.buckets]  # (a decode bucket's work items are its two halves)
    (eng.compiler.exe_cache.dir / f"{keys[0]}.exe").write_bytes(b"not an executable")
    eng2, cc2 = _engine("llama_tiny", tmp_path, max_logprobs=1)
    assert eng2.compiler.cache_hits == n - 1
    (why,) = eng2.compiler.cache_misses.values()  # the reason is kept (the start-up bench reports it)
    assert why.startswith("unusable: ")
    assert (eng.compiler.exe_cache.dir / f"{keys[0]}.exe").read_bytes() != b"not an executable"  # replaced


def test_no_executable_cache_on_the_cpu(tmp_path):
    eng, _ = _engine("llama_tiny", tmp_path)
    if jax.devices()[0].platform != "cpu":
        pytest.skip("CPU behaviour")
    assert eng.compiler.exe_cache.dir is None
    assert _run(eng)[0][0]


@pytest.mark.gpu
def test_warm_start_same_tokens_gpu(tmp_path):
    eng, _ = _engine("llama_tiny", tmp_path)
    cold = _run(eng)
    eng2, cc2 = _engine("llama_tiny", tmp_path)
    assert eng2.compiler.cache_hits == eng2.compiler.num_executables + len(eng2.compiler.swap_executables)
    assert cc2.backend_compiles == 0 and _run(eng2) == cold


@pytest.mark.parametrize("name,pallas", [pytest.param("qwen3_next_tiny", False, marks=pytest.mark.slow),
                                         ("nemotron_h_tiny", True)])
def test_warm_up_runs_every_step_and_writes_nothing(tmp_path, name, pallas):
    """Also through the Pallas kernels (interpret mode), as the GPU's warm-up runs them."""
    from metrale_jax.layers.attention import AttentionConfig

    model, params = load_model(FIXTURES / name, dtype="float32", show_progress=False)
    attn = AttentionConfig(use_pallas=True, interpret=True, unroll_layers=True) if pallas else None
    eng = LLMEngine(model, params, dataclasses.replace(CFG, compilation_cache_dir=str(tmp_path), warm_up=False,
                                                       attention=attn))
    assert eng.config.attention.use_pallas == pallas
    rng = np.random.default_rng(1)

    def poison(x):  # every pool, state slot and penalty row holds data that a stray write would change
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        if x.dtype == jnp.bool_:
            return jnp.asarray(rng.integers(0, 2, x.shape).astype(bool))
        return jnp.asarray(rng.integers(0, 7, x.shape), x.dtype)

    state = jax.tree.map(poison, eng.state)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
    cm = CompilationManager(eng.model, eng.config, eng.builder)
    cm.executables, cm.split_executables = eng.compiler.executables, eng.compiler.split_executables
    after = cm.warm_up(eng.params, state)
    assert cm.warmup_seconds > 0
    for b, a in zip(before, jax.tree.leaves(after)):
        np.testing.assert_array_equal(b, np.asarray(a))


def test_compile_cache_follows_xdg_cache_home(tmp_path):
    """The compile cache sits beside the model cache: under $XDG_CACHE_HOME when it is set."""
    import os
    import subprocess
    import sys

    code = "from metrale_jax.engine.config import DEFAULT_CACHE_DIR; print(DEFAULT_CACHE_DIR)"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "metrale_jax" / "jax_cache")


_FRESH_PROCESS_RUN = """
import json, sys
from metrale_jax import LLM, SamplingParams
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.model import random_model
config = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=128, vocab_size=512, rms_norm_eps=1e-5,
              max_position_embeddings=512, rope_theta=10000.0, torch_dtype="bfloat16")
model, params = random_model(config, dtype="bfloat16", split_layers=True)
# a fixed KV pool: sized from free memory (0.9 of it) it took what the other GPU tests' processes
# needed, or failed beside them (the H200, session 10)
eng = LLMEngine(model, params, EngineConfig(dtype="bfloat16", max_model_len=512, num_kv_blocks=64,
                                            show_progress=False, compilation_cache_dir=sys.argv[1]))
outs = LLM.from_engine(eng).generate([list(range(3, 200)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
c = eng.compiler
print(json.dumps(dict(hits=c.cache_hits, n=c.num_executables + len(c.swap_executables), misses=c.cache_misses,
                      tokens=[list(o.outputs[0].token_ids) for o in outs])))
"""


@pytest.mark.gpu
def test_warm_start_in_a_fresh_process_gpu(tmp_path):
    """A warm start in a new process (as users restart a server) loads every step, the bf16 Mosaic
    prefill ones included (they failed to link when nothing had imported JAX's Mosaic GPU module
    yet: `compile._link_mosaic_gpu_runtime`), and gives the cold start's tokens."""
    import json
    import subprocess
    import sys

    def run():
        out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_RUN, str(tmp_path)], capture_output=True,
                             text=True, cwd=FIXTURES.parents[2])
        assert out.returncode == 0, out.stderr[-4000:]  # (the H200, session 10: it failed, stderr unseen)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["hits"] == 0 and warm["misses"] == {}
    assert warm["hits"] == warm["n"] == cold["n"]
    assert warm["tokens"] == cold["tokens"]


def test_compiler_options_exist_in_this_jaxlib(monkeypatch):
    """The XLA options the step executables may get (`CompilationManager.compiler_options`: command
    buffers with conditionals, no rematerialization, programmatic dependent launch) are options
    this jaxlib knows: XLA refuses an unknown name ("No such compile option") at compile time,
    which would otherwise show only on the GPU."""
    from metrale_jax.layers.attention import AttentionConfig

    monkeypatch.setattr(compile_mod.jax, "default_backend", lambda: "gpu")
    attn = AttentionConfig(sampler_skip=True, xla_remat=False, xla_pdl=True)
    model, _ = load_model(FIXTURES / "llama_tiny", dtype="float32", show_progress=False)
    builder = BuilderConfig(block_size=4, max_blocks_per_seq=16, vocab_size=model.cfg.vocab_size)
    cm = CompilationManager(model, dataclasses.replace(CFG, attention=attn), builder)
    opts = cm.compiler_options
    assert {"xla_gpu_enable_command_buffer", "xla_disable_hlo_passes", "xla_gpu_enable_pdl"} <= set(opts)
    monkeypatch.undo()
    assert jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options=opts)(jnp.ones(3))[0] == 2
    with pytest.raises(Exception, match="No such compile option"):  # (the check can fail)
        jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options={"xla_gpu_enable_pdl_typo": True})
    monkeypatch.setattr(compile_mod.jax, "default_backend", lambda: "gpu")
    off = CompilationManager(model, dataclasses.replace(CFG, attention=AttentionConfig(xla_pdl=False)), builder)
    assert off.compiler_options == {"xla_gpu_enable_pdl": False, "xla_gpu_enable_pdl_launch": False}
    default = CompilationManager(model, dataclasses.replace(CFG, attention=AttentionConfig()), builder)
    assert default.compiler_options is None  # (jaxlib's own choice)
    # `xla_options` over the engine's own
    extra = AttentionConfig(xla_pdl=False, xla_options={"xla_gpu_enable_pdl": True, "xla_gpu_autotune_level": 0})
    assert extra.xla_options == (("xla_gpu_autotune_level", 0), ("xla_gpu_enable_pdl", True))  # (hashable)
    assert CompilationManager(model, dataclasses.replace(CFG, attention=extra), builder).compiler_options == {
        "xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": False, "xla_gpu_autotune_level": 0}
    with pytest.raises(TypeError, match="xla_options"):
        AttentionConfig(xla_options=[("xla_gpu_autotune_level", [0])])
