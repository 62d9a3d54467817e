"""Weight quantization formats (host side, numpy; quantize-on-load jitted): FP8 e4m3 with 128x128 block scales."""

from metrale_jax.quant.fp8 import (
    FP8_BLOCK,
    FP8_E4M3_MAX,
    check_fp8_quantization_config,
    check_fp8_weight,
    dequantize_fp8_block,
    fp8_scale_shape,
    quantize_fp8_block,
)

__all__ = [
    "FP8_BLOCK",
    "FP8_E4M3_MAX",
    "check_fp8_quantization_config",
    "check_fp8_weight",
    "dequantize_fp8_block",
    "fp8_scale_shape",
    "quantize_fp8_block",
]
