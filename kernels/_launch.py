"""Tile choices for the launchers.

The shapes are picked from the memory order of ``x``: the tile's long side runs along x's contiguous axis, so
each warp loads long runs of consecutive bytes. ``TUNING`` holds the numbers; the benchmark overrides them to
compare variants in one process.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
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


def _spec(a):
    """What Triton specializes a kernel on for one argument (dtype and 16-byte alignment of a tensor; an int's
    size class, divisibility by 16 and equality to 1)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int):
        return type(a), a == 1, a % 16 == 0, -2**31 <= a < 2**31
    return a


def _raw_stream(index):
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811  (same value, a fraction of the cost)


class FastLaunch:
    """A cached launch path for one ``@triton.jit`` kernel.

    ``kernel[grid](...)`` re-derives the specialization of every argument through Triton's generic binder on each
    call (17-32 us from Python on an H200). The first call of each specialization goes through it and keeps the
    compiled kernel; later calls compute the same key from the arguments here and call the compiled kernel's
    launcher directly. Under the interpreter, or for CPU tensors, it is plain ``kernel[grid](...)``.
    """

    def __init__(self, fn):
        self.fn = fn
        self._cache = {}
        self.direct = True  # False once the compiled launcher refused our arguments
        params = getattr(fn, "params", None)
        self._constexpr_names = [p.name for p in params if p.is_constexpr] if params is not None else None

    def __call__(self, grid, *args, num_warps: int, **constexprs):
        device = args[0].device
        if device.type != "cuda" or self._constexpr_names is None or not self.direct:
            self.fn[grid](*args, num_warps=num_warps, **constexprs)
            return
        key = (device.index, num_warps, tuple(constexprs.values()), tuple(map(_spec, args)))
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.fn[grid](*args, num_warps=num_warps, **constexprs)
            if hasattr(compiled, "result"):  # asynchronous compilation in some Triton versions
                compiled = compiled.result()
            self._cache[key] = compiled
            return
        consts = [constexprs[n] for n in self._constexpr_names]
        try:
            compiled.run(grid[0], grid[1], 1, _raw_stream(device.index), compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *consts)
        except (TypeError, SystemError, AttributeError) as exc:  # a Triton whose launcher takes other arguments
            warnings.warn(f"convserve: direct Triton launch unavailable ({exc!r}); using kernel[grid](...)")
            self.direct = False
            self.fn[grid](*args, num_warps=num_warps, **constexprs)
