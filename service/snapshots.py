"""Session snapshots of one engine: restore at start, write on stop and every ``snapshot_interval_s``.

:class:`Snapshotter` wraps an engine's start and stop. Both server layouts use it: ``--workers 0`` in the HTTP
process's lifespan, and each engine process (``cluster/engine_proc.py``) for its own engine, whose files are
named by its engine index (:class:`~.snapshot_file.SnapshotDir`).

* **Start.** The newest good snapshot of this engine is restored before the engine serves (torn, foreign and
  other-layout files are refused with a log line each, and the one before is tried). An engine process that the
  supervisor restarts after a crash restores nothing: its sessions answer ``410 state_lost`` (its journal), since
  its clients were mid-conversation and a rewind to the last periodic snapshot would be silent for those that
  send no position. Such a process writes a snapshot at once, so that a later cold start does not resurrect the
  sessions of the process that died.
* **Periodic.** A thread asks the engine for a snapshot every ``snapshot_interval_s``; the engine takes it
  between two steps (:meth:`Engine.request_snapshot`: a gather and an asynchronous copy to host memory), and this
  thread waits for the copy, serializes and writes it, off the engine's thread. One is skipped (counted, no file
  written, none rotated out) when the file this process last wrote still holds every session: the engine's change
  count (:mod:`.engine.snapshot`) is that file's, the file listed no session as lost (such a session may be
  settled now), it is still there, and no import or removal was noted since it was taken (its line then stays in
  the journal until a snapshot is written: the operation may have been withdrawn, and the next file says so).
* **Stop.** After the engine drained and stopped, every session is written, whatever the change count: the file
  the next start restores is the one written after the drain. A failed write is logged and counted, never
  raised: the server still stops.
* **Imports and removals.** An import (``PUT .../state``) sets a session's positions back to 0, and a removed
  session (deleted, evicted by the idle TTL, dropped) may be created again from 0, so a snapshot taken before
  either can hold another state at the same positions, which a client's positions cannot tell apart. Each is
  noted in the engine's :class:`~.rewind_journal.RewindJournal` (a line made durable, as the snapshots are, so
  that it survives the process and the host): an import or delete before it runs (or, in an engine process, before
  it is answered), an eviction or drop just after. A restore marks the sessions noted after the snapshot it
  restored as lost (410), rather than serving their older state. A session is noted
  once between two writes, and only when a file a restore may read holds it (or while one is being taken), and
  the lines older than the oldest such file go: the journal stays within the kept files' ids, and a restore that
  falls back to an older file (the newest refused) still finds every line since it.

:func:`prepare_state_dir` runs once per server start, before any engine: it records the engine count, and when
it changed since the last start (without a readable record, when the snapshots' own headers name another count)
it moves the old snapshots aside (``superseded-<time>/``), since placement
(:mod:`.cluster.placement`) hashes session ids over the engine count and the old files would restore sessions
onto engines that no longer own them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Optional

from convserve.clients.protocol.errors import StateUnwritable

from .engine.snapshot import check_content
from .snapshot_file import CRASH_SUFFIX, Snapshot, SnapshotDir, compatible, new_meta, read_meta
from .rewind_journal import RewindJournal
from .snapshot_marks import write_json

log = logging.getLogger("convserve.snapshots")

LAYOUT_FILE = "layout.json"


STATE_LOCK = "lock"


class StateDirInUse(OSError):
    """Another running server holds the state directory's lock."""


def lock_state_dir(folder) -> int:
    """Create ``folder`` and take its lock (``flock`` on ``folder/lock``) for this server's life: two servers
    writing snapshots into one directory would rotate out, and restore, each other's files. Returns the lock's
    descriptor (keep it open); :class:`StateDirInUse` when another server holds it."""
    from .cluster.run_dirs import take_lock

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        return take_lock(os.path.join(folder, STATE_LOCK))
    except BlockingIOError:
        raise StateDirInUse(f"another running server uses it (it holds {STATE_LOCK} there); give each server "
                            "its own --state-dir") from None


