"""The rewind journal of one engine: the sessions imported or removed since its snapshots (``rewinds-<engine>.log``
in the state folder; :mod:`.snapshots` says what it is for and when lines are written and dropped).

A line is appended at once (so that it survives the process: an import or delete is noted before it runs) and made
durable by one syncer thread per journal (so that it survives the host, as the snapshots it outdates do). Notes
made at the same time share one fsync: each write is numbered, and an fsync begun after write n makes 1..n
durable. :meth:`RewindJournal.note` returns a future that is done once its line is durable:

* a caller that may block (``fail_fast``) waits on it, and an fsync that fails fails it (the caller's operation
  is then refused, not run);
* a caller that must not block (the engine's loop; an engine process, which answers its operation once the
  future is done) leaves it to the syncer, which retries a failed fsync every second until it succeeds, logging
  each failure. After a failed fsync the file is rewritten whole (a new file fsynced, renamed, the folder fsynced)
  before anything more is called durable: Linux reports a failed writeback once, so a second fsync of the same file
  could succeed without the lost lines.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Optional

from .snapshot_marks import fsync_dir

log = logging.getLogger("convserve.snapshots")

#: seconds between the syncer's tries after a failed fsync
RETRY_S = 1.0


class RewindJournal:
    """Engine ``index``'s imports and removals since its snapshots: one line ``<unix time> <session id>`` each,
    in ``rewinds-<index>.log`` of ``folder`` (see the module docstring)."""

    def __init__(self, folder: str, index: int):
        self.path = os.path.join(folder, f"rewinds-{index}.log")
        self._lock = threading.Lock()            # the file: appends and rewrites
        # the syncer's state: writes issued (numbered) and made durable, the futures waiting on them
        # ((write number, future, fail_fast)), a folder entry not yet durable, a failed fsync to repair
        self._cv = threading.Condition(threading.Lock())
        self._written = self._synced = 0
        self._waiting: list = []
        self._dir_dirty = False
        self._repair = False
        self._syncer: Optional[threading.Thread] = None
        # no line is stamped before this: the newest snapshot time issued or on disk (a clock stepped back would
        # otherwise stamp a later removal before the snapshot it follows, which a restore would not read)
        self.floor = 0.0
        old = os.path.join(folder, f"imports-{index}.log")      # an older server's journal (imports): ours too
        if os.path.exists(old):
            lines = [f"{when:.6f} {sid}\n" for when, sid in self._lines() + self._lines(old)]
            with self._lock:
                self._rewrite(lines)
            os.unlink(old)

    def note(self, session_ids, fail_fast: bool = True) -> Future:
        """One line for each of ``session_ids``, in one write (after a line a failed write left cut, a full disk,
        on a line of their own); raises when the write fails. Returns the future of its durability (see the module
        docstring for ``fail_fast``)."""
        now = max(time.time(), self.floor) + 1e-6       # (1 µs up: written to 6 decimals, never below the floor)
        text = "".join(f"{now:.6f} {sid}\n" for sid in session_ids)
        with self._lock:
            created = not os.path.exists(self.path)
            with open(self.path, "a+b") as f:                # (appends go to the end wherever it reads)
                end = f.seek(0, os.SEEK_END)
                if end:
                    f.seek(max(0, end - 4096))
                    tail = f.read()
                    if not tail.endswith(b"\n"):             # a line a failed write cut: it names no session
                        f.truncate(end - len(tail) + tail.rfind(b"\n") + 1)
                f.write(text.encode())
            with self._cv:
                self._written += 1
                self._dir_dirty |= created
        return self.durable(fail_fast)

    def durable(self, fail_fast: bool = True) -> Future:
        """A future done once every line written so far is durable."""
        fut: Future = Future()
        with self._cv:
            if self._synced >= self._written and not self._dir_dirty and not self._repair:
                fut.set_result(None)
                return fut
            self._waiting.append((self._written, fut, fail_fast))
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_loop, name="rewind-fsync", daemon=True)
                self._syncer.start()
            self._cv.notify()
        return fut

    def _sync_loop(self) -> None:
        while True:
            try:
                self._sync_once()
            except BaseException:  # noqa: BLE001 - the syncer must outlive anything: every later note waits on it
                log.exception("rewind journal: the syncer failed; trying again")
                time.sleep(RETRY_S)

    def _sync_once(self) -> None:
        with self._cv:
            while not self._waiting:
                self._cv.wait()
            upto, repair, dir_dirty = self._written, self._repair, self._dir_dirty
        try:
            if repair:
                with self._lock:
                    self._rewrite([f"{when:.6f} {sid}\n" for when, sid in self._lines()])
            else:
                fd = os.open(self.path, os.O_RDONLY)        # (fsync is of the file, through any descriptor)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if dir_dirty:
                    fsync_dir(os.path.dirname(self.path))
        except OSError as e:
            log.error("cannot make the rewind journal durable; trying again (a host crash now may lose its last "
                      "lines)", extra={"path": self.path, "error": str(e)})
            with self._cv:
                self._repair = True
                failed = [w for w in self._waiting if w[2] and w[0] <= upto]
                self._waiting = [w for w in self._waiting if not (w[2] and w[0] <= upto)]
            for _n, fut, _ff in failed:
                if fut.set_running_or_notify_cancel():      # (a waiter that gave up: nothing to tell)
                    fut.set_exception(e)
            time.sleep(RETRY_S)
            return
        with self._cv:
            self._synced = max(self._synced, upto)
            if repair:
                self._repair = False
            if dir_dirty or repair:
                self._dir_dirty = False
            done = [w for w in self._waiting if w[0] <= upto]
            self._waiting = [w for w in self._waiting if w[0] > upto]
        for _n, fut, _ff in done:
            if fut.set_running_or_notify_cancel():
                fut.set_result(None)

    def since(self, t: float) -> list:
        """The sessions noted at or after unix time ``t``."""
        return sorted({sid for when, sid in self._lines() if when >= t})

    def drop_before(self, t: float) -> None:
        """Forget the lines before unix time ``t`` (every snapshot a restore may read was taken at ``t`` or later,
        and holds what they did)."""
        with self._lock:
            lines = self._lines()
            keep = [f"{when:.6f} {sid}\n" for when, sid in lines if when >= t]
            if len(keep) != len(lines):            # (nothing to forget: no rewrite)
                self._rewrite(keep)

    def _rewrite(self, lines: list) -> None:
        """The journal replaced whole by ``lines``, durably (a crash meanwhile leaves the old one); under
        ``_lock``. A failure leaves the file's durability unknown (the rename may have landed, the folder not):
        the syncer repairs before it calls anything durable."""
        try:
            self._replace(lines)
        except OSError:
            with self._cv:
                self._repair = True
            raise

    def _replace(self, lines: list) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())          # (the rename must not land before the lines: a host crash would empty it)
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(self.path))

    def _lines(self, path: Optional[str] = None) -> list:
        try:
            with open(path or self.path) as f:
                rows = [line.split(" ", 1) for line in f]
        except FileNotFoundError:
            return []
        out = []
        for row in rows:
            try:
                if row[1].endswith("\n"):           # (a line a crash cut mid-write has none: it is no id)
                    out.append((float(row[0]), row[1].strip()))
            except (ValueError, IndexError):
                continue
        return out
