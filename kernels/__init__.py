"""Triton kernels for the causal depthwise conv1d of Mamba-style models, with PyTorch references.

``from kernels import causal_conv1d_fn, causal_conv1d_update, PAD_SLOT_ID`` is a drop-in for the seed's API.

Without CUDA the Triton kernels can only run in Triton's interpreter, so importing this package on such a machine
switches it on (``TRITON_INTERPRET=1``) unless the variable is already set: the kernels then run, slowly, on CPU
tensors. The service's CPU engine uses the vectorized PyTorch ops (:mod:`.torch_ops`) instead.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from ._validate import MAX_WIDTH, MIN_WIDTH, PAD_SLOT_ID  # noqa: E402
from .decode import causal_conv1d_update  # noqa: E402
from .prefill import causal_conv1d_fn  # noqa: E402
from .reference import causal_conv1d_ref, causal_conv1d_update_ref  # noqa: E402
from .torch_ops import causal_conv1d_fn_torch, causal_conv1d_update_torch  # noqa: E402

__all__ = [
    "PAD_SLOT_ID",
    "MIN_WIDTH",
    "MAX_WIDTH",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "causal_conv1d_fn_torch",
    "causal_conv1d_update_torch",
]
