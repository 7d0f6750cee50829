"""The supervisor's start: the port is bound before the engines build and listened on after; another server
that takes the port in between ends this start with the one-line error and exit 2, not a traceback."""

from __future__ import annotations

import os
import socket

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
