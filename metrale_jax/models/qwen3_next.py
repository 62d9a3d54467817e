"""Qwen3-Next: Gated DeltaNet (linear attention) and gated full attention, with sparse MoE MLPs.

Follows transformers' `modeling_qwen3_next.py`. The layer stack follows `layer_types`; one
`lax.scan` runs over all layers and a `lax.switch` on each layer's kind picks the token mixer,
whose weights are stacked per kind and indexed by a per-kind counter (so compile time does not
grow with depth). Layer norms are the zero-centred `(1 + w)` RMSNorm; the GDN output norm is a
plain-weight RMSNorm followed by `* silu(z)`.

Parameter tree (L layers, La attention layers, Lg GDN layers):
    embed [V, H]   norm [H]   lm_head [H, V]
    layers/in_norm, post_norm [L, H]
    layers/router [L, H, E]  experts_gate_up [L, E, H, 2 Im]  experts_down [L, E, Im, H]
    layers/shared_gate_up [L, H, 2 Is]  shared_down [L, Is, H]  shared_gate [L, H, 1]
    attn/wq [La, H, Hq 2D] (per head: query then gate)  wkv [La, H, 2 Hkv D]  wo [La, Hq D, H]
    attn/q_norm, k_norm [La, D]
    gdn/w_qkvz [Lg, H, 2 Kd + 2 Vd]  w_ba [Lg, H, 2 HV]  (the checkpoint's column order: per key
        head [q (dk), k (dk), v (r dv), z (r dv)] and [b (r), a (r)], r = HV / Hk; `_gdn` regroups
        the products, so quantized checkpoints' rows stay as stored)
    gdn/conv_w [Lg, C, W] (C = 2 Kd + Vd)  dt_bias, A_log [Lg, HV]  norm [Lg, dv]  wo [Lg, Vd, H]
Every linear and the routed experts are an `Fp8Linear` / `W4Linear` where the checkpoint stores
them so, or with quantize-on-load (the router and shared_gate stay dense).
SSM pool per sequence slot: gdn/conv f32[slots, Lg, C, W-1], gdn/rec f32[slots, Lg, HV, dk, dv].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache.kv import write_kv
from metrale_jax.config import ModelConfig, rope_attention_factor, rope_inv_freq
from metrale_jax.layers.attention import (
    AttentionConfig,
    dense_causal_attention,
    paged_attention,
)
from metrale_jax.layers.mlp import add_shared_expert, linear
from metrale_jax.layers.moe import routed_experts, softmax_topk_router
from metrale_jax.layers.norms import rms_norm
from metrale_jax.layers.rope import apply_rope
from metrale_jax.layers.spec_states import (
    conv_states_per_position,
    gated_delta_per_position,
    verify_grid,
    write_scratch,
)
from metrale_jax.layers.ssm_state import read_layer, recurrent_streams, write_layer
from metrale_jax.layers.stack import scan_layers, switch, take_layer
from metrale_jax.lora.ops import LoRAInputs, token_slots
from pallas_kernels.conv1d import causal_conv1d_varlen, naive_causal_conv1d_varlen
from pallas_kernels.gated_delta import chunk_gated_delta_rule, naive_gated_delta_rule

ARCHITECTURES = ("Qwen3NextForCausalLM",)
GDN, ATTN = 0, 1


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                      for i in range(cfg.num_layers))
    if len(types) != cfg.num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {cfg.num_layers} layers")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1 or not cfg.get("num_experts"):
        raise NotImplementedError("Qwen3-Next with dense MLP layers mixed in is not supported yet")
    extra = dict(cfg.extra) | {"layer_types": tuple(types)}
    return dataclasses.replace(cfg, qk_norm=True, extra=tuple(sorted(extra.items())))


def _kinds(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(ATTN if t == "full_attention" else GDN for t in cfg.get("layer_types"))


def num_attention_layers(cfg: ModelConfig) -> int:
    return sum(k == ATTN for k in _kinds(cfg))


def _gdn_dims(cfg: ModelConfig):
    nk, nv = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
    dk, dv = cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim")
    return nk, nv, dk, dv, cfg.get("linear_conv_kernel_dim")


def ssm_spec(cfg: ModelConfig) -> dict:
    """Per-slot state arrays (shapes without the slot axis), f32."""
    from metrale_jax.cache.ssm import SSMArraySpec

    nk, nv, dk, dv, w = _gdn_dims(cfg)
    lg = cfg.num_layers - num_attention_layers(cfg)
    c = 2 * nk * dk + nv * dv
    return {"gdn": {"conv": SSMArraySpec((lg, c, w - 1)), "rec": SSMArraySpec((lg, nv, dk, dv))}}


# ---- loading ---------------------------------------------------------------------------------------
def load_params(cfg: ModelConfig, reader) -> dict:
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    nk, nv, dk, dv, w = _gdn_dims(cfg)
    e, im, ish = cfg.get("num_experts"), cfg.get("moe_intermediate_size"), cfg.get("shared_expert_intermediate_size")
    kinds = _kinds(cfg)
    la, lg, L = kinds.count(ATTN), kinds.count(GDN), cfg.num_layers
    at = {k: [i for i, kind in enumerate(kinds) if kind == k] for k in (ATTN, GDN)}  # each kind's checkpoint layers
    kd, vd = nk * dk, nv * dv
    c = 2 * kd + vd
    stacks = reader.stacks
    from metrale_jax.loading.experts import quantized_experts
    from metrale_jax.models.qwen2_moe import load_shared_expert

    def linears(kind, k: int, parts, key: str):  # parts: [(module under the layer, N)]
        return reader.linears(len(at[kind]), k, lambda j: [(f"model.layers.{at[kind][j]}.{m}.weight", n)
                                                           for m, n in parts], key, key)

    quant = quantized_experts(reader, L, e, h, im, "model.layers.{}.mlp.experts.{}.")  # FP8 / 4-bit experts stay so
    layers = {
        **stacks(L, in_norm=(h,), post_norm=(h,), router=(h, e)),
        **(quant or stacks(L, experts_gate_up=(e, h, 2 * im), experts_down=(e, im, h))),
        **load_shared_expert(reader, L, "model.layers.{}.mlp.", h, ish),
    }
    a, g = "self_attn.", "linear_attn."
    attn = {**stacks(la, q_norm=(d,), k_norm=(d,)),
            "wq": linears(ATTN, h, [(a + "q_proj", hq * 2 * d)], "wq"),
            "wkv": linears(ATTN, h, [(a + "k_proj", hkv * d), (a + "v_proj", hkv * d)], "wkv"),
            "wo": linears(ATTN, hq * d, [(a + "o_proj", h)], "wo")}
    gdn = {**stacks(lg, conv_w=(c, w), dt_bias=(nv,), A_log=(nv,), norm=(dv,)),
           "w_qkvz": linears(GDN, h, [(g + "in_proj_qkvz", 2 * kd + 2 * vd)], "w_qkvz"),
           "w_ba": linears(GDN, h, [(g + "in_proj_ba", 2 * nv)], "w_ba"),
           "wo": linears(GDN, vd, [(g + "out_proj", h)], "wo")}
    ia = ig = 0
    for i in reader.progress(range(L), "layers"):
        p = f"model.layers.{i}."
        layers["in_norm"][i] = reader.get(p + "input_layernorm.weight", (h,))
        layers["post_norm"][i] = reader.get(p + "post_attention_layernorm.weight", (h,))
        m = p + "mlp."
        reader.put_t(layers["router"], i, reader.get(m + "gate.weight", (e, h), cast=True))
        for j in range(0 if quant else e):
            q = f"{m}experts.{j}."
            g_ = reader.get(q + "gate_proj.weight", (im, h), cast=True)
            u_ = reader.get(q + "up_proj.weight", (im, h), cast=True)
            reader.put_t(layers["experts_gate_up"], (i, j), g_, u_)
            reader.put_t(layers["experts_down"], (i, j), reader.get(q + "down_proj.weight", (h, im), cast=True))
        if kinds[i] == ATTN:
            attn["q_norm"][ia] = reader.get(p + a + "q_norm.weight", (d,))
            attn["k_norm"][ia] = reader.get(p + a + "k_norm.weight", (d,))
            ia += 1
        else:
            gdn["conv_w"][ig] = reader.get(p + g + "conv1d.weight", (c, 1, w))[:, 0]
            gdn["dt_bias"][ig] = reader.get(p + g + "dt_bias", (nv,))
            gdn["A_log"][ig] = reader.get(p + g + "A_log", (nv,))
            gdn["norm"][ig] = reader.get(p + g + "norm.weight", (dv,))
            ig += 1
    params = {
        "embed": reader.get("model.embed_tokens.weight", (cfg.vocab_size, h), cast=True),
        "layers": layers, "attn": attn, "gdn": gdn,
        "norm": reader.get("model.norm.weight", (h,), cast=True),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(reader.get("lm_head.weight", (cfg.vocab_size, h), cast=True).T)
    if any(n.startswith("mtp.") for n in getattr(reader.source, "names", lambda: [])()):
        import logging

        logging.getLogger(__name__).info("the checkpoint's MTP weights (mtp.*) are read only for "
                                         "speculative_config method='mtp'")
    return reader.to_device(params)


def load_mtp(cfg: ModelConfig, reader) -> dict:
    """The family hook of speculative decoding's MTP drafter: the checkpoint's `mtp.*` head."""
    from metrale_jax.models.mtp import load_qwen3_next_mtp

    return load_qwen3_next_mtp(cfg, reader)


def mtp_forward_paged(cfg: ModelConfig, params: dict, kv, layer: int, tokens_next, hidden, dmd, pmd, attn,
                      step: int = 0):
    """The family hook running params["mtp"] over a step's tokens (`models/mtp.py`)."""
    from metrale_jax.models.mtp import qwen3_next_mtp_forward_paged

    return qwen3_next_mtp_forward_paged(cfg, params, params["mtp"], kv, layer, tokens_next, hidden, dmd, pmd,
                                        attn, step)


