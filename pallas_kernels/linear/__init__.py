"""Decode-path linear kernels: weight-streaming skinny GEMM for bf16, FP8 block-scaled and packed 4-bit weights."""

from pallas_kernels.linear.params import SkinnyParams, skinny_params_for
from pallas_kernels.linear.reference import (
    dequantize_fp8_reference,
    dequantize_w4_reference,
    skinny_matmul_fp8_reference,
    skinny_matmul_reference,
    skinny_matmul_w4_reference,
)
from pallas_kernels.linear.skinny import skinny_matmul, skinny_matmul_fp8
from pallas_kernels.linear.w4 import W4Params, skinny_matmul_w4

__all__ = [
    "SkinnyParams",
    "W4Params",
    "dequantize_fp8_reference",
    "dequantize_w4_reference",
    "skinny_matmul",
    "skinny_matmul_fp8",
    "skinny_matmul_fp8_reference",
    "skinny_matmul_reference",
    "skinny_matmul_w4",
    "skinny_matmul_w4_reference",
    "skinny_params_for",
]
