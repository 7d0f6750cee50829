"""Triton kernels for the causal depthwise conv1d of Mamba-style models, with PyTorch references.

``from convserve.kernels import causal_conv1d_fn, causal_conv1d_update, PAD_SLOT_ID`` is a drop-in for the
seed's API. ``prefill/`` holds ``causal_conv1d_fn`` and ``decode/`` ``causal_conv1d_update``, one file per kernel
(each package's docstring lists them); ``_launch`` the tile choices and launch plans, ``_replay`` the CUDA graphs of
a plan's repeated launches, ``_validate`` the argument checks, ``reference`` the PyTorch references, ``graphs``
CUDA-graph capture, ``commit`` an accept's commit and ``host_copy`` copies between pinned memory and the device made
by the SMs (both for the service's engine).

Glossary (PyTorch's conv1d vocabulary, for x ``(dim, T)``; the same words name tests, tuning keys and the
benchmark's layout column):

- **channels-first**: T contiguous, ``x.stride(1) == 1`` (a contiguous ``(dim, T)``: the benchmark card's
  layout).
- **channels-last**: dim contiguous, ``x.stride(0) == 1`` (a ``(T, dim)`` buffer seen through ``.t()``: how
  serving stacks hold activations).
- **body**: a kernel that convolves every channel row as if all tokens were one sequence; **head**: a sequence's
  first ``width - 1`` tokens, whose taps reach into the old state; **heads pass**: the launch after a body that
  rewrites every head, writes the new states and zeroes pad sequences.
- **piece**: the part of one sequence inside one block of tokens (the piece kernel's unit of work).
- **window**: the ``width - 1`` inputs before a token (a state row holds one).

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
