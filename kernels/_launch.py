"""Tile choices for the launchers.

The shapes are picked from the memory order of ``x``: the tile's long side runs along x's contiguous axis, so
each warp loads long runs of consecutive bytes. ``TUNING`` holds the numbers; the benchmark overrides them to
compare variants in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class Tile:
    block_t: int  # tokens per program
    block_d: int  # channels per program
    num_warps: int


TUNING = {
    # prefill, x contiguous along tokens (the benchmark card's (dim, T))
    "prefill_token_major": dict(block_t=256, elems=4096, num_warps=4),
    # prefill, x contiguous along channels (serving stacks: x.stride(0) == 1)
    "prefill_channel_major": dict(block_d=256, elems=8192, num_warps=4),
    # decode: channels per program
    "decode": dict(block_d=256, num_warps=4),
}


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def prefill_config(x, dim: int, total: int) -> Tile:
    token_major = total > 1 and abs(x.stride(1)) < abs(x.stride(0))
    if token_major:
        t = TUNING["prefill_token_major"]
        block_t = min(t["block_t"], max(16, _p2(total)))
        block_d = min(_p2(dim), max(1, t["elems"] // block_t))
        return Tile(block_t, block_d, t["num_warps"])
    t = TUNING["prefill_channel_major"]
    block_d = min(t["block_d"], max(16, _p2(dim)))
    block_t = min(_p2(total), max(1, t["elems"] // block_d))
    return Tile(block_t, block_d, t["num_warps"])


def decode_config(dim: int, seqlen: int, width: int) -> Tile:
    t = TUNING["decode"]
    block_l = min(_p2(seqlen), 16)
    block_d = min(t["block_d"], max(16, _p2(dim)))
    return Tile(block_l, block_d, t["num_warps"])
