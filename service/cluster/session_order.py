"""The order of one worker's sends per session while a batch split across engines is in flight.

A split batch first asks each engine to check its part and only then sends the parts
(:meth:`.remote.RemoteEngine._split_batch`). A conv or batch of one of its sessions submitted meanwhile (the next
frame of a stream, say) would reach that session's engine before the batch's part, and run first: requests of one
session must run in the order received. So a split batch holds its sessions from its submission until its parts
are sent, and a request on a held session is sent only after whatever holds it: each session has at most one
*tail*, a future done once the last send queued on that session went out, and a request that finds one waits for
it and becomes the new tail. With no split batch in flight there are no tails, and requests are sent at once.

An accept is checked by its engine at its turn, and the requests sent after it on that engine run after it; but the
checks a split batch or a split accept asks every engine for first read the sessions as they are on arrival. So an
accept in flight also marks its sessions as *settling* until it is answered, and such a check waits for the
settling of its sessions that began before it.
"""

from __future__ import annotations

import asyncio
from typing import Iterable


class SessionOrder:
    """The sessions' tails (see the module). Used on the worker's event loop only."""

    def __init__(self) -> None:
        self._tails: dict = {}                  # session id -> future done when its last queued send went out
        self._settling: dict = {}               # session id -> future of its last accept in flight (answered: done)

    def __bool__(self) -> bool:
        return bool(self._tails)

    def waits(self, sids: Iterable[str]) -> list:
        """The distinct tails of ``sids`` (what a request on them must wait for before it is sent)."""
        tails, out = self._tails, []
        if tails:
            for s in sids:
                f = tails.get(s)
                if f is not None and not any(f is g for g in out):
                    out.append(f)
        return out

    def hold(self, sids: Iterable[str], fut: asyncio.Future) -> None:
        """``fut`` is now the tail of every session of ``sids``."""
        for s in sids:
            self._tails[s] = fut

    def released_at_end(self, task: asyncio.Task, sids: Iterable[str], fut: asyncio.Future,
                        waits: list = ()) -> asyncio.Task:
        """``task``, which waits for ``waits`` and then sends what ``fut`` stands for, releasing ``fut``
        (:meth:`release`) whenever the task ends, also when it is cancelled before it ran at all; cancelled while
        it waited, it keeps its place in line until what it waited for is done (a later request must not overtake
        that)."""
        def at_end(_task):
            pending = [w for w in waits if not w.done()]
            if pending:
                asyncio.ensure_future(asyncio.wait(pending)).add_done_callback(lambda _w: self.release(sids, fut))
            else:
                self.release(sids, fut)

        task.add_done_callback(at_end)
        return task

    def release(self, sids: Iterable[str], fut: asyncio.Future) -> None:
        """The send that ``fut`` stands for went out (or failed): the sessions it is still the tail of have none,
        and whatever waits for it goes on. Never raises."""
        tails = self._tails
        for s in sids:
            if tails.get(s) is fut:
                del tails[s]
        if not fut.done():
            fut.set_result(None)

    def settling(self, sids: Iterable[str], fut: asyncio.Future) -> None:
        """An accept on ``sids`` is in flight until ``fut`` is done (see the module)."""
        sids = list(sids)
        for s in sids:
            self._settling[s] = fut

        def settled(_fut):
            for s in sids:
                if self._settling.get(s) is fut:
                    del self._settling[s]

        fut.add_done_callback(settled)

    def unsettled(self, sids: Iterable[str]) -> list:
        """The distinct accepts in flight on ``sids`` (what a check at arrival on them waits for)."""
        out, settling = [], self._settling
        if settling:
            for s in sids:
                f = settling.get(s)
                if f is not None and not f.done() and not any(f is g for g in out):
                    out.append(f)
        return out
