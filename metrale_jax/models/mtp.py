"""Multi-token prediction (MTP) heads: the draft model that Qwen3-Next (and DeepSeek-V3, GLM-4.5)
checkpoints ship under `mtp.*`, as vLLM defines it (`Qwen3NextMultiTokenPredictor`):

    x_i = fc(concat(norm_e(embed(tok[i+1])), norm_h(h[i])))      (fc: 2H -> H, no bias)
    x   = decoder_layer(x)          one full-attention layer of the family, causal over i
    logits = lm_head(norm(x))       the target's embedding table and LM head, shared

h[i] is the target's last hidden state at position i (after its final norm: what its LM head
reads) and tok[i+1] the token that followed; position i's logits predict tok[i+2]. With k > 1
drafts the head is applied again on its own output (layer `step % num_mtp_layers`).

`mtp_head` is the family-independent part; a family supplies its norm and decoder layer.
Qwen3-Next's: `load_qwen3_next_mtp` (reads `mtp.*`; the main loader skips them, so they cost no
memory unless asked for), `qwen3_next_mtp_logits` (dense, for research and the reference test)
and `qwen3_next_mtp_paged` (over a step's paged metadata, its K/V in a KV-pool layer of its own:
what the engine's steps run, `engine/spec_decode.py`'s MTP drafter, through the family hooks
`load_mtp` and `mtp_forward_paged`).

Parameter tree: fc [2H, H], norm_embed / norm_hidden / norm [H], and per MTP layer (Lm of them)
layers/{in_norm, post_norm [Lm, H], router, experts_*, shared_*} and attn/{wq, wkv, wo, q_norm,
k_norm} in the layouts of `models/qwen3_next.py`.
"""

from __future__ import annotations

import jax.numpy as jnp

from metrale_jax.cache.kv import write_kv
from metrale_jax.config import ModelConfig
from metrale_jax.layers.attention import AttentionConfig, dense_causal_attention, paged_attention
from metrale_jax.layers.stack import num_layers, take_layer


def mtp_head(norm, mtp: dict, embed_rows, hidden, layer_fn):
    """The family-independent MTP head up to its final norm: embed_rows [..., H] (embeddings of
    tok[i+1]), hidden [..., H] (target h[i]) -> [..., H]. `norm(x, w)` is the family's RMSNorm,
    `layer_fn(x)` its decoder layer (residuals included)."""
    x = jnp.concatenate([norm(embed_rows, mtp["norm_embed"]), norm(hidden, mtp["norm_hidden"])], axis=-1)
    x = jnp.einsum("...i,io->...o", x, mtp["fc"].astype(x.dtype))
    return norm(layer_fn(x), mtp["norm"])


