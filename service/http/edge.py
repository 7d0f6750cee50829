"""The edge of the app: API key, request metrics, access log, and the fast dispatch of the conv routes.

:class:`Edge` wraps every request, whichever way it arrives. :class:`ConvServeApp` sends the conv routes from the
server straight to the Edge and their plain ASGI endpoint, past Starlette's middleware stack and router; all other
requests take the FastAPI app, whose stack holds the same Edge.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Optional

from fastapi import FastAPI
from starlette.routing import Match, get_route_path

from convserve.clients.protocol.errors import NotReady, ServiceError
from convserve.service.http.asgi import CLIENT_CLOSED, CLIENT_CLOSED_STATUS, ERROR_SCOPE_KEY, ROUTE_SCOPE_KEY, header
from convserve.service.http.errors import HTTP_CODES, as_service_error, bearer_key, send_error, unauthorized
from convserve.service.http.oip_wire import send_oip_error
from convserve.service.http.parse import check_query
from convserve.service.http.replica import check_path_session, replica_header, with_replica_header
from convserve.service.http.websocket import WS_ROUTE, NoWebSocketRoute, WebSocketOverHTTP, refuse_handshake
from convserve.service.metrics import Metrics

access_log = logging.getLogger("convserve.access")


#: what the API key guards: the APIs, and the API's description (it names every route and field)
_GUARDED = ("/v1", "/v2", "/docs", "/redoc", "/openapi.json")
#: open like /healthz and /readyz: probes of an orchestrator or a load balancer carry no key
_OPEN = ("/v2/health/",)
#: a WebSocket handshake to no WebSocket route (404), and a plain HTTP request to one (426 or 405)
_NO_WS_ROUTE, _WS_OVER_HTTP = NoWebSocketRoute(), WebSocketOverHTTP()


class Edge:
    """Pure-ASGI outer layer: API-key check on ``/v1``, ``/v2`` (but its health) and the API docs, request metrics,
    optional access log."""

    def __init__(self, app, metrics: Metrics, api_key: Optional[str], access: bool):
        self.app = app
        self.metrics = metrics
        self.key = api_key.encode() if api_key else None
        self.access = access

    def _authorized(self, scope) -> bool:
        path = scope["path"]
        if self.key is None or not path.startswith(_GUARDED) or path.startswith(_OPEN):
            return True
        got = bearer_key(header(scope, b"authorization"))
        return got is not None and hmac.compare_digest(got, self.key)     # in constant time

    async def __call__(self, scope, receive, send):
        await self.serve(scope, receive, send, self.app)

    async def serve(self, scope, receive, send, app) -> None:
        """Run ``app`` (the rest of the stack, or a hot endpoint directly) behind the auth check and metrics."""
        t = scope["type"]
        if t == "http":
            start = time.perf_counter()
            status = None                                 # no response started (yet)

            async def send_wrapper(msg):
                nonlocal status
                if msg["type"] == "http.response.start":
                    status = msg["status"]
                await send(msg)

            try:
                if not self._authorized(scope):
                    # /v2 answers in the Open Inference Protocol's error form, which its clients parse
                    oip = _is_v2(scope["path"])
                    await (send_oip_error if oip else send_error)(scope, send_wrapper,
                                                                  unauthorized(header(scope, b"authorization")))
                else:
                    try:
                        check_path_session(scope)     # X-Session-Id against /v1/sessions/{id}: 400 when they differ
                        check_query(scope)
                    except ServiceError as e:
                        await (send_oip_error if _is_v2(scope["path"]) else send_error)(scope, send_wrapper, e)
                        return
                    try:
                        await app(scope, receive, send_wrapper)
                    except asyncio.CancelledError:
                        if status is not None:
                            raise
                        # the server stopping cut it off at shutdown_timeout_s (uvicorn cancels what still runs):
                        # one answer, not uvicorn's plain-text 500 and a traceback in the log
                        try:
                            await (send_oip_error if _is_v2(scope["path"]) else send_error)(
                                scope, send_wrapper, _cut_off(scope["method"]))
                        except Exception:  # noqa: BLE001 - the connection is gone: nothing more to send
                            pass
            finally:
                route = scope.get("route")
                label = route.path if route is not None else scope.get(ROUTE_SCOPE_KEY) or _route_of(scope)
                dt = time.perf_counter() - start
                code = scope.get(ERROR_SCOPE_KEY)
                if status is None:                        # nothing was sent: the client left, or a bug
                    status = CLIENT_CLOSED_STATUS if code == CLIENT_CLOSED else 500
                if code is None and status >= 400:
                    code = HTTP_CODES.get(status, "internal")
                self.metrics.observe_request(label, scope["method"], status, dt, code)
                if self.access:
                    access_log.info("request", extra={"method": scope["method"], "path": scope["path"],
                                                      "status": status, "ms": round(dt * 1e3, 3),
                                                      "error": code})
        elif t == "websocket":
            # the handshake is refused with an HTTP answer and the error map: 401 first, then 400 for a query string
            # (as on every /v1 route) or a session header; the app refuses an unknown path (404,
            # websocket.NoWebSocketRoute)
            try:
                if not self._authorized(scope):
                    raise unauthorized(header(scope, b"authorization"))
                check_query(scope)
                check_path_session(scope)     # (no session header on a stream)
            except ServiceError as exc:
                await refuse_handshake(scope, receive, send, exc)
            else:
                await app(scope, receive, send)
            code = scope.get(ERROR_SCOPE_KEY)
            if code is not None:                          # a refused handshake
                self.metrics.error(WS_ROUTE if scope["path"] == WS_ROUTE else "unmatched", code)
        else:
            await app(scope, receive, send)


def _is_v2(path: str) -> bool:
    """An Open Inference Protocol path, whose errors take the protocol's form."""
    return path == "/v2" or path.startswith("/v2/")