# ---- blocks ----------------------------------------------------------------------------------------
def _norm(cfg, x, w):
    return rms_norm(x, w, cfg.rms_norm_eps, zero_centered=True)


def _moe(cfg: ModelConfig, lp: dict, x: jax.Array, tokamax_moe: bool = False, lora=None) -> jax.Array:
    """x [T, H] -> [T, H]: routed experts plus the sigmoid-gated shared expert. lora: the experts'
    LoRA (`metrale_jax.lora.ops.LoRAInputs`) for the tokens whose moe_slot >= 0."""
    w, idx = softmax_topk_router(x, lp["router"], cfg.get("num_experts_per_tok"), cfg.get("norm_topk_prob", False))
    y = routed_experts(x, w, idx, lp["experts_gate_up"], lp["experts_down"], use_tokamax=tokamax_moe, lora=lora)
    return add_shared_expert(y, x, lp)


def _attn_qkv(cfg: ModelConfig, ap: dict, h: jax.Array, positions: jax.Array):
    """h [T, H] -> q [T, Hq, D], k/v [T, Hkv, D], gate [T, Hq D]."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(h, ap["wq"]).reshape(-1, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(-1, hq * d)
    k, v = jnp.split(linear(h, ap["wkv"]), 2, axis=-1)
    k, v = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    q = _norm(cfg, q, ap["q_norm"])
    k = _norm(cfg, k, ap["k_norm"])
    inv, m = rope_inv_freq(cfg), rope_attention_factor(cfg)
    return apply_rope(q, positions, inv, m), apply_rope(k, positions, inv, m), v, gate


def _attn_out(ap: dict, o: jax.Array, gate: jax.Array) -> jax.Array:
    o = o.reshape(o.shape[0], -1)
    o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)
    return linear(o, ap["wo"])


def _gdn(cfg: ModelConfig, gp: dict, h: jax.Array, cu_seqlens, conv0, rec0, kernels: AttentionConfig | None = None,
         verify=None):
    """The Gated DeltaNet mixer over varlen streams.

    h [T, H], cu_seqlens i32[B+1], conv0 f32[B, C, W-1], rec0 f32[B, HV, dk, dv]
    -> (out [T, H], conv f32[B, C, W-1], rec f32[B, HV, dk, dv]). `kernels.use_pallas` picks the
    Pallas conv1d and chunked delta-rule kernels; otherwise the float32 XLA references run.
    `verify` = (idx, mask) of a verify step (`layers/spec_states.py`): conv / rec are then the
    states after each window position, f32[N, W, ...].
    """
    if kernels is not None and kernels.use_pallas:
        conv_fn = functools.partial(causal_conv1d_varlen, interpret=kernels.interpret)
        rule_fn = functools.partial(chunk_gated_delta_rule, interpret=kernels.interpret)
    else:
        conv_fn, rule_fn = naive_causal_conv1d_varlen, naive_gated_delta_rule
    nk, nv, dk, dv, _ = _gdn_dims(cfg)
    kd, vd = nk * dk, nv * dv
    r = nv // nk
    # the products in the checkpoint's order, per key head [q, k, v (r heads), z (r heads)] and
    # [b (r), a (r)], regrouped to q | k | v (the conv's channels) and z, b, a
    qkvz = linear(h, gp["w_qkvz"]).reshape(-1, nk, 2 * dk + 2 * r * dv)
    q_, k_, v_, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    mixed = jnp.concatenate([q_.reshape(-1, kd), k_.reshape(-1, kd), v_.reshape(-1, vd)], axis=-1)
    z = z.reshape(-1, vd)
    b, a = (x.reshape(-1, nv) for x in jnp.split(linear(h, gp["w_ba"]).astype(jnp.float32).reshape(-1, nk, 2 * r),
                                                  2, axis=-1))
    pre_conv = mixed
    mixed, conv = conv_fn(mixed, gp["conv_w"], None, cu_seqlens=cu_seqlens, initial_state=conv0, silu=True)
    q = mixed[:, :kd].reshape(-1, nk, dk)
    k = mixed[:, kd: 2 * kd].reshape(-1, nk, dk)
    v = mixed[:, 2 * kd:].reshape(-1, nv, dv)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(gp["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + gp["dt_bias"].astype(jnp.float32))
    if verify is not None:
        conv = conv_states_per_position(pre_conv, conv0, verify[0])
        o, rec = gated_delta_per_position(q, k, v, g, beta, *verify, rec0, use_qk_l2norm=True)
    else:
        o, rec = rule_fn(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=rec0, use_qk_l2norm=True)
    o = rms_norm(o, gp["norm"], cfg.rms_norm_eps)  # plain weight, per head
    o = o.astype(jnp.float32) * jax.nn.silu(z.reshape(-1, nv, dv).astype(jnp.float32))
    return linear(o.reshape(-1, vd).astype(h.dtype), gp["wo"]), conv, rec


def compute_logits(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


# ---- dense forward ----------------------------------------------------------------------------------
def forward(cfg: ModelConfig, params: dict, tokens, positions, lengths):
    """tokens i32[B, T], positions i32[B, T], lengths i32[B] -> logits f32[B, T, V]."""
    return compute_logits(cfg, params, forward_hidden(cfg, params, tokens, positions, lengths))


def forward_hidden(cfg: ModelConfig, params: dict, tokens, positions, lengths):
    """`forward` up to the LM head: the final hidden states [B, T, H] (after the final norm: what
    an MTP head reads)."""
    bsz, t = tokens.shape
    nk, nv, dk, dv, w = _gdn_dims(cfg)
    c = 2 * nk * dk + nv * dv
    x = params["embed"][tokens].reshape(bsz * t, -1)
    cu = jnp.arange(bsz + 1, dtype=jnp.int32) * t
    scale = cfg.head_dim**-0.5
    kinds = jnp.asarray(_kinds(cfg), jnp.int32)

    def gdn_branch(x, h, ia, ig):
        gp = take_layer(params["gdn"], ig)
        conv0 = jnp.zeros((bsz, c, w - 1), jnp.float32)
        rec0 = jnp.zeros((bsz, nv, dk, dv), jnp.float32)
        out, _, _ = _gdn(cfg, gp, h, cu, conv0, rec0)
        return x + out

    def attn_branch(x, h, ia, ig):
        ap = take_layer(params["attn"], ia)
        q, k, v, gate = _attn_qkv(cfg, ap, h, positions.reshape(-1))
        o = dense_causal_attention(*(a.reshape((bsz, t) + a.shape[1:]) for a in (q, k, v)), lengths, scale)
        return x + _attn_out(ap, o.reshape(bsz * t, -1, cfg.head_dim), gate)

    def layer(carry, xs):
        x, ia, ig = carry
        lp, kind = xs
        h = _norm(cfg, x, lp["in_norm"])
        x = jax.lax.switch(kind, [gdn_branch, attn_branch], x, h, ia, ig)
        x = x + _moe(cfg, lp, _norm(cfg, x, lp["post_norm"]))
        return (x, ia + (kind == ATTN), ig + (kind == GDN)), None

    x, _, _ = scan_layers(layer, (x, jnp.int32(0), jnp.int32(0)), (params["layers"], kinds), unroll=False)
    return _norm(cfg, x, params["norm"]).reshape(bsz, t, -1)


# ---- paged forward ----------------------------------------------------------------------------------
def forward_paged(cfg: ModelConfig, params: dict, state, tokens, dmd, pmd, attn):
    """tokens i32[N + T] (decode rows, then prefill tokens) -> (state, hidden [N + T, H]).

    GDN layers treat each decode row as a stream of one token and each prefill chunk as a stream
    that starts from its pool row (or from zeros when the chunk starts at position 0).
    """
    parts = [m for m in (dmd, pmd) if m is not None]
    positions = jnp.concatenate([m.positions for m in parts])
    slots = jnp.concatenate([m.slots for m in parts])
    cu, ssm_slots, fresh = recurrent_streams(dmd, pmd)
    x = params["embed"][tokens]
    scale = cfg.head_dim**-0.5
    kinds = np.asarray(_kinds(cfg), np.int32)  # numpy: static under the Python layer loop
    # expert LoRA (engines built with enable_lora): each token's expert-LoRA slot, i32[N + T]
    moe_slot = token_slots(dmd, pmd, "moe_row_adapter") if "lora" in params["layers"] else None
    verify = verify_grid(pmd) if pmd is not None and pmd.verify_width else None

    def gdn_branch(x, h, kv, ssm, ia, ig):
        gp = take_layer(params["gdn"], ig)
        pool = ssm["gdn"]
        conv0 = read_layer(pool["conv"], ssm_slots, ig, fresh)
        rec0 = read_layer(pool["rec"], ssm_slots, ig, fresh)
        out, conv, rec = _gdn(cfg, gp, h, cu, conv0, rec0, attn, verify)
        if verify is not None:  # per-position states to the step's scratch (write-on-accept)
            return x + out, kv, write_scratch(ssm, "gdn", ig, {"conv": conv, "rec": rec})
        pool = {"conv": write_layer(pool["conv"], ssm_slots, ig, conv),
                "rec": write_layer(pool["rec"], ssm_slots, ig, rec)}
        return x + out, kv, {**ssm, "gdn": pool}

    def attn_branch(x, h, kv, ssm, ia, ig):
        ap = take_layer(params["attn"], ia)
        q, k, v, gate = _attn_qkv(cfg, ap, h, positions)
        kv = write_kv(kv, ia, slots, k, v, kernel=attn.use_pallas, interpret=attn.interpret)
        o = paged_attention(q, kv, ia, dmd, pmd, scale, attn)
        return x + _attn_out(ap, o, gate), kv, ssm

    def layer(carry, xs):
        x, kv, ssm, ia, ig = carry
        lp, kind = xs
        h = _norm(cfg, x, lp["in_norm"])
        x, kv, ssm = switch(kind, [gdn_branch, attn_branch], x, h, kv, ssm, ia, ig)
        lora = LoRAInputs(lp["lora"], moe_slot, moe_slot) if moe_slot is not None else None
        x = x + _moe(cfg, lp, _norm(cfg, x, lp["post_norm"]), attn.tokamax_moe, lora)
        return (x, kv, ssm, ia + (kind == ATTN), ig + (kind == GDN)), None

    init = (x, state.kv, state.ssm, np.int32(0), np.int32(0))
    x, kv, ssm, _, _ = scan_layers(layer, init, (params["layers"], kinds), attn.unroll_layers)
    return dataclasses.replace(state, kv=kv, ssm=ssm), _norm(cfg, x, params["norm"])
