"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3 attention with a sparse top-k softmax MoE MLP.

Parameters as in `llama.py`, with the MLP replaced per layer by
    layers/router [L, H, E]   layers/experts_gate_up [L, E, H, 2 I_moe]   layers/experts_down [L, E, I_moe, H]
Checkpoints name each expert's projections separately (`mlp.experts.{e}.gate_proj.weight`).
Only all-MoE stacks are supported (decoder_sparse_step 1, no mlp_only_layers), which covers
the released Qwen3-MoE models.
"""

import dataclasses

from metrale_jax.config import ModelConfig
from metrale_jax.models import llama
from metrale_jax.models.llama import compute_logits, forward, forward_paged, num_attention_layers

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise NotImplementedError("Qwen3-MoE with dense layers mixed in (mlp_only_layers / decoder_sparse_step)")
    extra = dict(cfg.extra) | {"num_experts": experts}
    return dataclasses.replace(cfg, qk_norm=True, extra=tuple(sorted(extra.items())))


def load_moe_mlp(cfg: ModelConfig, reader, block: str = "mlp",
                 projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict:
    """Router and per-expert weights, stacked over layers (FP8 and 4-bit experts stay so: `loading/experts.py`).
    Checkpoint names: `model.layers.{i}.{block}.gate.weight` (the router) and
    `model.layers.{i}.{block}.experts.{e}.{proj}.weight` for the gate, up and down `projs`."""
    from metrale_jax.loading.experts import quantized_experts

    e, h, inter, L = cfg.get("num_experts"), cfg.hidden_size, cfg.get("moe_intermediate_size"), cfg.num_layers
    gate, up, down = projs
    quant = quantized_experts(reader, L, e, h, inter, "model.layers.{}." + block + ".experts.{}.", projs)
    out = reader.stacks(L, router=(h, e))
    out.update(quant or reader.stacks(L, experts_gate_up=(e, h, 2 * inter), experts_down=(e, inter, h)))
    for i in reader.progress(range(L), "experts"):
        p = f"model.layers.{i}.{block}."
        reader.put_t(out["router"], i, reader.get(p + "gate.weight", (e, h), cast=True))
        for j in range(0 if quant else e):
            q = f"{p}experts.{j}."
            g = reader.get(q + gate + ".weight", (inter, h), cast=True)
            u = reader.get(q + up + ".weight", (inter, h), cast=True)
            reader.put_t(out["experts_gate_up"], (i, j), g, u)
            reader.put_t(out["experts_down"], (i, j), reader.get(q + down + ".weight", (h, inter), cast=True))
    return out


def load_params(cfg: ModelConfig, reader) -> dict:
    return llama.load_params(cfg, reader, load_mlp=load_moe_mlp)


__all__ = ["ARCHITECTURES", "adapt_config", "load_params", "forward", "forward_paged", "compute_logits",
           "num_attention_layers"]
