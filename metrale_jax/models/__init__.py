"""Model families and the registry that maps config `architectures` to them.

A family is a module exposing ARCHITECTURES, adapt_config, load_params, forward,
forward_paged, compute_logits and num_attention_layers (see `models/llama.py`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from metrale_jax.errors import UnknownArchitectureError

_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "nemotron_h")


def _registry() -> dict[str, str]:
    reg = {}
    for fam in _FAMILIES:
        mod = importlib.import_module(f"metrale_jax.models.{fam}")
        for arch in mod.ARCHITECTURES:
            reg[arch] = fam
    return reg


def family_for(architecture: str) -> tuple[str, ModuleType]:
    reg = _registry()
    if architecture not in reg:
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; supported: {', '.join(sorted(reg))}"
        )
    name = reg[architecture]
    return name, importlib.import_module(f"metrale_jax.models.{name}")


def supported_architectures() -> list[str]:
    return sorted(_registry())
