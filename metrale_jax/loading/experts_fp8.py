"""Block-FP8 MoE experts (Qwen3-30B-A3B-FP8, Qwen3-Next-FP8) kept FP8 on the device.

`fp8_experts` stacks every layer's experts into two `Fp8Linear`s in the checkpoint's [N, K]
layout, with an expert axis after the layer axis:
    experts_gate_up  w8 f8e4m3[L, E, 2 * I_pad, H]   scale_inv f32[L, E, 2 * I_pad / 128, ceil(H / 128)]
    experts_down     w8 f8e4m3[L, E, H_pad, I]       scale_inv f32[L, E, H_pad / 128, ceil(I / 128)]
(gate and up each padded to whole 128-row blocks, `segments` naming their rows, as for dense
FP8 linears). Experts with a scale per output channel keep block scales of 1 and their channel
scales as `col_scale` f32[L, E, N_pad], as dense linears do. `layers/moe_fp8.py` runs them.
"""

from __future__ import annotations

import math

import numpy as np

from metrale_jax.errors import LoadError
from metrale_jax.layers.linear import FP8_BLOCK, Fp8Linear
from metrale_jax.loading.weights import FP8


def _stack(reader, num_layers: int, num_experts: int, k: int, parts, desc: str, key: str, kind: str) -> Fp8Linear:
    """parts(i, j) -> [(name, N_j)] of layer i, expert j (output order); key: the parameter's name;
    kind: `WeightReader.fp8_kind` of every weight ("block", "channel"), or "quantize"."""
    sizes = [n for _, n in parts(0, 0)]
    padded = [math.ceil(n / FP8_BLOCK) * FP8_BLOCK for n in sizes]
    starts = np.cumsum([0] + padded[:-1]).tolist()
    w8 = reader.stacked(num_layers, (num_experts, sum(padded), k), (key, "w8"), dtype=FP8, fill=0)
    scale = reader.stacked(num_layers, (num_experts, sum(padded) // FP8_BLOCK, math.ceil(k / FP8_BLOCK)),
                           (key, "scale_inv"), dtype=np.float32, fill=1)
    col = None
    if kind == "channel":
        col = reader.stacked(num_layers, (num_experts, sum(padded)), (key, "col_scale"), dtype=np.float32, fill=1)
    for i in reader.progress(range(num_layers), desc):
        for j in range(num_experts):
            for (name, n), start in zip(parts(i, j), starts):
                if kind != "quantize" and reader.fp8_kind(name) != kind:
                    raise LoadError(f"{reader.origin}: expert weight {name!r} is not {kind}-scaled FP8 while "
                                    "expert 0 of layer 0 is")
                if kind == "channel":  # the codes, block scales 1, the channel scales after the product
                    w8[i, j, start:start + n], col[i, j, start:start + n] = reader.fp8_channel_weight(name, (n, k))
                    scale[i, j, start // FP8_BLOCK] = 1.0  # (a write: a streamed `LayerStack` places written layers)
                    continue
                q, s = reader.fp8_weight(name, (n, k))
                w8[i, j, start:start + n] = q
                scale[i, j, start // FP8_BLOCK:start // FP8_BLOCK + s.shape[0]] = s
    return Fp8Linear(w8, scale, tuple(zip(starts, sizes)), col_scale=col)


def fp8_experts(reader, num_layers: int, num_experts: int, hidden: int, inter: int, prefix: str) -> dict | None:
    """{"experts_gate_up", "experts_down"} as `Fp8Linear`s when the checkpoint's experts are FP8 or
    the reader quantizes to FP8 at load (`quantization="fp8"`, as vLLM's on-the-fly FP8 quantizes
    MoE experts too); None otherwise: the caller loads them dense.
    prefix: "model.layers.{}.mlp.experts.{}." (layer, expert)."""
    kind = "quantize" if reader.quantize_fp8 else reader.fp8_kind(prefix.format(0, 0) + "gate_proj.weight")
    if kind is None:
        return None

    def gate_up(i, j):
        return [(prefix.format(i, j) + "gate_proj.weight", inter), (prefix.format(i, j) + "up_proj.weight", inter)]

    return {
        "experts_gate_up": _stack(reader, num_layers, num_experts, hidden, gate_up, "experts gate|up (fp8)",
                                  "experts_gate_up", kind),
        "experts_down": _stack(reader, num_layers, num_experts, inter,
                               lambda i, j: [(prefix.format(i, j) + "down_proj.weight", hidden)], "experts down (fp8)",
                               "experts_down", kind),
    }
