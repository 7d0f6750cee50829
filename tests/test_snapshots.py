"""Session snapshots of a real server (service/snapshots.py), in both layouts: SIGTERM, restart and continue; kill -9
after a periodic snapshot, where positions reveal the stale sessions; torn and foreign snapshots refused with the
previous good one used; an engine process restarted after a crash restores nothing, and a stop before it is
back does not bring its sessions back at the next start."""

from __future__ import annotations

import os
import signal
import time
import uuid

import httpx
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.cluster.placement import engine_of
from convserve.service.config import ConfigError, Settings, load_settings
from convserve.service.snapshot_file import SnapshotDir, read_checked
from tests.http_api import DIM, LAYERS, Api, assert_close, metric, model, rand_x
from tests.http_api import conv_at as conv
from tests.live import LiveServer, Reference

MODEL_ARGS = ["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "32",
              "--max-queue-delay-us", "200", "--shutdown-timeout-s", "5"]
LAYOUTS = {"in-process": ["--workers", "0"], "engine processes": ["--workers", "1", "--devices", "cpu,cpu"]}


def serve(state_dir, layout: str, *extra) -> LiveServer:
    return LiveServer([*MODEL_ARGS, *LAYOUTS[layout], "--state-dir", str(state_dir), *extra])


def positions(api, sid):
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}")
    assert st == 200, obj
    return obj["positions"]


class Client:
    """A client that tracks each session's positions, checked against the reference on every answer."""

    def __init__(self, url):
        self.api, self.ref, self.pos = Api(url), Reference(model()), {}

    def create(self, sid):
        self.api.session(sid)
        self.ref.create(sid)
        self.pos[sid] = [0] * len(LAYERS)

    def conv(self, sid, layer, t, seed):
        x = rand_x(t, seed=seed)
        p = LAYERS.index(layer)
        st, y = conv(self.api, sid, layer, x, position=self.pos[sid][p])
        assert st == 200, y
        assert_close(y, self.ref.conv(sid, layer, x))
        self.pos[sid][p] += t

    def reconnect(self, url):
        self.api = Api(url)


def ids(n, layout):
    """Session ids spread over both engines of the two-engine layout."""
    out, i = [], 0
    while len(out) < n:
        sid = f"{uuid.uuid4().hex[:6]}-{i}"
        if layout != "engine processes" or engine_of(sid, 2) == len(out) % 2:
            out.append(sid)
        i += 1
    return out


def one_on_each_engine_at_3(c: Client) -> tuple:
    """Two sessions created through ``c``, on engines 0 and 1 of the two-engine layout, each prefilled with 3
    tokens on layer 0."""
    sids = ids(2, "engine processes")
    for s in sids:
        c.create(s)
        c.conv(s, 0, 3, seed=1)
    return tuple(sids)


def periodic_snapshots(url) -> dict:
    """Per engine (its metrics series' labels): the periodic snapshots written or skipped so far."""
    out: dict = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(("convserve_snapshot_writes_total", "convserve_snapshot_skips_total")):
            series, value = line.rsplit(" ", 1)
            labels = series.partition("{")[2]
            out[labels] = out.get(labels, 0.0) + float(value)
    return out


def wait_for_snapshots_of_all_so_far(url, timeout: float = 15.0) -> None:
    """Until every engine's files hold what was done before the call: two periodic snapshots of each ended
    since, so the second was taken after the call (written, it holds all; skipped, the file it kept does)."""
    base = periodic_snapshots(url)
    deadline = time.monotonic() + timeout
    while True:
        now = periodic_snapshots(url)
        if now.keys() >= base.keys() and all(now[k] >= base[k] + 2 for k in base):
            return
        assert time.monotonic() < deadline, f"no periodic snapshot: {base} then {now}"
        time.sleep(0.02)


# engine processes' variant slow (CI time): their final snapshots at SIGTERM are also in test_cluster_fork_server
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k == "engine processes" else k
                                    for k in LAYOUTS])
