"""Request bodies: reading them within the size limit, decoding them by Content-Type, and validating their fields.

Every function here raises a :class:`ServiceError` whose message says what to send instead; none touches the
engine. Values the engine checks itself (NaN/Inf, session existence, speculative state) are left to it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import (BadRequest, BodyTimeout, DtypeUnsupported, PayloadTooLarge,
                                              ShapeMismatch, UnknownLayer)
from convserve.clients.protocol.ids import MAX_SESSION_ID_LEN, check_session_id, is_session_id
from convserve.service.http.asgi import ClientGone, header
from convserve.service.claims import op_request_id, with_request_id


def body_format(scope, route: Optional[str] = None) -> str:
    """``"msgpack"`` or ``"json"`` from the Content-Type; raise :class:`BadRequest` for anything else. With
    ``route`` (a route that carries msgpack only), JSON is refused too, naming the route."""
    ct = header(scope, b"content-type")
    if ct is None:
        return "msgpack"
    ct = ct.split(b";", 1)[0].strip().lower().decode("latin-1")
    if ct in wire.MSGPACK_TYPES:
        return "msgpack"
    if route is not None:
        raise BadRequest(f"Content-Type {ct!r:.60} is not supported: {route} carries msgpack frames only; send "
                         f"Content-Type {wire.MEDIA_TYPE}")
    if ct == wire.JSON_TYPE:
        return "json"
    raise BadRequest(f"Content-Type {ct!r:.60} is not supported; send {wire.MEDIA_TYPE} (or application/json, whose "
                     "tensors carry their data in base64)")


async def read_body(scope, receive, max_bytes: int, timeout: Optional[float] = None) -> bytes:
    """The whole request body; :class:`PayloadTooLarge` past ``max_bytes``, :class:`ClientGone` on disconnect,
    :class:`BodyTimeout` when it has not all arrived ``timeout`` seconds after the call (a client trickling its
    body holds a connection and a buffer: the answer closes the connection)."""
    if timeout is None:
        return await _read_body(scope, receive, max_bytes)
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(scope, receive, max_bytes)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s; send it at once (or raise "
                          "--body-timeout-s)") from None


async def _read_body(scope, receive, max_bytes: int):
    """The body as bytes (one chunk) or a bytearray (several): a large body with a Content-Length is copied into
    one buffer chunk by chunk as it arrives, so the loop never spends one long copy joining 60 MiB at the end."""
    cl = header(scope, b"content-length")
    expect = None
    if cl is not None:
        try:
            expect = int(cl)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if expect > max_bytes:
            raise PayloadTooLarge(f"the body has {expect} bytes, above the limit of {max_bytes}; send fewer tokens "
                                  "per request (split a prefill into chunks) or raise --max-body-bytes")
    msg = await receive()
    if msg["type"] == "http.disconnect":
        raise ClientGone()
    first = msg.get("body", b"")
    if not msg.get("more_body", False):
        if len(first) > max_bytes:
            raise _too_large(max_bytes)
        return first
    buf = bytearray(expect) if expect is not None else None     # uvicorn holds the body to its Content-Length
    chunks = [] if buf is None else None
    n = 0
    while True:
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        chunk = msg.get("body", b"")
        if chunk:
            end = n + len(chunk)
            if end > max_bytes:
                raise _too_large(max_bytes)
            if buf is not None:
                buf[n:end] = chunk
            else:
                chunks.append(chunk)
            n = end
        if not msg.get("more_body", False):
            break
        msg = await receive()
    if buf is not None:
        if n != len(buf):          # uvicorn ends a body at its Content-Length: shorter means it was cut
            raise BadRequest(f"the body has {n} bytes but Content-Length says {len(buf)}")
        return buf
    return b"".join(chunks)


async def refuse_body(scope, receive, timeout: Optional[float] = None) -> None:
    """For a route that takes no body (GET, DELETE): :class:`BadRequest` when the request carries one, nothing when
    it has none (no body, an empty chunked one, ``Content-Length: 0``). A ``Content-Length`` above 0 is refused
    without reading the body; a body without a length (chunked) is read up to its first non-empty chunk."""
    cl = header(scope, b"content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if n > 0:
            raise _takes_no_body(scope, f"a body of {n} bytes")
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone()
                if msg.get("body"):
                    raise _takes_no_body(scope, "a body")
                if not msg.get("more_body", False):
                    return
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s; this route takes no body: send "
                          "the request without one") from None


def _takes_no_body(scope, got: str) -> BadRequest:
    route = scope.get("route")
    path = route.path if route is not None else scope["path"]
    return BadRequest(f"{scope['method']} {path} takes no body, got {got}; send the request without one (its "
                      "arguments are in the path and the query string)")


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the body exceeds the limit of {max_bytes} bytes; send fewer tokens per request (split "
                           "a prefill into chunks) or raise --max-body-bytes")


def parse_body(scope, body: bytes, max_bytes: int, max_objects: int, max_json_bytes: Optional[int] = None) -> Any:
    fmt = body_format(scope)
    if fmt == "json":
        check_json_size(len(body), max_json_bytes)
        return wire.loads_json(body, max_objects)
    return wire.unpackb(body, max_bytes, max_objects)


def check_json_size(n: int, max_json_bytes: Optional[int]) -> None:
    """JSON is decoded in one C call that holds the interpreter (no other thread, the event loop included, runs
    meanwhile): its size is bounded on its own, below ``max_body_bytes``."""
    if max_json_bytes is not None and n > max_json_bytes:
        raise PayloadTooLarge(f"the JSON body has {n} bytes, above the limit of {max_json_bytes} for JSON; send "
                              f"tensors in msgpack ({wire.MEDIA_TYPE}), or raise --max-json-body-bytes")


#: The fields each body may hold; any other field is a 400 that names it and lists these.
CONV_FIELDS = ("session", "layer", "x", "speculative", "position", "request_id")
BATCH_FIELDS = ("sessions", "layer", "x", "tokens", "speculative", "position", "request_id")
ACCEPT_BATCH_FIELDS = ("sessions", "tokens", "request_id")
#: an accept frame of a stream or WebSocket: a ``POST /v1/accept`` body plus its ``id`` and ``"op": "accept"``
ACCEPT_FRAME_FIELDS = ("op", *ACCEPT_BATCH_FIELDS, "id")
SESSION_FIELDS = ("session", "request_id")
STATE_FIELDS = ("layers", "state", "request_id")
ACCEPT_FIELDS = ("tokens", "request_id")
INT64_MAX = (1 << 63) - 1       # what an engine message carries (msgpack); a count or position is far below it
LIST_QUERY = ("cursor", "limit")
DELETE_QUERY = ("request_id",)


def check_query(scope) -> None:
    """400 for a query parameter on a /v1 route that takes none (``GET /v1/sessions`` takes ``LIST_QUERY``, which
    ``list_query`` checks, and ``DELETE /v1/sessions/{id}`` ``DELETE_QUERY``, which ``delete_query`` checks), the
    WebSocket's handshake included, or on any /v2 route (the Open Inference Protocol defines none): a misspelled
    parameter is never silently ignored."""
    qs = scope.get("query_string")
    path = scope["path"]
    method = scope.get("method")             # None: a WebSocket handshake
    ours = path.startswith(("/v1/", "/v2/")) or path == "/v2"
    if not qs or not ours or (path == "/v1/sessions" and method == "GET") or \
            (method == "DELETE" and path.startswith("/v1/sessions/") and path.count("/") == 3):
        return
    name = qs.split(b"&", 1)[0].split(b"=", 1)[0].decode("latin-1")
    where = (f"{method} {path} takes none (its fields go in the body)" if method in ("POST", "PUT") else
             f"{method} {path} takes none") if method else \
        f"the WebSocket {path} takes none (the fields of a conv go in each frame); open it without a query string"
    raise BadRequest(f"unknown query parameter {name!r:.60}: {where}")


def check_query_names(query, allowed: tuple) -> None:
    """400 for a query parameter of a route that takes only ``allowed``, or for one given more than once."""
    seen = set()
    for k, _ in query.multi_items():
        if k not in allowed:
            raise BadRequest(f"unknown query parameter {k!r:.60}; the allowed ones are {', '.join(allowed)}")
        if k in seen:
            raise BadRequest(f"query parameter {k!r:.60} is given more than once; give it once")
        seen.add(k)


def claimed(req: dict, position):
    """``position``, with the request's ``request_id`` when it has one (:class:`Claimed`): a repeat of an applied
    request must carry the same id (:func:`with_request_id`)."""
    return with_request_id(position, req.get("request_id"))


def shm_ref(req: Any):
    """The ``shm`` reference of a parsed conv or batch body's x (its y is written over it), else None."""
    x = req.get("x")
    return x.get("shm") if type(x) is dict else None


