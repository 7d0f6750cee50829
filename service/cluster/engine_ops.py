"""The session operations of an engine process (:class:`~.engine_proc.EngineProcess` takes them from its socket):
each queued in the engine where it arrived among its session's calls and answered from its future, a delete or an
import once its rewind note is durable, a create or fork of an id whose last removal's note is not durable yet
queued once it is."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time

from convserve.clients.protocol.errors import BadRequest, ServiceError, StateUnwritable

from . import messages as m

log = logging.getLogger("convserve.engine_proc")


class EngineOps:
    """The session operations of :class:`~.engine_proc.EngineProcess` (``engine``, ``snapshots``, ``settings``,
    ``pool``, ``journal`` and ``_send`` are its)."""

    def _op(self, ident: bytes, head: dict, data) -> None:
        """A session operation, on the worker thread as it arrives: queued with :meth:`Engine.submit_op` here, so
        each is ordered where it arrived among its session's convs and operations (as the in-process engine orders
        calls), and answered from its future (a delete or an import once its rewind note is durable:
        :meth:`_answer_durable`); a create or fork of an id whose last removal's note is not durable yet is queued
        once it is (:meth:`_after_removal_noted`). A list runs here; the weights file is built on a thread."""
        name, args, rid = head["f"], list(head.get("a") or ()), head.get("ri")
        if name not in m.OPS:
            raise BadRequest(f"unknown session operation {name!r}")
        eng = self.engine
        if name == "model_weights":
            self.pool.submit(eng.model_weights).add_done_callback(lambda f: self._op_done(ident, head, f))
        elif name == "list_sessions":
            self._op_finished(ident, head, eng.list_sessions(*args))
        elif name == "create_with_state":
            sid, positions, pending = args
            state, spec = m.get_tensors(head, data)

            def create_with_state() -> None:
                eng.create_session_now(sid, rid)       # (never queued: the id's removal note was waited for)
                try:
                    fut = eng.submit_op("import_state", sid, state, positions, pending, spec)
                except BaseException:
                    with contextlib.suppress(Exception):   # (the engine stopping: nothing to remove)
                        eng.submit_op("drop_created", sid)
                    raise
                fut.add_done_callback(lambda f: self._created_with_state(ident, head, f))

            # the new id of a fork from another engine may have been evicted or deleted here: as a create
            self._after_removal_noted(ident, head, sid, create_with_state)
        else:
            if name == "import_state":
                args.append(m.get_tensors(head, data)[0])
            made = args[0] if name == "create_session" and args else \
                args[1] if name == "fork_session" and len(args) > 1 else None
            self._after_removal_noted(ident, head, made, lambda: self._submit_op(ident, head, name, args, rid))

    def _after_removal_noted(self, ident: bytes, head: dict, made, go) -> None:
        """``go()`` now, or from the journal's syncer once the note of ``made``'s last removal is durable
        (:meth:`Snapshotter.before_create`), answering what it raises there (on the worker thread
        :meth:`_handle_one` does). A wait past ``request_timeout_s`` makes nothing and answers ``503
        state_unwritable``, as ``--workers 0`` does: the worker (``engine_reply_timeout_s`` above it) may have
        answered 504 by then, and the session would be made behind its client's back, after its later calls."""
        noted = None if made is None or self.snapshots is None else self.snapshots.before_create(made)
        if noted is None:
            go()
            return
        deadline = time.monotonic() + self.settings.request_timeout_s

        def noted_now(done) -> None:
            if done.exception() is not None or time.monotonic() > deadline:
                self._send(ident, m.error_reply(head["i"], StateUnwritable(
                    f"the note of {made!r}'s earlier removal was not durable in the state folder within "
                    f"request_timeout_s={self.settings.request_timeout_s:g} s (see the server log); nothing was "
                    "made: retry after Retry-After", retry_after=1.0)))
                return
            try:
                go()
            except Exception as e:  # noqa: BLE001 - answered, as _handle_one answers what the worker thread raises
                self._send(ident, m.error_reply(head["i"], e))

        noted.add_done_callback(noted_now)

    def _submit_op(self, ident: bytes, head: dict, name: str, args: list, rid) -> None:
        """Queue the operation and answer it from its future."""
        fut = self.engine.submit_op("export_for_move" if name == "export_for_fork" else name, *args, request_id=rid)
        if name in _NOTED_IDS:
            fut.add_done_callback(lambda f: self._answer_durable(ident, head, f))
        else:
            fut.add_done_callback(lambda f: self._op_done(ident, head, f))

    def _answer_durable(self, ident: bytes, head: dict, fut: cf.Future) -> None:
        """Answer an operation the rewind journal notes (a delete, an import) once its note is durable, not before:
        a host crash cannot then undo what a client was told is done (an unanswered one may be either way)."""
        snaps = self.snapshots
        if snaps is None or fut.exception() is not None:
            self._op_done(ident, head, fut)
            return
        result = fut.result()
        self._op_ran(head, result)                    # now, in its order (a create of its id may follow at once)
        noted = snaps.note_of(head["a"][0])
        if noted is None:
            self._answer_op(ident, head, result)
        else:
            noted.add_done_callback(lambda _d: self._answer_op(ident, head, result))

    def _created_with_state(self, ident: bytes, head: dict, fut: cf.Future) -> None:
        """A session moved here: created at arrival, its state imported in its turn; a failed import removes
        it again (nothing else can have used it: its id was answered to no one yet)."""
        if fut.exception() is not None:
            try:
                self.engine.submit_op("drop_created", head["a"][0])
            except Exception:  # noqa: BLE001 - already gone, or the engine is stopping: nothing to remove
                pass
        self._answer_durable(ident, head, fut)

    def _op_done(self, ident: bytes, head: dict, fut: cf.Future) -> None:
        exc = fut.exception()
        if exc is not None:
            self._send(ident, m.error_reply(head["i"], exc))
        else:
            self._op_finished(ident, head, fut.result())

    def _op_finished(self, ident: bytes, head: dict, result) -> None:
        """Answer an operation that ran: exactly one reply, whatever fails here (see :meth:`_op_ran` and
        :meth:`_answer_op`)."""
        self._op_ran(head, result)
        self._answer_op(ident, head, result)

    def _op_ran(self, head: dict, result) -> None:
        """An operation ran: journaled and its slot counts published, in its order among the operations (the
        answer may come later). Best effort: a failed write is logged; the operation did run, so it is answered
        as such."""
        name = head["f"]
        try:
            with self._journal_lock:
                self.journal.record(name, result, head.get("a") or (), self.engine)
            if name in ("create_session", "fork_session", "create_with_state", "delete_session"):
                self._publish_slots()                # before the answer: /v1/model after it sees the change
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("engine: cannot journal or publish a session operation", extra={"op": name})

    def _answer_op(self, ident: bytes, head: dict, result) -> None:
        """The answer of an operation that ran; one that cannot be built is an error that says it ran."""
        name, mid = head["f"], head["i"]
        try:
            self._reply_op(ident, mid, result)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.exception("engine: cannot build the answer of a session operation", extra={"op": name})
            self._send(ident, m.error_reply(mid, ServiceError(
                f"the operation {name} ran, but its answer could not be sent ({type(e).__name__}: {e}); "
                "GET the session to see its state")))

    def _reply_op(self, ident: bytes, mid: int, result) -> None:
        reply, spec = {"i": mid, "ok": None}, None
        if isinstance(result, tuple):     # (state, positions, pending, verify x) of a session moving to another engine
            result, reply["pos"], reply["pend"], spec = result
        if isinstance(result, bytes):                 # the weights file: as a second frame
            self._send(ident, {"i": mid, "ok": None, "bytes": True}, result)
        elif hasattr(result, "untyped_storage"):     # a state tensor (and a verify x): as a second frame
            self._send(ident, reply, m.put_tensors(reply, result, spec))
        else:
            self._send(ident, {"i": mid, "ok": result})


#: the operations whose answer waits for the rewind note of their id (a create or fork waits before it is queued:
#: Snapshotter.before_create)
_NOTED_IDS = ("delete_session", "import_state")
