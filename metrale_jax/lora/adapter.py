"""The device layout of LoRA slots (`LoRASpec`) and the PEFT reader that fills one slot's worth
of weights on the host (`load_peft_adapter`).

Slots: every decoder layer holds `max_loras` (S) slots of stacked A/B matrices, zero-padded to
`max_lora_rank` (R), under `params["layers"]["lora"]` (stacked over layers like every other
layer parameter, so `lax.scan` / the Python layer loop hand each layer its slice). Leaves, with
L layers, H hidden, Q = Hq*D, KV = Hkv*D, I the dense MLP width, Ie the experts' width:

    qkv_a [L, S, 3R, H]        q rows 0:R, k rows R:2R, v rows 2R:3R (PEFT's A is [r, in] already)
    qkv_b [L, S, 3R, Q+2KV]    block diagonal: (scale * B_q)^T at [0:r, 0:Q], B_k at [R:R+r, Q:Q+KV], ...
    o_a [L, S, R, Q]   o_b [L, S, R, H]
    dense models:  gate_up_a [L, S, 2R, H]  gate_up_b [L, S, 2R, 2I] (block diagonal)
                   down_a [L, S, R, I]  down_b [L, S, R, H]
    MoE models (Qwen3-MoE, Qwen3-Next), "virtual experts" v = slot * E + expert, plus one zero
    group V - 1 = S * E for the (token, expert) pairs of rows without expert LoRA; [G, in, out]
    as `ragged_dot` takes its right-hand side:
        x_gate_up_a [L, V, H, 2R]  x_gate_up_b [L, V, 2R, 2Ie] (block diagonal)
        x_down_a [L, V, Ie, R]  x_down_b [L, V, R, H]

Where the base weight is a plain array the engine keeps no `*_a` leaf: every slot's A is folded
into the base weight as columns `out + slot*kR ...` (`[in, out + S*kR]`, A transposed; the
q|k|v bias padded with zeros to match), and the base GEMM computes the shrink (`ops.py`).

The fused projections' B are block diagonal so that each projection's expand is one GEMM
(the zero blocks cost (k - 1) x the B bytes of q/k/v and gate/up, about 2% of Llama-3-8B's
weights at 8 rank-16 slots, against one GEMM launch instead of k per layer and projection).

A slot's content for one adapter is the same tree with the slot axis replaced by a group axis
G = 1 (dense leaves) or E (expert leaves): `[L, G, ...]`, written at slot * G (`manager.py`).
A target the adapter does not train stays zero. The scaling (lora_alpha / r, or / sqrt(r) with
use_rslora, per module with alpha_pattern) is folded into B on the host, as vLLM does.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metrale_jax.errors import (
    LoadError,
    LoRAAdapterNotFoundError,
    LoRAFormatError,
    LoRARankTooLargeError,
    LoRAShapeError,
    LoRATargetError,
)

# the families whose forward applies LoRA (the Llama decoder and its Qwen variants)
# (Qwen3-Next: expert LoRA only; its gated attention and Gated DeltaNet projections take none)
# (Qwen2-MoE: attention and routed experts; its shared expert takes none)
LORA_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next")
_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Mixtral's names of its experts' projections (`block_sparse_moe.experts.<e>.w1`, as PEFT writes them)
_MIXTRAL_TARGETS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# target -> (A leaf, B leaf, its slice of the fused projection); "x_" leaves are the experts'
_DENSE_SLOTS = {
    "q_proj": ("qkv_a", "qkv_b", 0), "k_proj": ("qkv_a", "qkv_b", 1), "v_proj": ("qkv_a", "qkv_b", 2),
    "o_proj": ("o_a", "o_b", 0),
    "gate_proj": ("gate_up_a", "gate_up_b", 0), "up_proj": ("gate_up_a", "gate_up_b", 1),
    "down_proj": ("down_a", "down_b", 0),
}
_EXPERT_SLOTS = {"gate_proj": ("x_gate_up_a", "x_gate_up_b", 0), "up_proj": ("x_gate_up_a", "x_gate_up_b", 1),
                 "down_proj": ("x_down_a", "x_down_b", 0)}


@dataclass(frozen=True)
class LoRASpec:
    """Shapes of the LoRA slots for one model and engine config (hashable, static)."""

    num_layers: int
    max_loras: int  # S
    max_rank: int  # R
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int  # dense MLP width (0 on MoE models)
    num_experts: int = 0  # E, the model's routed experts (0: dense)
    expert_intermediate: int = 0
    attention: bool = True  # q/k/v/o slots (False: Qwen3-Next, experts only)
    experts: bool = True  # expert slots on MoE models (EngineConfig.lora_experts)

    @staticmethod
    def for_model(model, max_loras: int, max_rank: int, experts: bool = True) -> LoRASpec:
        c = model.cfg
        e = int(c.get("num_experts") or 0) if model.family_name in _MOE_FAMILIES else 0
        return LoRASpec(num_layers=c.num_layers, max_loras=max_loras, max_rank=max_rank, hidden=c.hidden_size,
                        q_size=c.q_size, kv_size=c.kv_size, intermediate=0 if e else c.intermediate_size,
                        num_experts=e, expert_intermediate=int(c.get("moe_intermediate_size") or 0) if e else 0,
                        attention=model.family_name != "qwen3_next", experts=experts)

    @property
    def num_virtual(self) -> int:
        """V = S * E + 1 virtual experts (the last one all zeros)."""
        return self.max_loras * self.num_experts + 1

    def out_offset(self, target: str, expert: bool) -> int:
        """First output column of a target inside its fused projection (q|k|v, gate|up)."""
        i = self.expert_intermediate if expert else self.intermediate
        return {"k_proj": self.q_size, "v_proj": self.q_size + self.kv_size, "up_proj": i}.get(target, 0)

    def io(self, target: str, expert: bool) -> tuple[int, int]:
        """(in, out) features of a target module."""
        h, q, kv = self.hidden, self.q_size, self.kv_size
        i = self.expert_intermediate if expert else self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}[target]

    def leaf_shapes(self, slots: int | None = None) -> dict[str, tuple[int, ...]]:
        """Leaf -> shape. slots=None: the device slots ([L, S, ...] dense, [L, V, ...] expert
        leaves); slots=1: one adapter's content ([L, 1, ...] dense, [L, E, ...] expert leaves)."""
        L, R, h, q, kv = self.num_layers, self.max_rank, self.hidden, self.q_size, self.kv_size
        s = self.max_loras if slots is None else slots
        out = {}
        if self.attention:
            out |= {"qkv_a": (L, s, 3 * R, h), "qkv_b": (L, s, 3 * R, q + 2 * kv), "o_a": (L, s, R, q),
                    "o_b": (L, s, R, h)}
        if self.num_experts and self.experts:
            v = self.num_virtual if slots is None else slots * self.num_experts
            ie = self.expert_intermediate
            out |= {"x_gate_up_a": (L, v, h, 2 * R), "x_gate_up_b": (L, v, 2 * R, 2 * ie),
                    "x_down_a": (L, v, ie, R), "x_down_b": (L, v, R, h)}
        elif not self.num_experts:
            i = self.intermediate
            out |= {"gate_up_a": (L, s, 2 * R, h), "gate_up_b": (L, s, 2 * R, 2 * i), "down_a": (L, s, R, i),
                    "down_b": (L, s, R, h)}
        return out

    def zeros(self, dtype) -> dict[str, np.ndarray]:
        """The empty device slots (host numpy)."""
        return {k: np.zeros(s, dtype) for k, s in self.leaf_shapes().items()}

    def slot_bytes(self, itemsize: int) -> int:
        return sum(math.prod(s) for s in self.leaf_shapes(1).values()) * itemsize


