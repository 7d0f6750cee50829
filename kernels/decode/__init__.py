"""Decode and speculative verify, ``causal_conv1d_update``: one file per kernel.

- ``dense``: x and out dense per row and a few tokens (a decode step, a verify): ``[window | x]`` in registers.
- ``pairs``: one token per row on a 16-bit state contiguous along the window: whole 32-bit words per channel pair.
- ``chunked``: any strides, any number of tokens per row, in chunks.
- ``plan``: which of the three a call takes, the plan cache, and the public ``causal_conv1d_update``.
"""

from .plan import causal_conv1d_update

__all__ = ["causal_conv1d_update"]
