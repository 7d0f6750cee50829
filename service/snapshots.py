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
  noted in the engine's :class:`RewindJournal` (a line made durable, as the snapshots are, so that it survives
  the process and the host): an import or delete before it runs, an eviction or drop just after. A restore marks the sessions
  noted after the snapshot it restored as lost (410), rather than serving their older state. A session is noted
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

from .engine.snapshot import check_content
from .snapshot_file import CRASH_SUFFIX, Snapshot, SnapshotDir, compatible, new_meta, read_meta
from .snapshot_marks import fsync_dir, write_json

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


class RewindJournal:
    """Engine ``index``'s imports and removals since its snapshots: one line ``<unix time> <session id>`` each,
    in ``rewinds-<index>.log`` of the state folder (see the module docstring). A note is durable when
    :meth:`note` returns (fsynced, as the snapshots are: a host crash that kept a snapshot keeps the lines that
    outdate it); notes made at the same time share one fsync."""

    def __init__(self, folder: str, index: int):
        self.path = os.path.join(folder, f"rewinds-{index}.log")
        self._lock = threading.Lock()
        # group commit: each write is numbered; an fsync made after write n was issued makes 1..n durable
        self._sync_lock = threading.Lock()
        self._written = self._synced = 0
        # no line is stamped before this: the newest snapshot time issued or on disk (a clock stepped back would
        # otherwise stamp a later removal before the snapshot it follows, which a restore would not read)
        self.floor = 0.0
        old = os.path.join(folder, f"imports-{index}.log")      # an older server's journal (imports): ours too
        if os.path.exists(old):
            lines = [f"{when:.6f} {sid}\n" for when, sid in self._lines() + self._lines(old)]
            self._rewrite(lines)
            os.unlink(old)

    def note(self, session_ids, wait: bool = True) -> None:
        """One line for each of ``session_ids``, in one write; after a line a failed write left cut (a full disk),
        on a line of their own. Durable on return; with ``wait`` false (a removal noted after the fact, from the
        engine's loop, which must not stall on the disk) the fsync runs on a thread of its own."""
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
            self._written += 1
            mine = self._written
        if created:
            fsync_dir(os.path.dirname(self.path))
        if wait:
            self._sync(mine)
        else:
            threading.Thread(target=self._sync_logged, args=(mine,), name="rewind-fsync", daemon=True).start()

    def _sync_logged(self, mine: int) -> None:
        try:
            self._sync(mine)
        except OSError as e:
            log.error("cannot make the rewind journal durable: a host crash may lose its last lines",
                      extra={"path": self.path, "error": str(e)})

    def _sync(self, mine: int) -> None:
        """Return once write ``mine`` is durable: one fsync covers every write issued before it started, so notes
        made while another note's fsync runs wait for it and share the next one."""
        with self._sync_lock:
            if self._synced >= mine:
                return
            with self._lock:
                upto = self._written
            fd = os.open(self.path, os.O_RDONLY)        # (fsync is of the file, through any descriptor)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._synced = upto

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
        """The journal replaced whole by ``lines`` (a crash meanwhile leaves the old one)."""
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
        self._files_unknown = False          # a write failed: a file may be on disk that _files lacks
        engine.on_rewind = self._note_rewinds
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

    def _note_rewinds(self, session_ids, wait: bool = True) -> None:
        """The engine's ``on_rewind``: note those of ``session_ids`` that a snapshot a restore may read can hold
        (a kept file's, or any while one is being taken); any other was made after them, and cannot come back
        from them. ``wait``: see :meth:`RewindJournal.note`."""
        with self._lock:
            taking = self._taking
            keep = list(session_ids) if taking else \
                [sid for sid in session_ids if sid in self._held and sid not in self._noted]
        if keep:
            self.rewinds.note(keep, wait)         # (raises: nothing counted as noted)
            if not taking:
                with self._lock:
                    self._noted.update(keep)

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
