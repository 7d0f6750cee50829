"""CUDA graphs of a plan's repeated launches (``LaunchPlan``'s replays).

A launch plan fixes everything about a launch but the tensors' addresses, so two launches of one plan with the
same addresses are the same kernel node. A caller that passes the same buffers again and again (a decode loop over
persistent x, out and index buffers: what serving stacks do) can then have the launch replayed as a one-node CUDA
graph, which costs the host a fraction of ``cuLaunchKernel`` through Triton's launcher. A replay reads and writes the
memory at those addresses when it runs, in stream order on the stream the plain launch would use; the contents may
change between calls, the addresses may not (they are the key).

The graphs are made with the CUDA driver API (``libcuda`` through ctypes, as Triton's own launcher calls it), not
``torch.cuda.CUDAGraph``: a torch capture also registers the device's random-number generator and the caching
allocator for the whole process, and takes a stream from torch's shared pool, so it would disturb other threads'
work while it lasts. Here a capture records one kernel launch on a private stream in thread-local mode; nothing
else in the process sees it.

Rules that keep it exactly equivalent and bounded:
- a graph is captured on the ``after``-th plain launch with one set of addresses (``TUNING["replay"]``; 2: never
  on the first), so one-off calls pay nothing but a dictionary update;
- nothing is replayed or captured while the launch's stream is capturing (the caller's own CUDA graph then
  records the plain launch);
- a plan keeps at most ``keep`` graphs (the oldest dropped first; CUDA frees a graph still in flight when it
  finishes) and captures at most ``4 * keep`` in its life, so a caller whose addresses never settle stops paying
  for captures;
- a capture or replay that fails turns replays off for the plan, with a warning; the call launches plainly.
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch

_LOCK = threading.Lock()  # captures (each device's private stream) and every change to a plan's graphs
_STREAMS = {}  # device index -> the private stream captures run on (the legacy default stream cannot capture)
_CAPTURE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_CAPTURE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


def _driver():
    """libcuda's functions used here, typed; None where the library or a symbol is missing (replays stay off)."""
    try:
        lib = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the calls are short and keep the GIL (no release per call)
        p, u, ull = ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong
        pp = ctypes.POINTER(ctypes.c_void_p)
        sigs = dict(cuStreamCreate=(pp, u), cuStreamBeginCapture_v2=(p, ctypes.c_int), cuStreamEndCapture=(p, pp),
                    cuGraphInstantiateWithFlags=(pp, p, ull), cuGraphLaunch=(p, p), cuGraphDestroy=(p,),
                    cuGraphExecDestroy=(p,), cuStreamIsCapturing=(p, ctypes.POINTER(ctypes.c_int)),
                    cuThreadExchangeStreamCaptureMode=(ctypes.POINTER(ctypes.c_int),))
        fns = {}
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(args), ctypes.c_int
            fns[name] = fn
        return fns
    except (OSError, AttributeError):
        return None


_CU = _driver() if torch.cuda.is_available() else None
AVAILABLE = _CU is not None


def _check(result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"{what} failed: CUDA driver error {result}")


def stream_capturing(stream: int) -> bool:
    """Whether ``stream`` (a raw handle) is capturing; the legacy default stream (0) never is."""
    if not stream:
        return False
    status = ctypes.c_int(0)
    _check(_CU["cuStreamIsCapturing"](stream, ctypes.byref(status)), "cuStreamIsCapturing")
    return status.value != 0


class GraphExec:
    """An instantiated CUDA graph (``handle``: its CUgraphExec), destroyed with this object."""

    def __init__(self, handle: int):
        self.handle = handle

    def __del__(self):
        if self.handle and _CU is not None:
            _CU["cuGraphExecDestroy"](self.handle)
            self.handle = None


