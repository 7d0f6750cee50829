"""The supervisor's children and the fork server they are forked from (service/cluster/fork_server.py): no process
outlives the supervisor, however early it dies; a signal to the whole process group stops the server cleanly, as a
SIGTERM to the supervisor does; a killed fork server takes every child with it and every one comes back once."""

from __future__ import annotations

import glob
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
import torch

from convserve.clients.protocol import wire
from tests.http_api import DIM, Api, assert_close, model
from tests.live import LiveServer, Reference
from tests.proc_tree import alive, child_pids, children, descendants, tree, wait

ARGS = ["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
        "--workers", "2", "--devices", "cpu,cpu", "--shutdown-timeout-s", "5"]


def _ready(url) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=5).json().get("status") == "ready"
    except (httpx.HTTPError, ValueError):       # a worker that died while it answered
        return False


def _logged(srv, msg: str, n: int = 1):
    return lambda: sum(r.get("msg") == msg for r in srv.logs) >= n


@pytest.mark.parametrize("when", ["engines started", "engines building"])
def test_a_supervisor_killed_while_its_children_start_leaves_no_process_and_no_run_directory(when):
    # a child that had not yet read the supervisor's start time when it died once watched nothing but the fork
    # server, which in turn waited for the child: both ran on forever
    srv = LiveServer(ARGS, listening=False)
    try:
        wait(_logged(srv, "engine process started", 2), what="two engines started")
        if when == "engines building":
            wait(lambda: len(descendants(srv.proc.pid)) >= 3, timeout=10, what="the engines forked")
        below = descendants(srv.proc.pid)
        srv.kill()
        wait(lambda: not any(alive(p) for p in below), timeout=15, what="every process gone")
        wait(lambda: not glob.glob(f"/dev/shm/convserve-{srv.proc.pid}-*"), timeout=5, what="the run dir removed")
    finally:
        srv.kill()


def test_sigterm_to_the_whole_process_group_writes_every_final_snapshot_and_exits_0(tmp_path):
    # Ctrl-C, `timeout` and systemd signal the group: the fork server, signalled too, once died of it, and every
    # child read as exited in the middle of its drain and its final snapshot
    srv = LiveServer([*ARGS, "--state-dir", str(tmp_path)], group=True)
    api = Api(srv.url)
    for i in range(6):
        sid = api.session(f"s{i}")
        assert api.conv(sid, 0, torch.randn(2, DIM))[0] == 200
    below = descendants(srv.proc.pid)
    os.killpg(srv.proc.pid, signal.SIGTERM)
    assert srv.proc.wait(60) == 0, "\n".join(srv.raw[-30:])
    msgs = srv.log_messages()
    assert "stopped with a failure" not in " ".join(msgs)
    assert sum(r.get("msg") == "snapshot written" and r.get("kind") != "periodic" for r in srv.logs) >= 2
    assert msgs.index("stopped") > max(i for i, m in enumerate(msgs) if m == "snapshot written")
    wait(lambda: not any(alive(p) for p in below), timeout=10, what="every process gone")
    assert len(glob.glob(str(tmp_path / "e*.safetensors"))) == 2       # restoring them: tests/test_snapshots.py


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_during_start_up_stops_it_and_exits_0(sig):
    srv = LiveServer(ARGS, listening=False, group=True)
    try:
        wait(_logged(srv, "engine process started", 1), what="an engine started")
        os.killpg(srv.proc.pid, sig)
        assert srv.proc.wait(60) == 0, "\n".join(srv.raw[-30:])
        assert "Traceback" not in "\n".join(srv.raw)
    finally:
        srv.kill()