def test_sigterm_writes_every_session_and_the_restarted_server_continues_like_the_reference(tmp_path, layout):
    srv = serve(tmp_path, layout)
    try:
        c = Client(srv.url)
        sids = ids(4, layout)
        for s in sids:
            c.create(s)
        for k in range(12):
            c.conv(sids[k % 4], LAYERS[k % 3], 1 + (k * 5) % 7, seed=k)
        xv = rand_x(3, seed=77)                                  # a pending verify travels too
        st, y = conv(c.api, sids[1], 2, xv, position=c.pos[sids[1]][1], speculative=True)
        assert st == 200 and torch.allclose(y, c.ref.conv(sids[1], 2, xv, speculative=True), atol=1e-6)
        assert srv.terminate() == 0
    finally:
        srv.kill()
    written = [r for r in srv.logs if r.get("msg") == "snapshot written"]
    assert len(written) == (2 if layout == "engine processes" else 1)
    assert sum(r["sessions"] for r in written) == 4 and all(r["kind"] == "final" for r in written)

    srv = serve(tmp_path, layout)
    try:
        c.reconnect(srv.url)
        restored = [r for r in srv.logs if r.get("msg") == "snapshot restored"]
        assert sum(r["sessions"] for r in restored) == 4
        assert metric(srv.url, "convserve_snapshot_restored_sessions") == 4     # summed over engines
        for s in sids:
            assert positions(c.api, s) == c.pos[s]
            assert_close(c.api.state(s), c.ref.states[s])
        assert c.api.call("POST", f"/v1/sessions/{sids[1]}/accept", {"tokens": 2})[0] == 204
        c.ref.accept(sids[1], 2)
        c.pos[sids[1]][1] += 2
        for k in range(12, 24):
            c.conv(sids[k % 4], LAYERS[k % 3], 1 + (k * 3) % 5, seed=k)
        # a session the snapshot lacks but the client believes in is 410, not a fresh state
        st, body = conv(c.api, "never-snapshotted", 0, rand_x(1), position=3)
        assert st == 410 and body["error"]["code"] == "state_lost"
    finally:
        srv.kill()


