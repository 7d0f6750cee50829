"""Snapshot files: their format, their checks, and the directory that keeps them.

A snapshot is one safetensors file: the tensors of every saved session (``state``: the conv state rows of the
pool, ``spec``: the inputs of the pending speculative verifies) and, in the header's metadata, one JSON document
under the key ``convserve`` (:class:`Snapshot`'s ``meta``: format version, the engine that wrote it, the model
it belongs to, each session's id, positions and pending verify). safetensors because the header is plain JSON
that any tool reads, the loader never runs code (unlike pickle), and the library is already a dependency.

``meta["sha256"]`` digests the payload: the canonical JSON of the rest of ``meta`` (sorted keys, no whitespace),
then, per tensor in name order, its name, dtype, shape and raw bytes. A file that does not parse, lacks the key,
or whose digest differs is torn (a partial write, a flipped bit) and is refused; so is a file of another model
(weights digest, layers, dim, width, dtypes: :func:`compatible`). Neither is ever loaded into an engine.

Writes are atomic: a temporary file in the same directory, fsync, rename over the final name, fsync of the
directory, so a crash leaves the previous files and at most a stray temporary (removed at start). Files are
``e<engine>.<seq>.safetensors``, ``seq`` counting up per engine, so names sort by age without trusting the
clock; the newest ``keep`` of each engine stay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .snapshot_marks import CRASH_SUFFIX, MODEL_FIELDS, SNAPSHOT_NAME, CrashMarks, fsync_dir

log = logging.getLogger("convserve.snapshots")

FORMAT = "convserve-snapshot"
VERSION = 1
META_KEY = "convserve"
_TMP_PREFIX = ".tmp-e"


class SnapshotRefused(Exception):
    """A snapshot file that must not be loaded: torn, unreadable, or of another model or layout."""


@dataclass
class Snapshot:
    """What a snapshot file holds: ``meta`` (JSON-able; its ``sha256`` is filled by :func:`encode_digest`) and
    named CPU tensors."""

    meta: dict
    tensors: dict = field(default_factory=dict)

    @property
    def sessions(self) -> list:
        return self.meta.get("sessions", [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer (any dtype, bfloat16 included)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def digest(meta: dict, tensors: dict) -> str:
    """The payload digest (see the module docstring); ``meta["sha256"]`` itself is left out."""
    h = hashlib.sha256()
    body = {k: v for k, v in meta.items() if k != "sha256"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(_raw(t))
    return h.hexdigest()


def compatible(meta: dict, model: dict, n_engines: Optional[int] = None) -> Optional[str]:
    """None when ``meta`` belongs to ``model`` (a ``/v1/model``-like map) and, when given, to an engine layout
    of ``n_engines``; else why not."""
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return f"not a {FORMAT} of version {VERSION} ({meta.get('format')!r}, {meta.get('version')!r})"
    theirs = meta.get("model") or {}
    diff = [f for f in MODEL_FIELDS if theirs.get(f) != model.get(f)]
    if diff:
        return "another model: " + ", ".join(f"{f} {theirs.get(f)!r} (serving {model.get(f)!r})" for f in diff)
    count = (meta.get("engine") or {}).get("count")
    if n_engines is not None and count != n_engines:
        return f"written by a server of {count} engines, this one has {n_engines}"
    return None


def write_atomic(path: str, snap: Snapshot) -> int:
    """Write ``snap`` to ``path`` atomically and durably (see the module docstring); the file's size."""
    snap.meta["sha256"] = digest(snap.meta, snap.tensors)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f"{_TMP_PREFIX}{name[1:]}.{os.getpid()}")
    try:
        tensors = {k: v.contiguous() for k, v in snap.tensors.items()}
        save_file(tensors, tmp, metadata={META_KEY: json.dumps(snap.meta, separators=(",", ":"))})
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)
    return os.path.getsize(path)


