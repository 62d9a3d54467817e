"""Shared pytest setup: skipping `gpu` tests off-GPU. JAX's persistent compilation cache stays
off on the CPU (compile.setup_compilation_cache: a cached XLA:CPU executable read back can abort
the process in jax 0.11.2); on the GPU it lives under ~/.cache/metrale_jax/jax_cache_tests."""

import gc
import glob
import os
import shutil
from pathlib import Path

# On a machine without a GPU, XLA:CPU's LLVM runs at its cheapest optimization level: most of the
# suite's time is compiling steps, not running them (2 cores, session 15: a tiny engine's compile
# 16.7 -> 13.6 s, an engine/kernel subset 132 -> 98 s; the few tests that run the real SmolLM2 for
# long take ~2.5x as long; the suite as a whole ran faster). HLO optimizations are unchanged; the
# generated CPU code may round differently in the last bits, which no test's tolerance depends on.
# Session 45: level 1 ran SmolLM2's decode steps 2.9x faster (the per-layer weight slices of the
# layer loop are copied by unvectorized loops at 0), but the suite took 1,304 s against 1,154 s.
# Set here, before JAX starts its backend; subprocesses started by tests inherit it.
CPU_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if not glob.glob("/dev/nvidia[0-9]*") and shutil.which("nvidia-smi") is None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "metrale_jax" / "jax_cache_tests"
if jax.default_backend() != "cpu":
    jax.config.update("jax_compilation_cache_dir", str(_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

FIXTURES = Path(__file__).parent / "fixtures" / "data"


class DictLoad:
    """The quantized-weight readers' `load` over a dict of arrays: load(name) -> array, .has(name)."""

    def __init__(self, tensors: dict):
        self.t = tensors

    def __call__(self, name):
        return self.t[name]

    def has(self, name):
        return name in self.t


def has_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


# the longest files first: with `-n 2` (pytest-xdist, a file per worker at a time) they must not
# be the last ones running alone
_FIRST = ("test_tensor_parallel.py", "test_spec_decode.py", "test_startup.py", "test_gpu_acceptance_smoke.py",
          "test_fp8_model.py", "test_scheduler.py", "test_paged_forward.py")


# files that share engines built once per process run as one work unit, on one worker: the
# hybrid engines of `tests/test_engine_hybrid.py::hybrid_engine` (those three files alone: 100 s;
# together: 62 s, session 54) and the fake engines of `metrale_jax.engine.testing.fake_engine`
# (a file built ~20 s of them, or none, depending on what its worker had run before it)
_SHARED_ENGINES = {
    **dict.fromkeys(("test_engine_hybrid.py", "test_swap.py", "test_spec_decode.py"), "hybrid engines"),
    **dict.fromkeys(("test_engine_fake.py", "test_scheduler.py", "test_prefix_cache_scheduler.py",
                     "test_prefix_cache_api.py", "test_beam_search.py", "test_engine_api.py", "test_token_masks.py"),
                    "fake engines"),
}


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject's addopts), with the `_SHARED_ENGINES` files as one unit each."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedEngineFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return _SHARED_ENGINES.get(scope.rsplit("/", 1)[-1], scope)

    return SharedEngineFiles(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: the rest keep their order
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _num_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drop JAX's caches after a test module when the process nears Linux's limit of 65,530
    memory maps (`vm.max_map_count`). XLA:CPU keeps every compiled executable's code in maps of
    its own (three per object file); kept for the whole run they reached the limit late in the
    suite and the next compile crashed the process. (Not after every module: later modules reuse
    earlier ones' executables, and recompiling them cost minutes.)"""
    yield
    if _num_maps() > 30_000:
        jax.clear_caches()
        gc.collect()
