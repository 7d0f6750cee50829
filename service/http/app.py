"""The ASGI app: :class:`Service` (what the routes share, and the life cycle) and :func:`create_app`, which wires
the modules of this package together.

=================  ===========================================================================================
``asgi``           headers, content negotiation, encoding and sending bytes
``errors``         the one renderer of every error (responses and stream/WebSocket frames)
``parse``          reading and validating request bodies
``client_shm``     a conv's x and y in a client's shared memory instead of the body
``unary``          ``POST /v1/conv`` and ``POST /v1/conv/batch``
``pipeline``       frames to engine requests to results in per-session order
``stream``         ``POST /v1/conv/stream`` over the pipeline
``websocket``      ``GET /v1/conv/ws`` over the pipeline
``edge``           API key, metrics, access log, and the fast dispatch of the conv routes
``control``        health, readiness, metrics, model, sessions, state, accept
``backend``        the engine interface the routes use
=================  ===========================================================================================
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI
from starlette.routing import Route, WebSocketRoute

from convserve.clients.protocol.errors import NotReady
from convserve.service.gcfreeze import freeze_startup_objects
from convserve.service.http.backend import EngineAPI
from convserve.service.http.client_shm import SHM_ROOT, SWEEP_S, ClientSegments
from convserve.service.http.control import add_control_routes
from convserve.service.http.edge import ConvServeApp, Edge
from convserve.service.http.errors import install_handlers
from convserve.service.http.oip import add_oip_routes
from convserve.service.http.parse import Parser, shm_ref
from convserve.service.http.stream import StreamEndpoint
from convserve.service.http.unary import BatchEndpoint, ConvEndpoint
from convserve.service.http.websocket import WebSocketEndpoint
from convserve.service.metrics import Metrics

log = logging.getLogger("convserve.app")


class Service:
    """What the handlers share: settings, the engine, the body parser, metrics, and the life-cycle flags."""

    def __init__(self, settings, engine: EngineAPI, metrics: Metrics):
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        # a conv's x may lie in a client's shared memory (its y is written there too), when the host has /dev/shm
        self.client_shm = ClientSegments(settings.client_shm_segments) \
            if settings.client_shm and os.path.isdir(SHM_ROOT) else None
        self.parser = Parser(engine.model_info(), settings.max_tokens_per_request, settings.max_batch_tokens,
                             settings.max_batch_size, self.client_shm)
        #: the request limits a caller must fit (GET /v1/model's "limits"): a frontend budgets its steps by them
        self.limits = {k: getattr(settings, k, None) for k in ("max_batch_tokens", "max_batch_size",
                                                                "max_tokens_per_request", "max_spec_tokens",
                                                                "max_body_bytes", "max_body_objects")}
        self.limits["max_decode_rows"] = settings.max_decode_rows()
        self.max_body = settings.max_body_bytes
        self.max_objects = settings.max_body_objects
        self.max_json = settings.max_json_body_bytes
        self.body_timeout = settings.body_timeout_s
        self.offload_bytes = settings.parse_offload_bytes
        self._parse_pool: Optional[ThreadPoolExecutor] = None
        self.draining = False
        self.drain_deadline = None     # monotonic: the end of the one shutdown_timeout_s a stop has in all
        self.failed: Optional[BaseException] = None
        self.pipelines: set = set()
        self.snapshots = None            # the Snapshotter of an in-process engine with state_dir

    def reply_to(self, body):
        """Where a parsed conv or batch body's y goes when its x lay in a client's shared memory (a
        :class:`~.client_shm.ReplyTo`), else None."""
        ref = shm_ref(body)
        return None if ref is None else self.client_shm.reply_to(ref)

    async def decode(self, nbytes: int, fn, *args):
        """``fn(*args)``: on the event loop for a body under ``parse_offload_bytes``, else in a parser thread, so
        a large body's decoding and validation do not stall the loop (health probes, other requests). Two parser
        threads: a flood of large bodies queues here instead of taking every core."""
        if nbytes < self.offload_bytes:
            return fn(*args)
        if self._parse_pool is None:
            self._parse_pool = ThreadPoolExecutor(2, thread_name_prefix="convserve-parse")
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, fn, *args)

    @property
    def ready(self) -> bool:
        return not self.draining and self.failed is None and bool(self.engine.ready)

    def require_ready(self) -> None:
        if self.draining:
            raise NotReady("the server is shutting down; retry on another replica", retry_after=1)
        if self.failed is not None:
            raise NotReady(f"the engine failed to start ({self.failed}); see the server log", retry_after=5)
        if not self.engine.ready:
            why = getattr(self.engine, "not_ready_reason", lambda: None)()
            back = getattr(self.engine, "not_ready_retry_after", lambda: None)() if why else None
            raise NotReady(why or "the engine is starting (allocating the state pool, warming the kernels); retry "
                           "shortly", retry_after=back or 1)

    def start_draining(self) -> None:
        """Stop intake: /readyz turns 503, new requests and new stream frames get 503 not_ready."""
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.settings.shutdown_timeout_s
            log.info("draining", extra={"pipelines": len(self.pipelines)})
            for p in list(self.pipelines):
                p.wake()

    async def wait_pipelines(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the streams to end; then drop the connections of those that can be dropped
        (their unanswered frames are withdrawn where not started, as when a client leaves), so that a write
        blocked on a client that reads nothing ends here rather than in the server's cancellation of its task."""
        deadline = time.monotonic() + timeout
        while self.pipelines and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        cut = [p for p in self.pipelines if p.abort is not None]
        if cut:
            log.warning("streams cut off at the drain's deadline", extra={"streams": len(cut)})
        for p in cut:
            p.cancel_all()
            p.abort()
        if cut:
            await asyncio.sleep(0)              # (their writers see the connection gone and return)


