"""What an HTTP worker tells ``/readyz``, ``/healthz`` and ``/metrics`` about the engine processes: each engine's
row of the status table, whether it answers, and why the server should be restarted; whether every HTTP worker has
started serving; and the engines' counters, summed for a scrape. A part of
:class:`~convserve.service.cluster.remote.RemoteEngine`, which keeps the state read here (``status``, ``down``,
``links``, ``devices``, ``down_unhealthy_s``, ``loop``, ``run_dir``, ``worker``, ``n_workers``, ``series``,
``stats_timeout``) and asks the engines (``_call``)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Optional

from convserve.clients.protocol.errors import ServiceError

from . import messages as m
from ..metrics import numbers_of, sum_stats
from .status import UP


def _serving_mark(run_dir: str, worker: int) -> str:
    return os.path.join(run_dir, f"serving-w{worker}")


class EngineHealth:
    """The health side of :class:`~convserve.service.cluster.remote.RemoteEngine` (see the module docstring)."""

    def serving(self, connections) -> None:
        """This worker's HTTP server accepts connections now: its mark for the other workers' ``/readyz`` (a file
        in the run directory), and ``connections() -> open connections`` published on ``/metrics``."""
        if self.series is not None:
            self.series.watch_connections(connections)
        open(_serving_mark(self.run_dir, self.worker), "ab").close()

    def workers_starting(self) -> int:
        """How many HTTP workers have not served yet since the server started: ``/readyz`` waits for all, since a
        client that opens its connections at the first ready could leave the late workers none of them for as long
        as it keeps them. 0 from the first time every worker has served (a worker restarted later does not make the
        server unready)."""
        if self._workers_up:
            return 0
        n = sum(not os.path.exists(_serving_mark(self.run_dir, w)) for w in range(self.n_workers))
        self._workers_up = n == 0
        return n

    def not_ready_reason(self) -> Optional[str]:
        """Why no engine is up when one of them died (it is being restarted without its sessions); None when they
        are starting for the first time."""
        self.down.poll(time.monotonic())
        return self.down.dead_reason()

    def not_ready_retry_after(self) -> Optional[int]:
        """The Retry-After of :meth:`not_ready_reason`'s 503: the soonest an engine that died is expected back
        (:meth:`StatusTable.back_in`); None when none died."""
        dead = self.down.dead()
        return min(map(self.status.back_in, dead)) if dead else None

    def unhealthy_reason(self) -> Optional[str]:
        """Why this server should be restarted (``/healthz`` fails): an engine down for more than
        ``down_unhealthy_s`` since its process died (it keeps failing to start: a wedged GPU), or alive but
        answering nothing for that long since a request to it went past its deadline (stopped, wedged); else
        None."""
        if not self.down_unhealthy_s:
            return None
        e, s = self.down.longest(time.monotonic())
        if e is not None and s > self.down_unhealthy_s:
            return f"engine {e} ({self.devices[e]}) has been down for {s:.0f} s since its process died"
        for e, r in enumerate(self.engines()):
            if (r["unanswered_s"] or 0) > self.down_unhealthy_s:
                return (f"engine {e} ({r['device']}) has answered nothing for {r['unanswered_s']:.0f} s since a "
                        "request to it went unanswered past its deadline")
        return None

    def engines(self) -> list:
        """Each engine's row of the status table, for ``/readyz`` and the metrics, with ``unanswered_s``: seconds
        since a request to it went unanswered past its deadline with no answer since (None: it answers)."""
        now = time.monotonic() if self.loop is None else self.loop.time()
        silent = [lk.silent_since for lk in self.links] or [None] * self.n
        return [{"device": d, **self.status.row(e).as_dict(),
                 "unanswered_s": None if silent[e] is None or now < silent[e] else round(now - silent[e], 1)}
                for e, d in enumerate(self.devices)]

    def stats(self) -> dict:
        """Every up engine's ``stats()``, summed (blocking, off the loop; all asked at once: one stats_timeout)."""
        parts, per_engine = [], {}
        live = [e for e in range(self.n) if self.status.state(e)[0] == UP]
        if live and self.loop is not None:
            async def ask():
                return await asyncio.gather(*(self._call(e, {"k": m.STATS}, timeout=self.stats_timeout)
                                              for e in live), return_exceptions=True)
            for e, got in zip(live, asyncio.run_coroutine_threadsafe(ask(), self.loop).result()):
                if isinstance(got, ServiceError):    # not up by now, or no answer in time: left out
                    continue
                if isinstance(got, BaseException):
                    raise got
                parts.append(got[0]["ok"])
                per_engine[e] = numbers_of(got[0]["ok"])
        for e in range(self.n):                       # (an engine that is down has only this one)
            per_engine.setdefault(e, {})["engine_restarts"] = self.status.row(e).restarts
        total = sum_stats(parts)
        total["engine_restarts"] = sum(p["engine_restarts"] for p in per_engine.values())
        total["per_engine"] = per_engine     # the numbers of each engine (see metrics.EngineCollector)
        dec, pad = total.get("decode_rows", 0), total.get("decode_padded_rows", 0)
        total["pad_ratio"] = pad / max(1, pad + dec)
        total["engines_up"] = len(parts)
        if self.series is not None:     # this worker's arena: its own series (worker_series), fresh for the scrape
            self.series.publish()
        return total
