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
    h, ish, L = cfg.hidden_size, cfg.get("shared_expert_intermediate_size"), cfg.num_layers
    out = qwen3_moe.load_moe_mlp(cfg, reader)
    out.update(reader.stacks(L, shared_gate_up=(h, 2 * ish), shared_down=(ish, h), shared_gate=(h, 1)))
    for i in reader.progress(range(L), "shared experts"):
        put_shared_expert(reader, out, i, f"model.layers.{i}.mlp.", h, ish)
    return out


def put_shared_expert(reader, layers: dict, i: int, m: str, h: int, ish: int) -> None:
    """Layer i's shared expert (`{m}shared_expert.*`) and its gate (`{m}shared_expert_gate`) into the
    stacks shared_gate_up, shared_down and shared_gate (as Qwen3-Next's checkpoints name them too)."""
    s = m + "shared_expert."
    g = reader.get(s + "gate_proj.weight", (ish, h), cast=True)
    u = reader.get(s + "up_proj.weight", (ish, h), cast=True)
    reader.put_t(layers["shared_gate_up"], i, g, u)
    reader.put_t(layers["shared_down"], i, reader.get(s + "down_proj.weight", (h, ish), cast=True))
    reader.put_t(layers["shared_gate"], i, reader.get(m + "shared_expert_gate.weight", (1, h), cast=True))


def load_params(cfg: ModelConfig, reader) -> dict:
    return llama.load_params(cfg, reader, load_mlp=load_moe_mlp)


__all__ = ["ARCHITECTURES", "adapt_config", "load_params", "forward", "forward_paged", "compute_logits",
           "num_attention_layers"]
