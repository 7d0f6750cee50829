"""Triton kernels for the causal depthwise conv1d of Mamba-style models, with PyTorch references.

``from kernels import causal_conv1d_fn, causal_conv1d_update, PAD_SLOT_ID`` is a drop-in for the seed's API.
"""

from ._validate import MAX_WIDTH, MIN_WIDTH, PAD_SLOT_ID
from .decode import causal_conv1d_update
from .prefill import causal_conv1d_fn
from .reference import causal_conv1d_ref, causal_conv1d_update_ref

__all__ = [
    "PAD_SLOT_ID",
    "MIN_WIDTH",
    "MAX_WIDTH",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
]
