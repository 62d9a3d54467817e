"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

import dataclasses

from metrale_jax.config import ModelConfig
from metrale_jax.models.llama import compute_logits, forward, forward_paged, load_params, num_attention_layers

ARCHITECTURES = ("Qwen2ForCausalLM",)


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, attention_bias=True)


__all__ = ["ARCHITECTURES", "adapt_config", "load_params", "forward", "forward_paged", "compute_logits",
           "num_attention_layers"]
