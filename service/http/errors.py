"""The one place errors become bytes.

Every error the HTTP layer answers is a :class:`ServiceError` (anything else is wrapped as ``internal``) and is
rendered here, in one of two forms:

* a response: its ``status``, the body ``{"error": {"code", "message", "retry_after"?, ...extra}}`` in msgpack or JSON
  (the request's content negotiation, :func:`.asgi.wants_json`, unless the route decides otherwise) and a
  ``Retry-After`` header (whole seconds, at least 1) when the error is retryable;
* a frame of ``/v1/conv/stream`` or ``/v1/conv/ws``: ``{"id", "error": {...}}`` with the same error map.

``retry_after`` is the error's own, else :data:`DEFAULT_RETRY_AFTER` for 429 and 503, else absent.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from convserve.clients.protocol.errors import Internal, ServiceError, Unauthorized
from convserve.service.http.asgi import (CLIENT_CLOSED_STATUS, ERROR_SCOPE_KEY, ClientGone, client_gone, render,
                                         send_bytes, wants_json)

log = logging.getLogger("convserve.app")

#: Retry-After (seconds) for retryable errors that did not say how long to wait.
DEFAULT_RETRY_AFTER = 1.0

#: error code of the HTTP statuses the framework answers itself (no route, wrong method, body too large)
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def retry_after(exc: ServiceError) -> Optional[float]:
    if exc.retry_after is not None:
        return float(exc.retry_after)
    if exc.status in (429, 503):
        return DEFAULT_RETRY_AFTER
    return None


def error_fields(exc: ServiceError) -> dict:
    """The ``{"code", "message", "retry_after"?}`` map of ``exc``, plus its ``extra`` fields."""
    d = {"code": exc.code, "message": exc.message}
    if exc.extra:
        d.update(exc.extra)
    ra = retry_after(exc)
    if ra is not None:
        d["retry_after"] = ra
    return d


def render_error(exc: ServiceError, as_json: bool) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    """``(body, content type, headers)`` of the response for ``exc``; its status is ``exc.status``."""
    body, ct = render({"error": error_fields(exc)}, as_json)
    ra = retry_after(exc)
    headers = [] if ra is None else [(b"retry-after", str(max(1, math.ceil(ra))).encode())]
    if exc.status == 408:       # the rest of the body is never read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    return body, ct, headers


def error_frame(packer, fid, exc: ServiceError) -> bytes:
    """The stream/WebSocket frame answering frame ``fid`` (None: the stream itself) with ``exc``."""
    return packer.pack({"id": fid, "error": error_fields(exc)})


async def send_error(scope, send, exc: ServiceError) -> None:
    """Answer a plain-ASGI request with ``exc``, negotiated from its Accept header."""
    scope[ERROR_SCOPE_KEY] = exc.code
    body, ct, headers = render_error(exc, wants_json(scope))
    await send_bytes(send, exc.status, body, ct, headers)


def error_response(scope, exc: ServiceError, as_json: Optional[bool] = None,
                   extra_headers: Optional[dict] = None) -> Response:
    """The framework response for ``exc`` (FastAPI routes and exception handlers); ``as_json`` None negotiates
    from the Accept header."""
    scope[ERROR_SCOPE_KEY] = exc.code
    body, ct, headers = render_error(exc, wants_json(scope) if as_json is None else as_json)
    h = {k.decode(): v.decode() for k, v in headers}
    if extra_headers:
        h.update(extra_headers)
    return Response(body, status_code=exc.status, media_type=ct.decode(), headers=h)


def as_service_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    log.error("internal error", exc_info=exc)
    return Internal(f"internal error ({type(exc).__name__}); the request may be retried, and if it keeps failing "
                    "report it with the server log")


def bearer_key(value: Optional[bytes]) -> Optional[bytes]:
    """The key of an ``Authorization: Bearer <key>`` header value (the scheme's name in any case, RFC 9110 11.1);
    None when there is no such header or it names another scheme."""
    if value is None or value[:7].lower() != b"bearer ":
        return None
    return value[7:].strip()


def unauthorized(given: Optional[bytes] = None) -> Unauthorized:
    """The 401 for a request whose ``Authorization`` header was ``given`` (None: absent). The key itself is never
    repeated."""
    if given is None:
        return Unauthorized("this server needs an API key: send 'Authorization: Bearer <key>' (the server's key: "
                            "CONVSERVE_API_KEY, api_key_file, or --api-key)")
    if bearer_key(given) is None:
        return Unauthorized("the Authorization header is not 'Bearer <key>': send the server's key "
                            "(CONVSERVE_API_KEY, api_key_file, or --api-key) as 'Authorization: Bearer <key>'")
    return Unauthorized("the API key sent is not this server's: send the server's key "
                        "(CONVSERVE_API_KEY, api_key_file, or --api-key) as 'Authorization: Bearer <key>'")


class _FrameworkError(ServiceError):
    """An HTTP error the framework raised (no route, wrong method), with the status it chose."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


def allowed_methods(app: FastAPI, scope) -> list:
    """Every method some route takes on ``scope``'s path (the router's own 405 names only the first such route's):
    one path is often several routes, a GET and a PUT, say."""
    methods: set = set()
    for route in app.router.routes:
        if getattr(route, "methods", None) and route.matches({**scope, "type": "http"})[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    """Render every exception a FastAPI route raises (or the router's own 404/405) with :func:`error_response`."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return error_response(request.scope, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        headers = exc.headers
        if exc.status_code == 405:
            allowed = allowed_methods(app, request.scope)
            headers = {**{k: v for k, v in (headers or {}).items() if k.lower() != "allow"},
                       "allow": ", ".join(allowed)}
            msg = f"{request.method} is not allowed on {request.url.path}; its methods are {', '.join(allowed)}"
        else:
            msg = {404: f"no route {request.url.path}; see docs/api.md (API reference) for the routes"}.get(
                exc.status_code, str(exc.detail))
        err = _FrameworkError(exc.status_code, HTTP_CODES.get(exc.status_code, "bad_request"), msg)
        return error_response(request.scope, err, extra_headers=headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        # the client left while its body was read: nothing to answer and nothing to log; the metrics say 499
        client_gone(request.scope)
        return Response(status_code=CLIENT_CLOSED_STATUS)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return error_response(request.scope, as_service_error(exc))
