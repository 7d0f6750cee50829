"""Out-of-bounds checks for kernels run in Triton's interpreter (CPU, no CUDA).

:func:`bounds_checked` patches the interpreter so that every load and store a launch makes, on the lanes its
mask lets through, must fall inside the elements of one of the tensors passed to that launch (the view's own
span, not its whole storage). On a GPU such an access reads another allocation's memory or faults; in the
interpreter it silently reads whatever is there, and masked stores hide it from output checks. The patch uses
the interpreter's internals (``InterpreterBuilder.create_masked_load`` / ``create_masked_store``,
``GridExecutor.__call__``): where a Triton version lacks them, the test skips, saying so.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch


def _span(t: torch.Tensor):
    """``(first byte, past the last byte)`` of the elements of view ``t``."""
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    es = t.element_size()
    return t.data_ptr() + lo * es, t.data_ptr() + (hi + 1) * es


@contextlib.contextmanager
def _interpreter_hooks(what: str, on_access, on_call=None):
    """Within the block, the interpreter calls ``on_access(op, program, ptrs, mask)`` (op "load" or "store";
    program: the interpreter's builder, whose ``grid_idx`` is the program) before every masked load and store,
    and ``on_call(args, kwargs)`` before every launch; yields ``current``, a one-item list holding the name of
    the kernel being run. Skips the test where this Triton's interpreter lacks the hooks (``what`` says which
    check)."""
    try:
        from triton.runtime import interpreter as interp

        builder, executor = interp.InterpreterBuilder, interp.GridExecutor
        load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__
    except (ImportError, AttributeError) as e:
        pytest.skip(f"this Triton's interpreter has no hooks for {what} ({e})")
    current = [None]

    def hooked_load(self, ptrs, mask, other, *args):
        on_access("load", self, ptrs, mask)
        return load(self, ptrs, mask, other, *args)

    def hooked_store(self, ptrs, value, mask, *args):
        on_access("store", self, ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    def hooked_call(self, *args, **kwargs):
        if on_call is not None:
            on_call(args, kwargs)
        current[0] = getattr(self.fn, "__name__", "?")
        return call(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = hooked_load, hooked_store
    executor.__call__ = hooked_call
    try:
        yield current
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, call


@contextlib.contextmanager
def bounds_checked():
    """Within the block, every kernel launch in the interpreter is checked (see the module); yields the list of
    violations found, ``(kernel, "load" | "store", lanes, first address)``, which the caller asserts empty."""
    try:
        from triton.runtime.interpreter import _get_np_dtype as np_dtype
    except ImportError as e:
        pytest.skip(f"this Triton's interpreter has no hooks for the bounds check ({e})")
    spans: list = []
    found: list = []

    def check(op, _program, ptrs, mask):
        p = np.asarray(ptrs.data).astype(np.uint64).ravel()
        m = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).ravel().astype(bool)
        p = p[m]
        if p.size == 0:
            return
        size = np.dtype(np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(p.size, dtype=bool)
        for lo, hi in spans:
            ok |= (p >= lo) & (p + size <= hi)
        if not ok.all():
            found.append((current[0], op, int((~ok).sum()), int(p[~ok][0])))

    def spans_of(args, kwargs):
        spans[:] = [_span(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.numel()]

    with _interpreter_hooks("the bounds check", check, spans_of) as current:
        yield found


@contextlib.contextmanager
def program_accesses():
    """Within the block, every load and store lane a kernel launch in the interpreter makes (on the lanes its mask
    lets through) is logged with the program that made it: yields the log, a list of ``(kernel, "load" |
    "store", program (x, y, z), element addresses)`` for :func:`cross_program_conflicts`."""
    log: list = []

    def record(op, program, ptrs, mask):
        p = np.asarray(ptrs.data).astype(np.uint64)
        m = np.broadcast_to(np.asarray(mask.data), p.shape).astype(bool)
        if m.any():
            log.append((current[0], op, tuple(program.grid_idx), np.unique(p[m])))

    with _interpreter_hooks("the access log", record) as current:
        yield log


def cross_program_conflicts(log, kernel: str, t: torch.Tensor) -> list:
    """Within launches of ``kernel``, over the elements of view ``t``: addresses stored by two programs, and
    addresses one program loads that another stores (each as ``(op, address, programs)``; empty: race-free)."""
    lo, hi = _span(t)
    writers: dict = {}
    readers: dict = {}
    for k, op, prog, addrs in log:
        if k != kernel:
            continue
        for a in addrs[(addrs >= lo) & (addrs < hi)].tolist():
            (writers if op == "store" else readers).setdefault(a, set()).add(prog)
    found = [("store", a, progs) for a, progs in writers.items() if len(progs) > 1]
    found += [("load", a, progs | writers[a]) for a, progs in readers.items() if a in writers
              and progs - writers[a]]
    return found
