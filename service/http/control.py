"""The control routes: health and readiness, metrics, the model and its weights file, sessions (create, list,
info, delete, fork), state export and import, and accepting speculative verifies (one session, or several as one
request).

These are ordinary FastAPI routes; their errors reach the handlers of :func:`.errors.install_handlers`. Session
operations block on the engine, so they run in a thread. ``/healthz``, ``/readyz`` and ``/metrics`` need no
API key (the :class:`.edge.Edge` guards only ``/v1``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import NotReady, RequestTimeout
from convserve.clients.protocol.ids import check_session_id
from convserve.service.http.asgi import render, wants_json, wants_msgpack
from convserve.service.http.errors import error_response
from convserve.service.http.parse import parse_body, read_body, refuse_body
from convserve.service.http.replica import check_batch_sessions, merge_session
from convserve.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

if TYPE_CHECKING:
    from convserve.service.http.app import Service


def add_control_routes(app: FastAPI, svc: Service) -> None:
    engine, parser = svc.engine, svc.parser

    def reply(request: Request, obj: Any, status: int = 200) -> Response:
        body, ct = render(obj, wants_json(request.scope))
        return Response(body, status_code=status, media_type=ct.decode())

    async def read(request: Request) -> Any:
        body = await read_body(request.scope, request.receive, svc.max_body, svc.body_timeout)
        if not body:
            return {}
        return await svc.decode(len(body), parse_body, request.scope, body, svc.max_body, svc.max_objects,
                                svc.max_json)

    async def no_body(request: Request) -> None:
        """A GET or DELETE route takes no body: one is a 400 (before anything runs), as an unknown field is."""
        await refuse_body(request.scope, request.receive, svc.body_timeout)

    def path_session(session: str) -> str:
        """The ``{id}`` of a ``/v1/sessions/{id}[/...]`` path, by the rule a create applies to the id it is given:
        an id no create could have made is a 400 naming the rule, not a 404."""
        return check_session_id(session, "the session id in the path")

    # --- health and metrics (no API key)

    def probe(request: Request, obj: dict, status: int = 200) -> Response:
        """A probe's answer: JSON (what probes and people read) unless the request asks for msgpack, as the
        errors of these routes are."""
        body, ctype = render(obj, not wants_msgpack(request.scope))
        return Response(body, status_code=status, media_type=ctype.decode())

    @app.api_route("/healthz", methods=["GET", "HEAD"])     # HEAD: probes that send curl -I
    async def healthz(request: Request):
        await no_body(request)
        why = getattr(engine, "unhealthy_reason", lambda: None)()
        if why is not None:          # an engine keeps failing to start: a liveness probe restarts the server
            return probe(request, {"status": "unhealthy", "reason": why}, 503)
        return probe(request, {"status": "ok"})

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz(request: Request):
        await no_body(request)
        engines = getattr(engine, "engines", None)
        silent = None
        starting = engine.workers_starting() if svc.ready and engines is not None else 0   # >0: 503 below
        if svc.ready and engines is not None and not starting:  # engine processes: which serve (degraded: not all)
            rows = engines()
            serving = [r for r in rows if r["state"] == "up" and r["unanswered_s"] is None]
            if serving:
                status = "degraded" if len(serving) < len(rows) else "ready"
                return probe(request, {"status": status, "engines": rows})
            # none serves (a death this worker's ready flag has not seen yet, or none answers): 503 below
            silent = [i for i, r in enumerate(rows) if r["state"] == "up" and r["unanswered_s"] is not None]
        elif svc.ready and engines is None and svc.snapshots is not None:  # in-process, state_dir: last snapshot
            return probe(request, {"status": "ready", "snapshot": svc.snapshots.last()})
        elif svc.ready and engines is None:
            return probe(request, {"status": "ready"})
        try:
            svc.require_ready()
            if starting:
                raise NotReady(f"{starting} of {engine.n_workers} HTTP worker processes have not started serving yet; "
                               "retry", retry_after=1)
            if silent:
                raise NotReady(f"no engine is answering: engine(s) {', '.join(map(str, silent))} have answered "
                               "nothing since a request to them went unanswered past its deadline", retry_after=5)
            raise NotReady("no engine process is up; retry", retry_after=1)
        except NotReady as e:
            return error_response(request.scope, e, as_json=not wants_msgpack(request.scope))   # as probe()

    @app.get("/metrics")
    async def metrics_route(request: Request):
        await no_body(request)
        # in a thread: an engine in other processes is asked for its counters, over this loop
        return Response(await asyncio.to_thread(svc.metrics.render), media_type=METRICS_CONTENT_TYPE)

    # --- /v1 control routes

    @app.get("/v1/model")
    async def model(request: Request):
        await no_body(request)
        svc.require_ready()
        return reply(request, {**engine.model_info(), "limits": svc.limits, "client_shm": svc.client_shm is not None})

    @app.get("/v1/model/weights")
    async def model_weights(request: Request):
        # the canonical safetensors file whose sha256 /v1/model reports (also the ETag, so a download can be
        # checked on its own); built by the engine on first use, so off the event loop
        await no_body(request)
        svc.require_ready()
        body = await asyncio.to_thread(engine.model_weights)
        sha = engine.model_info()["weights_sha256"]
        return Response(body, media_type="application/octet-stream",
                        headers={"etag": f'"{sha}"',
                                 "content-disposition": 'attachment; filename="conv-weights.safetensors"'})

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request):
        svc.require_ready()
        body = await read(request)
        sid = merge_session(request.scope, parser.new_session_id(body))  # X-Session-Id
        rid = parser.op_request_id(body)
        return reply(request, {"session": await asyncio.to_thread(engine.create_session, sid, rid)}, 201)

    @app.get("/v1/sessions")
    async def list_sessions(request: Request):
        await no_body(request)
        svc.require_ready()
        cursor, limit = parser.list_query(request.query_params, svc.settings.sessions_page_max)
        return reply(request, await asyncio.to_thread(engine.list_sessions, cursor, limit))

    @app.get("/v1/sessions/{session}")
    async def session_info(session: str, request: Request):
        path_session(session)
        await no_body(request)
        svc.require_ready()
        return reply(request, await asyncio.to_thread(engine.session_info, session))

    @app.delete("/v1/sessions/{session}", status_code=204)
    async def delete_session(session: str, request: Request):
        path_session(session)
        await no_body(request)
        rid = parser.delete_query(request.query_params)
        svc.require_ready()
        await asyncio.to_thread(engine.delete_session, session, rid)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session}/fork", status_code=201)
    async def fork_session(session: str, request: Request):
        path_session(session)
        svc.require_ready()
        body = await read(request)
        new_id, rid = parser.new_session_id(body), parser.op_request_id(body)
        return reply(request, {"session": await asyncio.to_thread(engine.fork_session, session, new_id, rid)}, 201)

    @app.get("/v1/sessions/{session}/state")
    async def export_state(session: str, request: Request):
        path_session(session)
        await no_body(request)
        svc.require_ready()
        state = await asyncio.to_thread(engine.export_state, session)
        as_json = wants_json(request.scope)
        enc = wire.encode_tensor_json(state) if as_json else wire.encode_tensor(state)
        body, ct = render({"layers": parser.layers, "state": enc}, as_json)
        return Response(body, media_type=ct.decode())

    @app.put("/v1/sessions/{session}/state", status_code=204)
    async def import_state(session: str, request: Request):
        path_session(session)
        svc.require_ready()
        body = await read(request)
        state, rid = parser.state(body), parser.op_request_id(body)
        await asyncio.to_thread(engine.import_state, session, state, rid)  # NaN/Inf -> non_finite (engine)
        return Response(status_code=204)

    @app.post("/v1/accept", status_code=204)
    async def accept_batch(request: Request):
        svc.require_ready()
        body = await read(request)
        sessions, tokens = parser.accept_batch(body)
        check_batch_sessions(request.scope, sessions)
        await answered(engine.submit_accept_batch(sessions, tokens, parser.op_request_id(body)),
                       svc.settings.request_timeout_s)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session}/accept", status_code=204)
    async def accept(session: str, request: Request):
        path_session(session)
        svc.require_ready()
        body = await read(request)
        n = parser.accept_tokens(body)
        await answered(engine.submit_accept(session, n, parser.op_request_id(body)), svc.settings.request_timeout_s)
        return Response(status_code=204)


async def answered(fut, timeout: float):
    """An accept queued from the loop (no thread hop: a verify round's accept is on the frontend's critical path):
    its answer, from the worker's future (engine processes: the engine's own deadlines apply) or an in-process
    engine's. One of those not started within ``timeout`` (``request_timeout_s``) is withdrawn and answered 504: it
    never runs (the worker would withdraw it too, but only between steps); once started it is waited for."""
    if isinstance(fut, asyncio.Future):
        return await fut
    waiting = asyncio.wrap_future(fut)
    try:
        return await asyncio.wait_for(asyncio.shield(waiting), timeout)
    except asyncio.TimeoutError:
        if fut.cancel():
            raise RequestTimeout(f"the accept did not start within request_timeout_s={timeout} s and will not run; "
                                 "retry") from None
        return await waiting
