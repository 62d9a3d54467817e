"""Decode-path linear kernels: weight-streaming skinny GEMM for bf16 and FP8 block-scaled weights."""

from pallas_kernels.linear.params import SkinnyParams, skinny_params_for
from pallas_kernels.linear.reference import (
    dequantize_fp8_reference,
    skinny_matmul_fp8_reference,
    skinny_matmul_reference,
)
from pallas_kernels.linear.skinny import skinny_matmul, skinny_matmul_fp8

__all__ = [
    "SkinnyParams",
    "dequantize_fp8_reference",
    "skinny_matmul",
    "skinny_matmul_fp8",
    "skinny_matmul_fp8_reference",
    "skinny_matmul_reference",
    "skinny_params_for",
]
