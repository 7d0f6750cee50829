"""Page-locking the arenas in an engine process (:mod:`convserve.service.cluster.pinned`), with the CUDA runtime's
register and unregister replaced by recorders: which blocks go direct, when, and that every registered chunk is
unregistered once its arena's mapping is gone."""

import gc
import threading
import time

import numpy as np
import pytest

from convserve.service.cluster.pinned import HostPinning
from convserve.service.cluster.shm import ArenaMap, map_file

CHUNK = 1 << 16


class Runtime:
    def __init__(self, fail=()):
        self.fail = set(fail)            # chunk offsets (from the array's start) whose registration fails
        self.registered: dict = {}       # ptr -> bytes
        self.calls = 0
        self.base = 0
        self.gate = threading.Event()
        self.gate.set()

    def register(self, ptr, n):
        self.gate.wait(10)
        self.calls += 1
        if ptr - self.base in self.fail:
            return False
        self.registered[ptr] = n
        return True

    def unregister(self, ptr):
        assert ptr in self.registered, "unregistered twice, or never registered"
        del self.registered[ptr]
        return True


def _pinning(rt):
    return HostPinning(register=rt.register, unregister=rt.unregister, set_device=None, chunk=CHUNK)


def _settle(pin, n, timeout=5.0):
    end = time.monotonic() + timeout
    while pin.pinned + pin.failed < n and time.monotonic() < end:
        time.sleep(0.002)
    time.sleep(0.01)


@pytest.mark.parametrize("off,n,chunk", [(0, 100, 0), (CHUNK - 100, 100, 0), (CHUNK, CHUNK, 1),
                                         (3 * CHUNK + 7, 4096, 3), (2 * CHUNK - 1, 1, 1)])
def test_a_block_in_one_chunk_goes_direct_once_that_chunk_is_registered(off, n, chunk):
    rt, base = Runtime(), np.zeros(5 * CHUNK - 10, dtype=np.uint8)
    rt.base = base.ctypes.data
    pin = _pinning(rt)
    assert not pin.covers("a", base, off, n)          # first use: queued, this request copies
    _settle(pin, 1)
    assert pin.covers("a", base, off, n)
    assert list(rt.registered) == [rt.base + chunk * CHUNK]
    assert rt.registered[rt.base + chunk * CHUNK] == min(CHUNK, len(base) - chunk * CHUNK)
    assert rt.calls == 1


@pytest.mark.parametrize("off,n", [(CHUNK - 1, 2), (0, CHUNK + 1), (CHUNK // 2, 3 * CHUNK), (10, 0)])
def test_a_block_across_chunks_or_empty_always_copies_and_registers_nothing(off, n):
    rt, base = Runtime(), np.zeros(5 * CHUNK, dtype=np.uint8)
    pin = _pinning(rt)
    for _ in range(3):
        assert not pin.covers("a", base, off, n)
        time.sleep(0.01)
    assert rt.calls == 0 and pin._thread is None


def test_a_chunk_is_registered_once_and_a_failed_one_is_never_tried_again():
    rt, base = Runtime(fail={CHUNK}), np.zeros(4 * CHUNK, dtype=np.uint8)
    rt.base = base.ctypes.data
    rt.gate.clear()                                  # registration is slow: requests meanwhile copy
    pin = _pinning(rt)
    for _ in range(5):
        assert not pin.covers("a", base, 0, 64)
        assert not pin.covers("a", base, CHUNK + 8, 64)
    rt.gate.set()
    _settle(pin, 2)
    assert pin.covers("a", base, 100, 64)
    for _ in range(3):
        assert not pin.covers("a", base, CHUNK + 8, 64)
    time.sleep(0.02)
    assert rt.calls == 2 and (pin.pinned, pin.failed) == (1, 1)


def test_a_retired_arena_is_unregistered_only_when_its_last_view_is_gone(tmp_path):
    rt = Runtime()
    pin = _pinning(rt)
    arenas = ArenaMap(str(tmp_path), pinning=pin)
    for g in (1, 2):
        map_file(str(tmp_path / f"arena-w0-g{g}"), 3 * CHUNK, create=True)
    arenas.tensor("arena-w0-g1")
    assert not arenas.direct("arena-w0-g1", 0, 4096)
    assert not arenas.direct("arena-w0-g1", 2 * CHUNK, 4096)
    _settle(pin, 2)
    assert arenas.direct("arena-w0-g1", 0, 4096) and len(rt.registered) == 2
    view = arenas.tensor("arena-w0-g1")[16:32]       # a request still in flight on the old arena
    arenas.tensor("arena-w0-g2")                     # its worker was restarted
    gc.collect()
    assert len(rt.registered) == 2
    del view
    gc.collect()
    end = time.monotonic() + 5                       # (unregistered on the registration thread)
    while rt.registered and time.monotonic() < end:
        time.sleep(0.002)
    assert rt.registered == {} and pin.pinned == 0


def test_without_pinning_every_block_goes_direct(tmp_path):
    """An engine on the CPU: the step reads and writes the block as it would its own buffers."""
    arenas = ArenaMap(str(tmp_path))
    map_file(str(tmp_path / "arena-w0-g1"), 2 * CHUNK, create=True)
    arenas.tensor("arena-w0-g1")
    assert arenas.direct("arena-w0-g1", CHUNK - 1, 2)


def test_a_device_the_thread_cannot_set_turns_pinning_off_and_every_block_copies():
    rt, base = Runtime(), np.zeros(2 * CHUNK, dtype=np.uint8)

    def broken():
        raise RuntimeError("no such device")

    pin = HostPinning(register=rt.register, unregister=rt.unregister, set_device=broken, chunk=CHUNK)
    assert not pin.covers("a", base, 0, 64)
    end = time.monotonic() + 5
    while not pin.off and time.monotonic() < end:
        time.sleep(0.002)
    for off in (0, CHUNK):
        assert not pin.covers("a", base, off, 64)
    assert rt.calls == 0 and pin.pinned == 0


def test_a_failed_unregister_is_logged_and_not_counted_as_pinned(tmp_path, monkeypatch):
    from convserve.service.cluster import pinned

    errors = []
    monkeypatch.setattr(pinned.log, "error", lambda msg, *a, **k: errors.append(msg))
    rt = Runtime()
    rt.unregister = lambda ptr: False
    pin = _pinning(rt)
    arenas = ArenaMap(str(tmp_path), pinning=pin)
    for g in (1, 2):
        map_file(str(tmp_path / f"arena-w0-g{g}"), CHUNK, create=True)
    arenas.tensor("arena-w0-g1")
    arenas.direct("arena-w0-g1", 0, 64)
    _settle(pin, 1)
    arenas.tensor("arena-w0-g2")
    gc.collect()
    end = time.monotonic() + 5
    while pin.pinned and time.monotonic() < end:
        time.sleep(0.002)
    assert pin.pinned == 0 and errors == ["cannot unregister an arena chunk"]
