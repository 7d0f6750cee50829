"""Crash marks of an engine's snapshot files: which of them predate a crash of the process that wrote them, and
so are never restored (:mod:`.snapshots`). Free of torch and safetensors: the supervisor writes a mark the moment
it finds an engine process dead, and must not import either (its working directory is on its ``sys.path``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

log = logging.getLogger("convserve.snapshots")

#: the fields of the model part of ``meta`` that must equal the serving model's for a snapshot to load
MODEL_FIELDS = ("weights_sha256", "layers", "dim", "width", "dtype", "state_dtype")
SNAPSHOT_NAME = re.compile(r"^e(\d+)\.(\d{12})\.safetensors$")
#: ``e<index>.crashed``: the files of engine ``index`` that predate a crash of its process (``mark_crashed``)
CRASH_SUFFIX = ".crashed"


def write_json(path: str, obj) -> None:
    """``obj`` as JSON in ``path``, atomically and durably."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CrashMarks:
    """Engine ``index``'s snapshot files in ``folder`` as numbers, its crash marks, and the model it noted."""

    def __init__(self, folder: str, index: int):
        self.folder, self.index = str(folder), index

    def files(self) -> list:
        """This engine's snapshot paths, newest first."""
        found = []
        for name in os.listdir(self.folder):
            m = SNAPSHOT_NAME.match(name)
            if m and int(m.group(1)) == self.index:
                found.append((int(m.group(2)), os.path.join(self.folder, name)))
        return [p for _seq, p in sorted(found, reverse=True)]

    def _newest_seq(self) -> int:
        files = self.files()
        return int(SNAPSHOT_NAME.match(os.path.basename(files[0])).group(2)) if files else 0

    @property
    def crash_path(self) -> str:
        return os.path.join(self.folder, f"e{self.index}{CRASH_SUFFIX}")

    @property
    def model_path(self) -> str:
        return os.path.join(self.folder, f"e{self.index}.model.json")

    def note_model(self, model: dict) -> None:
        """Record the model this engine's process serves (at its start, before it restores): a crash of that
        process marks that model's files only (:meth:`mark_crashed`)."""
        write_json(self.model_path, {f: model.get(f) for f in MODEL_FIELDS})

    def forget_model(self) -> None:
        """No model noted (one from an earlier start would be wrong); best effort."""
        with contextlib.suppress(OSError):
            os.unlink(self.model_path)

    def mark_crashed(self) -> int:
        """Engine ``index``'s process died: its sessions are lost (they answer 410), so none of its files of the
        model it served written so far may be restored, not even at a cold start before its next process writes
        one (a stop during the restart's back-off). Files of another model stay restorable (a server started with
        the wrong model by mistake). Records ``{"through": newest file number, "model"}`` beside earlier marks
        (durably; the model None, refusing every model's files, when the process never said which it served);
        returns the number."""
        try:
            with open(self.model_path, encoding="utf-8") as f:
                model = json.load(f)
        except (OSError, ValueError):
            model = None
        marks = self.crash_marks()
        through = max([self._newest_seq()] + [m["through"] for m in marks])
        write_json(self.crash_path, {"marks": [m for m in marks if m["model"] != model]
                                     + [{"through": through, "model": model}]})
        return through

    def crash_marks(self) -> list:
        """The crash marks (``{"through", "model"}``, see :meth:`mark_crashed`). A torn mark file is replaced, once,
        by one refusing every file there is now (of any model), as the crash it recorded would have."""
        try:
            with open(self.crash_path, encoding="utf-8") as f:
                marks = json.load(f)
            if isinstance(marks, int) and not isinstance(marks, bool):   # a bare number: through it, any model
                return [{"through": marks, "model": None}]
            return [{"through": int(m["through"]), "model": m["model"]} for m in marks["marks"]]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError):
            marks = [{"through": self._newest_seq(), "model": None}]
            try:
                write_json(self.crash_path, {"marks": marks})
            except OSError as e:   # the marks hold in this process; a later read freezes them at its own newest
                log.error("cannot replace a torn crash mark", extra={"engine": self.index, "error": str(e)})
            return marks
