"""Llama family (SmolLM2, Llama 2/3 with `llama3` RoPE scaling), the base of Qwen2 and Qwen3.

Qwen2 is this model with q/k/v biases, Qwen3 with a per-head RMSNorm on q and k; their files
only set those flags. Parameters are one pytree with the decoder layers stacked on a leading
axis; forwards walk them with `layers/stack.py` (`lax.scan`, whose compile time does not grow
with depth, or on the GPU a Python loop over per-layer arrays, see there).

Parameter tree (L layers, H hidden, D head_dim, I intermediate):
    embed      [V, H]
    layers/attn_norm [L, H]      layers/wqkv [L, H, (Hq + 2 Hkv) D]   layers/bqkv [L, (Hq + 2 Hkv) D]?
    layers/q_norm, k_norm [L, D]?  layers/wo [L, Hq D, H]            layers/bo [L, H]?
    layers/mlp_norm [L, H]       layers/w_gate_up [L, H, 2 I]        layers/w_down [L, I, H]
    norm       [H]
    lm_head    [H, V]  (absent when the embeddings are tied)
Linear weights are stored [in, out] (transposed from the checkpoint's [out, in] once, at load).
`attention_bias` gives q/k/v biases (Qwen2's), and an o_proj bias where the checkpoint has one
(Llama's and Qwen3's attention_bias cover all four projections); Llama's `mlp_bias` is refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache import EngineState
from metrale_jax.cache.kv import rope_and_write_kv, write_kv
from metrale_jax.config import ModelConfig, rope_attention_factor, rope_inv_freq
from metrale_jax.layers.attention import (
    AttentionConfig,
    dense_causal_attention,
    paged_attention,
)
from metrale_jax.layers.mlp import add_shared_expert, linear, silu_mul_linear
from metrale_jax.layers.moe import routed_experts, softmax_topk_router
from metrale_jax.layers.norms import rms_norm, rms_norm_linear, rms_norm_matmul
from metrale_jax.layers.rope import apply_rope, rope_cos_sin
from metrale_jax.layers.stack import scan_layers
from metrale_jax.loading.weights import WeightReader
from metrale_jax.lora.ops import LoRAInputs, add_delta, token_slots
from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    if cfg.get("mlp_bias"):
        raise NotImplementedError("mlp_bias (biases on gate / up / down projections) is not supported yet")
    return cfg


# ---- loading ---------------------------------------------------------------------------------------
def load_params(cfg: ModelConfig, reader: WeightReader, load_mlp=None) -> dict:
    """Map Hugging Face tensor names to the parameter tree (see the module docstring).

    Families with another MLP (MoE) pass `load_mlp(cfg, reader) -> {name: stacked array}`;
    attention and norms load the same way. Linear weights stay FP8 where the checkpoint has
    them so (or with quantize-on-load): see `WeightReader.linears`.
    """
    load_mlp = load_mlp or load_dense_mlp
    hq, hkv, d, h, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.num_layers
    a = "model.layers.{}.self_attn."
    layers = {
        "wqkv": reader.linears(L, h, lambda i: [(a.format(i) + f"{x}_proj.weight", s * d)
                                               for x, s in (("q", hq), ("k", hkv), ("v", hkv))], "qkv", "wqkv"),
        "wo": reader.linears(L, hq * d, lambda i: [(a.format(i) + "o_proj.weight", h)], "o_proj", "wo"),
        **load_mlp(cfg, reader),
        **reader.stacks(L, attn_norm=(h,), mlp_norm=(h,)),
    }
    qkv = (hq + 2 * hkv) * d
    if cfg.attention_bias:
        layers["bqkv"] = reader.stacked(L, (qkv,), "bqkv")
    o_bias = cfg.attention_bias and reader.has(a.format(0) + "o_proj.bias")
    if o_bias:
        layers["bo"] = reader.stacked(L, (h,), "bo")
    if cfg.qk_norm:
        layers.update(reader.stacks(L, q_norm=(d,), k_norm=(d,)))
    for i in reader.progress(range(L), "norms"):
        p, q = f"model.layers.{i}.", a.format(i)
        if cfg.attention_bias:
            sizes = (("q", hq * d), ("k", hkv * d), ("v", hkv * d))
            layers["bqkv"][i] = np.concatenate([reader.get(q + f"{n}_proj.bias", (s,)) for n, s in sizes])
        if o_bias:
            layers["bo"][i] = reader.get(q + "o_proj.bias", (h,))
        if cfg.qk_norm:
            layers["q_norm"][i] = reader.get(q + "q_norm.weight", (d,))
            layers["k_norm"][i] = reader.get(q + "k_norm.weight", (d,))
        layers["attn_norm"][i] = reader.get(p + "input_layernorm.weight", (h,))
        layers["mlp_norm"][i] = reader.get(p + "post_attention_layernorm.weight", (h,))
    params = {
        "embed": reader.get("model.embed_tokens.weight", (cfg.vocab_size, h), cast=True),
        "layers": layers,
        "norm": reader.get("model.norm.weight", (h,), cast=True),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = reader.transposed(reader.get("lm_head.weight", (cfg.vocab_size, h), cast=True))
    return reader.to_device(params)


def load_dense_mlp(cfg: ModelConfig, reader: WeightReader) -> dict:
    h, inter, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    m = "model.layers.{}.mlp."
    return {
        "w_gate_up": reader.linears(L, h, lambda i: [(m.format(i) + "gate_proj.weight", inter),
                                                     (m.format(i) + "up_proj.weight", inter)], "gate_up", "w_gate_up"),
        "w_down": reader.linears(L, inter, lambda i: [(m.format(i) + "down_proj.weight", h)], "down_proj", "w_down"),
    }


# ---- shared pieces ---------------------------------------------------------------------------------
def _qkv_proj(cfg: ModelConfig, lp: dict, x: jax.Array, lora: LoRAInputs | None = None) -> jax.Array:
    """x [..., T, H] (the residual stream, before attn_norm) -> the fused projection [..., T, (Hq + 2 Hkv) D]
    (plus each token's LoRA delta on q, k and v when `lora` is given)."""
    qkv = rms_norm_linear(x, lp["attn_norm"], cfg.rms_norm_eps, lp["wqkv"], lp.get("bqkv"))
    if lora is not None:
        qkv = add_delta(qkv, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), lora, "qkv_a", "qkv_b",
                        (cfg.q_size, cfg.kv_size, cfg.kv_size))
    # The barrier keeps q|k|v one GEMM: without it XLA on the GPU fuses the three slices' users
    # into three copies of the dot (H200, Llama-3-8B decode: 52.7 us per layer instead of 17.5).
    return jax.lax.optimization_barrier(qkv)


