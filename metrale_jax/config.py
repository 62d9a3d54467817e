"""Model configuration: one frozen dataclass read from either config.json dialect.

Hub files write `rope_theta`, `rope_scaling` and `torch_dtype`; transformers 5 writes
`rope_parameters` and `dtype`. `ModelConfig.from_hf` reads both. The dataclass is frozen and
hashable, so it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any


def _freeze(v: Any) -> Any:
    """Turn dicts and lists into sorted tuples so a value can live in a frozen dataclass."""
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def parse_json_floats(obj: Any) -> Any:
    """transformers 5 writes infinities as {"__float__": "Infinity"}; turn those into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: parse_json_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [parse_json_floats(v) for v in obj]
    return obj


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers computes it (`modeling_rope_utils`).

    kind: "default" | "linear" | "llama3" | "yarn" | "dynamic". original_max_position_embeddings: the
    pre-training context (None in a config: the model's max_position_embeddings, transformers'
    default). yarn (Qwen3's and DeepSeek's long-context setting): beta_fast / beta_slow bound the
    ramp between extrapolated and interpolated frequencies, `truncate` rounds its ends, and
    attention_factor (cos and sin multiply by it) comes from the config or from factor, mscale
    and mscale_all_dim. dynamic (NTK): transformers rescales the base only for sequences past
    max_position_embeddings, recomputing every position's rotation, which keys cached already rotated
    cannot follow; so the default frequencies, and a context capped at max_position_embeddings
    (`ModelConfig.max_positions`), where the two agree.
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    @staticmethod
    def from_dict(d: dict | None, max_position_embeddings: int = 8192) -> RopeScaling:
        if not d:
            return RopeScaling()
        kind = d.get("rope_type", d.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3", "yarn", "dynamic"):
            raise NotImplementedError(f"rope scaling type {kind!r} is not supported yet (supported: default, "
                                      "linear, llama3, yarn, dynamic)")
        orig = int(d.get("original_max_position_embeddings") or max_position_embeddings)
        if kind == "yarn" and d.get("factor") is None:
            raise ValueError("rope scaling 'yarn' needs a factor")
        factor = float(d.get("factor", 1.0))
        attention = 1.0
        if kind == "yarn":
            def mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention = d.get("attention_factor")
            if attention is None:
                m, m_all = d.get("mscale"), d.get("mscale_all_dim")
                attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        return RopeScaling(
            kind=kind,
            factor=factor,
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=orig,
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            truncate=bool(d.get("truncate", True)),
            attention_factor=float(attention),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters shared by the model families.

    Every raw config.json key is also kept in `extra`, a frozen tuple of (key, value) pairs, for
    family-specific fields (hybrid layer patterns, MoE sizes, ...); read them with
    `cfg.get(key, default)`. Families may add derived keys there in `adapt_config`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    sliding_window: int | None = None  # every attention layer sees its last W keys (Mistral); None = all
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's own dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: tuple = ()

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.extra:
            if k == key:
                return v
        return default

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_positions(self) -> int:
        """The longest context the model takes (vLLM's derived max_model_len): yarn's original context
        times its factor, linear scaling's max_position_embeddings times its factor, else
        max_position_embeddings (dynamic NTK too: `RopeScaling`)."""
        s = self.rope_scaling
        if s.kind == "yarn":
            return int(s.original_max_position_embeddings * s.factor)
        if s.kind == "linear":
            return int(self.max_position_embeddings * s.factor)
        return self.max_position_embeddings

    @staticmethod
    def from_hf(d: dict, **overrides: Any) -> ModelConfig:
        """Build from a config.json dict (hub or transformers-5 dialect)."""
        d = parse_json_floats(dict(d))
        if "text_config" in d and "hidden_size" not in d:
            d = {**d, **d["text_config"]}
        archs = d.get("architectures") or [d.get("model_type", "?")]
        rope = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        hidden = int(d["hidden_size"])
        heads = int(d.get("num_attention_heads") or 1)  # pure SSM models (Mamba2) have none
        head_dim = d.get("head_dim") or hidden // heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        prf = d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        kw = dict(
            architecture=archs[0],
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size", 4 * hidden)),
            num_layers=int(d.get("num_hidden_layers") or len(
                d.get("layers_block_type") or d.get("layer_types") or d.get("hybrid_override_pattern") or ())),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", d.get("layer_norm_epsilon", 1e-6))),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_dict(scaling, int(d.get("max_position_embeddings", 4096))),
            partial_rotary_factor=float(prf),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            sliding_window=_sliding_window(d, archs[0]),
            hidden_act=str(d.get("hidden_act", "silu")),
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            extra=_freeze(d),  # every raw key, for family-specific fields
        )
        kw.update(overrides)
        return ModelConfig(**kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)


def _sliding_window(d: dict, architecture: str) -> int | None:
    """The attention layers' sliding window, by transformers' rules: `layer_types` (transformers 5's
    configs) naming "sliding_attention"; Qwen2 / Qwen3's hub `use_sliding_window` for the layers from
    `max_window_layers` on; Mistral's `sliding_window` (4096 when the key is absent, null = none).
    NotImplementedError where full and sliding-window attention layers are mixed."""
    window = d.get("sliding_window")
    kinds = [t for t in d.get("layer_types") or () if t in ("full_attention", "sliding_attention")]
    if kinds:
        sliding = kinds.count("sliding_attention")
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM"):  # (Mistral's default 4096, Mixtral's none)
        window = d.get("sliding_window", 4096 if architecture == "MistralForCausalLM" else None)
        return None if window is None else int(window)
    elif d.get("use_sliding_window") and window is not None:
        n = int(d.get("num_hidden_layers") or 0)
        sliding = max(0, n - int(d.get("max_window_layers", n)))
        kinds = [None] * n
    else:
        return None
    if sliding and window is None:
        raise ValueError("layer_types names sliding_attention layers but sliding_window is null")
    if 0 < sliding < len(kinds):
        raise NotImplementedError(f"{sliding} of {len(kinds)} attention layers use a sliding window and the rest "
                                  "full attention: mixed layers are not supported yet")
    return int(window) if sliding else None


def rope_inv_freq(cfg: ModelConfig) -> tuple[float, ...]:
    """Inverse RoPE frequencies f32[rotary_dim // 2], with the config's scaling applied.

    Computed in float64 on the host, as a tuple, so it can be a compile-time constant.
    """
    dim = cfg.rotary_dim
    inv = [1.0 / (cfg.rope_theta ** (2 * i / dim)) for i in range(dim // 2)]
    s = cfg.rope_scaling
    if s.kind == "linear":
        inv = [f / s.factor for f in inv]
    elif s.kind == "llama3":
        low_wl = s.original_max_position_embeddings / s.low_freq_factor
        high_wl = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in inv:
            wl = 2 * math.pi / f
            if wl < high_wl:
                out.append(f)
            elif wl > low_wl:
                out.append(f / s.factor)
            else:
                smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                out.append((1 - smooth) * f / s.factor + smooth * f)
        inv = out
    elif s.kind == "yarn":
        def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
            return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(cfg.rope_theta))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        out = []
        for i, f in enumerate(inv):  # ramp 0: the frequency as trained (extrapolated); 1: divided by factor
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            out.append(f / s.factor * ramp + f * (1 - ramp))
        inv = out
    return tuple(inv)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What RoPE's cos and sin multiply by (yarn's attention factor; 1 otherwise)."""
    return cfg.rope_scaling.attention_factor


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # parameter / activation dtypes (besides "auto")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # (vLLM's and torch's spellings of dtypes)
QUANTIZATIONS = (None, "fp8", "int4", "nvfp4")  # quantize-on-load choices
# vLLM's `quantization` names of checkpoint formats -> the quant_method (or file format) they name.
# They choose nothing here (the checkpoint's config says how to read it); a script passing the
# one that matches its checkpoint keeps working, and one that does not is told so.
CHECKPOINT_QUANTIZATIONS = {
    "gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors", "modelopt": "modelopt", "modelopt_fp4": "modelopt",
    "fbgemm_fp8": "fbgemm_fp8", "bitsandbytes": "bitsandbytes", "gguf": "gguf", "fp8": "fp8",
}


def check_quantization_name(quantization) -> None:
    """ValueError unless `quantization` is a quantize-on-load choice or vLLM's name of a checkpoint format."""
    if quantization not in QUANTIZATIONS and quantization not in CHECKPOINT_QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be one of {QUANTIZATIONS} (quantize at load) or "
                         f"vLLM's name of the checkpoint's own format: {sorted(CHECKPOINT_QUANTIZATIONS)}")
