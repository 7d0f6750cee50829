"""Snapshot files (service/snapshot_file.py) and the state directory's layout (service/snapshots.py): the
digest, atomic writes, retention, and what is refused (torn, flipped, foreign, another layout)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from convserve.service import snapshot_file as sf
from convserve.service import snapshot_marks
from convserve.service.snapshots import LAYOUT_FILE, prepare_state_dir

MODEL = {"weights_sha256": "ab" * 32, "layers": [0, 2, 5], "dim": 8, "width": 4, "dtype": "float32",
         "state_dtype": "float32"}


def snap(n_sessions: int = 2, dtype=torch.float32, seed: int = 0) -> sf.Snapshot:
    g = torch.Generator().manual_seed(seed)
    meta = sf.new_meta(dict(MODEL, state_dtype=str(dtype).removeprefix("torch.")), 0, 1, "cpu")
    meta["sessions"] = [{"id": f"s{i}", "positions": [i, 0, 1], "initialized": 5, "pending": []}
                        for i in range(n_sessions)]
    meta["lost"] = []
    return sf.Snapshot(meta, {"state": torch.randn(3, n_sessions, 3, 8, generator=g).to(dtype)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_a_written_snapshot_reads_back_bit_for_bit_and_leaves_no_temporary(tmp_path, dtype, n):
    s = snap(n, dtype)
    path = str(tmp_path / "e0.000000000001.safetensors")
    size = sf.write_atomic(path, s)
    assert size == os.path.getsize(path) and os.listdir(tmp_path) == [os.path.basename(path)]
    got = sf.read_checked(path)
    assert got.meta == s.meta and got.meta["sha256"] == sf.digest(s.meta, s.tensors)
    assert got.tensors["state"].dtype == dtype
    assert torch.equal(got.tensors["state"].view(torch.uint8), s.tensors["state"].view(torch.uint8))


@pytest.mark.parametrize("cut", [0, 7, 8, 100, -1, -40])
def test_a_truncated_file_is_refused(tmp_path, cut):
    path = str(tmp_path / "e0.000000000001.safetensors")
    size = sf.write_atomic(path, snap(3))
    with open(path, "r+b") as f:
        f.truncate(cut if cut >= 0 else size + cut)
    with pytest.raises(sf.SnapshotRefused):
        sf.read_checked(path)


@pytest.mark.parametrize("where", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_a_flipped_byte_anywhere_is_refused(tmp_path, where):
    path = str(tmp_path / "e0.000000000001.safetensors")
    size = sf.write_atomic(path, snap(3))
    off = min(size - 1, int(size * where))
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(sf.SnapshotRefused):
        sf.read_checked(path)


def test_a_safetensors_file_without_the_snapshot_metadata_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "e0.000000000001.safetensors")
    save_file({"state": torch.zeros(3, 1, 3, 8)}, path, metadata={"format": "pt"})
    with pytest.raises(sf.SnapshotRefused, match="not a convserve snapshot"):
        sf.read_checked(path)


@pytest.mark.parametrize("field,value", [("weights_sha256", "cd" * 32), ("layers", [0, 2]), ("dim", 16),
                                         ("width", 3), ("dtype", "bfloat16"), ("state_dtype", "float16")])
def test_a_snapshot_of_another_model_is_foreign(field, value):
    meta = snap(1).meta
    assert sf.compatible(meta, MODEL) is None
    why = sf.compatible(meta, dict(MODEL, **{field: value}))
    assert why is not None and field in why


def test_a_snapshot_of_another_engine_count_is_refused():
    meta = snap(1).meta
    assert sf.compatible(meta, MODEL, 1) is None
    why = sf.compatible(meta, MODEL, 2)
    assert why is not None and "of 1 engines" in why


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_directory_keeps_the_newest_files_of_each_engine(tmp_path, keep):
    d0, d1 = sf.SnapshotDir(tmp_path, 0, keep), sf.SnapshotDir(tmp_path, 1, keep)
    paths = [d0.write(snap(1, seed=i))[0] for i in range(keep + 2)]
    d1.write(snap(2))
    assert d0.files() == paths[::-1][:keep]                   # newest first, the rest removed
    assert len(d1.files()) == 1                               # another engine's files are its own
    assert sorted(paths) == paths                             # names sort by age


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_files_of_another_model_or_unreadable_are_never_rotated_out_so_the_right_model_finds_them_again(tmp_path,
                                                                                                      keep):
    d = sf.SnapshotDir(tmp_path, 0, keep)
    torn, size = d.write(snap(1, seed=9))
    with open(torn, "r+b") as f:
        f.truncate(size // 2)
    right = [d.write(snap(1, seed=i))[0] for i in range(keep + 1)]
    assert set(d.files()) == {torn, *right[-keep:]}
    mistaken = []
    for i in range(keep + 3):                       # a server started with another model by mistake, writing on
        other = snap(1, seed=10 + i)
        other.meta["model"]["dim"] = 16
        mistaken.append(d.write(other)[0])
    files = d.files()
    assert set(right[-keep:]) <= set(files) and torn in files     # the right model's newest keep, the torn one
    assert [p for p in files if p in mistaken] == mistaken[::-1][:keep]   # the mistaken model rotates its own
    path, got = d.newest_good(MODEL, 1)              # the right model back: its newest file
    assert path == right[-1] and torch.equal(got.tensors["state"], snap(1, seed=keep).tensors["state"])


def test_the_newest_good_file_is_used_and_torn_or_foreign_newer_ones_are_logged_and_skipped(tmp_path, caplog):
    d = sf.SnapshotDir(tmp_path, 0, 5)
    good, _ = d.write(snap(2, seed=1))
    foreign = snap(2, seed=2)
    foreign.meta["model"]["weights_sha256"] = "ff" * 32
    d.write(foreign)
    torn, size = d.write(snap(2, seed=3))
    with open(torn, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.ERROR, logger="convserve.snapshots"):
        path, got = d.newest_good(MODEL, 1)
    assert path == good
    assert torch.equal(got.tensors["state"], snap(2, seed=1).tensors["state"])
    refused = [r for r in caplog.records if r.getMessage() == "snapshot refused"]
    assert len(refused) == 2 and "unreadable" in refused[0].reason and "weights_sha256" in refused[1].reason


def test_no_good_file_is_none(tmp_path):
    d = sf.SnapshotDir(tmp_path, 0, 3)
    assert d.newest_good(MODEL) is None
    path, _ = d.write(snap(1))
    open(path, "wb").close()
    assert d.newest_good(MODEL) is None


def test_a_write_that_fails_midway_leaves_the_previous_files_and_no_temporary(tmp_path, monkeypatch):
    d = sf.SnapshotDir(tmp_path, 0, 3)
    first, _ = d.write(snap(1))

    def torn_save(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(sf, "save_file", torn_save)
    with pytest.raises(OSError, match="disk full"):
        d.write(snap(2))
    assert os.listdir(tmp_path) == [os.path.basename(first)]
    assert d.newest_good(MODEL)[0] == first


def test_a_temporary_left_by_a_crash_is_removed_when_the_engine_starts(tmp_path):
    stray = tmp_path / ".tmp-e0.000000000002.safetensors.123"
    other = tmp_path / ".tmp-e1.000000000002.safetensors.123"
    stray.write_bytes(b"x")
    other.write_bytes(b"x")
    sf.SnapshotDir(tmp_path, 0, 3)
    assert not stray.exists() and other.exists()              # another engine's is its own to clean


@pytest.mark.parametrize("before,now,set_aside", [(None, 1, False), (1, 1, False), (2, 2, False), (1, 2, True),
                                                  (2, 1, True)])
def test_snapshots_of_another_engine_count_are_set_aside_at_start(tmp_path, before, now, set_aside):
    if before is not None:
        prepare_state_dir(tmp_path, before)
        sf.SnapshotDir(tmp_path, 0, 3).write(snap(1))
    prepare_state_dir(tmp_path, now)
    assert json.loads((tmp_path / LAYOUT_FILE).read_text()) == {"engines": now}
    left = sf.SnapshotDir(tmp_path, 0, 3).files()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("superseded-")]
    if before is None:
        assert not left and not aside
    elif set_aside:
        assert not left and len(aside) == 1 and len(list(aside[0].iterdir())) == 1
    else:
        assert len(left) == 1 and not aside


@pytest.mark.parametrize("layout_file", ["missing", "garbage", "not a map"])
@pytest.mark.parametrize("written_by,now,set_aside", [(1, 1, False), (2, 2, False), (1, 2, True), (2, 1, True)])
def test_without_a_readable_layout_file_the_snapshots_headers_say_their_engine_count(tmp_path, layout_file,
                                                                                      written_by, now, set_aside):
    for e in range(written_by):
        s = snap(1, seed=e)
        s.meta["engine"] = {"index": e, "count": written_by, "device": "cpu"}
        sf.SnapshotDir(tmp_path, e, 3).write(s)
    if layout_file != "missing":
        (tmp_path / LAYOUT_FILE).write_text("garbage{" if layout_file == "garbage" else "[1, 2]")
    prepare_state_dir(tmp_path, now)
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".safetensors")]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("superseded-")]
    assert (len(left), len(aside)) == ((0, 1) if set_aside else (written_by, 0))
    assert json.loads((tmp_path / LAYOUT_FILE).read_text()) == {"engines": now}


@pytest.mark.parametrize("layout_file", ["missing", "garbage"])
def test_unreadable_snapshots_without_a_layout_file_stay_where_they_are(tmp_path, layout_file):
    """Nothing readable says another engine count: the files are left (a restore refuses each with a log line),
    not moved aside."""
    junk = [tmp_path / "e0.000000000001.safetensors", tmp_path / "e5.notanumber.safetensors"]
    for p in junk:
        p.write_bytes(b"not a safetensors file")
    if layout_file != "missing":
        (tmp_path / LAYOUT_FILE).write_text("garbage{")
    prepare_state_dir(tmp_path, 1)
    assert all(p.read_bytes() == b"not a safetensors file" for p in junk)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("superseded-")]


def test_a_whole_file_whose_content_the_check_refuses_falls_back_to_the_one_before(tmp_path, caplog):
    d = sf.SnapshotDir(tmp_path, 0, 3)
    good, _ = d.write(snap(1))
    d.write(snap(2))

    def one_session_only(s):
        if len(s.sessions) != 1:
            raise ValueError("too many")

    with caplog.at_level(logging.ERROR, logger="convserve.snapshots"):
        assert d.newest_good(MODEL, 1, one_session_only)[0] == good
    assert [r.reason for r in caplog.records] == ["malformed content: too many"]


@pytest.mark.parametrize("keep", [1, 3])
def test_files_written_before_a_crash_mark_are_never_restored_and_later_ones_are(tmp_path, caplog, keep):
    """The supervisor marks an engine whose process died: none of its files so far is restored (its sessions
    were lost), not even as the fallback of a later torn one; files written after the mark number above it, the
    marked ones are removed at the next write; the other engine's files are untouched."""
    d0, d1 = sf.SnapshotDir(tmp_path, 0, keep), sf.SnapshotDir(tmp_path, 1, keep)
    d0.note_model(MODEL)
    for i in range(keep + 1):
        d0.write(snap(2, seed=i))
    d1.write(snap(1))
    assert d0.mark_crashed() == keep + 1
    with caplog.at_level(logging.ERROR, logger="convserve.snapshots"):
        assert d0.newest_good(MODEL) is None
    assert all("crashed" in r.reason for r in caplog.records) and caplog.records
    assert d1.newest_good(MODEL) is not None
    paths = [d0.write(snap(0, seed=10 + i))[0] for i in range(2)]
    assert d0.files() == paths[::-1][:keep]                                  # the marked ones are gone
    assert int(os.path.basename(paths[0]).split(".")[1]) == keep + 2
    assert d0.newest_good(MODEL)[0] == paths[-1]
    with open(paths[-1], "r+b") as f:                                         # a torn newest: the one before
        f.truncate(10)
    assert d0.newest_good(MODEL)[0] == paths[-2] if keep > 1 else d0.newest_good(MODEL) is None