def create_app(settings, engine: EngineAPI, *, start_engine: bool = True, snapshots=None) -> ConvServeApp:
    """The ASGI app serving ``engine`` with ``settings``.

    With ``start_engine`` the lifespan starts the engine in a thread after the server is up (``/readyz`` is
    503 until it is warm) and stops it, draining, at shutdown. With ``snapshots`` (a
    :class:`~convserve.service.snapshots.Snapshotter` of ``engine``) the start restores the newest good snapshot
    and the stop writes one.
    """
    metrics = Metrics(stats=lambda: engine.stats())
    svc = Service(settings, engine, metrics)
    svc.snapshots = snapshots
    start = snapshots.start_engine if snapshots is not None else engine.start
    stop = snapshots.stop_engine if snapshots is not None else engine.stop

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starter = None
        bind = getattr(engine, "bind_loop", None)     # an engine in other processes connects from this loop
        if bind is not None:
            await bind()
        if start_engine:
            async def _start():
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(start)
                except BaseException as e:  # noqa: BLE001
                    svc.failed = e
                    log.error("engine failed to start", exc_info=e)
                    if app.state.on_fatal is not None:
                        app.state.on_fatal(e)
                    return
                if app.state.freeze_gc:    # a process of `convserve serve`: see service/gcfreeze.py
                    frozen = freeze_startup_objects()
                    log.info("start-up objects frozen out of the cyclic GC", extra={"objects": frozen})
                log.info("ready", extra={"seconds": round(time.perf_counter() - t0, 3), **_info_fields(engine)})

            starter = asyncio.ensure_future(_start())
        sweeper = None
        if svc.client_shm is not None:
            async def _sweep():
                while True:
                    await asyncio.sleep(SWEEP_S)
                    await asyncio.to_thread(svc.client_shm.sweep)

            sweeper = asyncio.ensure_future(_sweep())
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            svc.start_draining()
            if starter is not None and not starter.done():
                await starter
            if start_engine and svc.failed is None:
                # what is left of the stop's one budget (the streams and requests used the rest): a worker that
                # took it twice over would outlive the supervisor's grace
                left = max(0.1, svc.drain_deadline - time.monotonic())
                await asyncio.to_thread(stop, True, left)
                # (engine processes say "engine stopped" themselves: a worker only closed its links to them)
                log.info("engine links closed" if bind is not None else "engine stopped")

    # redirect_slashes off: a path with a trailing slash is a 404 with an error map, not a 307 that a client
    # following redirects would replay (a DELETE included)
    app = ConvServeApp(title="convserve", version=_version(), lifespan=lifespan, redirect_slashes=False,
                       description="Causal depthwise conv1d of Mamba/hybrid LLMs over HTTP/msgpack. "
                                   "See docs/api.md (API reference).")
    app.state.svc = svc
    app.state.metrics = metrics
    app.state.on_fatal = None
    app.state.freeze_gc = False        # set by cli.run_app: freeze the start-up objects once the engine is up

    install_handlers(app)
    add_control_routes(app, svc)
    add_oip_routes(app, svc)

    # The conv routes are plain ASGI endpoints, dispatched by ConvServeApp.__call__ ahead of the stack; they are
    # also routed in it, for what does not take that path (405 for other methods, a root_path).
    conv, batch = ConvEndpoint(svc), BatchEndpoint(svc)
    stream, ws = StreamEndpoint(svc), WebSocketEndpoint(svc)
    app.router.routes.append(Route("/v1/conv", conv, methods=["POST"]))
    app.router.routes.append(Route("/v1/conv/batch", batch, methods=["POST"]))
    app.router.routes.append(Route("/v1/conv/stream", stream, methods=["POST"]))
    app.router.routes.append(WebSocketRoute("/v1/conv/ws", ws))

    edge_args = dict(metrics=metrics, api_key=settings.api_key_value(), access=settings.access_log)
    app.add_middleware(Edge, **edge_args)
    app.set_hot_routes(Edge(None, **edge_args),
                       {"/v1/conv": conv, "/v1/conv/batch": batch, "/v1/conv/stream": stream},
                       {"/v1/conv/ws": ws})
    name = getattr(settings, "replica_name", None)
    if name:
        app.set_replica_name(name)     # X-Convserve-Replica on every answer (replica.with_replica_header)
    return app


def _info_fields(engine) -> dict:
    try:
        info = engine.model_info()
    except Exception:  # noqa: BLE001
        return {}
    return {k: info.get(k) for k in ("layers", "dim", "width", "dtype", "state_dtype", "slots")}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("convserve")
    except Exception:  # noqa: BLE001
        return "0.0.0"
