"""The session journal of an engine process: which session ids its next process answers ``410 state_lost``.

Sessions survive nothing: when this process dies its sessions die with it. So that their ids answer
``410 state_lost`` rather than ``404 unknown_session`` from the next process, the ids of live sessions are kept in a
journal file in the run directory (``+id`` at create, ``-id`` at delete, rewritten when it grows); the next process
of this engine reads it at start-up and marks those ids lost, and keeps them in its own journal as lost (``!id``)
until they are created or deleted again, so that a second crash does not turn them into 404s (and so are the ids
the idle TTL evicted, when the journal is rewritten).
"""

from __future__ import annotations

import collections
import os

#: lines below which the journal is never rewritten (a quarter of the smallest size that triggers a rewrite)
COMPACT_FROM = 1024


class Journal:
    """``+id`` / ``-id`` / ``!id`` lines of the sessions this engine process holds and of those its previous
    processes lost (see the module docstring). At most ``max_lost`` lost ids are kept, the newest, as the
    session table keeps at most that many evicted ones."""

    def __init__(self, path: str, max_lost: int = 65536):
        self.path = path
        self.f = None
        self.lines = 0
        self.max_lost = max_lost
        self.lost: collections.OrderedDict = collections.OrderedDict()   # lost ids not created or deleted since

    def recover(self) -> list:
        """The ids that were live in the previous process or lost before it (and not deleted since), and a fresh
        journal that holds them as lost."""
        ids: collections.OrderedDict = collections.OrderedDict()
        if os.path.exists(self.path):          # (none: no earlier process of this engine held a session)
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    sid = line[1:].rstrip("\n")
                    if line[:1] in ("+", "!"):
                        ids[sid] = None
                        ids.move_to_end(sid)
                    elif line.startswith("-"):
                        ids.pop(sid, None)
        while len(ids) > self.max_lost:
            ids.popitem(last=False)
        self.lost = ids
        self._rewrite([])
        return list(ids)

    def add(self, sid: str) -> None:
        self.lost.pop(sid, None)
        self.f.write(f"+{sid}\n")
        self.lines += 1

    def remove(self, sid: str) -> None:
        self.lost.pop(sid, None)
        self.f.write(f"-{sid}\n")
        self.lines += 1

    def record(self, name: str, result, args, engine) -> None:
        """What a session operation ``name`` that ran (``args``, ``result``) did to the live ids; then, when the
        journal has grown past four times what it holds (after creates too: sessions the idle TTL evicts leave
        their ``+id`` lines, and no delete comes), rewritten from ``engine``'s live and lost ids."""
        if name in ("create_session", "fork_session"):
            self.add(result)
        elif name == "create_with_state":
            self.add(args[0])
        elif name == "delete_session":
            self.remove(args[0])
        else:
            return
        if self.lines > 4 * max(COMPACT_FROM, len(engine._sessions) + len(self.lost)):
            self.compact(engine.session_ids(), engine.lost_ids())

    def compact(self, live: list, lost: list = ()) -> None:
        """The journal as ``live`` and the lost ids, ``lost`` (the engine's: the TTL's evictions too) among them."""
        for sid in lost:
            self.lost[sid] = None
            self.lost.move_to_end(sid)
        while len(self.lost) > self.max_lost:
            self.lost.popitem(last=False)
        self._rewrite(live)

    def _rewrite(self, live: list) -> None:
        """The journal as the lost ids and ``live``, replaced whole (a crash meanwhile leaves the old one), then
        open for appending."""
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(f"!{sid}\n" for sid in self.lost)
            f.writelines(f"+{sid}\n" for sid in live)
        os.replace(tmp, self.path)
        if self.f is not None:
            self.f.close()
        self.f = open(self.path, "a", encoding="utf-8", buffering=1)
        self.lines = len(self.lost) + len(live)