def test_a_crash_marks_only_the_files_of_the_model_its_process_served(tmp_path):
    """A server started by mistake with another model, whose engine then crashes: the right model's files stay
    restorable for the next start with it."""
    d = sf.SnapshotDir(tmp_path, 0, 3)
    right = d.write(snap(2))[0]
    other = dict(MODEL, weights_sha256="cd" * 32)
    s = snap(1)
    s.meta["model"] = dict(other)
    d.write(s)
    d.note_model(other)
    d.mark_crashed()
    assert d.newest_good(other) is None
    assert d.newest_good(MODEL)[0] == right
    d.note_model(MODEL)                                                       # later the right model's crashes
    d.mark_crashed()
    assert d.newest_good(MODEL) is None and len(d.crash_marks()) == 2


def test_a_torn_crash_mark_refuses_every_file_there_is_then_and_not_the_ones_written_after(tmp_path):
    d = sf.SnapshotDir(tmp_path, 0, 3)
    d.write(snap(1))
    with open(d.crash_path, "w") as f:
        f.write("garb")
    assert d.newest_good(MODEL) is None
    later = [d.write(snap(1, seed=i))[0] for i in range(2)]
    assert d.newest_good(MODEL)[0] == later[-1]
    d.note_model(MODEL)
    assert d.mark_crashed() == 3 and d.mark_crashed() == 3
    assert int(os.path.basename(d.write(snap(1))[0]).split(".")[1]) == 4


