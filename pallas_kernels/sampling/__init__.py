"""Sampler kernels: the threshold searches' counting pass (`count_ge.sums_ge`)."""

from pallas_kernels.sampling.count_ge import sums_ge, sums_ge_reference

__all__ = ["sums_ge", "sums_ge_reference"]
