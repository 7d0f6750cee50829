"""CUDA graphs of a plan's repeated launches (``LaunchPlan``'s replays).

A launch plan fixes everything about a launch but the tensors' addresses, so two launches of one plan with the
same addresses are the same kernel node. A caller that passes the same buffers again and again (a decode loop over
persistent x, out and index buffers: what serving stacks do) can then have the launch replayed as a one-node CUDA
graph, which costs the host a fraction of ``cuLaunchKernel`` through Triton's launcher. A replay reads and writes the
memory at those addresses when it runs, in stream order on the current stream, exactly as the launch would; the
contents may change between calls, the addresses may not (they are the key).

Rules that keep it exactly equivalent and bounded:
- a graph is captured on the ``after``-th launch with one set of addresses (``TUNING["replay"]``; 2: never on
  the first), so one-off calls pay nothing but a dictionary update;
- nothing is replayed or captured while the calling thread's current stream is capturing (the caller's own CUDA
  graph then records the plain launch);
- a plan keeps at most ``keep`` graphs (the oldest dropped first; CUDA frees a graph still in flight when it
  finishes) and captures at most ``4 * keep`` in its life, so a caller whose addresses never settle stops paying
  for captures;
- a capture that fails turns replays off for the plan, with a warning.
"""

from __future__ import annotations

import threading
import warnings

import torch

_LOCK = threading.Lock()  # one capture at a time: they share each device's capture stream
_STREAMS = {}  # device index -> the side stream captures run on (the default stream cannot capture)


def _is_capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


if hasattr(torch._C, "_cuda_isCurrentStreamCapturing"):
    _is_capturing = torch._C._cuda_isCurrentStreamCapturing  # noqa: F811  (same answer, a fraction of the cost)


def capture_graph(device_index: int, launch):
    """A CUDA graph of what ``launch()`` enqueues on the current stream, captured on a side stream of the device
    (nothing runs); thread-local capture mode, so other threads' CUDA calls are not refused meanwhile."""
    with _LOCK:
        stream = _STREAMS.get(device_index)
        if stream is None:
            stream = _STREAMS[device_index] = torch.cuda.Stream(device_index)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):  # also makes the device current
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    return graph


class Replays:
    """One plan's graphs, keyed on the launch's distinct addresses (a tuple of ints in a fixed order).

    The generated launcher (``LaunchPlan._make_fast``) looks a call's addresses up in ``graphs`` and replays the
    graph it finds unless the stream is capturing (``capturing``); otherwise it launches and calls ``note``.
    """

    def __init__(self, device_index: int, after: int, keep: int, capture=capture_graph, capturing=None):
        self.device_index, self.after, self.keep = device_index, max(1, int(after)), max(1, int(keep))
        self.graphs = {}  # addresses -> the captured graph of the launch with them
        self.counts = {}  # addresses -> launches with them since their graph (if any) was dropped
        self.captures_left = 4 * self.keep
        self.capture = capture
        self.capturing = _is_capturing if capturing is None else capturing
        self.launch_with = None  # set by the generated launcher: launch_with(addresses) launches the plan

    def note(self, key) -> None:
        """A plain launch with addresses ``key`` was just enqueued: count it, and on the ``after``-th capture the
        launch for the calls that follow."""
        n = self.counts.get(key, 0) + 1
        if n < self.after:
            if len(self.counts) >= 64 * self.keep:  # addresses that never repeat: forget them
                self.counts.clear()
            self.counts[key] = n
            return
        self.counts.pop(key, None)
        if self.captures_left <= 0 or self.capturing():
            return
        self.captures_left -= 1
        try:
            graph = self.capture(self.device_index, lambda: self.launch_with(key))
        except Exception as exc:  # noqa: BLE001 - any failure: plain launches from now on
            warnings.warn(f"convserve: CUDA graph capture of a launch failed ({exc!r}); launching directly")
            self.captures_left = 0
            return
        if len(self.graphs) >= self.keep:
            del self.graphs[next(iter(self.graphs))]
        self.graphs[key] = graph
