"""Errors of the service, each with one HTTP status and one snake_case code.

The server raises these and renders each as its status and ``{"error": {"code", "message"}}`` (plus the error's
``extra`` fields, such as the server's ``position`` of a :class:`PositionMismatch`); the clients raise the class of
the code they read back, with those fields in ``extra``. Messages say what to do about the error.
"""

from __future__ import annotations

from typing import Any, Optional


class ServiceError(Exception):
    """Base class: ``status`` is the HTTP status, ``code`` the stable machine-readable code."""

    status: int = 500
    code: str = "internal"

    def __init__(self, message: str, *, retry_after: Optional[float] = None, **extra: Any):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        #: fields of the error map beyond code, message and retry_after (msgpack/JSON values)
        self.extra = extra

    def to_dict(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, **self.extra}}

    @property
    def applied(self) -> list:
        """The sessions whose part of a request split across engine processes (or replicas) ran: the error's
        ``applied`` field (empty when it has none)."""
        return list(self.extra.get("applied") or ())

    @applied.setter
    def applied(self, sessions) -> None:
        self.extra["applied"] = list(sessions)

    @property
    def maybe_applied(self) -> bool:
        """The request may have run (its engine process died with it in flight, a stopping server cut it off):
        the error's ``maybe_applied`` field; False for every other error, which ran nothing (but ``applied``)."""
        return self.extra.get("maybe_applied") is True

    @property
    def lost(self) -> list:
        """The request's sessions whose state is lost (410), when the error is one of them: its ``lost`` field."""
        return list(self.extra.get("lost") or ())

    @property
    def unknown(self) -> list:
        """The request's sessions that do not exist (404), when the error is one of them: its ``unknown`` field."""
        return list(self.extra.get("unknown") or ())


class BadRequest(ServiceError):
    status, code = 400, "bad_request"


class BodyTimeout(ServiceError):
    """The request body did not arrive within the server's ``body_timeout_s``; the server closes the
    connection after this answer."""
    status, code = 408, "body_timeout"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class NotFound(ServiceError):
    """No such route (a trailing ``/`` included: the server does not redirect), or a WebSocket to another path
    than ``/v1/conv/ws``."""
    status, code = 404, "not_found"


class MethodNotAllowed(ServiceError):
    """The route exists, but not with this method (its ``Allow`` header lists the ones it takes)."""
    status, code = 405, "method_not_allowed"


class HeaderTimeout(ServiceError):
    """The request line and headers did not arrive within the server's ``header_timeout_s``; the server closed
    the connection."""
    status, code = 408, "header_timeout"


class UpgradeRequired(ServiceError):
    """A plain ``GET`` of the WebSocket route: open a WebSocket instead."""
    status, code = 426, "upgrade_required"


class HeaderTooLarge(ServiceError):
    """The request line and headers exceed the server's ``max_header_bytes``; the server closed the connection."""
    status, code = 431, "header_too_large"


class OverCapacity(ServiceError):
    """The worker holds ``max_connections`` connections, all carrying a request; retry after Retry-After."""
    status, code = 503, "over_capacity"


class UnknownSession(ServiceError):
    status, code = 404, "unknown_session"


class UnknownLayer(ServiceError):
    status, code = 404, "unknown_layer"


class SessionExists(ServiceError):
    status, code = 409, "session_exists"


class PositionMismatch(ServiceError):
    """The ``position`` a conv or batch carried is not the session's position on that layer (the tokens it has
    committed there); nothing ran. ``position`` is the server's: an int, or for a batch one per session."""
    status, code = 409, "position_mismatch"

    @property
    def position(self):
        return self.extra.get("position")


class LateRequest(ServiceError):
    """A call whose ``request_id`` ``PREFIX:N`` is below the highest N the session has seen from that client (one
    ``PREFIX``): a late copy of an earlier call (an attempt that sat in the server while its retry ran, reaching
    the engine after the client's later calls), or a call sent again after later ones. Nothing ran."""
    status, code = 409, "late_request"


class StateLost(ServiceError):
    status, code = 410, "state_lost"


class PayloadTooLarge(ServiceError):
    status, code = 413, "payload_too_large"


class ShapeMismatch(ServiceError):
    status, code = 422, "shape_mismatch"


class DtypeUnsupported(ServiceError):
    status, code = 422, "dtype_unsupported"


class NonFinite(ServiceError):
    status, code = 422, "non_finite"


class QueueFull(ServiceError):
    status, code = 429, "queue_full"


class PoolExhausted(ServiceError):
    status, code = 503, "pool_exhausted"


class NotReady(ServiceError):
    status, code = 503, "not_ready"


