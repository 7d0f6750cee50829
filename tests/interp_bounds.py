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
def bounds_checked():
    """Within the block, every kernel launch in the interpreter is checked (see the module); yields the list of
    violations found, ``(kernel, "load" | "store", lanes, first address)``, which the caller asserts empty."""
    try:
        from triton.runtime import interpreter as interp

        builder, executor = interp.InterpreterBuilder, interp.GridExecutor
        np_dtype = interp._get_np_dtype
        load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__
    except (ImportError, AttributeError) as e:
        pytest.skip(f"this Triton's interpreter has no hooks for the bounds check ({e})")
    spans: list = []
    found: list = []
    current = [None]

    def check(op, ptrs, mask, ptr_ty):
        p = np.asarray(ptrs.data).astype(np.uint64).ravel()
        m = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).ravel().astype(bool)
        p = p[m]
        if p.size == 0:
            return
        size = np.dtype(np_dtype(ptr_ty)).itemsize
        ok = np.zeros(p.size, dtype=bool)
        for lo, hi in spans:
            ok |= (p >= lo) & (p + size <= hi)
        if not ok.all():
            found.append((current[0], op, int((~ok).sum()), int(p[~ok][0])))

    def checked_load(self, ptrs, mask, other, *args):
        check("load", ptrs, mask, ptrs.get_element_ty())
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        check("store", ptrs, mask, ptrs.get_element_ty())
        return store(self, ptrs, value, mask, *args)

    def checked_call(self, *args, **kwargs):
        spans[:] = [_span(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.numel()]
        current[0] = getattr(self.fn, "__name__", "?")
        return call(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    executor.__call__ = checked_call
    try:
        yield found
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, call
