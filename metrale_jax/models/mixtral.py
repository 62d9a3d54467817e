"""Mixtral (Mixtral-8x7B, 8x22B): Llama / Mistral attention with a sparse top-k softmax MoE MLP, the
top-k weights always renormalized, no shared expert.

Parameters as in `qwen3_moe.py`. Checkpoints name the router `block_sparse_moe.gate` and each
expert's projections w1 (gate), w3 (up) and w2 (down): `block_sparse_moe.experts.{e}.w1.weight`.
"""

import dataclasses

from metrale_jax.config import ModelConfig
from metrale_jax.models import llama, qwen3_moe
from metrale_jax.models.llama import compute_logits, forward, forward_paged, num_attention_layers

ARCHITECTURES = ("MixtralForCausalLM",)


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    e = cfg.get("num_local_experts")
    if not e:
        raise ValueError("a Mixtral config needs num_local_experts")
    extra = dict(cfg.extra) | {"num_experts": int(e), "norm_topk_prob": True,
                               "moe_intermediate_size": cfg.intermediate_size}
    return dataclasses.replace(cfg, qk_norm=False, extra=tuple(sorted(extra.items())))


def load_moe_mlp(cfg: ModelConfig, reader) -> dict:
    return qwen3_moe.load_moe_mlp(cfg, reader, block="block_sparse_moe", projs=("w1", "w3", "w2"))


def load_params(cfg: ModelConfig, reader) -> dict:
    return llama.load_params(cfg, reader, load_mlp=load_moe_mlp)


__all__ = ["ARCHITECTURES", "adapt_config", "load_params", "forward", "forward_paged", "compute_logits",
           "num_attention_layers"]
