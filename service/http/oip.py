"""The Open Inference Protocol v2 routes (KServe / Triton HTTP), so that ``tritonclient.http`` and KServe's
``InferenceRESTClient`` drive the conv stage unchanged. The wire format is :mod:`.oip_wire`.

The model is ``conv`` (version ``1``). A request is one conv of one session, mapped as Triton's sequence batcher
maps requests onto sequences:

* parameter ``sequence_id`` (uint64 or string) is the session; ``42`` is the session ``"42"`` of the /v1 routes,
  which see the same state (export it, accept a verify, delete it);
* ``sequence_start: true`` runs the request from a zero state: the session is created, or, when it exists,
  reset (its state imported as zeros, which also discards a pending verify: one session operation, ordered
  after the session's earlier requests, keeping its slot);
* ``sequence_end: true`` deletes the session after the request;
* parameter ``layer`` is the conv layer, ``speculative`` is /v1's (accept through ``/v1/sessions/{id}/accept``);
* input ``x`` (BF16, FP16 or FP32, ``[T, dim]``) gives output ``y`` of the same datatype and shape.

A rejected request changes nothing: the body is validated whole before any session operation, a start's x is
checked by the engine's own rules (NaN/Inf, a verify's length) before the start, a session the start created is
deleted again when the engine refuses the conv, and the end deletes only after a conv that ran. (A start that
reset an existing session and then met a full queue or a timeout leaves it reset: sending it again is the
retry.)

Session operations block on the engine, so they run in a thread; the HTTP layer reaches the engine only through
:class:`.backend.EngineAPI`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Optional

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.routing import Match, Route

from convserve import __version__
from convserve.clients.protocol.errors import (MethodNotAllowed, NonFinite, SessionExists, ShapeMismatch, StateLost,
                                               UnknownSession)
from convserve.service.http.asgi import ERROR_SCOPE_KEY, ROUTE_SCOPE_KEY, ClientGone, client_gone
from convserve.service.http.errors import allowed_methods, as_service_error
from convserve.service.http.oip_wire import (INPUT, MODEL_NAME, MODEL_VERSION, OIP_DATATYPE, OUTPUT,
                                             InferParser, InferRequest, NotFound, dumps, infer_answer,
                                             oip_error_body, send_chunks, send_oip_error)
from convserve.service.http.parse import read_body
from convserve.service.http.replica import merge_session
from convserve.service.http.unary import wait_result

if TYPE_CHECKING:
    from convserve.service.http.app import Service

log = logging.getLogger("convserve.oip")

#: the protocol extensions served (Triton's names)
EXTENSIONS = ["binary_tensor_data", "parameters", "sequence"]
#: every /v2 route, for the message of a 404
ROUTES = ("GET /v2", "GET /v2/health/live", "GET /v2/health/ready", f"GET /v2/models/{MODEL_NAME}",
          f"GET /v2/models/{MODEL_NAME}/ready", f"POST /v2/models/{MODEL_NAME}/infer")


def check_model(model: str, version: Optional[str] = None) -> None:
    if model != MODEL_NAME:
        raise NotFound(f"no model {model!r:.60}; this server serves one model, {MODEL_NAME!r}")
    if version is not None and version != MODEL_VERSION:
        raise NotFound(f"model {MODEL_NAME!r} has no version {version!r:.20}; its one version is "
                       f"{MODEL_VERSION!r}")


def _json(obj, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def _error(request: Request, exc) -> Response:
    request.scope[ERROR_SCOPE_KEY] = exc.code
    body, headers = oip_error_body(exc)
    return Response(body, status_code=exc.status, headers={k.decode(): v.decode() for k, v in headers})


def add_oip_routes(app: FastAPI, svc: Service) -> None:
    """Serve ``/v2`` on ``app``: health, server and model metadata, model readiness and ``infer``."""
    info = svc.engine.model_info()
    dim = int(info["dim"])
    datatype = OIP_DATATYPE[info["dtype"]]
    tensor_meta = {"datatype": datatype, "shape": [-1, dim]}
    model_meta = {"name": MODEL_NAME, "versions": [MODEL_VERSION], "platform": "convserve",
                  "inputs": [{"name": INPUT, **tensor_meta}], "outputs": [{"name": OUTPUT, **tensor_meta}]}

    @app.get("/v2")
    async def server_metadata():
        return _json({"name": "convserve", "version": __version__, "extensions": EXTENSIONS})

    @app.get("/v2/health/live")
    async def live():
        return _json({"live": True})

    async def ready_answer(request, extra: dict):
        try:
            svc.require_ready()
        except Exception as e:  # noqa: BLE001 - NotReady, rendered as the protocol's error
            return _error(request, as_service_error(e))
        return _json({**extra, "ready": True})

    @app.get("/v2/health/ready")
    async def ready(request: Request):
        return await ready_answer(request, {})

    async def model_ready(request: Request, model: str, version: Optional[str] = None):
        try:
            check_model(model, version)
        except NotFound as e:
            return _error(request, e)
        return await ready_answer(request, {"name": MODEL_NAME})

    async def model_metadata(request: Request, model: str, version: Optional[str] = None):
        try:
            check_model(model, version)
        except NotFound as e:
            return _error(request, e)
        return _json(model_meta)

    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.add_api_route(prefix, model_metadata, methods=["GET"])
        app.add_api_route(prefix + "/ready", model_ready, methods=["GET"])
        app.router.routes.append(Route(prefix + "/infer", InferEndpoint(svc, prefix + "/infer"), methods=["POST"]))
    # last: any other /v2 path answers the protocol's 404 (the framework's would be /v1's error map)
    unknown = UnknownRoute(app)
    app.router.routes.append(Route("/v2", unknown))          # (another method on /v2 itself)
    app.router.routes.append(Route("/v2/{path:path}", unknown))


class UnknownRoute:
    """Any other ``/v2`` path or method: the protocol's 404, or 405 ``method_not_allowed`` (with ``Allow``) for a
    route taken with another method, as on ``/v1`` (an ASGI object, so Starlette passes it the raw request)."""

    def __init__(self, app: FastAPI):
        self.app = app

    def _route(self, scope) -> str:
        """The metrics' label: the template of the route the path has (a 405), else ``unmatched``, as on /v1."""
        for r in self.app.router.routes:
            if getattr(r, "endpoint", None) is not self and hasattr(r, "path") and \
                    r.matches({**scope, "type": "http"})[0] is not Match.NONE:
                return r.path
        return "unmatched"

    async def __call__(self, scope, receive, send):
        scope[ROUTE_SCOPE_KEY] = self._route(scope)
        allowed = allowed_methods(self.app, scope)
        if allowed:
            await send_oip_error(scope, send, MethodNotAllowed(
                f"{scope['method']} is not allowed on {scope['path']}; its methods are {', '.join(allowed)}"),
                [(b"allow", ", ".join(allowed).encode())])
            return
        await send_oip_error(scope, send, NotFound(f"no route {scope['method']} {scope['path']}; the /v2 routes "
                                                   f"are {', '.join(ROUTES)}"))