def read_meta(path: str) -> Optional[dict]:
    """A snapshot file's ``meta`` from its header alone (no tensor read, no digest checked: for sorting files,
    never for loading one); None when the file is unreadable."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
    except Exception:  # noqa: BLE001 - torn, foreign, gone: not a file whose header says anything
        return None
    return meta if isinstance(meta, dict) else None


def _summary(meta: dict) -> dict:
    """What the rotation and the start read of a file's header: its meta without the session records, and
    ``ids``, the sessions it holds (the records are what makes a header slow to parse: it is parsed once)."""
    out = {k: v for k, v in meta.items() if k not in ("sessions", "lost")}
    out["ids"] = frozenset(r.get("id") for r in meta.get("sessions", ()) if isinstance(r, dict))
    return out


def read_checked(path: str) -> Snapshot:
    """The snapshot in ``path`` after its digest matched; :class:`SnapshotRefused` (saying why) otherwise."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - the library raises its own error kinds for a torn file
        raise SnapshotRefused(f"unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    try:
        meta = json.loads(header[META_KEY])
        want = meta["sha256"]
    except (KeyError, TypeError, ValueError):
        raise SnapshotRefused(f"no {META_KEY!r} metadata with a digest: not a convserve snapshot") from None
    if not isinstance(meta, dict) or digest(meta, tensors) != want:
        raise SnapshotRefused("its digest does not match its content (a torn write or a corrupted file)")
    return Snapshot(meta, tensors)


class SnapshotDir(CrashMarks):
    """The snapshot files of one engine (``index``) in ``folder``, with its crash marks (:class:`CrashMarks`)."""

    def __init__(self, folder: str, index: int, keep: int):
        super().__init__(folder, index)
        self.keep = keep
        self._summaries: dict = {}      # path -> _summary of its header, or None (unreadable): files never change
        os.makedirs(self.folder, exist_ok=True)
        for name in os.listdir(self.folder):       # what a crash in the middle of a write left
            if name.startswith(f"{_TMP_PREFIX}{self.index}.") or (
                    name.startswith((f"e{self.index}{CRASH_SUFFIX}.", f"e{self.index}.model.json."))
                    and name.endswith(".tmp")):
                try:
                    os.unlink(os.path.join(self.folder, name))
                except FileNotFoundError:
                    pass

    def _next_path(self) -> str:
        top = max([self._newest_seq()] + [m["through"] for m in self.crash_marks()])   # above a crash mark's files
        return os.path.join(self.folder, f"e{self.index}.{top + 1:012d}.safetensors")

    def _crashed(self, path: str, marks: list) -> bool:
        """Whether ``path`` predates a crash of the process that served its model (see :meth:`mark_crashed`)."""
        seq = int(SNAPSHOT_NAME.match(os.path.basename(path)).group(2))
        return any(seq <= m["through"] and (m["model"] is None or self._of_model(path, m["model"])) for m in marks)

    def summary(self, path: str) -> Optional[dict]:
        """The :func:`_summary` of ``path``'s header, read once per file; None when it is unreadable."""
        if path not in self._summaries:
            meta = read_meta(path)
            self._summaries[path] = None if meta is None else _summary(meta)
        return self._summaries[path]

    def _of_model(self, path: str, model: dict) -> bool:
        s = self.summary(path)
        return s is not None and compatible(s, model) is None

    def write(self, snap: Snapshot) -> tuple[str, int]:
        """Write the next file, then drop this model's files past ``keep``; ``(path, bytes)``. A file of another
        model, or one whose header does not read, is never dropped and does not count: a server started with
        the wrong model by mistake leaves the right model's files, which the next start with it restores."""
        path = self._next_path()
        size = write_atomic(path, snap)
        model = snap.meta["model"]
        marks = self.crash_marks()
        ours = [p for p in self.files() if p == path or self._of_model(p, model)]
        dead = [p for p in ours if marks and p != path and self._crashed(p, marks)]      # never restored
        ours = [p for p in ours if p not in dead]
        for old in dead + ours[self.keep:]:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
            self._summaries.pop(old, None)
        return path, size

    def headers(self) -> list:
        """``(path, summary)`` (:meth:`summary`) of each file a restore may read (none a crash mark refuses),
        newest first; the unreadable ones are left out."""
        marks = self.crash_marks()
        out = []
        for path in self.files():
            s = None if marks and self._crashed(path, marks) else self.summary(path)
            if s is not None:
                out.append((path, s))
        return out

    def newest_good(self, model: dict, n_engines: Optional[int] = None,
                    check: Optional[Callable[[Snapshot], None]] = None) -> Optional[tuple[str, Snapshot]]:
        """The newest file that is whole, belongs to ``model`` (and the layout) and passes ``check`` (which raises
        ValueError to refuse); each refused one is logged."""
        marks = self.crash_marks()
        for path in self.files():
            try:
                if marks and self._crashed(path, marks):
                    raise SnapshotRefused(f"written before engine {self.index}'s process crashed: its sessions were "
                                          "lost then (they answered 410 state_lost)")
                snap = read_checked(path)
                why = compatible(snap.meta, model, n_engines)
                if why is not None:
                    raise SnapshotRefused(why)
                if check is not None:
                    try:
                        check(snap)
                    except ValueError as e:
                        raise SnapshotRefused(f"malformed content: {e}") from None
            except SnapshotRefused as e:
                log.error("snapshot refused", extra={"engine": self.index, "path": path, "reason": str(e)})
                continue
            return path, snap
        return None


def new_meta(model: dict, index: int, count: int, device: str) -> dict:
    """``meta`` of a snapshot being taken now, sessions to be added."""
    return {"format": FORMAT, "version": VERSION, "created_unix": time.time(),
            "engine": {"index": index, "count": count, "device": device},
            "model": {f: model[f] for f in MODEL_FIELDS}, "sessions": []}
