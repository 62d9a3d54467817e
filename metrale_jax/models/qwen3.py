"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k (before RoPE)."""

import dataclasses

from metrale_jax.config import ModelConfig
from metrale_jax.models.llama import compute_logits, forward, forward_paged, load_params, num_attention_layers

ARCHITECTURES = ("Qwen3ForCausalLM",)


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, qk_norm=True)


__all__ = ["ARCHITECTURES", "adapt_config", "load_params", "forward", "forward_paged", "compute_logits",
           "num_attention_layers"]
