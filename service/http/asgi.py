"""Plain-ASGI plumbing shared by the routes: headers, content negotiation, encoding a reply, sending bytes.

The conv routes are plain ASGI endpoints (no Request or Response objects), so these helpers work on the raw
``scope`` and ``send``. The scope keys below carry what an endpoint learnt to the :class:`~.edge.Edge`, which
labels the request's metrics with them after the response.
"""

from __future__ import annotations

from typing import Any, Optional

from convserve.clients.protocol import wire

MSGPACK_CT = wire.MEDIA_TYPE.encode()
JSON_CT = b"application/json"

#: scope key: the error code of the response (set by whoever rendered the error), for the error metrics
ERROR_SCOPE_KEY = "convserve.error"
#: scope key: the route label of a plain ASGI endpoint, which Starlette's router did not match
ROUTE_SCOPE_KEY = "convserve.route"
#: the scope key of a stream request's ``abort()`` (the connection's transport, set by the server's protocol):
#: closing would wait for the unsent answers of a client that reads nothing, which may be never
ABORT_SCOPE_KEY = "convserve.abort"


#: what a request whose client went away counts as in the metrics (nginx's convention): not a server error
CLIENT_CLOSED_STATUS, CLIENT_CLOSED = 499, "client_closed"


class ClientGone(Exception):
    """The client disconnected while its request was being read or computed."""


def client_gone(scope) -> None:
    """Mark the request as one whose client went away (no answer is sent; the metrics count it as 499)."""
    scope[ERROR_SCOPE_KEY] = CLIENT_CLOSED


def header(scope, name: bytes) -> Optional[bytes]:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def _qualities(scope):
    """``(json, msgpack)``: the quality the Accept header gives each (0: not at all), None where it names neither
    (``None`` for both without the header)."""
    accept = header(scope, b"accept")
    if accept is None:
        return None, None
    accept = accept.lower()                      # (media types and their parameter names are case-insensitive)
    if b"q=" not in accept:
        return (1.0 if b"json" in accept else None), (1.0 if b"msgpack" in accept else None)
    best: dict = {b"json": None, b"msgpack": None}
    for part in accept.split(b","):
        kind, *params = part.split(b";")
        q = 1.0
        for p in params:
            k, _, v = p.partition(b"=")
            if k.strip() == b"q":
                try:
                    q = float(v)
                except ValueError:               # not a quality: that range is not read as acceptable
                    q = 0.0
        for name in best:
            if name in kind:
                best[name] = max(best[name] or 0.0, q)
    return best[b"json"], best[b"msgpack"]


def wants_json(scope) -> bool:
    """JSON when the Accept header asks for JSON and not for msgpack, or for msgpack at a lower quality (``q=0``:
    not at all); msgpack otherwise, a tie included (the API's answers)."""
    j, m = _qualities(scope)
    return bool(j) and (m is None or j > m)


def wants_msgpack(scope) -> bool:
    """msgpack when the Accept header asks for it at least as much as for JSON (and not at ``q=0``); JSON otherwise
    (the probes' answers, which people and probes read)."""
    j, m = _qualities(scope)
    return bool(m) and (j is None or m >= j)


def render(obj: Any, as_json: bool) -> tuple[bytes, bytes]:
    """``(body, content type)``; tensors in ``obj`` must already be wire maps."""
    if as_json:
        return wire.dumps_json(obj), JSON_CT
    return wire.packb(obj), MSGPACK_CT


async def send_bytes(send, status: int, body: bytes, ctype: bytes, headers=(), more=None) -> None:
    """One response: ``body``, then ``more`` (a buffer written without a copy) when given."""
    n = len(body) + (more.nbytes if more is not None else 0)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(n).encode()), *headers]})
    if more is None:
        await send({"type": "http.response.body", "body": body})
    else:
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": more})
