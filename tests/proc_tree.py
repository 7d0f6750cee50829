"""A server's processes from outside, through ``/proc``: which are alive, what lies below a pid, which fork server
started a server's children."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """Does ``pid`` run (a zombie does not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _stats() -> dict:
    """``{pid: (state, parent's pid)}`` of every process in ``/proc``."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(name)] = (fields[0], int(fields[1]))
            except (OSError, ValueError, IndexError):
                pass
    return out


def children(pid: int, state: str = "") -> list[int]:
    """``pid``'s children (only those in ``state``, e.g. "Z", when given), zombies included."""
    return [c for c, (st, pp) in _stats().items() if pp == pid and (not state or st == state)]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    parents = {c: pp for c, (_st, pp) in _stats().items()}
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p and alive(c)]
        out.update(kids)
        todo += kids
    return out


def child_pids(srv) -> list[int]:
    """The engine and worker processes a server's log says it started (restarts included)."""
    return [int(r["pid"]) for r in srv.logs if r.get("msg") in ("engine process started", "worker process started")]


def tree(srv, pids=None) -> tuple[set, int]:
    """The supervisor's process tree (its children and theirs), and the fork server that ``pids`` (default: the
    children the log names) were started from: the parent of each, itself the supervisor's child."""
    pids = child_pids(srv) if pids is None else pids
    below = descendants(srv.proc.pid)
    servers = {parent_of(p) for p in pids}
    assert len(servers) == 1 and set(pids) <= below, (pids, below, servers)
    fork_server = servers.pop()
    assert fork_server in below and fork_server != srv.proc.pid
    return below, fork_server


def wait(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
