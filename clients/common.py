"""What the sync and async clients share: request and result records, error decoding, the stream frame tracker,
and the request bodies."""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence, Union

import httpx

from convserve.clients.positions import UNSENT_ERRORS, PositionBook
from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BY_CODE as _BY_CODE
from convserve.clients.protocol.errors import (EngineTimeout, LateRequest, OutcomeUnknown, PositionMismatch,
                                              ServiceError, SessionExists, UnknownSession)

if TYPE_CHECKING:
    from convserve.clients.stream_tracker import _Tracker

_HEADERS = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
DEFAULT_URL = "http://127.0.0.1:8000"
#: Largest message the client decodes (a response tensor of 8192 tokens x 8192 channels of float32 fits).
MAX_MESSAGE_BYTES = 512 << 20
#: Frames grouped into one HTTP chunk when streaming a known list of requests.
_CHUNK_BYTES = 256 << 10
_POLL_S = 0.05
#: the longest a WebSocket stream's close waits for the server's close frame (less when the client's timeout is)
WS_CLOSE_S = 10.0


@dataclass
class ConvRequest:
    """One conv request of a stream. ``id`` defaults to the request's place in the stream; ``position``: the
    tokens the session has committed on this layer before it (exactly once: see docs/api.md, *Positions*), or None;
    ``request_id`` (with ``position``): its own id, the same when it is sent again (only its repeat matches)."""

    session: str
    layer: int
    x: Any
    speculative: bool = False
    id: Any = None
    position: Optional[int] = None
    request_id: Optional[str] = None


@dataclass
class BatchRequest:
    """One batch of a stream: the tokens of several sessions on one layer (the frame form of
    ``POST /v1/conv/batch``). ``x (sum(tokens), dim)`` holds each session's tokens in the order of ``sessions``;
    ``tokens`` defaults to one per session, ``speculative`` (a bool or one per session) to false."""

    sessions: Sequence[str]
    layer: int
    x: Any
    tokens: Optional[Sequence[int]] = None
    speculative: Union[bool, Sequence[bool], None] = None
    id: Any = None
    position: Optional[Sequence[int]] = None      # one per session, as ConvRequest's
    request_id: Optional[str] = None              # as ConvRequest's


@dataclass
class AcceptRequest:
    """A batched accept as a stream frame (``POST /v1/accept``'s body plus ``"op": "accept"``): each of
    ``sessions`` commits the first ``tokens[i]`` tokens of its pending verify (0 discards it). It runs before the
    frames of its sessions sent after it, so a frontend sends it and its next step's frames without waiting for
    its answer; its result's ``y`` is None (``ok`` says whether it was applied; whole or not at all, as
    :meth:`ConvClient.accept_batch`)."""

    sessions: Sequence[str]
    tokens: Sequence[int]
    id: Any = None
    request_id: Optional[str] = None              # PREFIX:N, as accept_batch's (a tracking client sets its own)

    @property
    def layer(self) -> None:
        """None: an accept acts on every layer with a pending verify (its result's ``layer``)."""
        return None


@dataclass
class ConvResult:
    """One answer of a stream: ``y`` on success, else ``error`` (the frame failed alone). For a
    :class:`BatchRequest`, ``session`` is its list of sessions and ``y`` is ``(sum(tokens), dim)``."""

    id: Any
    session: Union[str, list]
    layer: int
    y: Any = None
    error: Optional[ServiceError] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self):
        """``y``, or raise ``error``."""
        if self.error is not None:
            raise self.error
        return self.y


@dataclass
class SessionState:
    """A session's conv state: ``state`` is ``(len(layers), dim, width - 1)``, layers in ascending order."""

    layers: list
    state: Any


def error_from(err: Any, status: Optional[int] = None) -> ServiceError:
    """The exception for an ``{"code", "message", "retry_after"?}`` map."""
    if not isinstance(err, dict):
        e = ServiceError(f"the server answered {status} with an unreadable error body")
        e.status, e.code = status or 500, "internal"
        return e
    code = err.get("code") or "internal"
    cls = _BY_CODE.get(code, ServiceError)
    extra = {k: v for k, v in err.items() if k not in ("code", "message", "retry_after") and isinstance(k, str)}
    e = cls(str(err.get("message", "")), retry_after=err.get("retry_after"), **extra)
    if cls is ServiceError:
        e.code = code
    if status is not None:
        e.status = status
    return e


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    _raise_error(resp.status_code, resp.headers, resp.content)


