"""The supervisor's children and the fork server they are forked from (service/cluster/fork_server.py): no process
outlives the supervisor, however early it dies; a signal to the whole process group stops the server cleanly, as a
SIGTERM to the supervisor does; a killed fork server takes every child with it and every one comes back once."""

from __future__ import annotations

import glob
import os
import signal
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