# ---- Qwen3-Next ------------------------------------------------------------------------------------
def num_mtp_layers(names) -> int:
    """How many `mtp.layers.<i>.` a checkpoint's tensor names hold."""
    ids = {int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")}
    return max(ids) + 1 if ids else 0


def load_qwen3_next_mtp(cfg: ModelConfig, reader) -> dict:
    """Read a Qwen3-Next checkpoint's `mtp.*` tensors through a WeightReader (device arrays). A
    reader without tensor names (random weights) draws `num_nextn_predict_layers` (default 1)."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    e, im, ish = cfg.get("num_experts"), cfg.get("moe_intermediate_size"), cfg.get("shared_expert_intermediate_size")
    names = reader.source.names()
    lm = num_mtp_layers(names) if names else int(cfg.get("num_nextn_predict_layers") or 1)
    if lm == 0:
        raise ValueError("the checkpoint has no mtp.layers.* tensors: it cannot draft with speculative_config "
                         "method='mtp'")
    stacks, get = reader.stacks, reader.get
    layers = stacks(lm, in_norm=(h,), post_norm=(h,), router=(h, e), experts_gate_up=(e, h, 2 * im),
                    experts_down=(e, im, h), shared_gate_up=(h, 2 * ish), shared_down=(ish, h), shared_gate=(h, 1))
    attn = stacks(lm, wq=(h, hq * 2 * d), wkv=(h, 2 * hkv * d), wo=(hq * d, h), q_norm=(d,), k_norm=(d,))
    for i in range(lm):
        p = f"mtp.layers.{i}."
        layers["in_norm"][i] = get(p + "input_layernorm.weight", (h,))
        layers["post_norm"][i] = get(p + "post_attention_layernorm.weight", (h,))
        m = p + "mlp."
        reader.put_t(layers["router"], i, get(m + "gate.weight", (e, h), cast=True))
        for j in range(e):
            q = f"{m}experts.{j}."
            reader.put_t(layers["experts_gate_up"], (i, j), *(get(q + f"{x}_proj.weight", (im, h), cast=True)
                                                                for x in ("gate", "up")))
            reader.put_t(layers["experts_down"], (i, j), get(q + "down_proj.weight", (h, im), cast=True))
        s = m + "shared_expert."
        reader.put_t(layers["shared_gate_up"], i, *(get(s + f"{x}_proj.weight", (ish, h), cast=True)
                                                      for x in ("gate", "up")))
        reader.put_t(layers["shared_down"], i, get(s + "down_proj.weight", (h, ish), cast=True))
        reader.put_t(layers["shared_gate"], i, get(m + "shared_expert_gate.weight", (1, h), cast=True))
        a = p + "self_attn."
        reader.put_t(attn["wq"], i, get(a + "q_proj.weight", (hq * 2 * d, h), cast=True))
        reader.put_t(attn["wkv"], i, *(get(a + f"{x}_proj.weight", (hkv * d, h), cast=True) for x in "kv"))
        reader.put_t(attn["wo"], i, get(a + "o_proj.weight", (h, hq * d), cast=True))
        attn["q_norm"][i] = get(a + "q_norm.weight", (d,))
        attn["k_norm"][i] = get(a + "k_norm.weight", (d,))
    mtp = {"fc": reader.transposed(get("mtp.fc.weight", (h, 2 * h), cast=True)),
           "norm_embed": get("mtp.pre_fc_norm_embedding.weight", (h,)),
           "norm_hidden": get("mtp.pre_fc_norm_hidden.weight", (h,)),
           "norm": get("mtp.norm.weight", (h,)), "layers": layers, "attn": attn}
    return reader.to_device(mtp)


def _qwen3_next_mtp(cfg: ModelConfig, params: dict, mtp: dict, tokens_next, hidden, positions, attend, step: int,
                    tokamax_moe: bool = False):
    """The Qwen3-Next MTP head over S flat tokens: tokens_next i32[S] (tok[i+1]), hidden [S, H]
    (target h[i]), positions i32[S] (i); `attend(q, k, v) -> o [S, Hq, D]` is its attention (dense
    or paged) -> its output [S, H] after the final norm (what the LM head reads, and the hidden
    state of the next draft step)."""
    from metrale_jax.models import qwen3_next as q3

    nl = num_layers(mtp["layers"]["in_norm"])
    lp, ap = take_layer(mtp["layers"], step % nl), take_layer(mtp["attn"], step % nl)

    def norm(x, w):
        return q3._norm(cfg, x, w)

    def layer(x):  # x [S, H]: Qwen3NextDecoderLayer with full attention
        q, k, v, gate = q3._attn_qkv(cfg, ap, norm(x, lp["in_norm"]), positions)
        x = x + q3._attn_out(ap, attend(q, k, v), gate)
        return x + q3._moe(cfg, lp, norm(x, lp["post_norm"]), tokamax_moe)

    return mtp_head(norm, mtp, params["embed"][tokens_next], hidden.astype(params["embed"].dtype), layer)


def qwen3_next_mtp_logits(cfg: ModelConfig, params: dict, mtp: dict, tokens_next, hidden, positions, lengths,
                          step: int = 0):
    """Dense MTP draft logits. tokens_next i32[B, T] (tok[i+1]), hidden [B, T, H] (target h[i]),
    positions i32[B, T] (i), lengths i32[B] -> f32[B, T, V] (position i predicts tok[i+2])."""
    from metrale_jax.models.qwen3_next import compute_logits

    y = qwen3_next_mtp_hidden(cfg, params, mtp, tokens_next, hidden, positions, lengths, step)
    return compute_logits(cfg, params, y)


def qwen3_next_mtp_hidden(cfg: ModelConfig, params: dict, mtp: dict, tokens_next, hidden, positions, lengths,
                          step: int = 0):
    """`qwen3_next_mtp_logits` before the LM head: the head's output [B, T, H] (the hidden state
    a next chained draft reads)."""
    b, t = tokens_next.shape

    def attend(q, k, v):  # causal within each sequence
        o = dense_causal_attention(*(a.reshape((b, t) + a.shape[1:]) for a in (q, k, v)), lengths,
                                   cfg.head_dim**-0.5)
        return o.reshape((b * t,) + o.shape[2:])

    y = _qwen3_next_mtp(cfg, params, mtp, tokens_next.reshape(-1), hidden.reshape(b * t, -1), positions.reshape(-1),
                        attend, step)
    return y.reshape(b, t, -1)


def qwen3_next_mtp_forward_paged(cfg: ModelConfig, params: dict, mtp: dict, kv, layer: int, tokens_next, hidden,
                                 dmd, pmd, attn: AttentionConfig = AttentionConfig(), step: int = 0):
    """The MTP head over one step's tokens, paged: tokens_next i32[N + T] (tok[i+1] for each of the
    step's tokens i: decode rows, then prefill tokens, as `forward_paged`), hidden [N + T, H] (the
    target's final hidden state at i) -> (kv, the head's output [N + T, H]). The MTP layer's K/V of
    the step's positions go to KV-pool layer `layer` (one the target does not use) at the step's
    slots, and its attention reads that layer through the step's block tables, so earlier steps'
    MTP K/V (written the same way) are its context."""
    parts = [m for m in (dmd, pmd) if m is not None]
    slots = jnp.concatenate([m.slots for m in parts])
    out = {}

    def attend(q, k, v):
        out["kv"] = write_kv(kv, layer, slots, k, v, kernel=attn.use_pallas, interpret=attn.interpret)
        return paged_attention(q, out["kv"], layer, dmd, pmd, cfg.head_dim**-0.5, attn)

    y = _qwen3_next_mtp(cfg, params, mtp, tokens_next, hidden, jnp.concatenate([m.positions for m in parts]),
                        attend, step, attn.tokamax_moe)
    return out["kv"], y


def qwen3_next_mtp_paged(cfg: ModelConfig, params: dict, mtp: dict, kv, layer: int, tokens_next, hidden, dmd, pmd,
                         attn: AttentionConfig = AttentionConfig(), step: int = 0):
    """`qwen3_next_mtp_forward_paged` with the shared LM head: -> (kv, draft logits f32[N + T, V])."""
    from metrale_jax.models.qwen3_next import compute_logits

    kv, y = qwen3_next_mtp_forward_paged(cfg, params, mtp, kv, layer, tokens_next, hidden, dmd, pmd, attn, step)
    return kv, compute_logits(cfg, params, y)
