"""An HTTP worker's own numbers on ``/metrics``: its shared-memory arena, its restarts and its connections.

A scrape reaches one worker, so what a worker holds in its own memory (its arena's counts) would show only that
worker's, changing with whichever answered. Instead each worker writes its numbers as prometheus-client
multiprocess series (files in ``PROMETHEUS_MULTIPROC_DIR``, which every worker's scrape reads), labelled with the
worker's index:

* ``convserve_worker_shm_leases_total``, ``_reused_total``, ``_inline_total`` (counters): summed over the
  worker's processes, dead ones included, so a restarted worker's series keeps counting up (``rate()`` works);
* ``convserve_worker_shm_in_use`` (gauge): blocks leased now, the live process's;
* ``convserve_worker_restarts_total`` (counter): how many times the supervisor started this worker again after
  its process died (each restarted process counts itself once; the dead ones' counts stay in their files);
* ``convserve_worker_connections`` (gauge): the client connections the worker holds open now (how evenly the
  workers share the clients: each accepts from the one listening socket).

The arena counts plain ints on the request path (no file write per request); :meth:`WorkerSeries.publish` copies
them out, from the worker's watch loop about once a second and at each scrape the worker answers (before the files
are read: ``metrics.Metrics`` collects the engine series first), so a scrape sees the other workers' numbers up to
about a second old.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

#: arena counter -> help text
_COUNTS = {
    "leases": "Blocks of this worker's shared-memory arena handed out (one per tensor sent to an engine)",
    "reused": "Of those, blocks taken from a free list (no new carving of the arena)",
    "inline": "Tensors that found no free arena block and travelled inline in the message (one copy more)",
}


class WorkerSeries:
    """Worker ``worker``'s series (see the module). Only with ``PROMETHEUS_MULTIPROC_DIR`` set, as it is in
    every worker the supervisor starts: :func:`create` returns None otherwise."""

    def __init__(self, worker: int, restarts: int, arena):
        from prometheus_client import Counter, Gauge

        w = str(worker)
        self.arena = arena
        # registry=None: the values go to this process's multiprocess files, read by every scrape
        self._counts = {k: Counter(f"convserve_worker_shm_{k}", help_, ["worker"], registry=None).labels(w)
                        for k, help_ in _COUNTS.items()}
        self._in_use = Gauge("convserve_worker_shm_in_use", "Blocks of this worker's shared-memory arena leased now",
                             ["worker"], registry=None, multiprocess_mode="livesum").labels(w)
        # summed over the worker's processes, dead ones included: each restarted one adds itself
        restarted = Counter("convserve_worker_restarts", "Times the supervisor started this worker again after its "
                            "process died", ["worker"], registry=None).labels(w)
        if restarts:
            restarted.inc()
        self._open = Gauge("convserve_worker_connections", "Client connections this worker holds open now",
                           ["worker"], registry=None, multiprocess_mode="livesum").labels(w)
        #: ``() -> connections open``, set by the HTTP server once it serves (:meth:`watch_connections`)
        self._connections = None
        self._seen = dict.fromkeys(self._counts, 0)
        self._lock = threading.Lock()          # the watch loop and a scrape's thread may publish at once

    def publish(self) -> None:
        """Add what the arena counted since the last call; set the blocks in use and the connections open."""
        a = self.arena
        with self._lock:
            for k, c in self._counts.items():
                v = getattr(a, k)
                if v != self._seen[k]:
                    c.inc(v - self._seen[k])
                    self._seen[k] = v
            self._in_use.set(a.in_use)
            if self._connections is not None:
                self._open.set(self._connections())

    def watch_connections(self, count) -> None:
        """Publish ``count() -> connections open`` from now on."""
        self._connections = count


def create(worker: int, restarts: int, arena) -> Optional[WorkerSeries]:
    """:class:`WorkerSeries` for this worker process, or None outside a multi-process server."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return WorkerSeries(worker, restarts, arena)
