"""The session operations of :class:`.remote.RemoteEngine` (create, delete, fork, export, import, info, list,
accept), each a blocking call to the engine that holds the session, made from the HTTP routes' threads.

A fork onto another engine goes through export and import (its pending verify with it); a listing merges every
engine's page by id; an ``accept_batch`` split across engines is checked whole, then by each engine, before any
part commits; a part refused after another committed (a concurrent change, an engine that died) answers with the
committed sessions in its error's ``applied`` field.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Optional, Sequence

import torch

from convserve.clients.protocol.errors import (BadRequest, EngineTimeout, EngineUnavailable, NotReady, PoolExhausted,
                                               ServiceError)

from ..engine.accepts import accept_token_list
from ..engine.validate import check_batch_sessions
from . import messages as m
from .placement import engine_of, new_id_on, split
from .split_batch import check_refusal, partly_applied
from .status import DOWN, STOPPED, UP


class RemoteSessions:
    """Mixed into :class:`.remote.RemoteEngine`: uses its ``_call_sync``, ``_target``, ``status``, ``n`` and
    ``limits``."""

    def _op(self, e: int, name: str, *args, state=None, spec=None, rid: Optional[str] = None):
        """``state`` (and ``spec``, a moved session's verify x) travel as the data frame (messages.put_tensors);
        ``rid``: the operation's ``request_id``."""
        head = {"k": m.OP, "f": name, "a": list(args)}
        if rid is not None:
            head["ri"] = rid
        data = m.put_tensors(head, state, spec) if state is not None else None
        reply, frame = self._call_sync(e, head, data)
        if reply.get("bytes"):
            return bytes(frame)
        if "sh" in reply:
            t, spec = m.get_tensors(reply, frame)
            return (t, reply["pos"], reply.get("pend") or [], spec) if "pos" in reply else t
        return reply["ok"]

    def _up(self, e: int) -> bool:
        return self.status.state(e)[0] == UP

    def create_session(self, session_id: Optional[str] = None, request_id: Optional[str] = None) -> str:
        if session_id is not None:
            e = self._engine_for_new(session_id)
            with self._full_names_elsewhere(e):
                return self._op(e, "create_session", session_id, rid=request_id)
        return self._on_engine_with_room(lambda e, sid: self._op(e, "create_session", sid, rid=request_id))

    def _on_engine_with_room(self, make, skip: Optional[int] = None):
        """``make(engine, fresh id on it)`` on the engine up with the most free slots (not ``skip``), and on the
        next when it refuses because it is full or went down since (nothing was made there). When every engine
        that is up is full: ``503 pool_exhausted`` for the whole server, or ``engine_unavailable`` when one is
        restarting (it comes back with room)."""
        order, last = [e for e in self._engines_for_new() if e != skip], None
        for e in order:
            try:
                return make(e, self._fresh_id(e))
            except (PoolExhausted, EngineUnavailable, NotReady) as err:
                last = err
        if skip is not None:         # a fork's source engine went down meanwhile: that is the answer
            self._target(skip)
        down = [e for e in range(self.n) if e != skip and not self._up(e)]
        if down:                     # none that is up has room: one that comes back will
            if not any(self.status.row(e).restarts or self.status.state(e)[0] in (DOWN, STOPPED) for e in down):
                raise NotReady("the engines are starting (allocating the state pool, warming the kernels); retry "
                               "shortly", retry_after=1)
            raise EngineUnavailable(f"no engine that is up has room for a new session, and engine(s) "
                                    f"{', '.join(map(str, down))} are restarting (with room once back); retry "
                                    "shortly", retry_after=min(map(self.status.back_in, down)))
        if last is None:             # (every engine came up since the choice: a moment ago, none was)
            raise NotReady("the engines are starting; retry shortly", retry_after=1)
        if isinstance(last, PoolExhausted) and self.n > 1:
            raise PoolExhausted(f"all {sum(self.status.row(e).slots_total for e in range(self.n))} session slots "
                                f"of the {self.n} engines are in use; delete idle sessions or retry later",
                                retry_after=last.retry_after)
        raise last

    @contextlib.contextmanager
    def _full_names_elsewhere(self, e: int):
        """Around a create (or a fork's) of a named id on engine ``e``: its ``503 pool_exhausted``, when another
        engine that is up has free slots, says so (``another_id``: another id, or none, may be created)."""
        try:
            yield
        except PoolExhausted as err:
            if not any(self._up(o) and self.status.row(o).slots_free for o in range(self.n) if o != e):
                raise
            raise PoolExhausted(f"{err.message}; engine {e} ({self.devices[e]}), which the new id hashes to, is "
                                "full, and another engine has free slots: send the create (or fork) without an "
                                "id, or with another id", retry_after=err.retry_after, **self._another_id()) \
                from None

    def _another_id(self) -> dict:
        """The fields of an answer saying that another id may succeed: ``another_id``, and ``suggested_id``, a
        fresh id on the engine that is up with the most free slots now (a client that must make its own ids, for
        its retries, may take it as its own: no one else is given it)."""
        order = self._engines_for_new()
        if not order:
            return {"another_id": True}
        return {"another_id": True, "suggested_id": self._fresh_id(order[0])}

    def _fresh_id(self, e: int) -> str:
        """A fresh session id that hashes to engine ``e``."""
        return new_id_on(lambda x: x == e, self.n, tries=4096)[0]

    def _engines_for_new(self) -> list:
        """The engines that are up, the most free slots first (as each last published them; ties in random
        order): where a session created without an id goes, the next one when the first is full."""
        up = [e for e in range(self.n) if self._up(e)]
        random.shuffle(up)
        return sorted(up, key=lambda e: -self.status.row(e).slots_free)

    def _engine_for_new(self, sid: str) -> int:
        """The engine a new session named ``sid`` goes to (the one its id hashes to); when that engine is down,
        :class:`EngineUnavailable` that says to send another id, or none."""
        e = engine_of(sid, self.n)
        try:
            self._target(e)
        except EngineUnavailable:
            raise EngineUnavailable(f"engine {e} ({self.devices[e]}), which the new id {sid!r:.80} hashes to, is down "
                                    "and restarting: send the create (or fork) without an id, and the server picks "
                                    "one on an engine that is up (a fork's on its source's engine when it has room), "
                                    "or with another id, or retry once it is back", retry_after=self.status.back_in(e),
                                    **self._another_id()) from None
        return e

    def delete_session(self, session_id: str, request_id: Optional[str] = None) -> None:
        self._op(engine_of(session_id, self.n), "delete_session", session_id, rid=request_id)

    def fork_session(self, src_id: str, new_id: Optional[str] = None, request_id: Optional[str] = None) -> str:
        e = engine_of(src_id, self.n)
        if new_id is None and self.n > 1:              # on its source's engine, no state crossing engines; when
            try:                                       # that one is full, on the one with the most room
                return self._op(e, "fork_session", src_id, self._fresh_id(e), rid=request_id)
            except PoolExhausted as full:     # (another engine restarting comes back with room: said below)
                if not any(not self._up(o) or self.status.row(o).slots_free for o in range(self.n) if o != e):
                    raise full from None
            return self._on_engine_with_room(lambda to, sid: self._fork_across(src_id, e, to, sid, request_id),
                                             skip=e)
        if new_id is None or engine_of(new_id, self.n) == e:
            with self._full_names_elsewhere(e):
                return self._op(e, "fork_session", src_id, new_id, rid=request_id)
        to = self._engine_for_new(new_id)
        with self._full_names_elsewhere(to):
            return self._fork_across(src_id, e, to, new_id, request_id)

    def _fork_across(self, src_id: str, e: int, to: int, new_id: str, request_id: Optional[str]) -> str:
        """Fork ``src_id`` (on engine ``e``) to ``new_id`` on engine ``to``: exported, then imported there, its
        pending verifies with it."""
        state, positions, pending, spec = self._op(e, "export_for_fork", src_id, rid=request_id)
        self._op(to, "create_with_state", new_id, positions, pending, state=state, spec=spec, rid=request_id)
        return new_id

    def export_state(self, session_id: str):
        return self._op(engine_of(session_id, self.n), "export_state", session_id)

    def import_state(self, session_id: str, state, request_id: Optional[str] = None) -> None:
        if not isinstance(state, torch.Tensor):
            raise BadRequest("state: expected a tensor")
        self._op(engine_of(session_id, self.n), "import_state", session_id, state=state, rid=request_id)

    def session_info(self, session_id: str) -> dict:
        return self._op(engine_of(session_id, self.n), "session_info", session_id)

    def list_sessions(self, cursor: Optional[str] = None, limit: int = 100) -> dict:
        """Every engine that is up lists its sessions after ``cursor`` in id order; the pages are merged by id,
        so the cursor (the last id of a page) is one order across engines. Sessions of an engine that is down
        are left out (their state is gone)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise BadRequest(f"limit: expected an integer >= 1, got {limit!r:.60}")
        items, more = [], False
        for e in range(self.n):
            if not self._up(e):
                continue
            try:
                page = self._op(e, "list_sessions", cursor, limit)
            except (EngineUnavailable, NotReady):
                continue
            items.extend(page["sessions"])
            more = more or page["next"] is not None
        items.sort(key=lambda i: i["session"])
        more = more or len(items) > limit
        items = items[:limit]
        return {"sessions": items, "next": items[-1]["session"] if more and items else None}

    def accept(self, session_id: str, n_tokens: int, request_id: Optional[str] = None) -> None:
        async def accept() -> None:
            await self.submit_accept(session_id, n_tokens, request_id)
        self._run_sync(accept)

    def submit_accept(self, session_id: str, n_tokens: int, request_id: Optional[str] = None) -> asyncio.Future:
        """:meth:`submit_accept_batch` of one session (``POST /v1/sessions/{id}/accept``), on the loop."""
        return self._accept_now(engine_of(session_id, self.n), "accept", [session_id, n_tokens], [session_id],
                                request_id)

    def accept_batch(self, session_ids: Sequence[str], tokens: Sequence[int],
                     request_id: Optional[str] = None) -> None:
        async def accept() -> None:
            await self.submit_accept_batch(session_ids, tokens, request_id)
        self._run_sync(accept)

    def submit_accept_batch(self, session_ids: Sequence[str], tokens: Sequence[int],
                            request_id: Optional[str] = None) -> asyncio.Future:
        """As :meth:`Engine.submit_accept_batch`, on this worker's loop (a stream's accept frame): sent now, or,
        when a split batch or accept holds one of its sessions (:mod:`.session_order`), once that one's parts are
        out; so a request on its sessions submitted after it reaches their engine after it. Split across engines:
        checked whole, then by each engine, and only then are the parts sent, one after another; a part refused
        after another committed (a concurrent change, an engine that died) answers with the committed sessions in
        its error's ``applied`` field."""
        sids, ri = list(session_ids), {} if request_id is None else {"ri": request_id}
        groups = split(sids, self.n) if self.n > 1 else {0: None}
        if len(groups) == 1:
            return self._accept_now(next(iter(groups)), "accept_batch", [sids, list(tokens)], sids, request_id)
        # what needs no session state is checked on the whole batch: no part is refused for it after another
        # part committed
        tokens = accept_token_list(tokens, check_batch_sessions(sids, self.limits.max_batch_size, "one accept_batch"))
        parts = [(e, [sids[i] for i in pos], [tokens[i] for i in pos]) for e, pos in groups.items()]
        hold = self.loop.create_future()            # its sessions' later sends wait until its parts are out
        waits, settle = self.order.waits(sids), self.order.unsettled(sids)
        self.order.hold(sids, hold)
        task = self.order.released_at_end(asyncio.ensure_future(self._split_accept(parts, sids, ri, waits + settle,
                                                                                   hold)), sids, hold, waits)
        self.order.settling(sids, task)
        return task

    def _accept_now(self, e: int, name: str, args: list, sids: list, request_id: Optional[str]) -> asyncio.Future:
        """Send the accept ``name(*args)`` of ``sids`` to engine ``e`` now (or after the split batch or accept
        holding one of them), its sessions settling until it is answered; the future of its answer."""
        head = {"k": m.OP, "f": name, "a": args, **({} if request_id is None else {"ri": request_id})}
        waits = self.order.waits(sids) if self.order else None
        fut = self._after(waits, sids, lambda _x: self._request(e, head), None, False) if waits else \
            self._request(e, head)
        self.order.settling(sids, fut)
        return fut

    async def _split_accept(self, parts: list, sids: list, ri: dict, waits: list, hold: asyncio.Future) -> None:
        """``waits``: the sends before it on its sessions, and the accepts in flight on them (answered before
        the engines check its parts, which read the sessions on arrival)."""
        if waits:
            await asyncio.wait(waits)              # (cancelling this task leaves them alone)
        committed: list = []
        try:
            checks = await asyncio.gather(*(self._call(e, {"k": m.CHECK, "f": "accept", "ss": ss, "t": tt, **ri})
                                            for e, ss, tt in parts), return_exceptions=True)
            refused = check_refusal(checks, sids)
            if refused is not None:
                raise refused
            for e, ss, tt in parts:
                try:
                    fut = self._request(e, {"k": m.OP, "f": "accept_batch", "a": [ss, tt], **ri})
                    if e == parts[-1][0]:
                        self.order.release(sids, hold)   # every part is out: later sends need not wait
                    await fut
                except ServiceError as err:
                    if committed:
                        done = set(committed)
                        raise partly_applied(err, [s for s in sids if s in done], "accepts",
                                             isinstance(err, EngineTimeout)) from None
                    raise
                committed.extend(ss)
        finally:
            self.order.release(sids, hold)