@dataclass
class HostAdapter:
    """One adapter's slot content on the host: leaf -> [L, G, ...] in the model dtype."""

    lora_int_id: int
    name: str
    path: str
    rank: int  # the largest module rank
    weights: dict[str, np.ndarray]
    has_experts: bool  # trains any expert (moe_row_adapter >= 0 for its rows)
    targets: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.weights.values())


_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.([qkvo])_proj|mlp\.(gate|up|down)_proj|"
                     r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3))$")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override (rank_pattern / alpha_pattern): the first key whose regex
    matches the end of the module path."""
    for pat, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module):
            return v
    return default


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json of a PEFT folder, checked for what this engine can serve."""
    if not path.is_dir():
        raise LoRAAdapterNotFoundError(f"LoRA adapter folder {path} does not exist (only local PEFT folders "
                                       f"are served)")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAAdapterNotFoundError(f"{path} has no adapter_config.json (not a PEFT adapter folder)")
    try:
        cfg = json.loads(cfg_file.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise LoRAFormatError(f"{cfg_file}: unreadable adapter config: {e}") from e
    where = f"{cfg_file}:"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAFormatError(f"{where} peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
    if cfg.get("use_dora"):
        raise LoRAFormatError(f"{where} DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAFormatError(f"{where} bias={cfg.get('bias')!r}: adapters that train biases are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAFormatError(f"{where} modules_to_save={cfg['modules_to_save']!r}: adapters that replace whole "
                              f"modules are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoRAFormatError(f"{where} fan_in_fan_out=true (Conv1D layouts) is not supported")
    if cfg.get("target_parameters"):
        raise LoRAFormatError(f"{where} target_parameters={cfg['target_parameters']!r}: LoRA on fused expert "
                              f"parameters is not supported; write per-expert modules "
                              f"(mlp.experts.<e>.gate_proj/up_proj/down_proj)")
    for k in ("r", "lora_alpha"):
        if not isinstance(cfg.get(k), int | float) or isinstance(cfg.get(k), bool) or cfg[k] <= 0:
            raise LoRAFormatError(f"{where} {k}={cfg.get(k)!r} must be a positive number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list | tuple):
        bad = [t for t in targets if str(t).split(".")[-1] not in (*TARGETS, *_MIXTRAL_TARGETS)]
        if bad:
            raise LoRATargetError(f"{where} target_modules {bad} are not served; LoRA is applied to "
                                  f"{', '.join(TARGETS)} only")
    return cfg


def load_peft_adapter(path: str | Path, spec: LoRASpec, dtype, lora_int_id: int = 0, name: str = "") -> HostAdapter:
    """Read a PEFT LoRA folder into one slot's content for `spec` (see the module docstring).

    Raises a `LoRAError` subclass naming the folder (and tensor) on any problem: missing files,
    a pickled `.bin` (refused: loading it would run arbitrary code), an unsupported adapter kind,
    an unknown target module, a rank above max_lora_rank, or shapes that do not fit the model.
    """
    from metrale_jax.loading.tensors import SafetensorsSource

    path = Path(path).expanduser()
    cfg = read_adapter_config(path)
    st = path / "adapter_model.safetensors"
    if not st.is_file():
        if (path / "adapter_model.bin").is_file():
            raise LoRAFormatError(f"{path} holds adapter_model.bin, a pickle, which is refused (loading it can run "
                                  f"code); convert it to adapter_model.safetensors")
        raise LoRAAdapterNotFoundError(f"{path} has no adapter_model.safetensors")
    try:
        src = SafetensorsSource(st)
    except LoadError as e:
        raise LoRAFormatError(f"{st}: {e}") from e
    R = spec.max_rank
    pairs: dict[tuple[int, int, str], dict[str, np.ndarray]] = {}  # (layer, expert or -1, target) -> {A, B}
    try:
        for key in src.names():
            m = _KEY.match(key)
            if m is None:
                raise LoRAFormatError(f"{st}: tensor {key!r} is not a LoRA A/B weight (embedding LoRA, DoRA "
                                      f"magnitudes and biases are not supported)")
            module, ab = m.group(1), m.group(2)
            mm = _MODULE.match(module)
            if mm is None:
                raise LoRATargetError(f"{st}: tensor {key!r} targets module {module!r}; LoRA is applied to the "
                                      f"decoder's {', '.join(TARGETS)} only")
            layer = int(mm.group(1))
            if mm.group(3):
                target, expert = f"{mm.group(3)}_proj", -1
            elif mm.group(4):
                target, expert = f"{mm.group(4)}_proj", -1
            else:
                target, expert = _MIXTRAL_TARGETS.get(mm.group(6), mm.group(6)), int(mm.group(5))
            if layer >= spec.num_layers:
                raise LoRAShapeError(f"{st}: tensor {key!r} is for layer {layer}, the model has {spec.num_layers}")
            if expert < 0 and target in ("gate_proj", "up_proj", "down_proj") and spec.num_experts:
                raise LoRATargetError(f"{st}: tensor {key!r} targets a dense MLP, this MoE model has none (target "
                                      f"the experts: mlp.experts.<e>.{target})")
            if expert < 0 and target[0] in "qkvo" and not spec.attention:
                raise LoRATargetError(f"{st}: tensor {key!r} targets attention; on this model (Qwen3-Next) LoRA "
                                      f"is served for the MoE experts only")
            if expert >= 0 and not spec.num_experts:
                raise LoRATargetError(f"{st}: tensor {key!r} targets an expert, this model has no MoE experts")
            if expert >= 0 and not spec.experts:
                raise LoRATargetError(f"{st}: tensor {key!r} targets an expert, and this engine has no expert "
                                      f"LoRA slots (lora_experts=False)")
            if expert >= spec.num_experts and spec.num_experts:
                raise LoRAShapeError(f"{st}: tensor {key!r} is for expert {expert}, the model has "
                                     f"{spec.num_experts}")
            pairs.setdefault((layer, expert, target), {})[ab] = np.asarray(src.load(key), np.float32)
    finally:
        src.close()
    if not pairs:
        raise LoRAFormatError(f"{st} holds no LoRA weights")
    use_rslora = bool(cfg.get("use_rslora"))
    shapes = spec.leaf_shapes(1)
    out = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    max_r = 0
    for (layer, expert, target), ab in sorted(pairs.items()):
        module = (f"model.layers.{layer}." + (f"mlp.experts.{expert}.{target}" if expert >= 0 else
                                              f"{'self_attn' if target[0] in 'qkvo' else 'mlp'}.{target}"))
        if set(ab) != {"A", "B"}:
            raise LoRAFormatError(f"{st}: module {module} has lora_{'A' if 'A' in ab else 'B'} but no "
                                  f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        n_in, n_out = spec.io(target, expert >= 0)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAShapeError(f"{st}: module {module}: lora_A {a.shape} and lora_B {b.shape} are not [r, in] "
                                 f"and [out, r] of one rank")
        r = a.shape[0]
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise LoRAShapeError(f"{st}: module {module}: lora_A {a.shape} / lora_B {b.shape} do not fit the "
                                 f"base model's {target} ({n_in} in, {n_out} out): an adapter of another model?")
        if r > R:
            raise LoRARankTooLargeError(f"{st}: module {module} has rank {r} > max_lora_rank={R}")
        max_r = max(max_r, r)
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
        scale = alpha / (math.sqrt(r) if use_rslora else r)
        bt = (b * scale).T  # [r, out]
        col = spec.out_offset(target, expert >= 0)
        if expert >= 0:
            a_leaf, b_leaf, j = _EXPERT_SLOTS[target]
            out[a_leaf][layer, expert, :, j * R: j * R + r] = a.T  # [in, r] columns
            out[b_leaf][layer, expert, j * R: j * R + r, col: col + n_out] = bt
        else:
            a_leaf, b_leaf, j = _DENSE_SLOTS[target]
            out[a_leaf][layer, 0, j * R: j * R + r] = a
            out[b_leaf][layer, 0, j * R: j * R + r, col: col + n_out] = bt
    weights = {k: v.astype(dtype) for k, v in out.items()}
    return HostAdapter(lora_int_id=lora_int_id, name=name, path=str(path), rank=max_r, weights=weights,
                       has_experts=any(e >= 0 for _, e, _ in pairs),
                       targets=tuple(sorted({t for _, _, t in pairs})))