def capture_graph(device_index: int, launch_on) -> GraphExec:
    """An instantiated graph of what ``launch_on(stream)`` enqueues on ``stream``, captured on the device's private
    stream (nothing runs). The calling thread's capture mode is relaxed meanwhile, so that another thread's
    global-mode capture (torch's default) neither refuses these calls nor is invalidated by them."""
    mode = ctypes.c_int(_CAPTURE_RELAXED)
    with _LOCK, torch.cuda.device(device_index):  # the device's primary context current for the driver calls
        _check(_CU["cuThreadExchangeStreamCaptureMode"](ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
        try:
            return GraphExec(_capture(device_index, launch_on))
        finally:
            _CU["cuThreadExchangeStreamCaptureMode"](ctypes.byref(mode))  # the thread's mode as it was


def _capture(device_index: int, launch_on) -> int:
    stream = _STREAMS.get(device_index)
    if stream is None:
        handle = ctypes.c_void_p()
        _check(_CU["cuStreamCreate"](ctypes.byref(handle), _STREAM_NON_BLOCKING), "cuStreamCreate")
        stream = _STREAMS[device_index] = handle.value
    _check(_CU["cuStreamBeginCapture_v2"](stream, _CAPTURE_THREAD_LOCAL), "cuStreamBeginCapture")
    graph = ctypes.c_void_p()
    try:
        launch_on(stream)
    finally:  # always end the capture, so the stream stays usable after a failed launch
        ended = _CU["cuStreamEndCapture"](stream, ctypes.byref(graph))
    try:
        _check(ended, "cuStreamEndCapture")
        exe = ctypes.c_void_p()
        _check(_CU["cuGraphInstantiateWithFlags"](ctypes.byref(exe), graph, 0), "cuGraphInstantiate")
    finally:
        if graph.value:
            _CU["cuGraphDestroy"](graph)
    return exe.value


def graph_launch(handle: int, stream: int) -> int:
    """Launch an instantiated graph on ``stream``; the driver's result (0: enqueued)."""
    return _CU["cuGraphLaunch"](handle, stream)


class Replays:
    """One plan's graphs, keyed on the launch's distinct addresses (a tuple of ints in a fixed order).

    The generated launcher (``LaunchPlan._make_fast``) looks a call's addresses up in ``graphs`` and launches the
    graph it finds on the plain launch's stream unless that stream is capturing (``capturing``); otherwise it
    launches plainly and calls ``note``. ``capture``, ``capturing`` and ``launch`` are the driver's by default
    (tests pass stand-ins).
    """

    def __init__(self, device_index: int, after: int, keep: int, capture=capture_graph, capturing=None,
                 launch=None):
        self.device_index, self.after, self.keep = device_index, max(1, int(after)), max(1, int(keep))
        self.graphs = {}  # addresses -> the captured graph of the launch with them
        self.counts = {}  # addresses -> plain launches with them since their graph (if any) was dropped
        self.captures_left = 4 * self.keep
        self.capture = capture
        self.capturing = stream_capturing if capturing is None else capturing
        self.launch = graph_launch if launch is None else launch
        self.launch_on = None  # set by the generated launcher: launch_on(addresses, stream) launches the plan

    def note(self, key, stream: int) -> None:
        """A plain launch with addresses ``key`` was just enqueued on ``stream``: count it, and on the ``after``-th
        capture the launch for the calls that follow (not while ``stream`` is capturing: the caller's graph)."""
        with _LOCK:
            n = self.counts.get(key, 0) + 1
            if n < self.after:
                if len(self.counts) >= 64 * self.keep:  # addresses that never repeat: forget them
                    self.counts.clear()
                self.counts[key] = n
                return
            self.counts.pop(key, None)
            if self.captures_left <= 0:  # spent: not even the capture check (a driver call)
                return
        try:
            if self.capturing(stream):
                return
            with _LOCK:  # the budget checked and spent in one step: two threads cannot both take the last one
                if self.captures_left <= 0:
                    return
                self.captures_left -= 1
            graph = self.capture(self.device_index, lambda stream: self.launch_on(key, stream))
        except Exception as exc:  # noqa: BLE001 - any failure: plain launches from now on
            self.failed(f"CUDA graph capture of a launch failed ({exc!r})")
            return
        with _LOCK:
            while len(self.graphs) >= self.keep:
                self.graphs.pop(next(iter(self.graphs)), None)
            self.graphs[key] = graph

    def failed(self, why: str) -> None:
        """Replays off for this plan (its graphs dropped), with a warning saying why."""
        warnings.warn(f"convserve: {why}; launching directly")
        with _LOCK:
            self.captures_left = 0
            self.graphs.clear()