def test_crash_marks_are_set_aside_with_the_snapshots_of_another_engine_count(tmp_path):
    prepare_state_dir(tmp_path, 2)
    d = sf.SnapshotDir(tmp_path, 0, 3)
    d.write(snap(1))
    d.mark_crashed()
    prepare_state_dir(tmp_path, 1)
    assert not os.path.exists(d.crash_path) and d.crash_marks() == []
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("superseded-")]
    assert sorted(n.name for n in aside[0].iterdir()) == ["e0.000000000001.safetensors", "e0.crashed"]


def test_a_crash_mark_of_the_first_format_refuses_the_files_up_to_its_number_only(tmp_path):
    """Files 2 and 3 written after a mark "1" (by the release that wrote that format) stay restorable."""
    d = sf.SnapshotDir(tmp_path, 0, 3)
    d.write(snap(1))
    with open(d.crash_path, "w") as f:
        f.write("1\n")
    later = [str(tmp_path / f"e0.00000000000{i}.safetensors") for i in (2, 3)]
    for i, path in enumerate(later):
        sf.write_atomic(path, snap(1, seed=i))
    assert d.crash_marks() == [{"through": 1, "model": None}]
    assert d.newest_good(MODEL)[0] == later[-1]


def test_a_state_dir_that_cannot_take_the_models_note_leaves_the_engine_starting_and_no_stale_note(tmp_path,
                                                                                                 monkeypatch):
    import errno
    from types import SimpleNamespace

    from convserve.service.snapshots import Snapshotter

    sf.SnapshotDir(tmp_path, 0, 3).note_model(dict(MODEL, weights_sha256="ef" * 32))   # an earlier start's

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(snapshot_marks, "write_json", full)
    settings = SimpleNamespace(state_dir=str(tmp_path), snapshot_keep=3, snapshot_interval_s=0)
    engine = SimpleNamespace(model_info=lambda: dict(MODEL))
    Snapshotter(engine, settings)                                 # does not raise
    assert not os.path.exists(sf.SnapshotDir(tmp_path, 0, 3).model_path)


