"""Prometheus metrics of the service (``GET /metrics``): of its one process, or summed over its worker processes.

HTTP-side series are updated by the request path; engine-side series (queue depth, batch sizes, pad ratio,
slots, kernel time) are read from ``engine.stats()`` when Prometheus scrapes, so the hot path pays nothing
for them. Each app has its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: the lowest bucket lies below a single decode, the highest is the default request timeout.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                   30.0)

log = logging.getLogger("convserve.metrics")


class Metrics:
    """The series of one app. ``observe_request`` is called once per HTTP request, ``observe_frames`` per flush
    of a stream or WebSocket."""

    def __init__(self, stats: Optional[Callable[[], dict]] = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("convserve_http_requests", "HTTP requests by route and status code",
                                ["route", "method", "status"], registry=r)
        self.errors = Counter("convserve_errors", "Errors by route (or transport) and error code",
                              ["route", "code"], registry=r)
        self.latency = Histogram("convserve_http_request_duration_seconds",
                                 "HTTP request latency by route, from the first byte read to the last byte "
                                 "written", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.frames = Counter("convserve_stream_frames", "Conv frames answered on /v1/conv/stream and "
                              "/v1/conv/ws, by transport and outcome (ok or error code)",
                              ["transport", "code"], registry=r)
        self.frame_latency = Histogram("convserve_stream_frame_duration_seconds",
                                       "Latency of one streamed conv frame, from parsed to its result queued "
                                       "for sending", ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.connections_closed = Counter("convserve_http_connections_closed", "Connections the server closed "
                                          "itself, by reason: over_capacity, replaced (an idle or header-sending "
                                          "connection gave its place to a new one above max_connections), "
                                          "header_timeout, header_too_large", ["reason"], registry=r)
        self._children: dict = {}
        if stats is not None:
            r.register(EngineCollector(stats))
        # Several worker processes: each writes its series to files in PROMETHEUS_MULTIPROC_DIR (prometheus-client
        # does that for every metric created in such a process), and a scrape of any worker sums all of them; the
        # engine series come from the engines themselves, through ``stats``.
        self._multiprocess: Optional[CollectorRegistry] = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            self._multiprocess = CollectorRegistry(auto_describe=True)
            if stats is not None:    # collected first: its stats() publishes this worker's own series (see
                self._multiprocess.register(EngineCollector(stats))     # worker_series) before the files are read
            multiprocess.MultiProcessCollector(self._multiprocess)

    # Labelled children are cached: ``labels()`` costs a lock and a dict lookup per call otherwise.

    def observe_request(self, route: str, method: str, status: int, seconds: float,
                        error_code: Optional[str]) -> None:
        key = (route, method, status)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = (self.requests.labels(route, method, str(status)),
                                       self.latency.labels(route))
        c[0].inc()
        c[1].observe(seconds)
        if error_code is not None:
            self.error(route, error_code)

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def error(self, route: str, code: str, n: int = 1) -> None:
        key = ("e", route, code)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self.errors.labels(route, code)
        c.inc(n)

    def observe_frames(self, transport: str, outcomes: dict, latencies: Iterable[float]) -> None:
        route = "/v1/conv/stream" if transport == "stream" else "/v1/conv/ws"
        for code, n in outcomes.items():
            key = ("f", transport, code)
            c = self._children.get(key)
            if c is None:
                c = self._children[key] = self.frames.labels(transport, code)
            c.inc(n)
            if code != "ok":
                self.error(route, code, n)
        key = ("fl", transport)
        h = self._children.get(key)
        if h is None:
            h = self._children[key] = self.frame_latency.labels(transport)
        for s in latencies:
            h.observe(s)

    def render(self) -> bytes:
        if self._multiprocess:
            return generate_latest(self._multiprocess)
        return generate_latest(self.registry)


def _num(v) -> Optional[float]:
    if isinstance(v, (int, float)):   # bool included
        return float(v)
    return None


class EngineCollector(Collector):
    """Reads ``engine.stats()`` at scrape time and exposes it as ``convserve_engine_*`` series.

    Well-known keys get stable names and help texts; every other numeric value (nested dicts flattened with
    ``_``) is exported as a gauge, so nothing the engine reports is hidden.
    """

    #: engine.stats() key -> (metric name, kind, help)
    KNOWN = {
        "engine_restarts": ("convserve_engine_restarts", "counter", "Engine processes started again after their "
                            "process died (per engine: label engine)"),
        "engines_up": ("convserve_engines_up", "gauge", "Engine processes answering the HTTP worker that "
                       "answered this scrape"),
        "queue_depth": ("convserve_queue_depth", "gauge", "Requests queued in the engine, not yet in a step"),
        "slots_total": ("convserve_slots_total", "gauge", "Allocatable session slots (without the null slot)"),
        "slots_in_use": ("convserve_slots_in_use", "gauge", "Session slots holding a session"),
        "slots_free": ("convserve_slots_free", "gauge", "Session slots free"),
        "sessions": ("convserve_sessions", "gauge", "Live sessions"),
        "steps": ("convserve_engine_steps", "counter", "Engine steps run"),
        "requests": ("convserve_engine_requests", "counter", "Requests completed by the engine"),
        "tokens": ("convserve_engine_tokens", "counter", "Tokens of the requests completed by the engine"),
        "pad_ratio": ("convserve_decode_pad_ratio", "gauge", "Padded decode rows over all decode rows "
                                                             "(cumulative)"),
        "kernel_time_s": ("convserve_kernel_seconds", "counter", "Time spent in conv kernels (CUDA: estimated "
                                                                 "from every gpu_timing_interval-th step)"),
        "step_time_s": ("convserve_engine_step_seconds", "counter", "Time spent in engine steps (host + device)"),
        "host_time_s": ("convserve_engine_host_seconds", "counter", "Host time of engine steps (packing, launch)"),
        "requests_failed": ("convserve_engine_requests_failed", "counter", "Requests failed while running"),
        "sessions_dropped": ("convserve_engine_sessions_dropped", "counter",
                             "Sessions dropped because a failed step may have written their state"),
        "requests_cancelled": ("convserve_engine_requests_cancelled", "counter",
                               "Requests withdrawn before they started (client gone, cancel)"),
        "requests_expired": ("convserve_engine_requests_expired", "counter",
                             "Requests that timed out before they started"),
        "sessions_evicted": ("convserve_engine_sessions_evicted", "counter", "Sessions evicted by the idle TTL"),
        "decode_rows": ("convserve_engine_decode_rows", "counter", "Decode rows computed"),
        "decode_padded_rows": ("convserve_engine_decode_padded_rows", "counter", "Pad rows added to decode buckets"),
        "batch_requests": ("convserve_engine_batch_requests", "counter",
                           "Batch requests run (one decode token for each of several sessions)"),
        "snapshot_writes": ("convserve_snapshot_writes", "counter", "Session snapshots written"),
        "snapshot_skips": ("convserve_snapshot_skips", "counter",
                           "Periodic session snapshots not written: nothing changed since the last one written"),
        "snapshot_failures": ("convserve_snapshot_failures", "counter",
                              "Session snapshots that could not be taken or written"),
        "snapshot_bytes": ("convserve_snapshot_bytes", "counter", "Bytes of session snapshots written"),
        "snapshot_seconds": ("convserve_snapshot_seconds", "counter",
                             "Time taking and writing session snapshots (the engine's pause is only the gather)"),
        "snapshot_restored_sessions": ("convserve_snapshot_restored_sessions", "gauge",
                                       "Sessions restored from a snapshot at start"),
        "caller_steps": ("convserve_engine_caller_steps", "counter",
                         "Engine steps run by the thread that submitted their request (no hand-off to the engine "
                         "thread)"),
        "batch_requests_in_slots": ("convserve_engine_batch_requests_in_slots", "counter",
                                    "Batch requests launched from a batch slot (one CUDA graph replay)"),
        "batch_requests_direct": ("convserve_engine_batch_requests_direct", "counter",
                                  "Decode batch requests computed straight from a worker's shared-memory block, y "
                                  "written back over it (no host copy in the engine; on a GPU the block is "
                                  "page-locked)"),
        "client_block_requests": ("convserve_engine_client_block_requests", "counter",
                                  "Decode batches an engine process took with x in a client's sealed "
                                  "shared-memory segment, to read x and write y there (no copy in the HTTP "
                                  "worker)"),
        "arena_chunks_pinned": ("convserve_engine_arena_chunks_pinned", "gauge",
                                "Chunks of the workers' shared-memory arenas page-locked for the GPU's copies"),
        "arena_chunks_pin_failed": ("convserve_engine_arena_chunks_pin_failed", "counter",
                                    "Chunks of the workers' arenas that could not be page-locked (their blocks are "
                                    "copied on the host)"),
        "multi_layer_launches": ("convserve_engine_multi_layer_launches", "counter",
                                 "Decode launches that ran several layers' decode batches at once"),
        "outputs_fresh": ("convserve_engine_outputs_fresh", "counter",
                          "Steps whose result buffer was still held by readers, so a fresh (pageable) one was "
                          "allocated"),
        "batch_requests_in_verify_slots": ("convserve_engine_batch_requests_in_verify_slots", "counter",
                                           "Verify-only batch requests launched from a verify slot (one CUDA "
                                           "graph replay)"),
        "batch_requests_in_prefill_slots": ("convserve_engine_batch_requests_in_prefill_slots", "counter",
                                            "Batch requests without verify rows launched from a prefill slot (one "
                                            "CUDA graph replay)"),
    }

    #: help texts of the engine.stats() keys exported under their own name (``convserve_engine_<key>``)
    HELP = {
        "batch_size": "Rows per engine step",
        "queued_tokens": "Tokens of the requests queued in the engine, not yet in a step",
        "prefill_budget_tokens": "Prefill tokens one step takes at most (max_prefill_tokens_per_step, resolved)",
        "ops_queued": "Session operations (create, fork, export, import, accept, delete) waiting for the engine",
        "slots_peak": "Most session slots in use at once since the engine started",
        "answers_kept": "Answers kept for a request with a position that may be sent again (a retry is answered "
                        "from them, not applied twice)",
        "last_step_rows": "Rows of the engine's last step",
        "last_step_tokens": "Tokens of the engine's last step",
        "last_step_host_s": "Host time of the engine's last step (scheduling, packing and launches, delivery), "
                            "seconds",
        "last_step_kernel_s": "Kernel time of the engine's last step, when it was timed (CUDA: every "
                              "gpu_timing_interval-th step), seconds",
        "last_step_wall_s": "Wall time of the engine's last step, from its scheduling to its delivery (the device's "
                            "time included), seconds",
        "last_step_sched_s": "Scheduling time of the engine's last step, seconds",
        "last_step_launch_s": "Packing and launch time of the engine's last step (before it waits for the device), "
                              "seconds",
        "last_step_deliver_s": "Time the engine's last step took to hand its results to their requests, seconds",
        "bytes_pool": "Bytes of the conv-state pool (every slot, the null slot included)",
        "bytes_weights": "Bytes of the model's conv weights and biases",
        "bytes_buffers": "Bytes of the engine's staging, launch and output buffers",
        "bytes_graphs": "Device memory reserved by the engine's CUDA graph captures, bytes",
        "bytes_answers": "Bytes of the answers kept for requests that may be sent again (answers_kept)",
        "cuda_graphs": "CUDA graphs captured by the engine (decode buckets, batch, verify and prefill slots)",
    }

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def _help(self, key: str) -> str:
        return self.HELP.get(key, f"engine.stats()['{key}']")

    def describe(self):
        return []

    def collect(self):
        try:
            stats = self._stats() or {}
        except Exception:  # a scrape must not fail because the engine is starting or stopping
            log.debug("engine.stats() failed during a scrape", exc_info=True)
            return
        # several engine processes: their numbers come one series per engine (label ``engine``), so that an
        # engine that restarts (its counters back at 0) is one series' reset, which rate() handles, and not a
        # drop of a sum, which rate() would read as a reset of everything; and a gauge of each (its slots, its
        # last step, its prefill budget) is its own, since a sum of values like these means nothing. What only
        # the worker reports (its shm arena, pad_ratio, engines_up) stays one series.
        per_engine = stats.pop("per_engine", None) or {}
        flat: dict = {}
        hists = []
        _flatten("", stats, flat, hists)
        for key, (buckets, total, count) in hists:
            name, help_ = _engine_series(key), self._help(key)
            parts = {e: part[HIST + key] for e, part in per_engine.items() if HIST + key in part}
            if parts:                    # one series per engine, as its counters: a restart is its own reset
                h = HistogramMetricFamily(name, help_, labels=["engine"])
                for e, (b, t, _n) in sorted(parts.items()):
                    h.add_metric([str(e)], buckets=b, sum_value=t)
            else:
                h = HistogramMetricFamily(name, help_)
                h.add_metric([], buckets=buckets, sum_value=total)
            yield h
        for key, value in flat.items():
            if key in self.KNOWN:
                name, kind, help_ = self.KNOWN[key]
            else:
                name, kind, help_ = _engine_series(key), "gauge", self._help(key)
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            if any(key in part for part in per_engine.values()):
                m = family(name, help_, labels=["engine"])
                for e, part in sorted(per_engine.items()):
                    if key in part:
                        m.add_metric([str(e)], float(part[key]))
            else:
                m = family(name, help_)
                m.add_metric([], value)
            yield m


def _flatten(prefix: str, d: dict, out: dict, hists: list) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            h = _as_histogram(v)
            if h is not None:
                hists.append((key, h))
            else:
                _flatten(key + "_", v, out, hists)
            continue
        n = _num(v)
        if n is not None:
            out[_sanitize(key)] = n


def _as_histogram(v: dict):
    """``{"buckets": {le: cumulative count}, "sum": s, "count": n}`` -> Prometheus histogram parts."""
    if not ({"buckets", "sum", "count"} <= set(v)) or not isinstance(v["buckets"], dict):
        return None
    items = sorted((float(le), int(c)) for le, c in v["buckets"].items())
    buckets = [(_le(le), c) for le, c in items if le != float("inf")]
    buckets.append(("+Inf", int(v["count"])))
    return buckets, float(v["sum"]), int(v["count"])


def _le(x: float) -> str:
    return repr(float(x))


def _engine_series(key: str) -> str:
    """The series of an ``engine.stats()`` key: ``convserve_engine_<key>`` with its unit spelled out last, as
    Prometheus names go (``last_step_host_s`` -> ``..._last_step_host_seconds``, ``bytes_pool`` ->
    ``..._pool_bytes``)."""
    if key.endswith("_s"):
        key = key[:-2] + "_seconds"
    elif key.startswith("bytes_"):
        key = key[6:] + "_bytes"
    return "convserve_engine_" + key


def _sanitize(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)


#: ``numbers_of``'s key prefix for a histogram's parts ``(buckets, sum, count)``
HIST = "histogram:"


def numbers_of(stats: dict) -> dict:
    """The numbers of one engine's ``stats()``, flattened as the collector names them (``snapshot.writes`` is
    ``snapshot_writes``), each histogram's parts under ``HIST + its name``: what ``per_engine`` holds for each
    engine process."""
    flat: dict = {}
    hists: list = []
    _flatten("", stats, flat, hists)
    flat.update((HIST + key, h) for key, h in hists)
    return flat


def sum_stats(parts: list) -> dict:
    """Numbers summed key by key (nested maps too); other values from the first part."""
    if not parts:
        return {}
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, dict):
                out[k] = sum_stats([out[k], v]) if isinstance(out.get(k), dict) else dict(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out
