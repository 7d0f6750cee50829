"""Copies between pinned host memory and the device made by the GPU's SMs (a kernel's loads and stores) instead
of a copy engine.

A copy engine reads pinned lines that the CPU has just written (still in the CPU's caches) at about half of PCIe's
speed, and writes into pinned lines the CPU has just read about as slowly; a kernel keeps enough requests in flight
to run at PCIe's speed either way, and at the copy engine's speed otherwise (bench/NOTES.md, "Copies by the SMs").
The engine moves each step's x in and y out through pinned buffers the CPU has just written or read, so it copies
this way (``TUNING["pinned_copy"]``).

The host memory must be page-locked and mapped. Under unified addressing (every 64-bit CUDA platform) a pinned
tensor's address is valid on the device as it is; a pageable one is not, and a kernel that reads it faults and
takes the CUDA context down. So the kernel runs on CUDA only through :class:`PinnedCopies`, which copies by the SMs
only from or into memory it was given as pinned (checked once, when it is given), and hands anything else to
``Tensor.copy_``.
"""

from __future__ import annotations

import bisect
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import TUNING, _entry, _raw_stream


@triton.jit(do_not_specialize=["n"])
def _copy_kernel(
    src_ptr,  # (n,) int64 words, contiguous
    dst_ptr,  # (n,) int64 words, contiguous
    n,  # words to copy (not specialized: one compiled kernel for every size)
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < n  # [BLOCK]
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_words(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The kernel through ``kernel[grid]``, for any two tensors Triton can address (contiguous, one dtype and
    size, a whole number of 8-byte words): the CPU under Triton's interpreter, and the reference path of the
    tests. The engine calls :meth:`PinnedCopies.copy`."""
    s, d = src.reshape(-1).view(torch.int64), dst.view(-1).view(torch.int64)
    if s.numel():
        cfg = TUNING["pinned_copy"]
        _copy_kernel[(triton.cdiv(s.numel(), cfg["block"]),)](s, d, s.numel(), BLOCK=cfg["block"],
                                                              num_warps=cfg["num_warps"])


class PinnedCopies:
    """``dst.copy_(src, non_blocking=True)`` by the SMs, on the current stream, between one CUDA device and the
    pinned host buffers given to :meth:`add` (the engine's own, alive as long as this object is used).

    A copy goes to the kernel when (:meth:`by_sms`): one side is a tensor on this device and the other lies inside a
    given buffer; both are contiguous, of one dtype and shape, a whole number of 8-byte words, at most ``max_bytes_in``
    into the device or ``max_bytes_out`` out of it,
    at 16-byte aligned addresses. Any other copy (a pageable or foreign host tensor, odd sizes, strided views,
    ``TUNING["pinned_copy"]["on"]`` off) is ``Tensor.copy_``, with the same result. Per copy: a few attribute reads
    and comparisons, then the compiled kernel's launcher called directly (no ``kernel[grid]`` binding); inside a
    CUDA-graph capture it is captured like any launch. Should that launcher refuse its arguments (a Triton whose
    launcher takes others), every copy from then on is ``Tensor.copy_``, with a warning.

    A buffer given to :meth:`add` must stay allocated and page-locked for as long as this object copies, and be
    memory whose host address is its device address (torch's pinned allocations, ``cudaHostAlloc``): never memory
    registered for a while (``cudaHostRegister``), such as a client's shared-memory block."""

    def __init__(self, device: torch.device, max_bytes_in: Optional[int] = None, max_bytes_out: Optional[int] = None):
        """``max_bytes_in`` / ``max_bytes_out``: the largest copy into / out of the device made by the SMs (defaults
        ``TUNING["pinned_copy"]``'s)."""
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        # the pinned buffers given, as disjoint [start, end) address ranges sorted by start (overlapping or
        # adjacent ones merged: every byte of a range is pinned): a copy's range is looked up by bisection
        self._starts: list = []
        self._ends: list = []
        self._launch = None                # the compiled kernel's entry (kernels._launch._entry), once compiled
        self._refused = False              # the launcher refused its arguments: Tensor.copy_ from then on
        cfg = TUNING["pinned_copy"]
        self._block, self._warps = cfg["block"], cfg["num_warps"]
        self._most_in = cfg["max_bytes_in"] if max_bytes_in is None else max_bytes_in
        self._most_out = cfg["max_bytes_out"] if max_bytes_out is None else max_bytes_out
        self.by_sm = 0                     # copies made by the kernel (for tests and stats)

    def add(self, *buffers: torch.Tensor) -> None:
        """Let copies read from or write into these pinned host tensors (their whole storage)."""
        for b in buffers:
            if b.device.type != "cpu" or not b.is_pinned():
                raise ValueError(f"PinnedCopies.add: expected pinned host memory, got a {b.device} tensor"
                                 f"{' (not pinned)' if b.device.type == 'cpu' else ''}")
            s = b.untyped_storage()
            lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
            if hi == lo:
                continue
            i = bisect.bisect_left(self._ends, lo)           # the first range ending at or past lo
            j = bisect.bisect_right(self._starts, hi)        # the ranges before j start at or before hi
            if i < j:                                        # ranges i..j-1 touch [lo, hi): one range now
                lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
            self._starts[i:j], self._ends[i:j] = [lo], [hi]

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Does every byte of the ``nbytes`` from address ``ptr`` lie in a buffer given to :meth:`add`?"""
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self._ends[i]

    def by_sms(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Would :meth:`copy` make this copy by the SMs (see the class docstring)?"""
        return self._words(dst, src) > 0

    def _words(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """The 8-byte words the SMs would copy for ``dst.copy_(src)``; 0 when the copy is not theirs."""
        nbytes = src.numel() * src.element_size()
        if dst.is_cuda == src.is_cuda or self._refused or not TUNING["pinned_copy"]["on"] or \
                dst.dtype != src.dtype or dst.shape != src.shape or nbytes & 7 or not nbytes or \
                nbytes > (self._most_in if dst.is_cuda else self._most_out):
            return 0
        host, dev = (src, dst) if dst.is_cuda else (dst, src)
        ok = not (src.data_ptr() | dst.data_ptr()) & 15 and dev.device.index == self.index and \
            src.is_contiguous() and dst.is_contiguous() and self.covers(host.data_ptr(), nbytes)
        return nbytes >> 3 if ok else 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` (see the class docstring for which copies the SMs make)."""
        words = self._words(dst, src)
        if not words:
            dst.copy_(src, non_blocking=True)
            return
        grid = -(-words // self._block)
        entry = self._launch
        if entry is None:                  # the first copy compiles the kernel (16-byte aligned pointers)
            with torch.cuda.device(self.index):
                compiled = _copy_kernel[(grid,)](src.view(-1).view(torch.int64), dst.view(-1).view(torch.int64),
                                                 words, BLOCK=self._block, num_warps=self._warps)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            self._launch = _entry(compiled)
            self.by_sm += 1
            return
        raw, run, function, meta, coop, pdl = entry
        stream = _raw_stream(self.index)
        sp, dp = src.data_ptr(), dst.data_ptr()
        try:
            if raw:
                run(grid, 1, 1, stream, function, coop, pdl, None, None, meta, None, None, None, sp, dp, words,
                    self._block)
            else:
                run(grid, 1, 1, stream, function, meta, None, None, None, sp, dp, words, self._block)
        except (TypeError, SystemError, AttributeError) as exc:  # a Triton whose launcher takes other arguments
            warnings.warn(f"convserve: the SMs' copy kernel cannot be launched directly ({exc!r}); copying with "
                          "Tensor.copy_")
            self._refused = True
            dst.copy_(src, non_blocking=True)
            return
        self.by_sm += 1