def test_temporaries_of_the_mark_and_the_note_left_by_a_crash_are_removed(tmp_path):
    for name in ("e0.crashed.123.tmp", "e0.model.json.77.tmp", "e1.crashed.5.tmp"):
        (tmp_path / name).write_text("x")
    sf.SnapshotDir(tmp_path, 0, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1.crashed.5.tmp"]


def test_the_supervisor_marks_a_crash_without_importing_torch(tmp_path):
    """It marks the moment an engine dies; torch there would cost seconds, and its working directory (on its
    sys.path) could shadow a module torch imports."""
    import subprocess
    import sys

    code = ("import sys; from convserve.service.snapshot_marks import CrashMarks; "
            f"CrashMarks({str(tmp_path)!r}, 0).mark_crashed(); "
            "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]" and (tmp_path / "e0.crashed").exists()


def test_the_rotation_reads_each_files_header_once_not_at_every_write(tmp_path, monkeypatch):
    """A header holds every session's record: the rotation's model check and the start's summary read each
    file's once, as files never change once written."""
    d = sf.SnapshotDir(tmp_path, 0, 3)
    reads = []
    real = sf.read_meta
    monkeypatch.setattr(sf, "read_meta", lambda path: reads.append(path) or real(path))
    written = [d.write(snap(2, seed=i))[0] for i in range(8)]
    assert len(reads) == len(set(reads)) <= len(written)
    assert [p for p, _s in d.headers()] == written[::-1][:3]
    assert len(reads) == len(set(reads))
