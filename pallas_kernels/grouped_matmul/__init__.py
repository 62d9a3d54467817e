"""Grouped GEMM for MoE experts (the contract of `jax.lax.ragged_dot`), Mosaic GPU."""

from pallas_kernels.grouped_matmul.kernel import grouped_matmul, task_table
from pallas_kernels.grouped_matmul.params import GroupedMatmulParams, grouped_matmul_params_for
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

__all__ = [
    "GroupedMatmulParams",
    "grouped_matmul",
    "grouped_matmul_params_for",
    "grouped_matmul_reference",
    "task_table",
]