def _cut_off(method: str) -> NotReady:
    """The answer of a request the stopping server cut off at shutdown_timeout_s: one that could change state
    (not a GET or HEAD) may have been applied (``maybe_applied``)."""
    again = "send it again to another replica, or once this one is back"
    if method in ("GET", "HEAD"):
        return NotReady(f"the server is stopping and cut this read off at shutdown_timeout_s; {again}")
    return NotReady("the server is stopping and cut this request off at shutdown_timeout_s; if it had started it "
                    f"may have been applied (GET the session to see its positions): {again}", maybe_applied=True)


def _route_of(scope) -> str:
    """The route template of a request answered before it was routed (401, the Edge's 400s) or that no route
    took (404, 405 for another method), for its metrics' label: "unmatched" only when no route has its path."""
    for r in getattr(getattr(scope.get("app"), "router", None), "routes", ()):    # the hot routes are there too
        if r.matches(scope)[0] is not Match.NONE and hasattr(r, "path"):
            return r.path
    return "unmatched"


class ConvServeApp(FastAPI):
    """FastAPI, except that the conv routes skip Starlette's middleware stack and router.

    ``POST /v1/conv``, ``POST /v1/conv/batch``, ``POST /v1/conv/stream`` and the ``/v1/conv/ws`` WebSocket go from
    the server straight to the :class:`Edge` (API key, metrics, access log) and their plain ASGI endpoint, so a
    request on the hot path creates no ServerErrorMiddleware, ExceptionMiddleware or AsyncExitStack frame and
    does no route matching. The endpoints answer every failure themselves, so those layers would never act on
    them; an exception that escapes anyway gets what ServerErrorMiddleware would give it (a 500 ``internal``
    error body when nothing was sent yet, then re-raised to the server). A WebSocket handshake to any other path
    gets its 404 the same way (the router would close it with a bare 403), and so does a plain HTTP request to
    the WebSocket route (426 without Upgrade, 405 for another method; the router would say 404). Everything else,
    other methods on the POST paths (405) and a non-empty ``root_path`` included, goes through the FastAPI app,
    whose stack holds the same Edge.
    """

    _hot_edge: Optional[Edge] = None
    _hot_http: dict = {}
    _hot_ws: dict = {}
    #: ``X-Convserve-Replica`` header added to every answer (None: none added)
    _replica: Optional[tuple] = None

    def set_replica_name(self, name: str) -> None:
        self._replica = replica_header(name)

    def set_hot_routes(self, edge: Edge, http: dict, ws: dict) -> None:
        self._hot_edge = edge
        self._hot_http = http
        self._hot_ws = ws

    async def __call__(self, scope, receive, send):
        t = scope["type"]
        if self._replica is not None and t != "lifespan":
            # here, ahead of everything, so that no answer escapes it: hot routes, the stack's error middleware,
            # the Edge's 401 and /metrics alike
            send = with_replica_header(send, self._replica)
        if t == "http":
            if scope["method"] == "POST" and not scope.get("root_path"):
                ep = self._hot_http.get(scope["path"])
                if ep is not None:
                    scope["app"] = self
                    try:
                        await self._hot_edge.serve(scope, receive, send, ep)
                    except Exception as e:  # noqa: BLE001 - ServerErrorMiddleware's part, re-raised like it
                        try:
                            await send_error(scope, send, as_service_error(e))
                        except Exception:  # noqa: BLE001 - the response had started: nothing more to send
                            pass
                        raise
                    return
            # a plain HTTP request to a WebSocket route: 426 (GET without Upgrade) or 405, behind the same Edge
            if (scope["path"] if not scope.get("root_path") else get_route_path(scope)) in self._hot_ws:
                scope["app"] = self
                await self._hot_edge.serve(scope, receive, send, _WS_OVER_HTTP)
                return
        elif t == "websocket":
            ep = self._hot_ws.get(scope["path"]) if not scope.get("root_path") else None
            if ep is None and not any(r.matches(scope)[0] is not Match.NONE for r in self.router.routes):
                ep = _NO_WS_ROUTE                         # 404 with the error map, not the router's bare 403
            if ep is not None:
                scope["app"] = self
                await self._hot_edge.serve(scope, receive, send, ep)
                return
        await super().__call__(scope, receive, send)