def _kill9(srv: LiveServer) -> None:
    """SIGKILL to the server and every child at once (a node loss): nothing gets to write."""
    pids = [int(r["pid"]) for r in srv.logs if r.get("msg") in ("engine process started", "worker process started")]
    for pid in [srv.proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    srv.proc.wait(10)


def test_after_kill_9_the_sessions_changed_since_the_last_periodic_snapshot_answer_409_with_its_position(
        tmp_path):
    # in-process; the periodic snapshots of engine processes are in the crash test below
    layout = "in-process"
    srv = serve(tmp_path, layout, "--snapshot-interval-s", "1.0")
    try:
        c = Client(srv.url)
        stale, kept = ids(4, layout), None
        for s in stale:
            c.create(s)
        for k in range(8):
            c.conv(stale[k % 4], LAYERS[k % 3], 2, seed=k)
        kept = stale.pop()                                       # untouched after the snapshot
        wait_for_snapshots_of_all_so_far(srv.url)
        at_snapshot = {s: list(c.pos[s]) for s in stale}
        assert metric(srv.url, "convserve_snapshot_writes_total") >= 1
        assert metric(srv.url, "convserve_snapshot_failures_total") == 0
        for k, s in enumerate(stale):                            # applied, then lost with the process
            c.conv(s, 0, 1, seed=100 + k)
        _kill9(srv)
    finally:
        srv.kill()

    srv = serve(tmp_path, layout)
    try:
        c.reconnect(srv.url)
        for k, s in enumerate(stale):
            st, body = conv(c.api, s, 0, rand_x(1, seed=200 + k), position=c.pos[s][0])
            assert st == 409 and body["error"]["code"] == "position_mismatch", body
            assert body["error"]["position"] == at_snapshot[s][0] < c.pos[s][0]
            assert positions(c.api, s) == at_snapshot[s]
        c.conv(kept, 5, 3, seed=300)                             # an unchanged session just continues
    finally:
        srv.kill()


@pytest.mark.parametrize("layout", ["in-process", pytest.param("engine processes", marks=pytest.mark.slow)])
def test_after_kill_9_a_session_imported_since_the_last_snapshot_answers_410_not_its_older_state(tmp_path, layout):
    # an import sets the positions back to 0: the snapshot's older state at the same positions would pass a
    # client's position check, so the restore must not serve it
    srv = serve(tmp_path, layout, "--snapshot-interval-s", "1.0")
    try:
        api = Api(srv.url)
        before, after, untouched = ids(3, layout)
        for sid in (before, after, untouched):
            api.session(sid)
        state = api.call("GET", f"/v1/sessions/{before}/state")[1]
        a = dict(state, state=wire.encode_tensor(torch.randn(len(LAYERS), DIM, 3)))
        b = dict(state, state=wire.encode_tensor(torch.randn(len(LAYERS), DIM, 3)))
        assert api.call("PUT", f"/v1/sessions/{before}/state", a)[0] == 204
        wait_for_snapshots_of_all_so_far(srv.url)
        for sid in (before, after):
            assert api.call("PUT", f"/v1/sessions/{sid}/state", b)[0] == 204
        _kill9(srv)
    finally:
        srv.kill()

    srv = serve(tmp_path, layout)
    try:
        api = Api(srv.url)
        for sid in (before, after):
            st, body = conv(api, sid, 0, rand_x(1, seed=1), position=0)
            assert st == 410 and body["error"]["code"] == "state_lost", body
            assert "imported" in body["error"]["message"]
        st, _ = conv(api, untouched, 0, rand_x(1, seed=2), position=0)
        assert st == 200
    finally:
        srv.kill()


# slow (CI time, 12 s): lost sessions staying 410 across an engine's later crash is also in test_cluster_failures
@pytest.mark.slow
def test_a_session_a_restore_left_lost_stays_410_after_its_engine_process_crashes(tmp_path):
    """Restored after a crash, a session deleted since its snapshot answers 410; the engine process notes it lost
    in its own journal too, so that after that process's crash it is still 410 (a client without positions
    would otherwise read 404, "never created or deleted")."""
    srv = serve(tmp_path, "engine processes")
    try:
        api = Api(srv.url)
        sid = ids(1, "engine processes")[0]                  # on engine 0
        api.session(sid)
        assert conv(api, sid, 0, rand_x(2, seed=1))[0] == 200
        assert srv.terminate() == 0                            # its final snapshot holds it
    finally:
        srv.kill()
    srv = serve(tmp_path, "engine processes")
    try:
        assert Api(srv.url).call("DELETE", f"/v1/sessions/{sid}")[0] == 204
        _kill9(srv)
    finally:
        srv.kill()
    srv = serve(tmp_path, "engine processes")
    try:
        api = Api(srv.url)
        assert api.call("GET", f"/v1/sessions/{sid}")[0] == 410
        victim = httpx.get(srv.url + "/readyz").json()["engines"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            ready = httpx.get(srv.url + "/readyz").json()
            if ready["status"] == "ready" and ready["engines"][0]["pid"] != victim:
                break
            assert time.monotonic() < deadline, ready
            time.sleep(0.1)
        assert api.call("GET", f"/v1/sessions/{sid}")[0] == 410
    finally:
        srv.kill()


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_a_torn_newest_snapshot_is_refused_and_the_previous_good_one_restored(tmp_path):
    c = None
    for run in range(2):                                         # two SIGTERMs: two files
        srv = serve(tmp_path, "in-process")
        try:
            if c is None:
                c = Client(srv.url)
                c.create("torn-1")
            c.reconnect(srv.url)
            c.conv("torn-1", 0, 3, seed=run)
            if run == 0:
                first = list(c.pos["torn-1"])
            assert srv.terminate() == 0
        finally:
            srv.kill()
    newest = max(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    with open(tmp_path / newest, "r+b") as f:                    # a torn write: half of it
        f.truncate(os.path.getsize(tmp_path / newest) // 2)

    srv = serve(tmp_path, "in-process")
    try:
        refused = [r for r in srv.logs if r.get("msg") == "snapshot refused"]
        assert len(refused) == 1 and refused[0]["path"].endswith(newest) and "unreadable" in refused[0]["reason"]
        api = Api(srv.url)
        assert positions(api, "torn-1") == first
        st, body = conv(api, "torn-1", 0, rand_x(1), position=c.pos["torn-1"][0])
        assert st == 409 and body["error"]["position"] == first[0]
    finally:
        srv.kill()


def test_a_snapshot_of_other_weights_is_refused_and_nothing_is_restored(tmp_path):
    srv = serve(tmp_path, "in-process")
    try:
        c = Client(srv.url)
        c.create("foreign-1")
        c.conv("foreign-1", 2, 4, seed=1)
        assert srv.terminate() == 0
    finally:
        srv.kill()
    srv = serve(tmp_path, "in-process", "--seed", "1")          # the same shapes, other weights
    try:
        refused = [r for r in srv.logs if r.get("msg") == "snapshot refused"]
        assert len(refused) == 1 and "weights_sha256" in refused[0]["reason"]
        assert "snapshot restored" not in srv.log_messages()
        st, body = conv(Api(srv.url), "foreign-1", 2, rand_x(1), position=4)
        assert st == 410 and body["error"]["code"] == "state_lost"
    finally:
        srv.kill()


def test_an_engine_process_restarted_after_a_crash_restores_nothing_and_its_sessions_answer_410(tmp_path):
    srv = serve(tmp_path, "engine processes", "--snapshot-interval-s", "0.2")
    try:
        c = Client(srv.url)
        doomed, other = one_on_each_engine_at_3(c)
        wait_for_snapshots_of_all_so_far(srv.url)
        # each engine process's snapshot counters reach the one scrape (a series per engine)
        assert metric(srv.url, "convserve_snapshot_writes_total") >= 2
        assert metric(srv.url, "convserve_snapshot_bytes_total") > 0
        assert metric(srv.url, "convserve_snapshot_failures_total") == 0
        victim = httpx.get(srv.url + "/readyz").json()["engines"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            rows = httpx.get(srv.url + "/readyz").json()["engines"]
            if rows[0]["state"] == "up" and rows[0]["restarts"] == 1:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        st, body = conv(c.api, doomed, 0, rand_x(1), position=3)
        assert st == 410 and body["error"]["code"] == "state_lost"
        c.conv(other, 0, 1, seed=2)
        assert srv.terminate() == 0
    finally:
        srv.kill()
    # the restarted process wrote at once, then at SIGTERM: a cold start finds its newest file without the
    # sessions of the process that died, and never falls back to one from before the crash
    files = SnapshotDir(tmp_path, 0, 3).files()
    newest = read_checked(files[0]).meta
    assert newest["sessions"] == [] and newest["lost"] == []
    written = [r for r in srv.logs if r.get("msg") == "snapshot written" and r.get("engine") == 0]
    assert written[-1]["kind"] == "final" and written[-1]["sessions"] == 0
    other_file = read_checked(SnapshotDir(tmp_path, 1, 3).files()[0]).meta
    assert [r["id"] for r in other_file["sessions"]] == [other]


def _crash_before_back(srv) -> int:
    """Engine 0's process dies and the server is stopped before its next process wrote a snapshot (its back-off
    and build). The stop's exit code."""
    os.kill(httpx.get(srv.url + "/readyz").json()["engines"][0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/readyz").json()["engines"][0]["state"] != "down":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return srv.terminate()


def _crash_as_it_stops(srv) -> int:
    """Engine 0's process dies just as the server is told to stop (the supervisor, paused, sees the SIGTERM
    before the death): it writes no final snapshot. The stop's exit code."""
    engine = httpx.get(srv.url + "/readyz").json()["engines"][0]["pid"]
    sup = srv.server_pid()
    os.kill(sup, signal.SIGSTOP)
    try:
        os.kill(engine, signal.SIGKILL)
        os.kill(sup, signal.SIGTERM)
    finally:
        os.kill(sup, signal.SIGCONT)
    code = srv.proc.wait(30)
    srv._reader.join(timeout=5)
    return code


@pytest.mark.parametrize("crash, exit_code", [pytest.param(_crash_before_back, 0, marks=pytest.mark.slow),
                                              (_crash_as_it_stops, 1)],      # (the first slow: CI time)
                         ids=["before-it-is-back", "as-the-server-stops"])
def test_a_crashed_engines_older_files_are_not_restored_at_the_next_start(tmp_path, crash, exit_code):
    """Engine 0's files are older than its sessions when its process died (before its next process wrote a
    snapshot, or during the stop, with no final snapshot): they must not be restored at the next start (its
    sessions answer 410, not an older state); engine 1's sessions come back. A stop that lost state exits 1."""
    srv = serve(tmp_path, "engine processes")
    try:
        c = Client(srv.url)
        doomed, kept = one_on_each_engine_at_3(c)
        assert srv.terminate() == 0                       # both engines' files hold the sessions at 3
    finally:
        srv.kill()
    srv = serve(tmp_path, "engine processes")
    try:
        c.reconnect(srv.url)
        for s in (doomed, kept):
            c.conv(s, 0, 2, seed=2)
        assert crash(srv) == exit_code
    finally:
        srv.kill()
    assert any(r.get("msg") == "snapshots of the crashed engine will not be restored" for r in srv.logs)
    srv = serve(tmp_path, "engine processes")
    try:
        c.reconnect(srv.url)
        st, body = conv(c.api, doomed, 0, rand_x(1), position=5)
        assert st == 410 and body["error"]["code"] == "state_lost", body
        assert positions(c.api, kept) == [5, 0, 0]
        c.conv(kept, 0, 1, seed=3)
    finally:
        srv.kill()


def test_sessions_beyond_the_new_pool_are_logged_as_not_restored_and_answer_410(tmp_path):
    srv = serve(tmp_path, "in-process")
    try:
        c = Client(srv.url)
        sids = ids(6, "in-process")
        for k, s in enumerate(sids):
            c.create(s)
            c.conv(s, 0, 1, seed=k)
        assert srv.terminate() == 0
    finally:
        srv.kill()
    srv = LiveServer([*MODEL_ARGS, "--slots", "4", *LAYOUTS["in-process"], "--state-dir", str(tmp_path)])
    try:
        restored = [r for r in srv.logs if r.get("msg") == "snapshot restored"]
        assert len(restored) == 1 and restored[0]["sessions"] == 4 and restored[0]["not_restored"] == 2
        api = Api(srv.url)
        answers = [conv(api, s, 0, rand_x(1), position=1)[0] for s in sids]
        assert sorted(answers) == [200] * 4 + [410] * 2
    finally:
        srv.kill()


@pytest.mark.parametrize("layout", ["in-process", pytest.param("engine processes", marks=pytest.mark.slow)])
def test_a_second_server_on_a_state_dir_in_use_exits_2_and_the_first_keeps_its_files(tmp_path, layout):
    first = serve(tmp_path, layout)
    try:
        c = Client(first.url)
        c.create("mine-1")
        c.conv("mine-1", 0, 2, seed=1)
        with pytest.raises(RuntimeError, match=r"rc=2\)[\s\S]*another running server uses it") as e:
            serve(tmp_path, layout)
        assert "can create and write" not in str(e.value)     # the lock's own advice, not the generic one
        assert first.terminate() == 0
    finally:
        first.kill()
    again = serve(tmp_path, layout)                      # free once the first has stopped
    try:
        assert positions(Api(again.url), "mine-1") == c.pos["mine-1"]
    finally:
        again.kill()


def test_serve_releases_the_state_dirs_lock_when_it_returns(tmp_path, capsys):
    import socket

    from convserve.service import cli
    from convserve.service.cluster.run_dirs import take_lock
    from convserve.service.snapshots import STATE_LOCK

    with socket.socket() as taken:                    # every start fails on the port, after taking the lock
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = load_settings({"state_dir": str(tmp_path), "workers": "0", "port": str(taken.getsockname()[1]),
                                  "dim": "32", "device": "cpu"})
        for _ in range(2):
            assert cli.serve(settings) == 2
            os.close(take_lock(str(tmp_path / STATE_LOCK)))      # the lock is free again: nothing holds it
    err = capsys.readouterr().err
    assert err.count("convserve: cannot listen") == 2 and "another running server" not in err


@pytest.mark.parametrize("bad", [{"state_dir": "FILE"}, {"snapshot_interval_s": "0"}, {"snapshot_keep": "0"},
                                 {"snapshot_timeout_s": "-1"}])
def test_bad_snapshot_settings_are_config_errors_naming_the_setting(tmp_path, bad):
    (tmp_path / "FILE").write_text("x")
    bad = {k: str(tmp_path / v) if v == "FILE" else v for k, v in bad.items()}
    with pytest.raises(ConfigError, match="--" + next(iter(bad)).replace("_", "-")):
        load_settings(bad)


def test_a_state_dir_that_cannot_be_created_exits_2_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    from convserve.service import cli

    (tmp_path / "FILE").write_text("x")

    def no_model(settings):
        raise AssertionError("the model was built")

    monkeypatch.setattr(cli, "build_engine", no_model)
    assert cli.serve(Settings(state_dir=tmp_path / "FILE" / "sub", workers=0)) == cli.EXIT_CONFIG
    assert "state_dir" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [pytest.param("in-process", marks=pytest.mark.slow), "engine processes"])
def test_a_final_snapshot_that_cannot_be_written_makes_the_server_exit_1_not_0(tmp_path, layout):
    state = tmp_path / "state"
    srv = serve(state, layout)
    try:
        c = Client(srv.url)
        for sid in ids(2, layout):
            c.create(sid)
            c.conv(sid, 0, 2, seed=3)
        os.rename(state, tmp_path / "moved")     # the directory goes, and a file takes its name: every write fails
        (tmp_path / "state").write_text("not a directory")
        assert srv.terminate() == 1
        assert any("writing a snapshot failed" in m for m in srv.log_messages())
        assert "stopped" not in srv.log_messages()
    finally:
        srv.kill()