class InferEndpoint:
    """``POST /v2/models/conv/infer``: one conv of one session, as the request's sequence parameters say."""

    def __init__(self, svc: Service, route: str):
        self.svc = svc
        self.route = route
        self.engine = svc.engine
        info = svc.engine.model_info()
        self.parser = InferParser(info, svc.settings.max_tokens_per_request, svc.max_objects, svc.max_json)
        self.model_dtype_name = info["dtype"]
        self.model_dtype = getattr(torch, info["dtype"])
        self.check_finite = bool(getattr(svc.settings, "check_finite", True))
        self.max_spec_tokens = getattr(svc.settings, "max_spec_tokens", None)
        # the state a start imports into an existing session; import_state copies it, so one tensor serves all
        self.zero_state = torch.zeros(len(info["layers"]), int(info["dim"]), int(info["width"]) - 1,
                                      dtype=getattr(torch, info["state_dtype"]))

    async def __call__(self, scope, receive, send):
        svc = self.svc
        # the metrics' route label: FastAPI's router sets scope["route"] for its own routes only
        scope[ROUTE_SCOPE_KEY] = self.route
        try:
            params = scope.get("path_params", {})
            check_model(params.get("model", MODEL_NAME), params.get("version"))
            svc.require_ready()
            body = await read_body(scope, receive, svc.max_body, svc.body_timeout)
            req = await svc.decode(len(body), self.parser.parse, scope, body)
            merge_session(scope, req.session, "sequence_id")     # X-Session-Id, when sent, names this sequence
            y = await self.run(req, receive)
            chunks, headers = infer_answer(req, y)
        except ClientGone:
            client_gone(scope)
            return
        except Exception as e:  # noqa: BLE001 - every failure becomes the protocol's error answer
            await send_oip_error(scope, send, as_service_error(e))
            return
        await send_chunks(send, 200, chunks, headers)

    async def run(self, req: InferRequest, receive) -> torch.Tensor:
        engine = self.engine
        created = False
        if req.start:
            self._precheck(req)
            created = await asyncio.to_thread(self._start, req.session)
        try:
            fut = engine.submit_async(req.session, req.layer, req.x, speculative=req.speculative)
            y = await wait_result(engine, fut, receive)
        except UnknownSession as e:
            raise UnknownSession(f"{e.message}; over /v2, start a sequence with sequence_start true") from None
        except ClientGone:
            raise                                            # the conv may still run: the session stays
        except Exception:
            if created:                                      # undo the start: a refused request changes nothing
                await asyncio.to_thread(self._delete_quietly, req.session)
            raise
        if req.end:
            await asyncio.to_thread(self._delete_quietly, req.session)
        return y

    def _precheck(self, req: InferRequest) -> None:
        """What the engine would refuse the conv for, checked before a start creates or resets the session: the
        engine's own rules (the settings' check_finite and max_spec_tokens), so a refused start changes
        nothing."""
        if self.check_finite and not bool(torch.isfinite(req.x.to(self.model_dtype)).all()):
            raise NonFinite(f"x: contains NaN or Inf as {self.model_dtype_name} (the model dtype it is computed "
                            "in); it would poison the session's state: send finite values within that dtype's range")
        if req.speculative and self.max_spec_tokens is not None and req.x.shape[0] > self.max_spec_tokens:
            raise ShapeMismatch(f"x: a speculative verify takes at most max_spec_tokens={self.max_spec_tokens} "
                                f"tokens, got T={req.x.shape[0]}")

    def _start(self, session: str) -> bool:
        """Create the session with a zero state, or reset the one that exists; True when it was created."""
        try:
            self.engine.create_session(session)
            return True
        except SessionExists:
            self.engine.import_state(session, self.zero_state)
            return False

    def _delete_quietly(self, session: str) -> None:
        try:
            self.engine.delete_session(session)
        except (UnknownSession, StateLost):
            pass                                             # gone already: what the end asked for
        except Exception as e:  # noqa: BLE001 - the conv's answer stands; the idle TTL frees the slot
            log.warning("could not delete the session of a finished sequence",
                        extra={"session": session, "error": str(e)})
