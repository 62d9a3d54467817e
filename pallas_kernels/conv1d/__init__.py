"""Depthwise causal conv1d: varlen prefill and single-step decode update (conv state = last inputs)."""

from pallas_kernels.conv1d.causal_conv1d import ConvParams, causal_conv1d_update, causal_conv1d_varlen
from pallas_kernels.conv1d.naive import naive_causal_conv1d_update, naive_causal_conv1d_varlen

__all__ = [
    "ConvParams",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "naive_causal_conv1d_update",
    "naive_causal_conv1d_varlen",
]
