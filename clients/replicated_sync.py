""":class:`ReplicatedConvClient`: what ``ConvClient([url, ...])`` or ``ConvClient("dns://name:port")`` builds.

The same methods as :class:`.sync_client.ConvClient`, each sent to the replica that holds its session (the rules
are :class:`.replicas.Router`'s); one plain ``ConvClient`` per replica does the HTTP. Batches are split by
replica, the parts run concurrently on a thread pool and ``y`` is joined in the batch's order. A thread asks
every replica's ``/readyz`` every ``health_interval_s`` and resolves a DNS name again every
``resolve_interval_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Optional, Sequence

import httpx

from convserve.clients.common import AcceptRequest, BatchRequest, ConvResult, SessionState, _as_request
from convserve.clients.protocol.errors import (OutcomeUnknown, ReplicaUnavailable, ServiceError, SessionExists,
                                              StateLost, UnknownSession, Unreachable)
from convserve.clients.replicas import (Endpoints, Router, batch_failure, health_result, join_batch, maybe_applied,
                                        merged_model, part_position, routed_url, split_batch, SessionsWalk)
from convserve.clients.stream_tracker import ReadAheadPins, StreamsEnd
from convserve.clients.sync_client import ConvClient


def network_errors() -> tuple:
    """The exceptions that mean "the replica did not answer" (connection refused or reset, timeouts, a WebSocket
    that closed abnormally), as opposed to an error answer."""
    from websockets.exceptions import WebSocketException

    return httpx.TransportError, OSError, WebSocketException


def unavailable(router: Router, url: str, sessions: list, e: BaseException) -> ReplicaUnavailable:
    """Mark ``url`` down after a network failure and the error for ``sessions``."""
    router.mark(url, False, f"{type(e).__name__}: {e}")
    err = ReplicaUnavailable(f"replica {url} failed while serving session(s) {', '.join(sessions)[:400]} "
                             f"({type(e).__name__}: {e}); a request in flight may or may not have run. Their "
                             "state is on that replica: start new sessions (re-prefill), or retry once it is back",
                             sessions=sessions, replica=url, retry_after=1.0)
    err.__cause__ = e
    return err


def failure(router: Router, url: str, sessions: list, e: BaseException, net: tuple) -> Optional[BaseException]:
    """What a call to replica ``url`` for ``sessions`` that raised ``e`` raises instead (None: ``e`` itself). A
    network failure marks the replica down (:func:`unavailable`), and so does a tracked client's
    :class:`Unreachable` (its connects all failed) or an :class:`OutcomeUnknown` lost on the network (which is
    raised as it is: it names the call to send again). Not ``PoolTimeout``: no free connection in this client's
    pool says nothing about the replica."""
    if isinstance(e, httpx.PoolTimeout):
        return None
    if isinstance(e, net) or isinstance(e, Unreachable):
        return unavailable(router, url, sessions, e)
    if isinstance(e, OutcomeUnknown) and isinstance(e.__cause__, net):
        router.mark(url, False, f"{type(e.__cause__).__name__}: {e.__cause__}")
    return None


#: how often a stream's feeder, waiting for room in a replica's queue, looks whether the caller left
_STOP_POLL_S = 0.05


class ReplicatedConvClient(ConvClient):
    """:class:`ConvClient` over several replicas (see :mod:`.replicas`). Extra keywords: ``health_interval_s``
    (default 2), ``resolve_interval_s`` (default 10, DNS endpoints), ``resolver`` (``host -> [addresses]``, for
    tests or a custom discovery); the others go to each replica's ``ConvClient``."""

    def __init__(self, url=None, *, api_key: Optional[str] = None, timeout: float = 60.0,
                 health_interval_s: float = 2.0, resolve_interval_s: float = 10.0, resolver=None, **client_kwargs):
        if url is None:                       # CONVSERVE_URL, which named several replicas (see ConvClient)
            url = routed_url(None)
            if url is None:
                raise ValueError("url: give the replicas (a list of URLs, comma-separated URLs or dns://name:port), "
                                 "or set CONVSERVE_URL to them")
        self.router = Router(Endpoints.parse(url, resolver))
        self.url = self.router.endpoints.describe()
        self.api_key, self.timeout = api_key, timeout
        self.health_interval_s, self.resolve_interval_s = health_interval_s, resolve_interval_s
        self._client_kwargs = dict(api_key=api_key, timeout=timeout, **client_kwargs)
        self.shm = client_kwargs.get("shm")    # as each replica's client has it (callers read it)
        self._clients: dict[str, ConvClient] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="convserve-replica")
        self._closed = threading.Event()
        self._net = network_errors()
        self.refresh(resolve=True)          # placement needs the live replicas from the first call on
        self._checker = threading.Thread(target=self._check_loop, name="convserve-replica-health", daemon=True)
        self._checker.start()

    # --- replicas

    def _client(self, url: str) -> ConvClient:
        with self._lock:
            c = self._clients.get(url)
            if c is None:
                c = self._clients[url] = ConvClient(url, **self._client_kwargs)
            return c

    def refresh(self, resolve: bool = False) -> None:
        """Resolve the endpoints again (``resolve``) and check every replica's ``/readyz`` now, concurrently."""
        if resolve:
            try:
                self.router.set_urls(self.router.endpoints.resolve())
            except OSError:                 # DNS unreachable: keep what we have
                pass
        list(self._pool.map(self._check, self.router.urls()))

    def _check(self, url: str) -> None:
        try:
            r = self._client(url)._http.get("/readyz", timeout=min(self.timeout, 5.0))
            self.router.mark(url, *health_result(r.status_code, r.headers))
        except self._net as e:
            self.router.mark(url, False, f"{type(e).__name__}: {e}")

    def _check_loop(self) -> None:
        next_resolve = time.monotonic() + self.resolve_interval_s
        while not self._closed.wait(self.health_interval_s):
            resolve = self.router.endpoints.dns is not None and time.monotonic() >= next_resolve
            if resolve:
                next_resolve = time.monotonic() + self.resolve_interval_s
            try:
                self.refresh(resolve)
            except RuntimeError:            # the pool was shut down by close()
                return

    def replicas(self) -> list[dict]:
        """Every replica: ``url``, ``name``, ``up``, ``listed``, ``why`` (down) and the ``sessions`` placed on it."""
        return self.router.status()

    def replica_of(self, session: str) -> str:
        """The URL of the replica that holds (or will hold) ``session``."""
        return self.router.place(session)

    def _on(self, session: str, fn, *args, **kw):
        """``fn(client of session's replica, *args)``; a network failure is :class:`ReplicaUnavailable`."""
        url = self.router.route(session)
        try:
            return fn(self._client(url), *args, **kw)
        except Exception as e:
            err = failure(self.router, url, [session], e, self._net)
            if err is None:
                raise
            raise err from e

    def _any(self, fn):
        """``fn(client)`` on a live replica (model information: every replica serves the same model)."""
        live = self.router.live()
        if not live:
            self.refresh()
            live = self.router.live()
        for url in sorted(live.values()):
            try:
                return fn(self._client(url))
            except self._net as e:
                self.router.mark(url, False, f"{type(e).__name__}: {e}")
        raise ReplicaUnavailable(f"no replica of {self.url} is up", retry_after=1.0)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in list(self._clients.values()))

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in list(self._clients.values()))

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in list(self._clients.values()):
            c.close()

    # --- health and model

    def health(self) -> bool:
        """True when at least one replica is up."""
        return bool(self.router.live())

    def ready(self) -> bool:
        self.refresh()
        return bool(self.router.live())

    def model(self) -> dict:
        """The live replicas' model as one (:func:`~convserve.clients.replicas.merged_model`): the first one's,
        with ``replicas`` (each one's ``url``, ``name``, ``weights_sha256``, ``slots`` and ``limits``) and the
        tightest of their ``limits``. Raises :class:`ServiceError` (``replica_mismatch``) when live replicas serve
        different weights."""
        live = self.router.live()
        infos = [(u, f.result()) for u, f in [(u, self._pool.submit(self._try_model, u)) for u in live.values()]]
        infos = [(u, i) for u, i in infos if i is not None]
        if not infos:
            return self._any(lambda c: c.model())
        return merged_model(infos, {u: n for n, u in live.items()})

    def _try_model(self, url: str) -> Optional[dict]:
        try:
            return self._client(url).model()
        except self._net as e:
            self.router.mark(url, False, f"{type(e).__name__}: {e}")
            return None

    def model_weights(self) -> bytes:
        return self._any(lambda c: c.model_weights())

    # --- sessions

    def create_session(self, session: Optional[str] = None) -> str:
        """A new session on the replica it hashes to (the client picks a UUID when ``session`` is None)."""
        sid = session if session is not None else self.router.new_id()
        placed = self.router.where(sid)     # an earlier attempt's placement: kept, it may have created it there
        try:
            return self._on(sid, ConvClient.create_session, sid)
        except SessionExists:
            raise                           # it exists where it was placed: keep the placement
        except BaseException as e:
            if placed is None and not maybe_applied(e):   # placed by this call, not created: placed afresh next
                self.router.forget(sid)
            raise

    def delete_session(self, session: str) -> None:
        try:
            self._on(session, ConvClient.delete_session, session)
        except (UnknownSession, StateLost):
            self.router.forget(session)
            raise
        self.router.forget(session)

    def fork(self, session: str, new_session: Optional[str] = None) -> str:
        """The fork lives on its source's replica (the state is there), whatever its id hashes to."""
        url = self.router.route(session)
        new = new_session if new_session is not None else self.router.new_id()
        was = self.router.pin(new, url)     # before it is sent: a fork whose answer is lost lives there too
        try:
            return self._on(session, ConvClient.fork, session, new)
        except BaseException as e:
            if isinstance(e, SessionExists) or not maybe_applied(e):
                self.router.pin(new, was)   # not forked (an existing id stays where it was)
            raise

    def list_sessions(self, cursor: Optional[str] = None, limit: Optional[int] = None) -> dict:
        """One page of every replica's sessions, replica by replica: ``{"sessions": [session_info...], "next",
        "unavailable"}``, each info with its ``replica`` (URL); pass ``next`` as the cursor of the following page
        (None when it was the last; ``limit`` is per replica). A replica down or failing is passed over and named
        in ``unavailable``: its sessions are not in the listing."""
        w = SessionsWalk(self.router.servers(), cursor)
        while (url := w.server()) is not None:
            try:
                page = ConvClient.list_sessions(self._client(url), w.inner, limit)
            except (*self._net, Unreachable) as e:      # (a tracking client's retried read: none answered)
                self.router.mark(url, False, f"{type(e).__name__}: {e}")
                w.failed()
                continue
            except ServiceError as e:                   # it answers, but cannot list now (503 not_ready, say)
                if e.status < 500:
                    raise
                w.failed()
                continue
            out = w.page(page)
            if out is not None:
                return out
        return w.done()

    def resync(self, session: str) -> dict:
        """As :meth:`ConvClient.resync`, on the session's replica (whose client keeps its positions)."""
        return self._on(session, ConvClient.resync, session)

    def export_state(self, session: str, backend: Optional[str] = None) -> SessionState:
        return self._on(session, ConvClient.export_state, session, backend)

    def import_state(self, session: str, state, layers=None) -> None:
        self._on(session, ConvClient.import_state, session, state, layers)

    def session_info(self, session: str) -> dict:
        return self._on(session, ConvClient.session_info, session)

    def accept(self, session: str, tokens: int) -> None:
        self._on(session, ConvClient.accept, session, tokens)

    def conv(self, session: str, layer: int, x, speculative: bool = False, position: Optional[int] = None,
             request_id: Optional[str] = None):
        return self._on(session, ConvClient.conv, session, layer, x, speculative, position, request_id)

    # --- batches: split by replica, parts concurrently, joined in order

    def _parts(self, parts, call):
        """Run ``call(client, part)`` for every part, concurrently; outcomes (a result or an exception) in order."""
        def run(p):
            try:
                return call(self._client(p.url), p)
            except BaseException as e:  # noqa: BLE001 - returned, raised by the caller with the others' outcome
                return (failure(self.router, p.url, p.sessions, e, self._net) if isinstance(e, Exception)
                        else None) or e
        if len(parts) == 1:
            return [run(parts[0])]
        return list(self._pool.map(run, parts))

    def conv_batch(self, sessions: Sequence[str], layer: int, x, tokens: Optional[Sequence[int]] = None,
                   speculative=None, position: Optional[Sequence[int]] = None, request_id: Optional[str] = None):
        """:meth:`ConvClient.conv_batch` over replicas: one request per replica, concurrently, y in order. When a
        part fails, the error's ``applied`` lists the sessions whose parts ran (they are not undone)."""
        split = self.router.split(sessions)
        if len(split) == 1:                 # one replica: the request as given, no copy
            url = next(iter(split))
            try:
                return self._client(url).conv_batch(sessions, layer, x, tokens, speculative, position, request_id)
            except Exception as e:
                err = failure(self.router, url, list(sessions), e, self._net)
                if err is None:
                    raise
                raise err from e
        parts = split_batch(split, sessions, x, tokens, speculative)
        outcomes = self._parts(parts, lambda c, p: c.conv_batch(p.sessions, layer, p.x, p.tokens, p.speculative,
                                                                part_position(position, p), request_id))
        err = batch_failure(parts, outcomes)
        if err is not None:
            raise err
        return join_batch(len(sessions), tokens, parts, outcomes)

    def accept_batch(self, sessions: Sequence[str], tokens: Sequence[int]) -> None:
        """:meth:`ConvClient.accept_batch` over replicas: all-or-nothing within each replica, not across them."""
        split = self.router.split(sessions)
        parts = split_batch(split, sessions, list(range(len(sessions))), None, None)
        outcomes = self._parts(parts, lambda c, p: c.accept_batch(p.sessions, [tokens[i] for i in p.positions]))
        err = batch_failure(parts, outcomes)
        if err is not None:
            raise err

    # --- streams: one sub-stream per replica

    def stream(self, requests: Iterable, *, transport: str = "http", window: int = 64) -> Iterator[ConvResult]:
        """:meth:`ConvClient.stream` over replicas: each request goes to its session's replica (one stream per
        replica, ``window`` each). A replica that fails answers its own requests with :class:`ReplicaUnavailable`
        results; the others go on. A :class:`BatchRequest` or :class:`AcceptRequest` must keep to one replica (use
        :meth:`conv_batch` or :meth:`accept_batch`, which split)."""
        if transport not in ("http", "ws"):
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")
        out: queue.Queue = queue.Queue()
        inputs: dict[str, queue.Queue] = {}
        end = object()

        def target(req) -> str:
            if isinstance(req, (BatchRequest, AcceptRequest)):
                split = self.router.split(req.sessions)
                if len(split) > 1:
                    raise ValueError(f"stream request {req.id!r}: a {type(req).__name__}'s sessions live on "
                                     f"{len(split)} replicas; send it with "
                                     f"{'conv_batch' if isinstance(req, BatchRequest) else 'accept_batch'}, which "
                                     "splits it")
                return next(iter(split))
            return self.router.route(req.session)

        # the caller left, or a replica's stream failed: nothing more is taken from ``requests``, nor sent
        stop = threading.Event()
        left = False                    # the caller left: the answers still coming are not yielded
        lead: dict[str, threading.Semaphore] = {}   # a replica's requests queued, not yet taken by its stream
        # answers handed on and not yet done with by the caller, per replica (None: the feeder's own, for requests
        # no replica could take): the caller's pace holds whoever answers, at most `window` answers each
        held: dict[Optional[str], threading.Semaphore] = {None: threading.Semaphore(window)}
        lock = threading.Lock()         # the stop and the replicas' queues: none is made once stopped

        def hand(url, res):
            while not held[url].acquire(timeout=_STOP_POLL_S) and not stop.is_set():
                continue
            out.put(("res", (res, url)))

        def feeder():
            try:
                for i, r in enumerate(requests):
                    if stop.is_set():
                        break
                    req = _as_request(r, i)
                    pins.take(req)
                    try:
                        url = target(req)
                    except ReplicaUnavailable as e:
                        hand(None, _failed(req, e))     # it may wait for the caller, who may leave meanwhile
                        if stop.is_set():
                            break
                        continue
                    with lock:
                        if stop.is_set():
                            break
                        if url not in inputs:
                            inputs[url], lead[url] = queue.Queue(), threading.Semaphore(window)
                            held[url] = threading.Semaphore(window)
                            threading.Thread(target=replica_stream, args=(url, inputs[url]), daemon=True,
                                             name="convserve-replica-stream").start()
                    # at most `window` requests ahead of that replica's stream; the wait ends at the stop too
                    while not lead[url].acquire(timeout=_STOP_POLL_S) and not stop.is_set():
                        continue
                    if stop.is_set():
                        break
                    inputs[url].put(req)
            except BaseException as e:  # noqa: BLE001 - raised by the reader once what was fed is answered
                out.put(("failed", e))
            finally:
                with lock:
                    for q in inputs.values():
                        q.put(end)
                    out.put(("fed", len(inputs)))

        def replica_stream(url, q):
            pending: dict = {}
            ended = []          # the end was taken: the queue holds nothing more for this replica

            def take(timeout=None):
                req = q.get(timeout=timeout)
                if req is end or stop.is_set():  # after the caller left, a queued request is not sent
                    ended.append(True)
                    return end
                lead[url].release()
                return req

            taking = threading.Lock()   # a request taken by the stream's sender is in `pending` before it is let go
            broken = []                 # the stream failed: a sender it left behind takes nothing more

            def reqs():
                while True:
                    with taking:
                        if broken:
                            return
                        try:    # polled, so that a sender left behind by a failed stream sees `broken`
                            req = take(_STOP_POLL_S)
                        except queue.Empty:
                            continue
                        if req is end:
                            return
                        pending[req.id] = req
                    yield req
            try:
                for res in self._client(url).stream(reqs(), transport=transport, window=window):
                    pending.pop(res.id, None)
                    hand(url, res)
            except self._net as e:
                err = unavailable(self.router, url, [], e)
                with taking:    # what a sender left behind took is in `pending`; from here this loop alone takes
                    broken.append(err)
                while True:     # every request of this replica, sent or not, answers with the failure
                    for req in list(pending.values()):
                        hand(url, _failed(req, err))
                    pending.clear()
                    if ended or (req := take()) is end:
                        break
                    pending[req.id] = req
            except BaseException as e:  # noqa: BLE001 - raised by the reader
                out.put(("raise", e))
            finally:
                out.put(("done", url))

        def halt() -> int:
            """Stop the feeder and every replica's stream after what they sent; the number of streams."""
            with lock:
                stop.set()
                for q in inputs.values():
                    q.put(end)              # wakes a stream waiting for its next request
                return len(inputs)          # final: the feeder makes no queue after the stop

        pins = ReadAheadPins(self.shm)
        threading.Thread(target=feeder, daemon=True, name="convserve-replica-feeder").start()
        end_of = StreamsEnd()
        try:
            while end_of.running:
                kind, val = out.get()
                if kind == "res":
                    res, url = val
                    try:
                        if not left:
                            yield res
                    except GeneratorExit:   # the replicas' streams end once what they sent is answered
                        left, end_of.started = True, halt()
                    finally:
                        pins.given(res)     # the caller asked for the next (or left): y's block is its own
                        held[url].release()
                elif end_of.note(kind, val, left):
                    end_of.started = halt()
            end_of.check(left)
        finally:
            halt()                          # on every way out: no feeder left waiting on a queue nobody reads
            pins.close()


def _failed(req, err: ReplicaUnavailable) -> ConvResult:
    many = isinstance(req, (BatchRequest, AcceptRequest))
    sessions = list(req.sessions) if many else [req.session]
    e = ReplicaUnavailable(err.message, sessions=sessions, replica=err.replica, retry_after=err.retry_after)
    return ConvResult(req.id, sessions if many else req.session, req.layer, error=e)
