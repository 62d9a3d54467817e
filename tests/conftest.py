"""Shared pytest setup: skipping `gpu` tests off-GPU. JAX's persistent compilation cache stays
off on the CPU (compile.setup_compilation_cache: a cached XLA:CPU executable read back can abort
the process in jax 0.11.2); on the GPU it lives under ~/.cache/metrale_jax/jax_cache_tests."""

import gc
import os
from pathlib import Path

import jax
import pytest

_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "metrale_jax" / "jax_cache_tests"
if jax.default_backend() != "cpu":
    jax.config.update("jax_compilation_cache_dir", str(_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

FIXTURES = Path(__file__).parent / "fixtures" / "data"


def has_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drop JAX's caches after each test module. XLA:CPU keeps every compiled executable's code in
    memory maps of its own (three per object file); kept for the whole run, they reached Linux's
    limit of 65,530 maps per process (`vm.max_map_count`) late in the suite, and the next compile
    crashed the process. Engines that modules keep alive on purpose keep their executables."""
    yield
    jax.clear_caches()
    gc.collect()