def check_fields(req: dict, allowed, what: str) -> None:
    """:class:`BadRequest` naming the first field of ``req`` not in ``allowed`` (a misspelled field is never
    silently ignored)."""
    if len(req) > len(allowed) or any(k not in allowed for k in req):
        bad = next((k for k in req if k not in allowed), None)
        raise BadRequest(f"unknown field {bad!r:.60} in {what}; the allowed fields are {', '.join(allowed)}")


class Parser:
    """Validates the fields of decoded bodies against the served model and the settings' limits.

    ``frame=True`` parses a stream or WebSocket frame: the same body plus its ``id``.
    """

    def __init__(self, info: dict, max_tokens_per_request: int, max_batch_tokens: int, max_batch_size: int,
                 shm=None):
        """``shm``: the :class:`~.client_shm.ClientSegments` a conv's x may lie in (None: x must carry data)."""
        self.shm = shm
        self.layers = list(info["layers"])
        self.layer_set = frozenset(self.layers)
        dim, width = int(info["dim"]), int(info["width"])
        self.state_dtype = str(info["state_dtype"])
        self.max_batch_size = max_batch_size
        self.max_tokens_per_request = max_tokens_per_request
        self.x_check = wire.shape_checker((dim,), min_first=1, max_first=max_tokens_per_request)
        self.max_batch_tokens = max_batch_tokens
        self.batch_check = wire.shape_checker((dim,), min_first=1, max_first=max_batch_tokens, first_name="rows")
        self.state_check = wire.exact_shape_checker((len(self.layers), dim, width - 1), "state")
        self._frame_fields = {f: (*f, "id") for f in (CONV_FIELDS, BATCH_FIELDS)}

    def conv(self, req: Any, frame: bool = False):
        """``(session, layer, x, speculative, position)`` from a /v1/conv body (or stream frame); ``position`` is
        None when absent."""
        if type(req) is not dict:
            raise BadRequest(f"a conv request must be a map {{session, layer, x}}, got {type(req).__name__}")
        check_fields(req, self._frame_fields[CONV_FIELDS] if frame else CONV_FIELDS,
                     "a conv frame" if frame else "a conv request")
        session = req.get("session")
        if type(session) is not str:
            raise BadRequest("'session' is missing or not a string; create a session with POST /v1/sessions")
        layer = self.layer(req)
        x = wire.decode_tensor(req.get("x"), check_shape=self.x_check, shm=self.shm)
        spec = req.get("speculative")
        if spec is None:                      # an optional field given as null is left out, on every route
            spec = False
        elif type(spec) is not bool:
            raise BadRequest("'speculative' must be true or false")
        position = req.get("position")
        if position is not None and (type(position) is not int or not 0 <= position <= INT64_MAX):
            raise BadRequest(f"'position' must be an integer >= 0 (the tokens the session has committed on this "
                             f"layer; at most 2**63 - 1), got {position!r:.40}")
        position = claimed(req, position)
        return session, layer, x, spec, position  # NaN/Inf (non_finite) is checked by the engine (check_finite)

    def batch(self, req: Any, frame: bool = False):
        """``(sessions, layer, x, tokens, speculative, position)`` from a /v1/conv/batch body (or a batch frame).

        ``tokens``, ``speculative`` and ``position`` are None when absent (one plain token per session). Types,
        lengths and limits are checked here; what needs the sessions' state (existence, pending verifies, the decode
        bucket) the engine checks, also whole-batch.
        """
        if type(req) is not dict:
            raise BadRequest(f"a batch request must be a map {{sessions, layer, x}}, got {type(req).__name__}")
        check_fields(req, self._frame_fields[BATCH_FIELDS] if frame else BATCH_FIELDS,
                     "a batch frame" if frame else "a batch request")
        sessions = self._sessions(req)
        n = len(sessions)
        if n > self.max_batch_size:
            raise PayloadTooLarge(f"'sessions' has {n} sessions, above max_batch_size {self.max_batch_size}; "
                                  "split the batch")
        layer = self.layer(req)
        tokens = req.get("tokens")
        if tokens is not None:
            if type(tokens) is not list or len(tokens) != n:
                raise BadRequest(f"'tokens' must be a list of {n} integers, one per session, got {tokens!r:.80}")
            for i, t in enumerate(tokens):
                if type(t) is not int or t < 1:
                    raise BadRequest(f"'tokens'[{i}] is {t!r:.40}; each entry is an integer >= 1 (every session "
                                     "sends at least one token)")
            if sum(tokens) > self.max_batch_tokens:
                raise PayloadTooLarge(f"'tokens' add up to {sum(tokens)}, above max_batch_tokens "
                                      f"{self.max_batch_tokens}; split the batch")
            if max(tokens) > self.max_tokens_per_request:     # a slice is one session's conv
                i = tokens.index(max(tokens))
                raise PayloadTooLarge(f"'tokens'[{i}] is {tokens[i]}, above max_tokens_per_request "
                                      f"{self.max_tokens_per_request} (the most tokens of one session's conv, in a "
                                      "batch too); split that session's prefill into chunks")
        spec = req.get("speculative")
        if spec is not None and type(spec) is not bool:
            if type(spec) is not list or len(spec) != n or not all(type(s) is bool for s in spec):
                raise BadRequest(f"'speculative' must be true, false or a list of {n} booleans, one per session")
        position = req.get("position")
        if position is not None and (type(position) is not list or len(position) != n or
                                     not all(type(q) is int and 0 <= q <= INT64_MAX for q in position)):
            raise BadRequest(f"'position' must be a list of {n} integers >= 0 (at most 2**63 - 1), one per session, "
                             f"got {position!r:.80}")
        position = claimed(req, position)
        x = wire.decode_tensor(req.get("x"), check_shape=self.batch_check, shm=self.shm)
        want = n if tokens is None else sum(tokens)
        if x.shape[0] != want:
            raise ShapeMismatch(f"'x' has {x.shape[0]} rows but the sessions' tokens add up to {want}; pack each "
                                "session's tokens in the order of 'sessions'")
        return sessions, layer, x, tokens, spec, position

    def accept_batch(self, req: Any, frame: bool = False):
        """``(sessions, tokens)`` of a ``POST /v1/accept`` body (or, ``frame``, of an accept frame)."""
        if type(req) is not dict:
            raise BadRequest(f"the body must be a map {{sessions, tokens}}, got {type(req).__name__}")
        if frame:
            check_fields(req, ACCEPT_FRAME_FIELDS, "an accept frame")
            if req["op"] != "accept":
                raise BadRequest(f"'op' is {req['op']!r:.40}; the one operation a frame carries is \"accept\" (a "
                                 "conv or batch frame has no 'op')")
        else:
            check_fields(req, ACCEPT_BATCH_FIELDS, "an accept request")
        sessions = self._sessions(req)
        tokens = req.get("tokens")
        if type(tokens) is not list or len(tokens) != len(sessions) or \
                not all(type(t) is int and 0 <= t <= INT64_MAX for t in tokens):
            raise BadRequest(f"'tokens' must be a list of {len(sessions)} integers >= 0 (at most 2**63 - 1), the "
                             "verified tokens each session keeps")
        return sessions, tokens

    @staticmethod
    def _sessions(req: dict) -> list:
        sessions = req.get("sessions")
        if type(sessions) is not list or not sessions or not all(type(s) is str for s in sessions):
            raise BadRequest("'sessions' is missing or not a non-empty list of session ids (strings)")
        return sessions

    def layer(self, req: dict) -> int:
        layer = req.get("layer")
        if type(layer) is not int:
            raise BadRequest("'layer' is missing or not an integer; use a model layer index from GET /v1/model")
        if layer not in self.layer_set:
            raise UnknownLayer(f"layer {layer} has no conv; the model's conv layers are {self.layers}")
        return layer

    @staticmethod
    def new_session_id(body: Any, what: str = "session") -> Optional[str]:
        """The id asked for by a create or fork body (an empty body reads as ``{}``), or None (the engine picks
        one). A body that is no map (a msgpack nil or empty bin, a JSON null) is a 400, as any other non-map."""
        if type(body) is not dict:
            got = "null" if body is None else type(body).__name__
            raise BadRequest(f"the body must be a map {{\"session\": id}} or empty, got {got}")
        check_fields(body, SESSION_FIELDS, "this body")
        sid = body.get("session")
        if sid is None:
            return None
        return check_session_id(sid, what)

    def state(self, body: Any):
        """The state tensor of a ``PUT .../state`` body, as ``GET .../state`` returns it."""
        if type(body) is not dict or "state" not in body:
            raise BadRequest("the body must be a map {\"layers\": [...], \"state\": tensor}, as GET .../state returns")
        check_fields(body, STATE_FIELDS, "a state body")
        layers = body.get("layers")
        # compared by type too: 1.0 == 1 == True in Python, and a mistyped list is not the model's
        if layers is not None and (type(layers) is not list or layers != self.layers
                                   or any(type(v) is not int for v in layers)):
            raise ShapeMismatch(f"'layers' {layers!r:.100} do not match the model's conv layers {self.layers}")
        st = body["state"]
        if type(st) is dict and isinstance(st.get("dtype"), str) and st["dtype"] in wire.ITEMSIZE \
                and st["dtype"] != self.state_dtype:
            raise DtypeUnsupported(f"'state.dtype' is {st['dtype']}; this server keeps its state in "
                                   f"{self.state_dtype} (see /v1/model state_dtype): send the state as exported")
        return wire.decode_tensor(st, check_shape=self.state_check, name="state")  # NaN/Inf: the engine

    @staticmethod
    def op_request_id(body: Any) -> Optional[str]:
        """The ``request_id`` of a session operation's body (a map, checked before), or None; it must be
        ``PREFIX:N`` (:func:`~convserve.service.claims.op_request_id`)."""
        rid = body.get("request_id") if type(body) is dict else None
        op_request_id(rid)
        return rid

    @staticmethod
    def delete_query(query) -> Optional[str]:
        """The ``request_id`` of ``DELETE /v1/sessions/{id}?request_id=PREFIX:N`` (a DELETE has no body), or
        None; any other query parameter, or this one twice, is a 400."""
        check_query_names(query, DELETE_QUERY)
        rid = query.get("request_id")
        op_request_id(rid)
        return rid

    @staticmethod
    def list_query(query, most: int) -> tuple:
        """``(cursor, limit)`` of ``GET /v1/sessions?cursor=&limit=``: ``limit`` plain ASCII digits from 1 to
        ``most`` (the ``sessions_page_max`` setting; default 100 or ``most`` if smaller), ``cursor`` the previous
        page's ``next`` (a session id: the last id of that page) or absent; each at most once. Anything the server
        could not have handed out is a 400 naming the rule (not read leniently: int() alone takes " 5" and
        non-ASCII digits)."""
        check_query_names(query, LIST_QUERY)
        limit = query.get("limit")
        if limit is None:
            n = min(100, most)
        else:
            n = int(limit) if limit.isascii() and limit.isdigit() and len(limit) <= 20 else 0
            if not 1 <= n <= most:
                raise BadRequest(f"limit: expected plain ASCII digits for an integer from 1 to {most} "
                                 f"(sessions_page_max), got {limit!r:.40}")
        cursor = query.get("cursor")
        if cursor is not None and not is_session_id(cursor):
            raise BadRequest(f"cursor: expected the 'next' of the previous page, a session id of 1 to "
                             f"{MAX_SESSION_ID_LEN} characters from A-Z a-z 0-9 . _ ~ : -, got {cursor!r:.80}; "
                             "omit cursor for the first page")
        return cursor, n

    @staticmethod
    def accept_tokens(body: Any) -> int:
        """``n`` of an ``accept`` body ``{"tokens": n}``."""
        if type(body) is dict:
            check_fields(body, ACCEPT_FIELDS, "an accept body")
        n = body.get("tokens") if type(body) is dict else None
        if type(n) is not int or not 0 <= n <= INT64_MAX:
            raise BadRequest("the body must be {\"tokens\": n} with 0 <= n < 2**63, the number of verified tokens to "
                             "keep")
        return n