def ws_refused(exc: Exception) -> Exception:
    """The error for a WebSocket handshake the server refused (websockets' ``InvalidStatus``): the class of the
    code in its body, as an HTTP answer's (401 ``Unauthorized``, say); any other exception as it is."""
    resp = getattr(exc, "response", None)
    if resp is None or not isinstance(getattr(resp, "status_code", None), int):
        return exc
    try:
        _raise_error(resp.status_code, resp.headers, bytes(resp.body or b""))
    except ServiceError as e:
        return e
    return exc


def ws_connect(connect, *args, **kwargs):
    """websockets' sync ``connect(...)``, a refused handshake raised as :func:`ws_refused` says."""
    from websockets.exceptions import InvalidStatus

    try:
        return connect(*args, **kwargs)
    except InvalidStatus as e:
        raise ws_refused(e) from None


async def ws_connect_async(connect, *args, **kwargs):
    """websockets' asyncio ``connect(...)``, awaited; a refused handshake raised as :func:`ws_refused` says."""
    from websockets.exceptions import InvalidStatus

    try:
        return await connect(*args, **kwargs)
    except InvalidStatus as e:
        raise ws_refused(e) from None


def _raise_error(status: int, headers, body: bytes) -> None:
    ct = headers.get("content-type", "")
    try:
        obj = wire.loads_json(body) if "json" in ct else wire.unpackb(body, MAX_MESSAGE_BYTES)
        err = obj.get("error") if isinstance(obj, dict) else None
    except ServiceError:
        err = None
    if err is None:
        e = ServiceError(f"HTTP {status}: {body[:200]!r}")
        e.status, e.code = status, f"http_{status}"
        raise e
    exc = error_from(err, status)
    if exc.retry_after is None and headers.get("retry-after") is not None:
        try:
            exc.retry_after = float(headers["retry-after"])
        except ValueError:
            pass
    raise exc


def error_of(resp: httpx.Response) -> Optional[ServiceError]:
    """The error an answer carries (the class of its code, with its extra fields), or None for a success: what a
    retrying client reads from the answers it may not retry blindly. Its ``applied``: some of a batch split across
    engine processes ran (one part failed), so a retry, its failed part's cause still there, would fail again: the
    caller learns which slices ran instead. Its ``maybe_applied``: the request may have run (its engine process
    died with it in flight, a stopping server cut it off), so its retry must not be told that nothing ran."""
    if resp.status_code < 400:
        return None
    try:
        _raise_error(resp.status_code, resp.headers, resp.content)
    except ServiceError as e:
        return e
    return None


def _decode(resp: httpx.Response) -> Any:
    _raise_for(resp)
    if not resp.content:
        return None
    return wire.unpackb(resp.content, MAX_MESSAGE_BYTES)


def _backend_of(x) -> str:
    return "torch" if wire._is_torch(x) else "numpy"


def _default_backend() -> str:
    import importlib.util

    return "torch" if importlib.util.find_spec("torch") is not None else "numpy"


def _as_request(r: Union[ConvRequest, BatchRequest, AcceptRequest, tuple, dict], i: int):
    if isinstance(r, (ConvRequest, BatchRequest, AcceptRequest)):
        req = r
    elif isinstance(r, dict):
        if r.get("op") == "accept":
            req = AcceptRequest(**{k: v for k, v in r.items() if k != "op"})
        else:
            req = BatchRequest(**r) if "sessions" in r else ConvRequest(**r)
    else:
        req = ConvRequest(*r)
    if req.id is None:
        req.id = i
    return req


def _frame(req: Union[ConvRequest, BatchRequest, AcceptRequest], shm=None) -> dict:
    """A stream or WebSocket frame of ``req``; an x lying in ``shm`` (the client's arena) goes by reference."""
    if isinstance(req, AcceptRequest):
        frame = {"id": req.id, "op": "accept", "sessions": _id_list(req.sessions),
                 "tokens": _int_list(req.tokens, "tokens")}
    elif isinstance(req, BatchRequest):
        frame = {"id": req.id, **_batch_fields(req.sessions, req.layer, req.x, req.tokens, req.speculative, shm)}
        if req.position is not None:
            frame["position"] = _int_list(req.position, "position")
    else:
        frame = {"id": req.id, "session": req.session, "layer": req.layer, "x": wire.encode_tensor(req.x, shm),
                 "speculative": req.speculative}
        if req.position is not None:
            frame["position"] = operator.index(req.position)
    if req.request_id is not None:
        frame["request_id"] = req.request_id
    return frame