class EngineUnavailable(ServiceError):
    """The engine process that holds the session is down (it died and is being restarted). A conv that was in
    flight when it died was lost with the session's state; once the engine is back the session answers
    ``410 state_lost``."""
    status, code = 503, "engine_unavailable"


class OutOfMemory(ServiceError):
    """The device ran out of memory in the engine step that carried the request; nothing of it was applied.
    Retry after Retry-After, or send smaller requests (fewer tokens per conv or batch)."""
    status, code = 503, "out_of_memory"


class StateUnwritable(ServiceError):
    """The server could not write the note this operation needs in its state folder first (a full disk, say):
    nothing was applied. Retry after Retry-After; the server logs the cause, for its operator to free space."""
    status, code = 503, "state_unwritable"


class RequestTimeout(ServiceError):
    status, code = 504, "timeout"


class EngineTimeout(ServiceError):
    """The engine process did not answer within the server's ``engine_reply_timeout_s``: it is alive but hung or
    far behind. Unlike ``504 timeout``, the request may have been applied: find out before sending it again
    (``GET /v1/sessions/{id}``: its positions, or whether it exists; a conv sent again with ``position`` is
    applied once: a repeat of an applied conv gets its answer, a mismatch says the server's position)."""
    status, code = 504, "engine_timeout"


class Internal(ServiceError):
    status, code = 500, "internal"


class ReplicaUnavailable(ServiceError):
    """Raised by a client routing over several replicas (never sent by a server): the replica that holds these
    sessions is down (it failed its health check, or a request to it failed on the network), or left the DNS
    name. The sessions are not moved: a session's state lives on its replica, so a moved session would start from
    nothing. The caller decides (re-prefill on a new session, or wait for the replica to come back).

    ``sessions``: the ids affected; ``replica``: the replica's URL; ``applied``: for a batch split over replicas,
    the sessions whose part did run."""
    status, code = 503, "replica_unavailable"

    def __init__(self, message: str, *, sessions=(), replica: Optional[str] = None, applied=(),
                 retry_after: Optional[float] = None):
        super().__init__(message, retry_after=retry_after)
        self.sessions = list(sessions)
        self.replica = replica
        self.applied = list(applied)


class OutcomeUnknown(ServiceError):
    """Raised by a client with ``track_positions`` (never sent by a server): a request got no answer within its
    retries (the connection kept failing after an attempt was sent), so it may have been applied or not.
    ``client.resync(session)`` reads the session's positions back from the server (applied on a layer whose
    position moved by its tokens); to be sure, send the same call again with ``position=e.positions`` (a conv:
    ``e.positions[0]``) and ``request_id=e.request_id``: a server that applied it answers from its kept answer or
    with a ``409`` naming that id, and one that did not applies it now. ``sessions``: the ids of the request;
    ``request_id``, ``layer``, ``positions`` (one per session): those it carried (None for an accept or a session
    operation); the exception's cause is the last connection error."""
    status, code = 504, "outcome_unknown"

    def __init__(self, message: str, *, sessions=(), request_id: Optional[str] = None, layer: Optional[int] = None,
                 positions=None):
        super().__init__(message)
        self.sessions = list(sessions)
        self.request_id = request_id
        self.layer = layer
        self.positions = None if positions is None else list(positions)


class Unreachable(ServiceError):
    """Raised by a client with ``track_positions`` (never sent by a server): no attempt of the request reached the
    server (every connection was refused or timed out while connecting), or the read of the session's positions
    that a tracked call makes first got no answer, so the request was never sent: nothing of it was applied, and
    calling it again is safe. ``sessions``: the ids of the request; the cause is the last connection error."""
    status, code = 503, "unreachable"

    def __init__(self, message: str, *, sessions=()):
        super().__init__(message, retry_after=1.0)
        self.sessions = list(sessions)


#: The name clients use for the base class.
ConvServeError = ServiceError

ALL_ERRORS = (BadRequest, BodyTimeout, Unauthorized, NotFound, MethodNotAllowed, HeaderTimeout, UpgradeRequired,
              HeaderTooLarge, OverCapacity, UnknownSession, UnknownLayer, SessionExists, PositionMismatch,
              LateRequest, StateLost, PayloadTooLarge, ShapeMismatch, DtypeUnsupported, NonFinite, QueueFull,
              PoolExhausted, NotReady, EngineUnavailable, OutOfMemory, StateUnwritable, RequestTimeout, EngineTimeout,
              Internal)

#: ``code -> class``, for turning an error body back into its class.
BY_CODE = {cls.code: cls for cls in ALL_ERRORS}
