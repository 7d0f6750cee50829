"""Run directories of servers that are gone (service/cluster/run_dirs.py): a starting supervisor removes those
whose lock is free and leaves every other one alone; a real server's directory carries a held lock."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from convserve.service.cluster.run_dirs import LOCK, make_run_dir, sweep_dead


def _dir(root, name, lock=True, age_s=3600.0):
    path = root / name
    path.mkdir()
    (path / "arena-w0-g1").write_bytes(b"\0" * 4096)
    if lock:
        (path / LOCK).write_bytes(b"")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_only_the_directories_of_servers_that_are_gone_are_removed(tmp_path):
    dead = _dir(tmp_path, "convserve-123-abc_9")                       # lock free, old: its server is gone
    live_path, live_fd = make_run_dir(str(tmp_path))                     # this process's lock held
    os.utime(live_path, (time.time() - 3600, time.time() - 3600))
    young = _dir(tmp_path, "convserve-124-new", age_s=0)                 # starting: its lock not taken yet
    no_lock = _dir(tmp_path, "convserve-125-old", lock=False)            # not a directory this code made
    other = _dir(tmp_path, "convserve-client-x")                         # a client's segment name, not a run dir
    # a lock held by another process (another pid namespace would do the same: flock is on the file)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
                               "time.sleep(60)", str(_dir(tmp_path, "convserve-126-held") / LOCK)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert sweep_dead(str(tmp_path)) == [str(dead)]
    finally:
        holder.kill()
        holder.wait()
    assert not dead.exists()
    assert all(p.exists() for p in (Path(live_path), young, no_lock, other, tmp_path / "convserve-126-held"))
    assert sweep_dead(str(tmp_path)) == [str(tmp_path / "convserve-126-held")]   # its holder is gone now
    fcntl.flock(live_fd, fcntl.LOCK_UN)
    os.close(live_fd)
    assert sweep_dead(str(tmp_path)) == [live_path]


def test_a_missing_root_sweeps_nothing(tmp_path):
    assert sweep_dead(str(tmp_path / "nope")) == []
