"""Quantized MoE experts kept quantized on the device: block-FP8 (Qwen3-30B-A3B-FP8,
Qwen3-Next-FP8) and 4-bit (GPTQ, AWQ, compressed-tensors W4A16, NVFP4 checkpoints of the MoE
families, e.g. Qwen3-30B-A3B-GPTQ-Int4).

`quantized_experts` stacks every layer's experts into two quantized linears with an expert axis
after the layer axis, the first projection(s) fused (gate | up, or up alone for non-gated
experts) and the down projection:
* FP8 (`fp8_experts`): `Fp8Linear`s in the checkpoint's [N, K] layout,
    experts_gate_up  w8 f8e4m3[L, E, 2 * I_pad, H]   scale_inv f32[L, E, 2 * I_pad / 128, ceil(H / 128)]
    experts_down     w8 f8e4m3[L, E, H_pad, I]       scale_inv f32[L, E, H_pad / 128, ceil(I / 128)]
  (gate and up each padded to whole 128-row blocks, `segments` naming their rows, as for dense
  FP8 linears: `WeightReader.fp8_stack`). Experts with a scale per output channel keep block
  scales of 1 and their channel scales as `col_scale` f32[L, E, N_pad], as dense linears do.
* 4-bit (`w4_experts`): `W4Linear`s in `quant.w4`'s one layout (every format is read into it),
    experts_gate_up  packed u8[L, E, 2 * I, H / 2]   scales [L, E, 2 * I, H / G]   (int4: zeros alike)
    experts_down     packed u8[L, E, H, I / 2]       scales [L, E, H, I / G]
  (fp4: row_scale f32[L, E, N]; GPTQ act-order: perm i32[L, E, K], gate and up sharing one). A
  checkpoint whose experts are 4-bit in some layers or experts only, or in mixed formats, loads
  them dense, as `WeightReader.linears` does for linears.
`layers/moe_fp8.py` and `layers/moe_w4.py` run them; `quantization="fp8"` / `"int4"` /
`"nvfp4"` quantize dense experts at load into the same forms.
"""

from __future__ import annotations

from collections.abc import Callable

from metrale_jax.errors import LoadError


def quantized_experts(reader, num_layers: int, num_experts: int, hidden: int, inter: int, prefix,
                      projs: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")) -> dict | None:
    """{"experts_gate_up" (or "experts_up" for non-gated experts), "experts_down"} as quantized
    linears when the checkpoint's experts are FP8 or 4-bit, or the reader quantizes at load; None
    otherwise: the caller loads them dense.
    prefix: "model.layers.{}.mlp.experts.{}." (layer, expert; or a function of the two, for families
    whose MoE layers are some of the checkpoint's layers); projs: the projections' names in it,
    the input one(s) first and down last (Qwen's gate_proj, up_proj, down_proj; Mixtral's w1, w3,
    w2; non-gated experts: up_proj, down_proj)."""
    return (fp8_experts(reader, num_layers, num_experts, hidden, inter, prefix, projs)
            or w4_experts(reader, num_layers, num_experts, hidden, inter, prefix, projs))


def _at(prefix) -> Callable[[int, int], str]:
    return prefix.format if isinstance(prefix, str) else prefix


def _keys(projs) -> tuple[str, str]:
    return ("experts_gate_up" if len(projs) == 3 else "experts_up"), "experts_down"


def fp8_experts(reader, num_layers: int, num_experts: int, hidden: int, inter: int, prefix,
                projs: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")) -> dict | None:
    """`quantized_experts` for FP8 experts (stored so, or `quantization="fp8"`, as vLLM's
    on-the-fly FP8 quantizes MoE experts too); None for any other experts."""
    *first, down = projs
    prefix = _at(prefix)
    mode = "quantize" if reader.quantize_fp8 else reader.fp8_kind(prefix(0, 0) + first[0] + ".weight")
    if mode is None:
        return None

    def names(*projs):  # -> (layer, expert) -> that expert's weights, each FP8 as expert 0 of layer 0 is
        def of(i, j):
            out = [prefix(i, j) + f"{p}.weight" for p in projs]
            bad = [name for name in out if mode != "quantize" and reader.fp8_kind(name) != mode]
            if bad:
                raise LoadError(f"{reader.origin}: expert weight {bad[0]!r} is not {mode}-scaled FP8 while "
                                "expert 0 of layer 0 is")
            return out
        return of

    key_in, key_down = _keys(projs)
    return {
        key_in: reader.fp8_stack(num_layers, (num_experts,), hidden, [inter] * len(first), key_in, mode,
                                 names(*first), f"experts {'|'.join(first)} (fp8)"),
        key_down: reader.fp8_stack(num_layers, (num_experts,), inter, [hidden], key_down, mode, names(down),
                                   "experts down (fp8)"),
    }


def w4_experts(reader, num_layers: int, num_experts: int, hidden: int, inter: int, prefix,
               projs: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")) -> dict | None:
    """`quantized_experts` for 4-bit experts (a GPTQ / AWQ / compressed-tensors / NVFP4 checkpoint,
    or `quantization="int4"` / `"nvfp4"`); None for other experts, and for 4-bit ones that
    `loading.linears_w4.read_w4_linears` loads dense (quantized in some experts only, mixed
    formats or group sizes, gate and up with different act-orders)."""
    if reader.w4_scheme is None and not reader.quantize_w4:
        return None
    import dataclasses

    from metrale_jax.loading.linears_w4 import read_w4_linears

    *first, down = projs
    e, prefix = num_experts, _at(prefix)

    def parts(names_sizes):  # one flat index per (layer, expert): the reader stacks L * E "layers"
        return lambda i: [(prefix(i // e, i % e) + f"{p}.weight", n) for p, n in names_sizes]

    key_in, key_down = _keys(projs)
    w_in = read_w4_linears(reader, num_layers * e, hidden, parts([(p, inter) for p in first]),
                           f"experts {'|'.join(first)} (4-bit)")
    if w_in is None:
        return None
    w_down = read_w4_linears(reader, num_layers * e, inter, parts([(down, hidden)]), "experts down (4-bit)")
    if w_down is None:
        return None

    def by_expert(w):  # [L * E, ...] -> [L, E, ...]
        return dataclasses.replace(w, **{f: a.reshape(num_layers, e, *a.shape[1:]) for f in
                                         ("packed", "scales", "zeros", "row_scale", "perm")
                                         if (a := getattr(w, f)) is not None})

    return {key_in: by_expert(w_in), key_down: by_expert(w_down)}
