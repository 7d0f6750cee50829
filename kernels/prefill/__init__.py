"""Varlen prefill, ``causal_conv1d_fn``: one file per kernel, in launch order.

- ``body_channels_first``: the body of a contiguous channels-first ``(dim, T)`` x, read as one flat array.
- ``body_channels_last``: the body of a channels-last x (``stride(0) == 1``), a sliding window along tokens.
- ``heads``: after either body, each sequence's head, its new state, and zeros for pads and the tail.
- ``piece``: the whole op in one launch, for any strides (small shapes and other layouts).
- ``plan``: which of these a call takes, the plan cache, and the public ``causal_conv1d_fn``.
"""

from .plan import causal_conv1d_fn

__all__ = ["causal_conv1d_fn"]
