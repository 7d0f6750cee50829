"""Tile choices for the launchers.

The shapes are picked from the memory order of ``x``: the tile's long side runs along x's contiguous axis, so
each warp loads long runs of consecutive bytes. ``TUNING`` holds the numbers; the benchmark overrides them to
compare variants in one process.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tile:
    block_t: int  # tokens per program
    block_d: int  # channels per program
    num_warps: int


TUNING = {
    # prefill, x contiguous along tokens (the benchmark card's (dim, T))
    "prefill_token_major": dict(block_t=512, elems=2048, num_warps=4),
    # prefill, x a contiguous (dim, T) with T >= min_t and width <= 4: the flat path, up to `groups` aligned
    # groups of 8 elements per program: about T / (8 * tiles_per_row), but not below min_groups (nor above T / 8),
    # groups_per_thread per thread. H200 sweep (bench/NOTES.md): flat beats the piece kernel from T = 1024 on
    "prefill_flat": dict(groups=512, min_groups=128, groups_per_thread=4, num_warps=4, tiles_per_row=2, min_t=512),
    # prefill, x.stride(0) == 1, width <= 4, dim * T >= min_elems: the channel-last sliding window, 8 * 32 *
    # num_warps channels per program, rows_per_step rows per loop step, chunks of at most max_chunk tokens
    # (halved until there are min_programs programs)
    "prefill_channel_last": dict(num_warps=2, rows_per_step=4, max_chunk=128, min_programs=132 * 16,
                                 min_elems=1 << 24),
    # the heads-only pass after either fast path: channels per program, elements per zeroing step of a pad
    "prefill_heads": dict(block_d=256, elems=2048, num_warps=4),
    # prefill, x contiguous along channels (serving stacks: x.stride(0) == 1)
    "prefill_channel_major": dict(block_d=256, elems=4096, num_warps=4),
    # decode, one token per row: channels per program (2 per thread measured best on the H200)
    "decode": dict(block_d=512, num_warps=8),
    # several tokens per row with x dense per row (speculative verify): the register-window kernel while width
    # - 1 + tokens <= max_positions (0: never), one channel per thread (measured best)
    "decode_short": dict(max_positions=8, block_d=128, num_warps=4),
    # several tokens per row otherwise (strided x, long chunks): narrower tiles keep the token chunk and its
    # windows in registers
    "decode_multi": dict(block_d=128, num_warps=2),
}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1). triton.next_power_of_2 costs microseconds per call in new Tritons."""
    return 1 << max(0, int(n) - 1).bit_length()



def prefill_config(x, dim: int, total: int) -> Tile:
    token_major = total > 1 and abs(x.stride(1)) < abs(x.stride(0))
    if token_major:
        t = TUNING["prefill_token_major"]
        block_t = min(t["block_t"], max(16, next_pow2(total)))
        block_d = min(next_pow2(dim), max(1, t["elems"] // block_t))
        return Tile(block_t, block_d, t["num_warps"])
    t = TUNING["prefill_channel_major"]
    block_d = min(t["block_d"], max(16, next_pow2(dim)))
    block_t = min(next_pow2(total), max(1, t["elems"] // block_d))
    return Tile(block_t, block_d, t["num_warps"])


def decode_config(dim: int, seqlen: int, width: int) -> Tile:
    t = TUNING["decode" if seqlen == 1 else "decode_multi"]
    block_l = min(next_pow2(seqlen), 16)
    block_d = min(t["block_d"], max(16, next_pow2(dim)))
    return Tile(block_l, block_d, t["num_warps"])


def _raw_stream(index):
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811  (same value, a fraction of the cost)


class LaunchPlan:
    """One kernel launch with everything fixed except the tensors' addresses: grid, scalar arguments, constexprs.

    ``kernel[grid](...)`` re-derives the specialization of every argument through Triton's generic binder on each
    call (17-32 us from Python on an H200). A plan is built once per argument layout (the public functions key
    their plan cache on shapes, strides and dtypes); per call it only checks the one thing Triton still
    specializes on, each pointer's 16-byte alignment, and calls the compiled kernel's launcher directly. The
    first call of each alignment pattern goes through ``kernel[grid]`` (compiling if needed). Under the
    interpreter, or for CPU tensors, every call is plain ``kernel[grid](...)``.
    """

    def __init__(self, fn, grid, scalars, constexprs: dict, num_warps: int, device: torch.device):
        self.fn, self.grid, self.scalars = fn, grid, tuple(scalars)
        self.constexprs, self.num_warps = constexprs, num_warps
        params = getattr(fn, "params", None)
        self.direct = device.type == "cuda" and params is not None
        self.const_values = tuple(constexprs[p.name] for p in params if p.is_constexpr) if self.direct else ()
        self.device_index = device.index if device.index is not None else 0
        self._compiled = {}

    def _slow(self, tensors):
        return self.fn[self.grid](*tensors, *self.scalars, num_warps=self.num_warps, **self.constexprs)

    def __call__(self, *tensors):
        if not self.direct:
            self._slow(tensors)
            return
        sig = tuple([t.data_ptr() % 16 == 0 for t in tensors])
        compiled = self._compiled.get(sig)
        if compiled is None:
            compiled = self._slow(tensors)
            if hasattr(compiled, "result"):  # asynchronous compilation in some Triton versions
                compiled = compiled.result()
            self._compiled[sig] = compiled
            return
        try:
            compiled.run(self.grid[0], self.grid[1], 1, _raw_stream(self.device_index), compiled.function,
                         compiled.packed_metadata, None, None, None, *tensors, *self.scalars, *self.const_values)
        except (TypeError, SystemError, AttributeError) as exc:  # a Triton whose launcher takes other arguments
            warnings.warn(f"convserve: direct Triton launch unavailable ({exc!r}); using kernel[grid](...)")
            self.direct = False
            self._slow(tensors)


def tensor_key(t):
    """What a plan depends on for one tensor argument (None stays None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)