def check_given_position(book, position, request_id=None) -> None:
    """An explicit ``position`` and ``request_id`` of a conv or batch call. Without ``track_positions`` a
    ``request_id`` goes with a ``position``. A client that tracks positions sends its own, and takes both
    together only to send again a call whose outcome is unknown (``OutcomeUnknown``'s ``positions`` and
    ``request_id``)."""
    if book is not None and (position is None) != (request_id is None):
        raise ValueError("position, request_id: this client tracks positions itself (track_positions=True) and "
                         "sends its own; pass neither, or both to send again a call that raised OutcomeUnknown "
                         "(position=e.positions, request_id=e.request_id)")
    if request_id is not None and position is None:
        raise ValueError("request_id goes with position (it tells a retry of the request applied there from "
                         "another request); pass both, or neither")


def _id_list(sessions, name: str = "sessions") -> list:
    """``sessions`` as a list of ids; a lone id (a str) is a TypeError, not a list of its characters."""
    if isinstance(sessions, (str, bytes)):
        raise TypeError(f"{name}: expected a list of session ids, got one {type(sessions).__name__}; wrap a single "
                        "id in a list: [session]")
    return list(sessions)


def _int_list(values, name: str) -> list:
    """``values`` as a list of ints (numpy integers too); a float or another non-integer is a TypeError rather
    than truncated."""
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        bad = next(v for v in values if not hasattr(v, "__index__"))
        raise TypeError(f"{name}: expected integers, got {bad!r:.40} ({type(bad).__name__})") from None


def _batch_fields(sessions, layer, x, tokens, speculative, shm=None) -> dict:
    """A batch's fields; ``tokens`` and ``speculative`` only when given (absent means one plain token each)."""
    fields = {"sessions": _id_list(sessions), "layer": layer, "x": wire.encode_tensor(x, shm)}
    if tokens is not None:
        fields["tokens"] = _int_list(tokens, "tokens")
    if speculative is not None:
        fields["speculative"] = _flags(speculative)
    return fields


def _any_speculative(speculative) -> bool:
    """Does a call's ``speculative`` (a bool, or one per session) mark any row speculative? (A value of another
    type counts as true: the server refuses it.)"""
    if isinstance(speculative, (list, tuple)) or getattr(speculative, "ndim", 0):
        return any(bool(f) for f in speculative)
    return bool(speculative)


def _flags(speculative) -> Union[bool, list]:
    """A batch's ``speculative`` as the wire takes it: one bool (numpy's and a 0-d tensor too) or one per
    session."""
    if isinstance(speculative, bool) or getattr(speculative, "ndim", None) == 0:
        return bool(speculative)
    return [bool(s) for s in speculative]


def _ws_url(base: str) -> str:
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + "/v1/conv/ws"
    if base.startswith("http://"):
        return "ws://" + base[len("http://"):] + "/v1/conv/ws"
    raise ValueError(f"url {base!r} must start with http:// or https://")