def test_a_file_in_the_working_directory_named_like_a_module_torch_imports_shadows_nothing(tmp_path):
    # the fork server runs as `python -c`, whose sys.path starts with the working directory
    (tmp_path / "grp.py").write_text("raise SystemExit('the working directory shadowed the module grp')\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    srv = LiveServer(ARGS, cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])])})
    try:
        assert Api(srv.url).session()
        assert "shadowed" not in "\n".join(srv.raw)
    finally:
        srv.terminate()


def test_a_killed_fork_server_takes_its_children_and_every_one_comes_back_once_without_its_sessions():
    # the fork server reports its children's exits to the supervisor: once it is gone, every child must go too,
    # or the supervisor, reading them as exited, would start a second process for one engine or worker
    srv = LiveServer(ARGS)
    try:
        api = Api(srv.url)
        sid = api.session()
        _, fork_server = tree(srv)
        old = set(child_pids(srv)) | {fork_server}
        os.kill(fork_server, signal.SIGKILL)
        wait(lambda: not any(alive(p) for p in old), timeout=5, what="the old children gone")
        wait(lambda: len(child_pids(srv)) == 8 and _ready(srv.url), what="the server back")
        kids = set(child_pids(srv)) - old
        _, new_fork_server = tree(srv, kids)
        assert new_fork_server != fork_server and all(alive(p) for p in kids)
        assert sorted(open(f"/proc/{p}/comm").read().strip() for p in kids) == [
            f"cs-{k}:{srv.port}" for k in ("e0", "e1", "w0", "w1")]                       # one of each, no more
        assert any(r.get("msg", "").startswith("the fork server is gone") for r in srv.logs)   # the log says why
        st, body, _ = api.call("POST", "/v1/conv", {"session": sid, "layer": 0,
                                                    "x": wire.encode_tensor(torch.randn(1, DIM))})
        assert st == 410 and body["error"]["code"] == "state_lost", body
        fresh = api.session()
        x = torch.randn(2, DIM)
        ref = Reference(model())
        ref.create(fresh)
        assert_close(api.conv(fresh, 0, x)[1], ref.conv(fresh, 0, x))
        # the restarts' times (the next restart's Retry-After estimate) count from each process's fork, not from the
        # supervisor's request: the wait for the new fork server's imports is not in them
        import time

        from convserve.service.cluster.lifeline import started
        rows = httpx.get(srv.url + "/readyz", timeout=5).json()["engines"]
        for r in rows:
            fork_server_wait = (started(r["pid"]) - started(new_fork_server)) / os.sysconf("SC_CLK_TCK")
            age = time.clock_gettime(time.CLOCK_BOOTTIME) - started(r["pid"]) / os.sysconf("SC_CLK_TCK")
            assert 0 < r["last_restart_s"] <= age + 0.02, (r, age, fork_server_wait)
        assert srv.terminate() == 0
    finally:
        srv.terminate()


def _pid_namespace() -> tuple:
    """A command prefix that runs the server as PID 1 of a new PID namespace, as a container's entry point without
    an init runs; empty where this machine does not allow one."""
    import shutil
    import subprocess

    for prefix in (("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
                   ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child")):
        if shutil.which(prefix[0]) and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return ()


#: loaded by every process of the server (sitecustomize): each engine process starts a ``sleep`` it never waits for,
#: which outlives it when it dies
_GRANDCHILD_HOOK = '''
import os
if os.environ.get("ENGINE_GRANDCHILD"):
    import subprocess
    from convserve.service.cluster import engine_proc as _engine_proc
    _real = _engine_proc.main

    def main(spec):
        subprocess.Popen(["sleep", os.environ["ENGINE_GRANDCHILD"]])
        return _real(spec)

    _engine_proc.main = main
'''


def test_as_pid_1_the_supervisor_collects_every_process_orphaned_below_it(tmp_path):
    # in a container whose entry point is the server, the children of a killed fork server, and what a dying
    # engine left running, are re-parented to the supervisor: their zombies would stay until the container ends
    prefix = _pid_namespace()
    if not prefix:
        pytest.skip("this machine allows no PID namespace (unshare --pid), so the supervisor cannot run as PID 1")
    (tmp_path / "sitecustomize.py").write_text(_GRANDCHILD_HOOK)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    srv = LiveServer(ARGS, prefix=prefix, env={"PYTHONPATH": path, "ENGINE_GRANDCHILD": "2"})
    try:
        supervisor = srv.server_pid()                                  # unshare's child: PID 1 inside
        (fork_server,) = [p for p in children(supervisor) if len(children(p)) == 4]
        old = set(children(fork_server))
        sleeps = {p for e in old for p in children(e)}                # the engines' grandchildren
        assert len(sleeps) == 2
        os.kill(fork_server, signal.SIGKILL)
        wait(lambda: not any(alive(p) for p in old | sleeps), timeout=10, what="the old children gone")
        wait(lambda: _ready(srv.url) and any(len(children(p)) == 4 for p in children(supervisor)),
             what="the server back")
        wait(lambda: not children(supervisor, "Z"), timeout=5, what="no zombie left under the supervisor")
        assert not set(children(supervisor)) & (old | sleeps)
        assert srv.terminate() == 0
    finally:
        srv.kill()


#: loaded by every process of the server (sitecustomize): once the test has made the file $FORK_SERVER_MARK, each
#: fork server starts $FORK_SERVER_SLOW_S seconds late (a slow disk, a loaded machine), or exits at once in each of
#: its first $FORK_SERVER_DIES starts (an out-of-memory kill, a broken import)
_FORK_SERVER_HOOK = '''
import os
import sys
import time

if ("multiprocessing.forkserver" in " ".join(getattr(sys, "orig_argv", ()))
        and os.path.exists(os.environ["FORK_SERVER_MARK"])):
    starts = os.environ["FORK_SERVER_MARK"] + ".starts"
    with open(starts, "a") as f:
        f.write("x")
    if os.path.getsize(starts) <= int(os.environ.get("FORK_SERVER_DIES", "0")):
        os._exit(1)
    time.sleep(float(os.environ.get("FORK_SERVER_SLOW_S", "0")))
'''


def _hooked(tmp_path, **env):
    from tests.live import sitecustomized

    mark = tmp_path / "mark"
    return mark, sitecustomized(tmp_path, _FORK_SERVER_HOOK, FORK_SERVER_MARK=str(mark), **env)


def _status(srv):
    from convserve.service.cluster.status import StatusTable

    (path,) = glob.glob(f"/dev/shm/convserve-{srv.proc.pid}-*/status")
    return StatusTable(path)


def _kill_fork_server(srv):
    """SIGKILL to the fork server of the server's latest children; the time of the kill."""
    import time

    _, fork_server = tree(srv, child_pids(srv)[-4:])
    t0 = time.time()
    os.kill(fork_server, signal.SIGKILL)
    return t0


def test_while_a_killed_fork_server_starts_again_its_engines_are_down_and_expected_back_after_its_start(tmp_path):
    # multiprocessing starts a fork server again within the next child's start, which waits out its imports: the
    # supervisor's loop once stood still there, its engines' rows said nothing of that wait, and a SIGTERM waited
    import time

    from convserve.service.cluster.status import DOWN, STARTING, UP

    slow = 3.0
    mark, env = _hooked(tmp_path, FORK_SERVER_SLOW_S=str(slow))
    srv = LiveServer(ARGS, env=env)
    try:
        table = _status(srv)
        mark.write_text("")
        _kill_fork_server(srv)                                  # restarts: each engine's time up is measured
        wait(lambda: len(child_pids(srv)) == 8 and _ready(srv.url), what="the server back")
        assert all(table.row(e).up_s > 0 for e in (0, 1))

        t0 = _kill_fork_server(srv)
        seen = {}                       # what, when: the rows down, then starting (a new process), then up
        while time.time() - t0 < 30 and "up" not in seen:
            rows = [table.row(e) for e in (0, 1)]
            now = time.time() - t0
            if all(r.state == DOWN for r in rows):
                seen.setdefault("down", (now, [r.back_at - t0 for r in rows]))
            if any(r.state == STARTING for r in rows):
                seen.setdefault("starting", now)
            if all(r.state == UP for r in rows) and "down" in seen:
                seen["up"] = now
            time.sleep(0.005)
        down, expected = seen["down"]
        assert down < 1.0, seen                                 # at once, not after the fork server's start
        assert seen["starting"] >= slow, seen                   # (the new fork server's start is that long)
        # the expected time back counts the fork server's start (the last one's length), not only the back-off
        # and the engine's own time up (then 1 s + about 0.6 s here)
        assert all(slow <= t <= 3 * seen["up"] for t in expected), seen
        tree(srv, child_pids(srv)[-4:])                         # four new children, of one new fork server
        assert len(child_pids(srv)) == 12 and all(alive(p) for p in child_pids(srv)[-4:])
        assert sum(r.get("msg") == "fork server started" for r in srv.logs) == 3   # the first, then one a kill
        # (a kill's restart begins as its children's exits are seen, maybe before the killed one has exited)
        assert not [r for r in srv.logs if r.get("msg", "").startswith("the fork server did not start")]
        x = torch.randn(2, DIM)
        api = Api(srv.url)
        sid = api.session()
        ref = Reference(model())
        ref.create(sid)
        assert_close(api.conv(sid, 0, x)[1], ref.conv(sid, 0, x))
        assert srv.terminate() == 0
    finally:
        srv.kill()


def test_a_sigterm_while_a_killed_fork_server_starts_again_stops_the_server_at_once(tmp_path):
    import time

    from convserve.service.cluster.status import DOWN

    mark, env = _hooked(tmp_path, FORK_SERVER_SLOW_S="30")
    srv = LiveServer(ARGS, env=env)
    try:
        table = _status(srv)
        mark.write_text("")
        _kill_fork_server(srv)
        wait(lambda: all(table.row(e).state == DOWN for e in (0, 1)), timeout=5, what="the engines down")
        time.sleep(0.5)                                         # the children's back-off over: they wait for it
        below = descendants(srv.proc.pid)                       # the new fork server among them
        t0 = time.monotonic()
        assert srv.terminate() == 0
        assert time.monotonic() - t0 < 10, "it waited for the fork server's start"
        wait(lambda: not any(alive(p) for p in below), timeout=5, what="every process gone")
        assert "Traceback" not in "\n".join(srv.raw)
    finally:
        srv.kill()


@pytest.mark.parametrize("dies", [2, 99], ids=["then-starts", "always"])
def test_a_fork_server_that_dies_while_it_starts_is_started_again_after_a_growing_pause_a_few_times(tmp_path, dies):
    from datetime import datetime

    from convserve.service.cluster.fork_server import RETRY_S, START_TRIES

    mark, env = _hooked(tmp_path, FORK_SERVER_DIES=str(dies))
    srv = LiveServer(ARGS, env=env)
    try:
        mark.write_text("")
        _kill_fork_server(srv)
        if dies < START_TRIES:
            wait(lambda: len(child_pids(srv)) == 8 and _ready(srv.url), what="the server back")
            Api(srv.url).session()
            assert srv.terminate() == 0
        else:
            assert srv.proc.wait(60) == 1, "\n".join(srv.raw[-30:])
            assert "the fork server could not be started again; stopping" in srv.log_messages()
            assert "Traceback" not in "\n".join(srv.raw)
        failed = [r for r in srv.logs if r.get("msg", "").startswith("the fork server did not start")]
        assert len(failed) == min(dies, START_TRIES)
        times = [datetime.fromisoformat(r["ts"].rstrip("Z")).timestamp() for r in failed]
        pauses = [b - a for a, b in zip(times, times[1:])]
        assert all(p >= RETRY_S * 2 ** i for i, p in enumerate(pauses)), pauses    # never a tight loop
    finally:
        srv.kill()


def test_an_unexpected_error_in_a_fork_server_start_reaches_the_supervisor_as_a_failed_start(monkeypatch):
    # a start that ends any way at all must wake the loop with a result: else the loop waits on it for ever
    from convserve.service.cluster import fork_server

    def broken(*a, **k):
        raise RuntimeError("something multiprocessing did not expect")

    monkeypatch.setattr(fork_server, "_probe", broken)
    woken = threading.Event()
    keeper = fork_server.Keeper(fork_server.context(), woken.set)
    if not keeper.active:
        pytest.skip("no fork server on this platform")
    assert not keeper.up()                       # begins a start
    assert woken.wait(10), "the failed start never woke the supervisor"
    assert not keeper.up()
    assert keeper.failed is not None and "RuntimeError" in keeper.failed
    keeper.close()
