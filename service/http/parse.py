"""Request bodies: reading them within the size limit, decoding them by Content-Type, and validating their fields.

Every function here raises a :class:`ServiceError` whose message says what to send instead; none touches the
engine. Values the engine checks itself (NaN/Inf, session existence, speculative state) are left to it.
"""

from __future__ import annotations

from typing import Any, Optional

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, DtypeUnsupported, PayloadTooLarge, ShapeMismatch, UnknownLayer
from convserve.clients.protocol.ids import check_session_id
from convserve.service.http.asgi import ClientGone, header


def body_format(scope) -> str:
    """``"msgpack"`` or ``"json"`` from the Content-Type; raise :class:`BadRequest` for anything else."""
    ct = header(scope, b"content-type")
    if ct is None:
        return "msgpack"
    ct = ct.split(b";", 1)[0].strip().lower().decode("latin-1")
    if ct in wire.MSGPACK_TYPES:
        return "msgpack"
    if ct == wire.JSON_TYPE:
        return "json"
    raise BadRequest(f"Content-Type {ct!r} is not supported; send {wire.MEDIA_TYPE} (or application/json on "
                     "control routes)")


async def read_body(scope, receive, max_bytes: int) -> bytes:
    """The whole request body; :class:`PayloadTooLarge` past ``max_bytes``, :class:`ClientGone` on disconnect."""
    cl = header(scope, b"content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if n > max_bytes:
            raise PayloadTooLarge(f"the body has {n} bytes, above the limit of {max_bytes}; send fewer tokens per "
                                  "request (split a prefill into chunks) or raise --max-body-bytes")
    chunks = []
    n = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        chunk = msg.get("body", b"")
        if chunk:
            n += len(chunk)
            if n > max_bytes:
                raise PayloadTooLarge(f"the body exceeds the limit of {max_bytes} bytes; send fewer tokens per "
                                      "request (split a prefill into chunks) or raise --max-body-bytes")
            chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


def parse_body(scope, body: bytes, max_bytes: int) -> Any:
    fmt = body_format(scope)
    if fmt == "json":
        return wire.loads_json(body)
    return wire.unpackb(body, max_bytes)


class Parser:
    """Validates the fields of decoded bodies against the served model and the settings' limits."""

    def __init__(self, info: dict, max_tokens_per_request: int, batch_rows: int):
        self.layers = list(info["layers"])
        self.layer_set = frozenset(self.layers)
        dim, width = int(info["dim"]), int(info["width"])
        self.state_dtype = str(info["state_dtype"])
        self.batch_rows = batch_rows
        self.x_check = wire.shape_checker((dim,), min_first=1, max_first=max_tokens_per_request)
        self.batch_check = wire.shape_checker((dim,), min_first=1, max_first=batch_rows, first_name="rows")
        self.state_check = wire.exact_shape_checker((len(self.layers), dim, width - 1), "state")

    def conv(self, req: Any):
        """``(session, layer, x, speculative)`` from a /v1/conv body (or stream frame)."""
        if type(req) is not dict:
            raise BadRequest(f"a conv request must be a map {{session, layer, x}}, got {type(req).__name__}")
        session = req.get("session")
        if type(session) is not str:
            raise BadRequest("'session' is missing or not a string; create a session with POST /v1/sessions")
        layer = self.layer(req)
        x = wire.decode_tensor(req.get("x"), check_shape=self.x_check)
        spec = req.get("speculative", False)
        if type(spec) is not bool:
            raise BadRequest("'speculative' must be true or false")
        return session, layer, x, spec  # NaN/Inf (non_finite) is checked by the engine (settings.check_finite)

    def batch(self, req: Any):
        """``(sessions, layer, x)`` from a /v1/conv/batch body."""
        if type(req) is not dict:
            raise BadRequest(f"a batch request must be a map {{sessions, layer, x}}, got {type(req).__name__}")
        sessions = req.get("sessions")
        if type(sessions) is not list or not sessions or not all(type(s) is str for s in sessions):
            raise BadRequest("'sessions' is missing or not a non-empty list of session ids (strings)")
        if len(sessions) > self.batch_rows:
            raise PayloadTooLarge(f"'sessions' has {len(sessions)} sessions, above the limit of {self.batch_rows} "
                                  "rows per batch (max_batch_size, the largest decode bucket); split the batch")
        layer = self.layer(req)
        x = wire.decode_tensor(req.get("x"), check_shape=self.batch_check)
        return sessions, layer, x

    def layer(self, req: dict) -> int:
        layer = req.get("layer")
        if type(layer) is not int:
            raise BadRequest("'layer' is missing or not an integer; use a model layer index from GET /v1/model")
        if layer not in self.layer_set:
            raise UnknownLayer(f"layer {layer} has no conv; the model's conv layers are {self.layers}")
        return layer

    @staticmethod
    def new_session_id(body: Any, what: str = "session") -> Optional[str]:
        """The id asked for by a create or fork body, or None (the engine picks one)."""
        if body is None or body == {} or body == b"":
            return None
        if type(body) is not dict:
            raise BadRequest(f"the body must be a map {{\"session\": id}} or empty, got {type(body).__name__}")
        sid = body.get("session")
        if sid is None:
            return None
        return check_session_id(sid, what)

    def state(self, body: Any):
        """The state tensor of a ``PUT .../state`` body, as ``GET .../state`` returns it."""
        if type(body) is not dict or "state" not in body:
            raise BadRequest("the body must be a map {\"layers\": [...], \"state\": tensor}, as GET .../state returns")
        layers = body.get("layers")
        if layers is not None and (type(layers) is not list or layers != self.layers):
            raise ShapeMismatch(f"'layers' {layers!r:.100} do not match the model's conv layers {self.layers}")
        st = body["state"]
        if type(st) is dict and isinstance(st.get("dtype"), str) and st["dtype"] in wire.ITEMSIZE \
                and st["dtype"] != self.state_dtype:
            raise DtypeUnsupported(f"'state.dtype' is {st['dtype']}; this server keeps its state in "
                                   f"{self.state_dtype} (see /v1/model state_dtype): send the state as exported")
        return wire.decode_tensor(st, check_shape=self.state_check, name="state")  # NaN/Inf: the engine

    @staticmethod
    def accept_tokens(body: Any) -> int:
        """``n`` of an ``accept`` body ``{"tokens": n}``."""
        n = body.get("tokens") if type(body) is dict else None
        if type(n) is not int or n < 0:
            raise BadRequest("the body must be {\"tokens\": n} with n >= 0, the number of verified tokens to keep")
        return n
