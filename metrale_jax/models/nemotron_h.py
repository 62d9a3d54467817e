"""Nemotron-H (Mamba-2 + attention + relu² MLP / MoE blocks) and plain Mamba-2 models.

Follows transformers' `modeling_nemotron_h.py` and `modeling_mamba2.py`. Each block is
`x + mixer(norm(x))` with one mixer per layer, coded by the layer pattern:
    M  Mamba-2          *  attention (no positional embedding)
    -  relu² MLP        E  MoE (sigmoid router, group-limited top-k, relu² experts, shared expert)
read from `hybrid_override_pattern` (hub form) or `layers_block_type` (transformers 5 form, where
`linear_attention` means Mamba-2). A `Mamba2ForCausalLM` is the all-`M` pattern.

One `lax.scan` runs over the layers with a `lax.switch` on each layer's kind; weights are stacked
per kind and indexed by per-kind counters. dt is clamped to `(time_step_min, inf)` for prefill
tokens only: transformers' single-step (decode) path does not clamp, and we match it.

Parameter tree (Lm Mamba, La attention, Lp MLP, Le MoE layers):
    embed [V, H]   norm_f [H]   lm_head [H, V]   layers/norm [L, H]
    mamba/in_proj [Lm, H, I + Cd + nh] (z | xBC | dt)  conv_w [Lm, Cd, W]  conv_b [Lm, Cd]
    mamba/dt_bias, A_log, D [Lm, nh]  norm [Lm, I]  out [Lm, I, H]      (Cd = I + 2 G N)
    attn/wqkv [La, H, (Hq + 2 Hkv) D]  wo [La, Hq D, H]
    mlp/up [Lp, H, Imlp]  down [Lp, Imlp, H]
    moe/router [Le, H, E]  e_bias [Le, E]  experts_up [Le, E, H, Im]  experts_down [Le, E, Im, H]
    moe/shared_up [Le, H, Is]  shared_down [Le, Is, H]
SSM pool per sequence slot: mamba/conv f32[slots, Lm, Cd, W-1], mamba/ssm f32[slots, Lm, nh, P, N].
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache.kv import write_kv
from metrale_jax.config import ModelConfig
from metrale_jax.layers.attention import dense_causal_attention, paged_attention
from metrale_jax.layers.mamba2 import gated_group_rms_norm, softplus, ssd_varlen
from metrale_jax.layers.mlp import linear
from metrale_jax.layers.moe import routed_experts
from metrale_jax.layers.norms import rms_norm
from metrale_jax.layers.spec_states import conv_states_per_position, ssd_per_position, verify_grid, write_scratch
from metrale_jax.layers.ssm_state import read_layer, recurrent_streams, write_layer
from metrale_jax.layers.stack import scan_layers, switch, take_layer
from pallas_kernels.conv1d import causal_conv1d_varlen, naive_causal_conv1d_varlen
from pallas_kernels.mamba2 import selective_state_update, ssd_chunk_scan

ARCHITECTURES = ("NemotronHForCausalLM", "Mamba2ForCausalLM")
MAMBA, ATTN, MLP, MOE = 0, 1, 2, 3
_CODES = {"M": MAMBA, "*": ATTN, "-": MLP, "E": MOE}
_NAMES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def adapt_config(cfg: ModelConfig) -> ModelConfig:
    g = cfg.get
    if cfg.architecture == "Mamba2ForCausalLM":
        pattern = "M" * cfg.num_layers
        lim = g("time_step_limit") or (0.0, math.inf)
        mamba = dict(mamba_num_heads=g("num_heads"), mamba_head_dim=cfg.head_dim, ssm_state_size=g("state_size"),
                     dt_min=float(lim[0]), dt_max=float(lim[1]))
    else:
        if g("layers_block_type"):
            pattern = "".join(_NAMES[t] for t in g("layers_block_type"))
        else:
            pattern = g("hybrid_override_pattern")
        mamba = dict(mamba_num_heads=g("mamba_num_heads"), mamba_head_dim=g("mamba_head_dim"),
                     ssm_state_size=g("ssm_state_size"), dt_min=float(g("time_step_min", 0.0)), dt_max=math.inf)
    if not pattern or set(pattern) - set(_CODES):
        raise ValueError(f"layer pattern {pattern!r} must use only the codes M * - E")
    extra = dict(cfg.extra) | mamba | {"pattern": pattern}
    return dataclasses.replace(cfg, num_layers=len(pattern), extra=tuple(sorted(extra.items())))


def decode_matches_prefill(cfg: ModelConfig) -> bool:
    """Prefill clamps dt to [dt_min, dt_max], decode does not (`Model.decode_matches_prefill`);
    softplus(dt) > 0, so a clamp to [0, inf) changes nothing."""
    return cfg.get("dt_min", 0.0) <= 0 and cfg.get("dt_max", math.inf) == math.inf


def _kinds(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(_CODES[c] for c in cfg.get("pattern"))


def num_attention_layers(cfg: ModelConfig) -> int:
    return _kinds(cfg).count(ATTN)


def _dims(cfg: ModelConfig):
    nh, p, n, ng = cfg.get("mamba_num_heads"), cfg.get("mamba_head_dim"), cfg.get("ssm_state_size"), cfg.get("n_groups")
    inner = nh * p
    return nh, p, n, ng, inner, inner + 2 * ng * n, cfg.get("conv_kernel")


def ssm_spec(cfg: ModelConfig) -> dict:
    from metrale_jax.cache.ssm import SSMArraySpec

    nh, p, n, _, _, cd, w = _dims(cfg)
    lm = _kinds(cfg).count(MAMBA)
    return {"mamba": {"conv": SSMArraySpec((lm, cd, w - 1)), "ssm": SSMArraySpec((lm, nh, p, n))}} if lm else {}


# ---- loading ---------------------------------------------------------------------------------------
def load_params(cfg: ModelConfig, reader) -> dict:
    """The parameter tree above. Linears go through `WeightReader.linears` (FP8 and 4-bit
    checkpoints' linears stay quantized, quantize-on-load takes them), the experts through
    `loading.experts.quantized_experts`."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    nh, p, n, ng, inner, cd, w = _dims(cfg)
    kinds = _kinds(cfg)
    count = {k: kinds.count(k) for k in (MAMBA, ATTN, MLP, MOE)}
    at = {k: [i for i, kind in enumerate(kinds) if kind == k] for k in count}  # each kind's checkpoint layers
    stacks, get = reader.stacks, reader.get

    def linears(kind, k: int, parts, key: str):  # parts: [(module under the layer's mixer, N)]
        return reader.linears(count[kind], k, lambda j: [(f"backbone.layers.{at[kind][j]}.mixer.{m}.weight", n_)
                                                         for m, n_ in parts], key, key)

    params = {"layers": stacks(len(kinds), norm=(h,))}
    if count[MAMBA]:
        params["mamba"] = {**stacks(count[MAMBA], conv_w=(cd, w), conv_b=(cd,), dt_bias=(nh,), A_log=(nh,), D=(nh,),
                                    norm=(inner,)),
                           "in_proj": linears(MAMBA, h, [("in_proj", inner + cd + nh)], "in_proj"),
                           "out": linears(MAMBA, inner, [("out_proj", h)], "out")}
    if count[ATTN]:
        params["attn"] = {"wqkv": linears(ATTN, h, [("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)],
                                          "wqkv"),
                          "wo": linears(ATTN, hq * d, [("o_proj", h)], "wo")}
    if count[MLP]:
        im = cfg.intermediate_size
        params["mlp"] = {"up": linears(MLP, h, [("up_proj", im)], "up"),
                         "down": linears(MLP, im, [("down_proj", h)], "down")}
    if count[MOE]:
        e, im, ish, le = cfg.get("n_routed_experts"), cfg.get("moe_intermediate_size"), \
            cfg.get("moe_shared_expert_intermediate_size"), count[MOE]
        from metrale_jax.loading.experts import quantized_experts

        quant = quantized_experts(reader, le, e, h, im, lambda j, x: f"backbone.layers.{at[MOE][j]}.mixer.experts.{x}.",
                                  ("up_proj", "down_proj"))  # FP8 / 4-bit experts stay so (relu² experts: no gate)
        params["moe"] = {**stacks(le, router=(h, e), e_bias=(e,)),
                         "shared_up": linears(MOE, h, [("shared_experts.up_proj", ish)], "shared_up"),
                         "shared_down": linears(MOE, ish, [("shared_experts.down_proj", h)], "shared_down"),
                         **(quant or stacks(le, experts_up=(e, h, im), experts_down=(e, im, h)))}
    idx = dict.fromkeys(count, 0)
    for i in reader.progress(range(len(kinds)), "layers"):
        pre = f"backbone.layers.{i}."
        m = pre + "mixer."
        params["layers"]["norm"][i] = get(pre + "norm.weight", (h,))
        kind, j = kinds[i], idx[kinds[i]]
        idx[kind] += 1
        if kind == MAMBA:
            q = params["mamba"]
            q["conv_w"][j] = get(m + "conv1d.weight", (cd, 1, w))[:, 0]
            q["conv_b"][j] = get(m + "conv1d.bias", (cd,)) if reader.has(m + "conv1d.bias") else 0.0
            for name in ("dt_bias", "A_log", "D"):
                q[name][j] = get(m + name, (nh,))
            q["norm"][j] = get(m + "norm.weight", (inner,))
        elif kind == MOE:
            q = params["moe"]
            reader.put_t(q["router"], j, get(m + "gate.weight", (e, h), cast=True))
            q["e_bias"][j] = get(m + "gate.e_score_correction_bias", (e,))
            for x in range(0 if quant else e):
                reader.put_t(q["experts_up"], (j, x), get(m + f"experts.{x}.up_proj.weight", (im, h), cast=True))
                reader.put_t(q["experts_down"], (j, x), get(m + f"experts.{x}.down_proj.weight", (h, im), cast=True))
    params["embed"] = get("backbone.embeddings.weight", (cfg.vocab_size, h), cast=True)
    params["norm_f"] = get("backbone.norm_f.weight", (h,), cast=True)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = reader.transposed(get("lm_head.weight", (cfg.vocab_size, h), cast=True))
    return reader.to_device(params)


# ---- blocks ----------------------------------------------------------------------------------------
def _relu2(x):
    return jnp.square(jax.nn.relu(x))


def _moe(cfg: ModelConfig, q: dict, x: jax.Array, tokamax_moe: bool = False) -> jax.Array:
    """Sigmoid router with correction bias and group-limited top-k; relu² experts + shared expert."""
    e, k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
    n_group, topk_group = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    logits = jnp.einsum("th,he->te", x.astype(jnp.float32), q["router"].astype(jnp.float32), precision="highest")
    scores = jax.nn.sigmoid(logits)
    choice = scores + q["e_bias"].astype(jnp.float32)
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(-1, n_group, e // n_group), 2)[0], axis=-1)
    _, gidx = jax.lax.top_k(group_scores, topk_group)
    gmask = jnp.zeros_like(group_scores).at[jnp.arange(x.shape[0])[:, None], gidx].set(1.0)
    emask = jnp.repeat(gmask, e // n_group, axis=1) > 0
    _, idx = jax.lax.top_k(jnp.where(emask, choice, -jnp.inf), k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.get("norm_topk_prob", False):
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg.get("routed_scaling_factor", 1.0)
    y = routed_experts(x, w, idx.astype(jnp.int32), q["experts_up"], q["experts_down"], act=_relu2, gated=False,
                       use_tokamax=tokamax_moe)
    return y + linear(_relu2(linear(x, q["shared_up"])), q["shared_down"])


def _mamba(cfg: ModelConfig, q: dict, h, cu_seqlens, conv0, ssm0, n_decode: int = 0, kernels=None, verify=None):
    """Mamba-2 mixer over varlen streams: the first `n_decode` streams are single-token decode rows
    (dt not clamped, as transformers' step path), the rest prefill streams (dt clamped below by
    time_step_min). h [T, H], conv0 f32[S, Cd, W-1], ssm0 f32[S, nh, P, N] -> (out [T, H], conv, ssm).
    `kernels.use_pallas` picks the Pallas conv1d, SSD scan and state-update kernels. `verify` = (idx, mask)
    of a verify step (`layers/spec_states.py`): every stream is a decode window, and conv / ssm are
    the states after each position, f32[N, W, ...]."""
    nh, p, n, ng, inner, cd, _ = _dims(cfg)
    pallas = kernels is not None and kernels.use_pallas
    proj = linear(h, q["in_proj"])
    z, xbc, dt_raw = proj[:, :inner], proj[:, inner:inner + cd], proj[:, inner + cd:]
    conv_fn = functools.partial(causal_conv1d_varlen, interpret=kernels.interpret) if pallas \
        else naive_causal_conv1d_varlen
    xbc, conv = conv_fn(xbc, q["conv_w"], q["conv_b"], cu_seqlens=cu_seqlens, initial_state=conv0, silu=True)
    x = xbc[:, :inner].reshape(-1, nh, p)
    B = xbc[:, inner:inner + ng * n].reshape(-1, ng, n)
    C = xbc[:, inner + ng * n:].reshape(-1, ng, n)
    dt_min, dt_max, D = cfg.get("dt_min"), cfg.get("dt_max"), q["D"].astype(jnp.float32)
    if verify is not None:  # decode semantics (dt not clamped), state after every position
        idx, mask = verify
        conv = conv_states_per_position(proj[:, inner:inner + cd], conv0, idx)
        dt = softplus(dt_raw.astype(jnp.float32) + q["dt_bias"].astype(jnp.float32))
        y, ssm = ssd_per_position(x, dt, -jnp.exp(q["A_log"].astype(jnp.float32)), B, C, D, idx, mask, ssm0)
    elif pallas:
        k = n_decode
        ys, states = [], []
        if k:
            y_d, s_d = selective_state_update(ssm0[:k], x[:k], dt_raw[:k], q["A_log"], B[:k], C[:k], D, q["dt_bias"],
                                              out_dtype=jnp.float32, interpret=kernels.interpret)
            ys.append(y_d)
            states.append(s_d)
        if x.shape[0] > k:
            y_p, s_p = ssd_chunk_scan(x[k:], dt_raw[k:], q["A_log"], B[k:], C[k:], D, q["dt_bias"],
                                      cu_seqlens=cu_seqlens[k:] - k, initial_states=ssm0[k:], dt_min=dt_min,
                                      dt_max=dt_max, out_dtype=jnp.float32, interpret=kernels.interpret)
            ys.append(y_p)
            states.append(s_p)
        y, ssm = jnp.concatenate(ys), jnp.concatenate(states)
    else:
        dt = softplus(dt_raw.astype(jnp.float32) + q["dt_bias"].astype(jnp.float32))
        is_prefill = jnp.arange(x.shape[0]) >= n_decode
        dt = jnp.where(is_prefill[:, None], jnp.clip(dt, dt_min, dt_max), dt)
        A = -jnp.exp(q["A_log"].astype(jnp.float32))
        y, ssm = ssd_varlen(x, dt, A, B, C, D, cu_seqlens=cu_seqlens, initial_state=ssm0)
    y = gated_group_rms_norm(y.reshape(-1, inner).astype(h.dtype), z, q["norm"], ng, cfg.rms_norm_eps)
    return linear(y, q["out"]), conv, ssm


def compute_logits(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


def _stack(cfg, params, x, mixers, carry_extra, unroll: bool = False):
    """Scan over layers: x + mixer(norm(x)), the mixer picked by the layer's kind."""
    kinds = _kinds(cfg)
    present = sorted(set(kinds))
    branch = np.asarray([present.index(k) for k in kinds], np.int32)  # numpy: see layers/stack.py
    kind_arr = np.asarray(kinds, np.int32)

    def layer(carry, xs):
        x, extra, counters = carry
        norm_w, b, kind = xs
        h = rms_norm(x, norm_w, cfg.rms_norm_eps)
        out, extra = switch(b, [mixers[k] for k in present], h, extra, counters)
        counters = counters + (np.arange(4) == kind).astype(np.int32)
        return (x + out, extra, counters), None

    init = (x, carry_extra, np.zeros((4,), np.int32))
    x, extra, _ = scan_layers(layer, init, (params["layers"]["norm"], branch, kind_arr), unroll)
    return rms_norm(x, params["norm_f"], cfg.rms_norm_eps), extra


def _ffn_mixers(cfg, params, tokamax_moe: bool = False):
    return {
        MLP: lambda h, extra, c: (linear(_relu2(linear(h, take_layer(params["mlp"], c[MLP])["up"])),
                                         take_layer(params["mlp"], c[MLP])["down"]), extra),
        MOE: lambda h, extra, c: (_moe(cfg, take_layer(params["moe"], c[MOE]), h, tokamax_moe), extra),
    }


# ---- dense forward ----------------------------------------------------------------------------------
def forward(cfg: ModelConfig, params: dict, tokens, positions, lengths):
    """tokens i32[B, T], positions i32[B, T] (unused: no positional embedding), lengths i32[B]
    -> logits f32[B, T, V]."""
    bsz, t = tokens.shape
    nh, p, n, _, _, cd, w = _dims(cfg)
    x = params["embed"][tokens].reshape(bsz * t, -1)
    cu = jnp.arange(bsz + 1, dtype=jnp.int32) * t
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def mamba(h, extra, c):
        zeros = (jnp.zeros((bsz, cd, w - 1), jnp.float32), jnp.zeros((bsz, nh, p, n), jnp.float32))
        out, _, _ = _mamba(cfg, take_layer(params["mamba"], c[MAMBA]), h, cu, *zeros)
        return out, extra

    def attn(h, extra, c):
        ap = take_layer(params["attn"], c[ATTN])
        q, k, v = jnp.split(linear(h, ap["wqkv"]), [hq * d, (hq + hkv) * d], axis=-1)
        o = dense_causal_attention(q.reshape(bsz, t, hq, d), k.reshape(bsz, t, hkv, d), v.reshape(bsz, t, hkv, d),
                                   lengths, d**-0.5)
        return linear(o.reshape(bsz * t, -1), ap["wo"]), extra

    mixers = {MAMBA: mamba, ATTN: attn, **_ffn_mixers(cfg, params)}
    x, _ = _stack(cfg, params, x, mixers, ())
    return compute_logits(cfg, params, x.reshape(bsz, t, -1))


# ---- paged forward ----------------------------------------------------------------------------------
def forward_paged(cfg: ModelConfig, params: dict, state, tokens, dmd, pmd, attn_cfg):
    """tokens i32[N + T] (decode rows, then prefill tokens) -> (state, hidden [N + T, H]).

    Mamba layers treat each decode row as a one-token stream (no dt clamp) and each prefill chunk
    as a stream starting from its pool row (zeros when the chunk starts at position 0).
    """
    n = dmd.num_seqs if dmd is not None else 0
    parts = [m for m in (dmd, pmd) if m is not None]
    slots = jnp.concatenate([m.slots for m in parts])
    cu, ssm_slots, fresh = recurrent_streams(dmd, pmd)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = params["embed"][tokens]
    verify = verify_grid(pmd) if pmd is not None and pmd.verify_width else None

    def mamba(h, extra, c):
        kv, ssm = extra
        pool, i = ssm["mamba"], c[MAMBA]
        conv0 = read_layer(pool["conv"], ssm_slots, i, fresh)
        ssm0 = read_layer(pool["ssm"], ssm_slots, i, fresh)
        out, conv, s = _mamba(cfg, take_layer(params["mamba"], i), h, cu, conv0, ssm0, n, attn_cfg, verify)
        if verify is not None:  # per-position states to the step's scratch (write-on-accept)
            return out, (kv, write_scratch(ssm, "mamba", i, {"conv": conv, "ssm": s}))
        pool = {"conv": write_layer(pool["conv"], ssm_slots, i, conv), "ssm": write_layer(pool["ssm"], ssm_slots, i, s)}
        return out, (kv, {**ssm, "mamba": pool})

    def attn(h, extra, c):
        kv, ssm = extra
        ap, i = take_layer(params["attn"], c[ATTN]), c[ATTN]
        q, k, v = jnp.split(linear(h, ap["wqkv"]), [hq * d, (hq + hkv) * d], axis=-1)
        q, k, v = q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
        kv = write_kv(kv, i, slots, k, v, kernel=attn_cfg.use_pallas, interpret=attn_cfg.interpret)
        o = paged_attention(q, kv, i, dmd, pmd, d**-0.5, attn_cfg)
        return linear(o.reshape(o.shape[0], -1), ap["wo"]), (kv, ssm)

    mixers = {MAMBA: mamba, ATTN: attn, **_ffn_mixers(cfg, params, attn_cfg.tokamax_moe)}
    x, (kv, ssm) = _stack(cfg, params, x, mixers, (state.kv, state.ssm), attn_cfg.unroll_layers)
    return dataclasses.replace(state, kv=kv, ssm=ssm), x