class _Base:
    def __init__(self, url: Optional[str], api_key: Optional[str], timeout: float, track_positions: bool = False,
                 max_retries: int = 3, retry_backoff_s: float = 0.05, shm=None):
        #: a :class:`~convserve.clients.protocol.shm.ShmArena`: an x lying in it is sent by reference, and its y
        #: comes back in the same block (a server on this host only); None: every tensor travels in the body
        self.shm = shm
        self.url = (url or os.environ.get("CONVSERVE_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("CONVSERVE_API_KEY")
        self.timeout = timeout
        self.headers = dict(_HEADERS)
        #: Bytes of conv bodies and stream frames sent and received (HTTP/WebSocket payload, headers not counted).
        self.bytes_sent = 0
        self.bytes_received = 0
        if self.api_key:
            self.headers["authorization"] = f"Bearer {self.api_key}"
        #: with ``track_positions``: the positions the client believes its sessions are at (see clients/positions.py)
        self.positions: Optional[PositionBook] = PositionBook(max_retries, retry_backoff_s) if track_positions \
            else None
        self._rid_prefix, self._rid_count = uuid.uuid4().hex[:20], itertools.count()

    @contextlib.contextmanager
    def _sent_from(self, x):
        """Around a call that may send ``x`` by reference (a block of :attr:`shm`): when the call ends without
        the server's answer (a timeout, a dropped connection, a cancelled task) or with ``504 engine_timeout``,
        the server may still read x there and write y over it, so the block is held out of the arena's reuse
        (:meth:`ShmArena.hold`)."""
        try:
            yield
        except BaseException as e:
            # (a failed connect sent nothing; every other failure may have)
            if self.shm is not None and not isinstance(e, UNSENT_ERRORS) and (
                    not isinstance(e, ServiceError) or isinstance(e, (EngineTimeout, OutcomeUnknown))):
                self._hold(x)
            raise

    def _hold(self, block) -> None:
        with contextlib.suppress(ValueError):      # the arena was closed meanwhile: nothing to hold
            self.shm.hold(block)

    def _resend_from_copy(self, x, speculative, body_of):
        """``rebody`` for a tracked call (:meth:`_retrying`), or None to send the first body again on a
        retry. A call with a speculative row whose x goes by reference is computed again when retried (the server
        keeps no verify's answer to repeat), and the server writes y over x's block before it answers: an answer
        lost on the way leaves y there. So such a call keeps a copy of x, made before the first attempt, and a
        retry sends that copy in the body (``body_of(copy)``; its y comes back in the body too), taking nothing
        from the arena, whose blocks other calls may be using. ``rebody(ran)``: ``ran`` when the attempt before
        may still be running on the server (it was sent and not refused), which may then still write y over x's
        block: the block is held (:meth:`ShmArena.hold`)."""
        if self.positions is None or self.shm is None or not _any_speculative(speculative) or \
                self.shm.locate(x) is None:
            return None
        keep = x.clone() if hasattr(x, "clone") else x.copy()
        held = []

        def rebody(ran: bool) -> bytes:
            if ran and not held:
                self._hold(x)
                held.append(x)
            return body_of(keep)

        return rebody

    def _ws_headers(self) -> dict:
        return {"authorization": self.headers["authorization"]} if self.api_key else {}

    @staticmethod
    def _state_from(obj, backend) -> SessionState:
        return SessionState(list(obj["layers"]), wire.decode_tensor(obj["state"], backend=backend, name="state"))

    def _stream_frame(self, req, shm=None) -> dict:
        """A stream or WebSocket frame of ``req``; a tracking client's carries its own ``request_id``
        (``PREFIX:N``, no position): the frames then order the client's calls on their sessions, so that a late
        copy of an earlier import or accept cannot overtake them. An x in ``shm`` (the client's arena, when the
        stream's tracker claimed x's block) goes by reference, and its y comes back in the same block."""
        frame = _frame(req, shm)
        if "request_id" not in frame and self.positions is not None:
            frame["request_id"] = self._request_id()
        return frame

    def _request_id(self) -> Optional[str]:
        """A tracked call's ``request_id``, the same in its retries: the server then answers a repeat only of
        this call, never of another request applied at the same position (one interrupted, say). ``PREFIX:N``,
        one prefix per client and N counting its calls: a verify's late copy (an attempt that sat in the server
        while its retry ran) reaching the engine after a later call of this client on the session is refused."""
        if self.positions is None:
            return None
        return f"{self._rid_prefix}:{next(self._rid_count)}"

    def _conv_body(self, session, layer, x, speculative, position=None, rid: Optional[str] = None) -> bytes:
        body = {"session": session, "layer": layer, "x": wire.encode_tensor(x, self.shm), "speculative": speculative}
        if position is not None:
            body["position"] = position
            if rid is not None:
                body["request_id"] = rid
        return wire.packb(body)

    def _batch_body(self, sessions, layer, x, tokens, speculative, position=None, rid: Optional[str] = None) -> bytes:
        fields = _batch_fields(sessions, layer, x, tokens, speculative, self.shm)
        if position is not None:
            fields["position"] = _int_list(position, "position")
            if rid is not None:
                fields["request_id"] = rid
        return wire.packb(fields)

    @staticmethod
    def _list_path(cursor: Optional[str], limit: Optional[int]) -> str:
        q = {k: v for k, v in (("cursor", cursor), ("limit", limit)) if v is not None}
        return "/v1/sessions" + ("?" + urllib.parse.urlencode(q) if q else "")

    @staticmethod
    def _batch_rows(sessions, x, tokens, speculative) -> tuple[list, list]:
        """Each session's tokens and speculative flag, as the server reads a batch's defaults."""
        n = len(sessions)
        toks = [1] * n if tokens is None else _int_list(tokens, "tokens")
        f = False if speculative is None else _flags(speculative)
        spec = [f] * n if isinstance(f, bool) else f
        return toks, spec

    def _late_retry(self, att, sessions, sent_again: bool) -> OutcomeUnknown:
        """A tracked call's retry refused as ``late_request`` after an attempt that may have run, or the call
        ``sent_again`` with its ``request_id`` so refused: the server saw a later call of this client on the session
        meanwhile, so the refusal says nothing of the earlier attempt. Its outcome is unknown
        (:meth:`Attempts.late`), and the sessions' positions are read again at their next tracked call."""
        self.positions.unknown_outcome(sessions)
        return att.late(sent_again)

    def _batch_answer(self, body: bytes, resp, retried: bool, sessions, layer, x, tokens, speculative, pos,
                      rid=None, marks=None, att=None, sent_again: bool = False) -> tuple:
        """A ``/v1/conv/batch`` call's answer (both clients' ``conv_batch``): its bytes counted, its body decoded,
        and with a position book what a refusal tells it (a mismatch after a retry or on a call sent again, the
        parts of a split batch that ran, a retry refused as late after an attempt that may have run, or the call
        ``sent_again`` with its ``request_id`` so refused: ``att``'s :class:`OutcomeUnknown`). Returns ``(answer,
        tokens per session, speculative per session)``."""
        book = self.positions
        self.bytes_sent += len(body)
        self.bytes_received += len(resp.content)
        toks, spec = self._batch_rows(sessions, x, tokens, speculative)
        try:
            return _decode(resp), toks, spec
        except PositionMismatch as e:       # (a split batch's part refused after other parts ran: those count)
            if book is not None:
                ran = e.extra.get("applied") or ()
                book.partly_applied(e, list(sessions), layer, pos, toks, spec, marks)
                if retried:
                    book.moved_on(e, list(sessions), layer, pos, toks, spec, rid, skip=frozenset(ran))
            raise
        except ServiceError as e:   # a batch split across engines, some of whose parts ran: they count
            if book is not None:
                if isinstance(e, LateRequest) and att is not None and (att.maybe_ran or sent_again):
                    raise self._late_retry(att, list(sessions), sent_again) from e
                book.partly_applied(e, list(sessions), layer, pos, toks, spec, marks)
            raise

    def _batch_y(self, answer: tuple, sessions, layer, x, pos=None, marks=None):
        """The y of a batch answer (:meth:`_batch_answer`), the rows it applied (at ``pos``, sent when the book's
        marks were ``marks``) noted in the position book."""
        obj, toks, spec = answer
        if self.positions is not None:
            for s, p, n, f, mk in zip(sessions, pos, toks, spec, marks or [None] * len(sessions)):
                self.positions.applied_at(s, layer, p, n, f, mk)
        return wire.decode_tensor(obj["y"], backend=_backend_of(x), name="y", shm=self.shm)

    def _ws_results(self, msg, unpacker, tracker: _Tracker) -> Iterator["ConvResult"]:
        """The results in one WebSocket message (binary: msgpack frames), counted in ``bytes_received``."""
        if isinstance(msg, str):
            raise ServiceError(f"the server sent a text message: {msg[:200]}")
        self.bytes_received += len(msg)
        unpacker.feed(msg)
        for obj in unpacker:
            yield tracker.result(obj)

    @staticmethod
    def _created(answer: tuple, att, sid: str) -> str:
        """The id a tracked create or fork of ``sid`` made (``answer``: its ``(response, retries)``). A retry
        refused because ``sid`` exists, after an attempt that may have been applied: that attempt made it (an id
        the client made is known to no one else; one the caller chose is taken as the caller's). Refused as a late
        copy (``late_request``): the server received an attempt of this call before, and made the session then (it
        was removed since, by another client)."""
        try:
            return _decode(answer[0])["session"]
        except (SessionExists, LateRequest):
            if not att.maybe_ran:
                raise
            return sid

    @staticmethod
    def _deleted(answer: tuple, att) -> None:
        """A tracked delete's answer: a retry that finds no session, or is refused as a late copy (the session was
        made again under the id since), after an attempt that may have been applied, found that attempt's work
        done."""
        try:
            _raise_for(answer[0])
        except (UnknownSession, LateRequest):
            if not att.maybe_ran:
                raise


def _chunked(requests: Iterable, tracker: _Tracker, failed: list, frame=_frame) -> Iterator[bytes]:
    """Encode requests into HTTP chunks of ~256 KiB (the whole body is sent before any answer is read). A request
    that cannot be encoded (or an error of ``requests`` itself) ends the body after the frames before it, which are
    sent and answered; the error goes into ``failed``, for the reader to raise after their answers."""
    packer = wire.new_packer()
    buf, size = [], 0
    try:
        for i, r in enumerate(requests):
            req = _as_request(r, i)
            b = tracker.packed(req, frame, packer)
            buf.append(b)
            size += len(b)
            if size >= _CHUNK_BYTES:
                yield b"".join(buf)
                buf, size = [], 0
    except Exception as e:  # noqa: BLE001 - raised by the reader once the frames sent are answered
        failed.append(e)
    if buf:
        yield b"".join(buf)
