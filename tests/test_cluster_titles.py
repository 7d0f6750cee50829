"""The names ``ps`` shows for a server's engine and worker processes carry the server's port, so that the servers
of one host are told apart (the children's command lines are all the same ``multiprocessing`` one)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import types

import pytest

from convserve.service.cluster.lifeline import set_name, title
from convserve.service.cluster.supervisor import Supervisor
from convserve.service.config import load_settings


def test_a_title_names_the_kind_the_index_and_the_port_and_fits_the_15_bytes_linux_keeps():
    assert title("engine", 0, 8000) == "cs-e0:8000" and title("worker", 3, 8000) == "cs-w3:8000"
    assert title("engine", 0, 8000) != title("engine", 0, 8001)          # two servers on one host
    assert len(title("worker", 99_999, 65_535).encode()) == 15


def _name_and_report(name: str, conn) -> None:
    set_name(name)
    with open("/proc/self/comm") as f:
        conn.send(f.read().strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process names are Linux's prctl")
def test_the_longest_title_is_shown_whole():
    name = title("worker", 12, 65_535)
    here, there = multiprocessing.Pipe()
    p = multiprocessing.get_context("fork").Process(target=_name_and_report, args=(name, there))
    p.start()
    try:
        assert here.recv() == name
    finally:
        p.join(10)


def test_the_supervisor_titles_its_children_with_the_port_it_bound(monkeypatch):
    """With --port 0 the title carries the port the bind picked, which is the one the server listens on."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unused")        # run() sets it for its children: restored
    sup = Supervisor(load_settings({"port": 0, "device": "cpu"}), ["cpu", "cpu"], 1)
    specs = []

    def process(target, args, name, daemon):
        specs.append((args[0]["title"], sup.sock.getsockname()[1]))
        return types.SimpleNamespace(start=lambda: None, pid=10**7, name=name, exitcode=-signal.SIGTERM,
                                     is_alive=lambda: False, join=lambda timeout=None: None)

    monkeypatch.setattr(sup.ctx, "Process", process)

    def built():                                   # then a SIGTERM: a stop during start-up
        sup.stopping = True
        return False

    monkeypatch.setattr(sup, "_wait_built", built)
    assert sup.run() == 0
    port = specs[0][1]
    assert port != 0 and specs == [(f"cs-e0:{port}", port), (f"cs-e1:{port}", port)]
    assert not os.path.exists(sup.run_dir)
