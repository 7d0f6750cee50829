"""The supervisor: the port is bound before the engines build and listened on after (another server that takes
the port in between ends this start with the one-line error and exit 2, not a traceback); at shutdown a child
that does not stop in time is killed."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from convserve.service.cluster.supervisor import Supervisor
from convserve.service.config import load_settings


def test_a_port_taken_while_the_engines_build_ends_the_start_with_cannot_listen_and_status_2(monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unused")        # run() sets it for its children: restored
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sup = Supervisor(load_settings({"port": port, "device": "cpu"}), ["cpu"], 1)
    rival = socket.socket()
    spawned, stopped = [], []

    def spawn(child):              # another server (SO_REUSEADDR, as ours) binds and listens while ours builds
        spawned.append(child.index)
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rival.bind(("127.0.0.1", port))
        rival.listen()

    monkeypatch.setattr(sup, "_spawn_engine", spawn)
    monkeypatch.setattr(sup, "_wait_built", lambda: True)
    monkeypatch.setattr(sup, "_stop_all", lambda: stopped.append(True))
    try:
        assert sup.run() == 2
    finally:
        rival.close()
    assert spawned == [0] and stopped == [True]                 # the engines it started are stopped
    assert f"cannot listen on 127.0.0.1:{port}" in sup.start_error and "--port" in sup.start_error
    assert not os.path.exists(sup.run_dir)


def _ignore_sigterm_and_sleep():
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_a_child_that_does_not_stop_in_time_is_killed_and_logged(caplog):
    # the log call once raised (KeyError: 'name' overwrites a LogRecord attribute), so the child was never killed
    import logging
    import multiprocessing
    import types

    from convserve.service.cluster.supervisor import Supervisor

    p = multiprocessing.get_context("fork").Process(target=_ignore_sigterm_and_sleep, name="engine-0")
    p.start()
    time.sleep(0.3)                          # its handler in place
    marked = []
    fake = types.SimpleNamespace(failed=False, _mark_crashed=marked.append)
    child = types.SimpleNamespace(proc=p, restart_at=None, born=None, kind="engine", index=0)
    with caplog.at_level(logging.ERROR, logger="convserve"):
        Supervisor._stop(fake, [child], 0.5)
    assert not p.is_alive() and p.exitcode == -9
    assert fake.failed and child.proc is None
    assert marked == [0]                     # killed: no final snapshot, so its files are not to be restored
    rec = [r for r in caplog.records if "did not stop in time" in r.getMessage()]
    assert rec and rec[0].child == "engine-0" and rec[0].pid == p.pid


class _StuckProcess:
    """A child that neither SIGTERM nor SIGKILL ends at once (one in the kernel's uninterruptible sleep): each join
    waits out its timeout, and records it."""

    def __init__(self, i: int):
        self.pid, self.name, self.exitcode, self.joins = 10**7 + i, f"worker-{i}", None, []

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        self.joins.append(timeout)
        time.sleep(timeout or 0)


def test_the_children_overdue_at_a_stage_end_are_killed_together_so_the_stage_waits_once(monkeypatch):
    """A stage's kill wait is one KILL_JOIN_S for all its overdue children, not one each: the orchestrator's grace
    (terminationGracePeriodSeconds) allows one per stage."""
    import types

    from convserve.service.cluster import supervisor

    sent = []
    monkeypatch.setattr(supervisor, "_signal", lambda c, sig: sent.append((c.proc.name, sig)))
    monkeypatch.setattr(supervisor, "KILL_JOIN_S", 0.3)
    children = [types.SimpleNamespace(proc=_StuckProcess(i), restart_at=None, born=None, kind="worker", index=i)
                for i in range(3)]
    procs = [c.proc for c in children]
    fake = types.SimpleNamespace(failed=False)
    Supervisor._stop(fake, children, 0.2)
    assert [sig for _, sig in sent] == [signal.SIGTERM] * 3 + [signal.SIGKILL] * 3 and fake.failed
    kill_waits = [p.joins[-1] for p in procs]       # each child's last join: after the kills
    assert kill_waits[0] == pytest.approx(0.3, abs=0.05) and sum(kill_waits[1:]) < 0.05, kill_waits


@pytest.mark.parametrize("code, marked", [(-9, [0]), (1, [0]), (3, []), (255, [])],
                         ids=["killed", "final-snapshot-failed", "start-failed", "fork-server-gone"])
def test_an_engine_that_ended_before_the_stop_fails_it_and_is_marked_crashed_only_if_its_files_are_stale(code, marked):
    """Killed, or its final snapshot not written: its files are older than its sessions (marked). A start that
    failed (EXIT_BUILD) served nothing, and 255 is what every child reads once the fork server is gone: not
    marked. Each fails the stop."""
    import types

    from convserve.service.cluster.supervisor import Supervisor

    got = []
    fake = types.SimpleNamespace(failed=False, _mark_crashed=got.append)
    proc = types.SimpleNamespace(pid=10**7, name="engine-0", exitcode=code, is_alive=lambda: False,
                                 join=lambda timeout=None: None)
    child = types.SimpleNamespace(proc=proc, restart_at=None, born=None, kind="engine", index=0)
    Supervisor._stop(fake, [child], 0.1)
    assert fake.failed and got == marked and child.proc is None


def _exit_with(code: int) -> None:
    import os
    import signal

    if code < 0:                                   # killed by that signal, as its default action does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _supervisor_whose_engine_exits(monkeypatch, code: int, reason=None):
    """A supervisor of one cpu engine and no workers whose engine process exits with ``code`` at once (leaving
    ``reason`` as its start error, as engine_proc.main does), before it ever comes up."""
    import multiprocessing

    from convserve.service.cluster import engine_proc

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unused")        # run() sets it for its children: restored
    sup = Supervisor(load_settings({"port": 0, "device": "cpu"}), ["cpu"], 1)

    def spawn(c):
        if reason is not None:
            with open(engine_proc.start_error_path(sup.run_dir, c.index), "w") as f:
                f.write(reason)
        c.proc = multiprocessing.get_context("fork").Process(target=_exit_with, args=(code,), name="engine-0")
        c.proc.start()
        c.proc.join()                     # its exit is there to be seen from here on

    monkeypatch.setattr(sup, "_spawn_engine", spawn)
    monkeypatch.setattr(sup, "_spawn_worker", lambda c: None)
    return sup


@pytest.mark.parametrize("reason, why", [("999 slots need 9 TiB; lower --slots", "999 slots need 9 TiB; lower --slots"),
                                         (None, "it exited before it came up")], ids=["its-reason", "no-reason"])
def test_a_sigterm_in_the_turn_an_engine_fails_its_start_still_exits_2_with_the_reason(monkeypatch, reason, why):
    """The loop's wait returns for the engine's exit, and the SIGTERM's handler runs before the loop looks at the
    exits: the stop that follows still reads the engine's EXIT_BUILD as its failed start (2), not as a child that
    failed to stop (1)."""
    from convserve.service.cluster import supervisor

    sup = _supervisor_whose_engine_exits(monkeypatch, 3, reason)
    monkeypatch.setattr(sup, "_wait_built", lambda: True)

    def wait(sentinels, timeout=None):            # the exit and a SIGTERM in one turn
        sup._on_signal(signal.SIGTERM, None)
        return sentinels

    monkeypatch.setattr(supervisor, "wait", wait)
    assert sup.run() == 2
    assert sup.start_error == f"engine 0 (cpu) cannot start: {why}" + ("; see the log above" if reason is None else "")
    assert not sup.failed                          # its exit is its start's failure, not a stop's
    assert not os.path.exists(sup.run_dir)


def test_a_sigterm_while_the_engines_build_still_exits_2_when_one_failed_its_start(monkeypatch):
    sup = _supervisor_whose_engine_exits(monkeypatch, 3, "cannot allocate the pool")
    spawn = sup._spawn_engine

    def spawn_then_sigterm(c):                    # the exit, then the SIGTERM before the build's wait looks
        spawn(c)
        sup._on_signal(signal.SIGTERM, None)

    monkeypatch.setattr(sup, "_spawn_engine", spawn_then_sigterm)
    assert sup.run() == 2 and sup.start_error == "engine 0 (cpu) cannot start: cannot allocate the pool"


def test_a_sigterm_to_the_whole_group_while_the_engines_build_is_a_clean_stop(monkeypatch):
    """An engine that the group's SIGTERM ends while it builds exits -15: a stop, not a failed start."""
    sup = _supervisor_whose_engine_exits(monkeypatch, -signal.SIGTERM)
    spawn = sup._spawn_engine

    def spawn_then_sigterm(c):
        spawn(c)
        sup._on_signal(signal.SIGTERM, None)

    monkeypatch.setattr(sup, "_spawn_engine", spawn_then_sigterm)
    assert sup.run() == 0 and sup.start_error is None and not sup.failed


class _ExitNotYetReported:
    """An engine process that has exited with EXIT_BUILD but whose fork server reports it only once joined."""

    def __init__(self):
        self.pid, self.name, self._code = 10**7, "engine-0", None

    @property
    def exitcode(self):
        return self._code

    def is_alive(self) -> bool:
        return self._code is None

    def join(self, timeout=None) -> None:
        self._code = 3


def test_an_engine_start_failure_reported_only_during_the_stop_is_still_the_start_failure(monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unused")
    sup = Supervisor(load_settings({"port": 0, "device": "cpu"}), ["cpu"], 1)
    try:
        sup.engines[0].proc = _ExitNotYetReported()
        sup.stopping = True
        sup._stop_all()
        assert sup.start_error == "engine 0 (cpu) cannot start: it exited before it came up; see the log above"
    finally:
        import shutil

        shutil.rmtree(sup.run_dir, ignore_errors=True)
        os.close(sup._run_lock)


_SLOW_WARM_UP = """
import time
from convserve.service.engine import core
_start = core.Engine.start
def start(self, *args, **kwargs):   # built, then a warm-up that hangs (a CUDA-graph capture that never ends)
    time.sleep(120)
    return _start(self, *args, **kwargs)
core.Engine.start = start
"""


def test_an_engine_built_but_not_up_within_the_build_timeout_ends_the_start_with_exit_1_naming_it(tmp_path):
    """``engine_build_timeout_s`` covers the warm-up after the build too (the state pool, CUDA graphs), which runs
    while the workers already listen: an engine that never comes up ends the start (exit 1, the reason named)
    rather than leaving a server that is alive, healthy and never ready."""
    import subprocess
    import sys

    from tests.test_cluster_failures import ARGS

    (tmp_path / "sitecustomize.py").write_text(_SLOW_WARM_UP)      # imported by every process, the engines' too
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--host", "127.0.0.1", "--port", "0",
                           "--device", "cpu", *ARGS, "--engine-build-timeout-s", "4"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=90)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 1, out[-3000:]
    assert time.monotonic() - t0 < 60, "it waited for the warm-up"
    assert '"listening"' in out and "engines not up in time" in out, out[-3000:]
    assert "not up within engine_build_timeout_s=4 s" in out, out[-3000:]
