"""Block-FP8 MoE experts (Qwen3-30B-A3B-FP8, Qwen3-Next-FP8) kept FP8 on the device.

`fp8_experts` stacks every layer's experts into two `Fp8Linear`s in the checkpoint's [N, K]
layout, with an expert axis after the layer axis:
    experts_gate_up  w8 f8e4m3[L, E, 2 * I_pad, H]   scale_inv f32[L, E, 2 * I_pad / 128, ceil(H / 128)]
    experts_down     w8 f8e4m3[L, E, H_pad, I]       scale_inv f32[L, E, H_pad / 128, ceil(I / 128)]
(gate and up each padded to whole 128-row blocks, `segments` naming their rows, as for dense
FP8 linears: `WeightReader.fp8_stack`). Experts with a scale per output channel keep block scales of 1 and their channel
scales as `col_scale` f32[L, E, N_pad], as dense linears do. `layers/moe_fp8.py` runs them.
"""

from __future__ import annotations

from metrale_jax.errors import LoadError


def fp8_experts(reader, num_layers: int, num_experts: int, hidden: int, inter: int, prefix: str,
                projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict | None:
    """{"experts_gate_up", "experts_down"} as `Fp8Linear`s when the checkpoint's experts are FP8 or
    the reader quantizes to FP8 at load (`quantization="fp8"`, as vLLM's on-the-fly FP8 quantizes
    MoE experts too); None otherwise: the caller loads them dense.
    prefix: "model.layers.{}.mlp.experts.{}." (layer, expert); projs: the gate, up and down
    projections' names in it (Mixtral's: w1, w3, w2)."""
    gate, up, down = projs
    mode = "quantize" if reader.quantize_fp8 else reader.fp8_kind(prefix.format(0, 0) + gate + ".weight")
    if mode is None:
        return None

    def names(*projs):  # -> (layer, expert) -> that expert's weights, each FP8 as expert 0 of layer 0 is
        def of(i, j):
            out = [prefix.format(i, j) + f"{p}.weight" for p in projs]
            bad = [name for name in out if mode != "quantize" and reader.fp8_kind(name) != mode]
            if bad:
                raise LoadError(f"{reader.origin}: expert weight {bad[0]!r} is not {mode}-scaled FP8 while "
                                "expert 0 of layer 0 is")
            return out
        return of

    return {
        "experts_gate_up": reader.fp8_stack(num_layers, (num_experts,), hidden, [inter, inter], "experts_gate_up",
                                            mode, names(gate, up), "experts gate|up (fp8)"),
        "experts_down": reader.fp8_stack(num_layers, (num_experts,), inter, [hidden], "experts_down", mode,
                                         names(down), "experts down (fp8)"),
    }