def prepare_state_dir(folder, n_engines: int) -> None:
    """Create ``folder``, and set aside snapshots of another engine count (see the module docstring). Raises
    OSError when it cannot be written."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LAYOUT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            before = json.load(f).get("engines")
    except (FileNotFoundError, ValueError, AttributeError):
        before = None
    names = os.listdir(folder)
    snaps = [n for n in names if n.endswith(".safetensors")]
    if snaps and before is None:      # no readable layout file: the snapshots' own headers say their layout
        counts = {((read_meta(os.path.join(folder, n)) or {}).get("engine") or {}).get("count") for n in snaps}
        counts.discard(None)
        # none readable says nothing of another layout: such files stay (a restore refuses each with a log line)
        before = n_engines if counts <= {n_engines} else before
    if snaps and before != n_engines:
        aside = os.path.join(folder, f"superseded-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        os.makedirs(aside)
        for n in snaps + [n for n in names if n.endswith(CRASH_SUFFIX)]:    # the crash marks refer to them
            os.replace(os.path.join(folder, n), os.path.join(aside, n))
        log.warning("snapshots of another engine layout set aside, not restored",
                    extra={"engines_before": before, "engines_now": n_engines, "files": len(snaps), "to": aside})
    write_json(path, {"engines": n_engines})


class Snapshotter:
    """Snapshots of ``engine`` in ``settings.state_dir`` as engine ``index`` of ``count`` (see the module
    docstring)."""

    def __init__(self, engine, settings, index: int = 0, count: int = 1, device: str = "cpu",
                 restarted: bool = False, on_written=None):
        self.engine, self.index, self.count, self.device = engine, index, count, device
        self.dir = SnapshotDir(settings.state_dir, index, settings.snapshot_keep)
        self.interval = settings.snapshot_interval_s
        self.restarted = restarted
        self.on_written = on_written         # called with last() after each write (an engine process publishes it)
        self.final_failed = False            # set by stop_engine: the final snapshot was not written
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.restored = 0
        # counters (summed over engines by the cluster's stats), then the last write's numbers
        self._st = {"writes": 0, "skips": 0, "failures": 0, "bytes": 0, "seconds": 0.0, "restored_sessions": 0}
        self._last: Optional[dict] = None
        # (changes, created_unix, path) of the last file written that a periodic snapshot may keep instead of
        # writing (see the module docstring); None: the next one writes
        self._kept: Optional[tuple] = None
        engine.snapshot_stats = self.stats
        self.rewinds = RewindJournal(self.dir.folder, index)
        # the files a restore may read (path -> (created_unix, their session ids)) and the ids they hold, the
        # snapshots being taken, the ids noted since the last write: a removed or imported session is noted once,
        # and only when a snapshot may hold it, which keeps the journal within the kept files' ids
        self._files: dict = {}
        self._held: set = set()
        self._taking = 0
        self._noted: set = set()
        self._durable: dict = {}             # id -> the future of its last note, until it is durable
        self._files_unknown = False          # a write failed: a file may be on disk that _files lacks
        engine.on_rewind, engine.on_create = self._note_rewinds, self.before_create
        try:                                  # as soon as the model is built: what a crash mark of it refuses
            self.dir.note_model(engine.model_info())
        except OSError as e:                  # (a later mark then refuses every model's files, as one without it)
            log.error("cannot note the model beside the snapshots", extra={"engine": index, "error": str(e)})
            self.dir.forget_model()

    # ------------------------------------------------------------------ life cycle

    def start_engine(self) -> int:
        """Start the engine from the newest good snapshot (none after a crash restart); the sessions restored."""
        e = self.engine
        m = e.model_cpu

        def restorable(snap):
            check_content(snap.meta, snap.tensors, m.n_layers, m.width, m.dim, e.state_dtype, m.dtype)

        found = None if self.restarted else self.dir.newest_good(e.model_info(), self.count, restorable)
        snap = found[1] if found else None
        self.restored = e.start(snapshot=snap)
        if found is not None:
            # lost: busy when it was taken; not_restored: in it, but not fitting this pool (both answer 410)
            log.info("snapshot restored", extra={"engine": self.index, "path": found[0],
                                                 "sessions": self.restored, "lost": len(snap.meta.get("lost", [])),
                                                 "not_restored": len(snap.meta.get("sessions", [])) - self.restored,
                                                 "taken_unix": snap.meta.get("created_unix")})
        if snap is not None:
            self._lose_rewound_since(snap.meta["created_unix"])   # (their lines stay: a second crash reads them)
        self._files_now(self._files_on_disk())
        newest = max((t for t, _ids in self._files.values()), default=None)
        if newest is not None:        # noted since every kept file: not again (crash after crash, no snapshot)
            noted = self.rewinds.since(newest)
            with self._lock:
                self._noted.update(noted)
        with self._lock:
            self._st["restored_sessions"] = self.restored
        if self.restarted:
            self.write_now("restart")
        if self.interval:
            self._thread = threading.Thread(target=self._periodic, name="convserve-snapshot", daemon=True)
            self._thread.start()
        return self.restored

    def _note_rewinds(self, session_ids, wait: bool = True):
        """The engine's ``on_rewind``: note those of ``session_ids`` that a snapshot a restore may read can hold
        (a kept file's, or any while one is being taken); any other was made after them, and cannot come back
        from them. With ``wait`` it returns once their notes (and an earlier one of theirs still on its way) are
        durable (a failed fsync raises, and nothing counts as noted); else :meth:`note_of` has each note's future
        (:mod:`.rewind_journal`)."""
        with self._lock:
            taking = self._taking
            keep = list(session_ids) if taking else \
                [sid for sid in session_ids if sid in self._held and sid not in self._noted]
            # an id noted before may still be on its way to the disk: its note is waited for too
            earlier = [f for f in map(self._durable.get, session_ids) if f is not None]
        if keep:
            durable = self.rewinds.note(keep, wait)
            with self._lock:
                self._durable.update(dict.fromkeys(keep, durable))
            durable.add_done_callback(lambda f: self._forget_durable(keep, f))
            earlier.append(durable)
        if wait:
            for f in earlier:
                f.result()
        if keep and not taking:
            with self._lock:
                self._noted.update(keep)

    def _forget_durable(self, ids, fut) -> None:
        with self._lock:
            for sid in ids:
                if self._durable.get(sid) is fut:
                    del self._durable[sid]

    def before_create(self, session_id: str):
        """A create or fork is about to make the id ``session_id``: the future of the note of the id's last removal
        while that is not durable yet (None when it is, or there was none), for the create to wait on. An evicted
        or dropped id's note that still waits for the engine's loop is handed to the journal first; one that cannot
        be written raises :class:`StateUnwritable` (nothing is made)."""
        if not self.engine.note_removed_now(session_id):
            raise StateUnwritable(f"the note of {session_id!r}'s earlier removal could not be written to the state "
                                  "folder (see the server log); nothing was made: retry after Retry-After",
                                  retry_after=1.0)
        return self.note_of(session_id)

    def note_of(self, session_id: str):
        """The future of ``session_id``'s last note while it is not durable yet, else None."""
        with self._lock:
            return self._durable.get(session_id)

    def _files_on_disk(self) -> dict:
        """``_files`` read from the headers of this model's files (at start, and after a write that failed); a
        file of another model is not restored while this one serves."""
        model = self.engine.model_info()
        return {path: (s.get("created_unix", 0.0), s["ids"]) for path, s in self.dir.headers()
                if compatible(s, model, self.count) is None}

    def _files_now(self, files: dict) -> None:
        """``files`` are those a restore may read now: the ids noted from now on are theirs, and the journal's
        lines older than the oldest of them go (any of them may be restored: a refused newest falls back)."""
        held = set().union(*(ids for _t, ids in files.values()))
        with self._lock:
            self._files, self._held = files, held
            self._noted.clear()
        self.rewinds.floor = max([self.rewinds.floor, *(t for t, _ids in files.values())])
        self.rewinds.drop_before(min((t for t, _ids in files.values()), default=float("inf")))

    def _lose_rewound_since(self, taken: float) -> None:
        """The restored sessions noted after the snapshot was taken answer 410: their state is not in it (a
        session removed since may have been created again under its id)."""
        e = self.engine
        lost = sorted(set(self.rewinds.since(taken)) & set(e.session_ids()))
        for sid in lost:
            e.delete_session(sid)
        if lost:
            e.mark_lost(lost, "was imported (PUT .../state), deleted, evicted or dropped after the snapshot the server "
                              "restored at start was taken; that snapshot holds an older state: import it or create "
                              "it again")
            log.warning("sessions imported or removed after the restored snapshot are lost",
                        extra={"engine": self.index, "sessions": len(lost)})
            self.restored -= len(lost)

    def stop_engine(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the periodic writer, stop the engine (draining), write every session. ``final_failed`` when the
        final snapshot could not be taken or written: the process then exits non-zero, so whatever restarts it
        can tell that the sessions since the last good snapshot are lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.engine.stop(drain, timeout)
        if self.engine.pool is None:
            return                                   # never started: nothing to write
        t0 = time.perf_counter()
        with self._taking_one():
            try:
                cap = self.engine.capture_snapshot(self._meta())
            except Exception:  # noqa: BLE001 - logged and counted; the server still stops
                log.exception("taking the final snapshot failed")
                with self._lock:
                    self._st["failures"] += 1
                self.final_failed = True
                return
            self.final_failed = not self._write(cap, t0, "final")

    @contextlib.contextmanager
    def _taking_one(self):
        """A snapshot is being taken (from before its capture until its file is written or given up)."""
        with self._lock:
            self._taking += 1
        try:
            yield
        finally:
            with self._lock:
                self._taking -= 1

    def write_now(self, kind: str = "periodic") -> bool:
        """Take a snapshot of the running engine and write it (blocks until written); a periodic one is skipped
        when nothing changed since the last file written (see the module docstring). False when it failed or
        the engine stopped first."""
        with self._taking_one():
            return self._take_and_write(kind)

    def _take_and_write(self, kind: str) -> bool:
        t0 = time.perf_counter()
        done = threading.Event()
        box: list = []

        def handed(cap):
            box.append(cap)
            done.set()

        since = self._unchanged_since() if kind == "periodic" else None
        if not self.engine.request_snapshot(self._meta(), handed, since):
            return False
        while not done.wait(0.5):
            worker = self.engine._thread
            if worker is None or not worker.is_alive():      # it died: no callback will come
                return False
        if box[0] is None:
            with self._lock:
                self._st["failures"] += 1
            return False
        if box[0].tensors is None:                # nothing changed since the file it keeps (since is not None)
            with self._lock:
                self._st["skips"] += 1
            log.debug("snapshot skipped: nothing changed", extra={"engine": self.index, "kind": kind})
            return True
        return self._write(box[0], t0, kind)

    def _unchanged_since(self) -> Optional[int]:
        """The change count of the file a periodic snapshot may keep instead of writing, or None."""
        with self._lock:
            kept = self._kept
        if kept is None or not os.path.exists(kept[2]) or self.rewinds.since(kept[1]):
            return None
        return kept[0]

    def _periodic(self) -> None:
        while not self._stop.wait(self.interval):
            self.write_now()

    # ------------------------------------------------------------------ writing

    def _meta(self) -> dict:
        meta = new_meta(self.engine.model_info(), self.index, self.count, self.device)
        self.rewinds.floor = max(self.rewinds.floor, meta["created_unix"])
        return meta

    def _write(self, cap, t0: float, kind: str) -> bool:
        ids = frozenset(rec["id"] for rec in cap.meta["sessions"])
        with self._lock:          # before the file can be on disk: a write that fails past that point leaves it
            self._held |= ids
            self._noted.clear()   # (what was noted before it is not noted since it)
        try:
            cap.wait()
            path, size = self.dir.write(Snapshot(cap.meta, cap.tensors))
        except Exception as e:  # noqa: BLE001 - logged and counted; serving goes on
            log.error("writing a snapshot failed", extra={"engine": self.index, "kind": kind, "error": str(e)})
            with self._lock:
                self._st["failures"] += 1
                self._files_unknown = True
            return False
        if self._files_unknown:
            self._files_unknown = False
            self._files_now(self._files_on_disk())
        else:                     # this file, and those the rotation left
            files = {p: v for p, v in self._files.items() if os.path.exists(p)}
            self._files_now({**files, path: (cap.meta["created_unix"], ids)})
        seconds = time.perf_counter() - t0
        n = len(cap.meta["sessions"])
        with self._lock:
            # a session listed as lost may be settled by now without a change counted: the next one writes
            self._kept = None if cap.meta["lost"] else (cap.changes, cap.meta["created_unix"], path)
            st = self._st
            st["writes"] += 1
            st["bytes"] += size
            st["seconds"] += seconds
            self._last = {"unix_time": round(cap.meta["created_unix"], 3), "sessions": n, "bytes": size,
                          "seconds": round(seconds, 4)}
        if self.on_written is not None:
            self.on_written(self.last())
        log.log(logging.DEBUG if kind == "periodic" else logging.INFO, "snapshot written",
                extra={"engine": self.index, "kind": kind, "path": path, "sessions": n,
                       "lost": len(cap.meta["lost"]), "bytes": size, "seconds": round(seconds, 4)})
        return True

    def stats(self) -> dict:
        """Counters for ``engine.stats()["snapshot"]`` (metrics)."""
        with self._lock:
            return dict(self._st)

    def last(self) -> Optional[dict]:
        """``{"unix_time", "sessions", "bytes", "seconds"}`` of the last snapshot written, or None."""
        with self._lock:
            return None if self._last is None else dict(self._last)
