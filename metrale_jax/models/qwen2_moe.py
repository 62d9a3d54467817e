"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) with a sparse
top-k softmax MoE MLP plus a shared expert, gated per token by a sigmoid.

Parameters as in `qwen3_moe.py`, with per layer also
    layers/shared_gate_up [L, H, 2 Is]   layers/shared_down [L, Is, H]   layers/shared_gate [L, H, 1]
(`mlp.shared_expert.*` and `mlp.shared_expert_gate.weight` in checkpoints). Only all-MoE stacks
(decoder_sparse_step 1, no mlp_only_layers), as the released models.
"""

import dataclasses

from metrale_jax.config import ModelConfig
from metrale_jax.models import llama, qwen3_moe
from metrale_jax.models.llama import compute_logits, forward, forward_paged, num_attention_layers

ARCHITECTURES = ("Qwen2MoeForCausalLM",)


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    cfg = qwen3_moe.adapt_config(cfg)
    return dataclasses.replace(cfg, qk_norm=False, attention_bias=bool(cfg.get("qkv_bias", True)))


def load_moe_mlp(cfg: ModelConfig, reader) -> dict:
    """Qwen3-MoE's router and experts, and the shared expert with its gate."""
    out = qwen3_moe.load_moe_mlp(cfg, reader)
    out.update(load_shared_expert(reader, cfg.num_layers, "model.layers.{}.mlp.", cfg.hidden_size,
                                  cfg.get("shared_expert_intermediate_size")))
    return out


def load_shared_expert(reader, num_layers: int, prefix: str, h: int, ish: int) -> dict:
    """The shared expert (`{prefix}shared_expert.{gate,up,down}_proj`, prefix formatted with the
    layer) and its gate (`{prefix}shared_expert_gate`) as the stacks shared_gate_up, shared_down
    (through `WeightReader.linears`: quantized where the checkpoint is) and shared_gate (dense), as
    Qwen2-MoE's and Qwen3-Next's checkpoints name them."""
    s = prefix + "shared_expert."
    out = {"shared_gate_up": reader.linears(num_layers, h, lambda i: [(s.format(i) + "gate_proj.weight", ish),
                                                                       (s.format(i) + "up_proj.weight", ish)],
                                            "shared experts", "shared_gate_up"),
           "shared_down": reader.linears(num_layers, ish, lambda i: [(s.format(i) + "down_proj.weight", h)],
                                         "shared experts", "shared_down"),
           **reader.stacks(num_layers, shared_gate=(h, 1))}
    for i in range(num_layers):
        gate = reader.get(prefix.format(i) + "shared_expert_gate.weight", (1, h), cast=True)
        reader.put_t(out["shared_gate"], i, gate)
    return out


def load_params(cfg: ModelConfig, reader) -> dict:
    return llama.load_params(cfg, reader, load_mlp=load_moe_mlp)


__all__ = ["ARCHITECTURES", "adapt_config", "load_params", "forward", "forward_paged", "compute_logits",
           "num_attention_layers"]