def _qkv(cfg: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array, lora: LoRAInputs | None = None):
    """x [..., T, H] (the residual stream, before attn_norm) -> q [..., T, Hq, D], k/v [..., T, Hkv, D],
    with q/k norm and RoPE applied."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _qkv_proj(cfg, lp, x, lora)
    q, k, v = jnp.split(qkv, [hq * d, (hq + hkv) * d], axis=-1)
    q = q.reshape(q.shape[:-1] + (hq, d))
    k = k.reshape(k.shape[:-1] + (hkv, d))
    v = v.reshape(v.shape[:-1] + (hkv, d))
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    inv, m = rope_inv_freq(cfg), rope_attention_factor(cfg)
    return apply_rope(q, positions, inv, m), apply_rope(k, positions, inv, m), v


def _mlp_block(cfg: ModelConfig, lp: dict, x: jax.Array, tokamax_moe: bool = False,
               lora: LoRAInputs | None = None) -> jax.Array:
    """Post-attention norm, then the dense SwiGLU MLP, or the sparse MoE when the layer has a router
    (with each token's LoRA deltas when `lora` is given: see `metrale_jax.lora`)."""
    if "router" not in lp:
        if lora is None:
            gate_up = rms_norm_linear(x, lp["mlp_norm"], cfg.rms_norm_eps, lp["w_gate_up"])
            return silu_mul_linear(gate_up, lp["w_down"], residual=x)
        inter = cfg.intermediate_size
        # the product before the norm's row scale: the expand-add kernel scales it as it reads it
        gate_up, norm = rms_norm_matmul(x, lp["mlp_norm"], cfg.rms_norm_eps, lp["w_gate_up"])
        act = add_delta(gate_up, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lora, "gate_up_a", "gate_up_b",
                        (inter, inter), silu_mul=True, row_norm=norm)
        return add_delta(linear(act, lp["w_down"]), act, lora, "down_a", "down_b", residual=x)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    shape = h.shape
    h = h.reshape(-1, shape[-1])
    w, idx = softmax_topk_router(h, lp["router"], cfg.get("num_experts_per_tok"), cfg.get("norm_topk_prob", False))
    y = routed_experts(h, w, idx, lp["experts_gate_up"], lp["experts_down"], use_tokamax=tokamax_moe, lora=lora)
    if "shared_gate_up" in lp:  # (Qwen2-MoE)
        y = add_shared_expert(y, h, lp)
    return x + y.reshape(shape)


def compute_logits(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (already final-normed) -> f32[..., V]."""
    if "lm_head" in params:
        w = params["lm_head"]
        return jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    e = params["embed"]
    return jnp.einsum("...h,vh->...v", hidden, e.astype(hidden.dtype), preferred_element_type=jnp.float32)


# ---- dense forward (research API: scoring, gradients) -----------------------------------------------
def forward(cfg: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array, lengths: jax.Array):
    """tokens i32[B, T], positions i32[B, T], lengths i32[B] (right padding) -> logits f32[B, T, V]."""
    x = params["embed"][tokens]
    scale = cfg.head_dim**-0.5

    def layer(x, lp):
        q, k, v = _qkv(cfg, lp, x, positions)
        o = dense_causal_attention(q, k, v, lengths, scale, cfg.sliding_window)
        x = x + linear(o.reshape(o.shape[:2] + (-1,)), lp["wo"], lp.get("bo"))
        return _mlp_block(cfg, lp, x), None

    x = scan_layers(layer, x, params["layers"], unroll=False)
    return compute_logits(cfg, params, rms_norm(x, params["norm"], cfg.rms_norm_eps))


# ---- paged forward (engine steps) -------------------------------------------------------------------
def forward_paged(
    cfg: ModelConfig,
    params: dict,
    state: EngineState,
    tokens: jax.Array,
    dmd: AttnMetadata | None,
    pmd: BatchedAttnMetadata | None,
    attn: AttentionConfig,
):
    """tokens i32[N + T]: N decode rows, then T prefill tokens -> (state, hidden [N + T, H])."""
    parts = [m for m in (dmd, pmd) if m is not None]
    positions = jnp.concatenate([m.positions for m in parts])
    slots = jnp.concatenate([m.slots for m in parts])
    x = params["embed"][tokens]
    scale = cfg.head_dim**-0.5
    if cfg.sliding_window is not None:  # (the attention kernels' and references' window)
        attn = dataclasses.replace(attn, sliding_window=cfg.sliding_window)
    # With the Pallas kernels, RoPE and the K/V write are one kernel (no per-head q/k norm between
    # the projection and RoPE, as Qwen3 has): three launches fewer per layer at a decode step.
    fused_rope = attn.use_pallas and not cfg.qk_norm
    # f32[N + T, rot]
    cos_sin = rope_cos_sin(positions, rope_inv_freq(cfg), rope_attention_factor(cfg)) if fused_rope else None
    # LoRA slots (engine built with enable_lora): each token's adapter slot, i32[N + T]
    lora_on = "lora" in params["layers"]
    lora_slot = token_slots(dmd, pmd, "seq_slot") if lora_on else None
    moe_slot = token_slots(dmd, pmd, "moe_row_adapter") if lora_on else None
    live = dmd.live_rows if dmd is not None and pmd is None else 0  # (rows the step padded carry no delta)

    def layer(carry, lp):
        x, kv, i = carry
        # (the Pallas expand-add under tensor parallelism would see every device's columns: XLA's there)
        lora = (LoRAInputs(lp["lora"], lora_slot, moe_slot, attn.lora_kernel, attn.interpret, live,
                           attn.use_pallas and attn.mesh is None) if lora_on else None)
        if fused_rope:
            kv, q = rope_and_write_kv(kv, i, slots, _qkv_proj(cfg, lp, x, lora), cos_sin, cfg.num_heads,
                                      attn.interpret)
        else:
            q, k, v = _qkv(cfg, lp, x, positions, lora)
            kv = write_kv(kv, i, slots, k, v, kernel=attn.use_pallas, interpret=attn.interpret)
        o = paged_attention(q, kv, i, dmd, pmd, scale, attn)
        o = o.reshape(o.shape[0], -1)
        x = linear(o, lp["wo"], lp.get("bo"), residual=x) if lora is None else \
            add_delta(linear(o, lp["wo"], lp.get("bo")), o, lora, "o_a", "o_b", residual=x)
        return (_mlp_block(cfg, lp, x, attn.tokamax_moe, lora), kv, i + 1), None

    x, kv, _ = scan_layers(layer, (x, state.kv, np.int32(0)), params["layers"], attn.unroll_layers)
    return dataclasses.replace(state, kv=kv), rms_norm(x, params["norm"], cfg.rms_norm_eps)


def num_attention_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers

