"""Helpers for the end-to-end tests: a real ``convserve serve`` subprocess on 127.0.0.1, and the reference run.

The server is started with ``--port 0``; the port it bound is read from its ``listening`` log line, so tests
never race for a free port. Its JSON log lines are kept in memory (``LiveServer.logs``) for assertions and
for the failure message.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import torch

from convserve.kernels.reference import causal_conv1d_ref

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def app_in_thread(settings: dict, start_engine: bool = True, ready: bool = False):
    """The app and an in-process engine built from ``settings`` under a real uvicorn server in a thread of this
    process, so a test can reach into the engine. Yields ``(url, engine)`` once uvicorn accepts connections (with
    ``ready``, once /readyz is 200); the server is stopped on exit."""
    import uvicorn

    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings
    from convserve.service.http.app import create_app

    loaded = load_settings(settings)
    engine = build_engine(loaded)
    app = create_app(loaded, engine, start_engine=start_engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        while ready and time.monotonic() < deadline and httpx.get(url + "/readyz").status_code != 200:
            time.sleep(0.05)
        yield url, engine
    finally:
        server.should_exit = True
        t.join(10)


def sitecustomized(tmp_path: Path, code: str, **env) -> dict:
    """The environment of a :class:`LiveServer` whose processes run ``code`` first (a ``sitecustomize`` module on
    their path), plus ``env``: how a test makes the server's disk slow or full, for the server alone."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p), **env}


class LiveServer:
    def __init__(self, args: list[str], env: Optional[dict] = None, ready: bool = True, timeout: float = 60.0,
                 listening: bool = True, group: bool = False, cwd=ROOT, prefix: tuple = ()):
        """``listening``: return once the server listens (else at once, its logs still read); ``group``: the
        server leads a process group of its own, as a shell's job or a systemd unit does; ``cwd``: its working
        directory; ``prefix``: a command the server runs under (``unshare ...``)."""
        self.args = list(args)
        self.prefix = tuple(prefix)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        full_env.update(env or {})
        cmd = [*prefix, sys.executable, "-m", "convserve.service", "serve", "--host", "127.0.0.1", "--port", "0",
               "--device", "cpu", *self.args]
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=group)
        self.logs: list[dict] = []
        self.raw: list[str] = []
        self.port: Optional[int] = None
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not listening:
            return
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start (rc={self.proc.returncode}):\n" + "\n".join(self.raw[-40:]))
        self.url = f"http://127.0.0.1:{self.port}"
        if ready:
            self.wait_ready(deadline - time.monotonic())

    def _read(self):
        for line in iter(self.proc.stdout.readline, b""):
            text = line.decode(errors="replace").rstrip()
            self.raw.append(text)
            try:
                rec = json.loads(text)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            self.logs.append(rec)
            if rec.get("msg") == "listening":
                self.port = int(rec["port"])
                self._listening.set()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until /readyz is 200 with every engine up (a server of engine processes is ready, "degraded", once one
        is; tests start from all of them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200 and r.json().get("status") == "ready":
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("server never became ready:\n" + "\n".join(self.raw[-40:]))

    def server_pid(self) -> int:
        """The server's pid: with a ``prefix``, the prefix's child (``unshare --fork`` passes no signal on)."""
        if not self.prefix:
            return self.proc.pid
        from tests.proc_tree import children

        (pid,) = children(self.proc.pid)
        return pid

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.server_pid(), signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(timeout=5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_messages(self) -> list[str]:
        return [r.get("msg", "") for r in self.logs]


class Reference:
    """The conv stage computed request by request with ``kernels.reference`` from the same weights.

    Mirrors the service's contract: a session's first call on a layer starts from a zero state, later calls
    continue from it; a speculative call leaves the state alone until ``accept(n)`` commits the state after n of
    its tokens, for every layer at once; ``fork`` copies every layer's state and the pending verifies.
    """

    def __init__(self, model, state_dtype: torch.dtype = torch.float32):
        self.model = model
        self.state_dtype = state_dtype
        self.states: dict[str, torch.Tensor] = {}
        self.spec: dict[str, dict[int, torch.Tensor]] = {}

    def _state(self, session: str) -> torch.Tensor:
        m = self.model
        if session not in self.states:
            self.states[session] = torch.zeros(m.n_layers, m.dim, m.width - 1, dtype=self.state_dtype)
            self.spec[session] = {}
        return self.states[session]

    def create(self, session: str) -> None:
        self._state(session)

    def delete(self, session: str) -> None:
        self.states.pop(session, None)
        self.spec.pop(session, None)

    def fork(self, src: str, dst: str) -> None:
        self.states[dst] = self._state(src).clone()
        self.spec[dst] = dict(self.spec[src])          # a pending verify goes with the fork, to be accepted there

    def set_state(self, session: str, state: torch.Tensor) -> None:
        self._state(session)
        self.states[session] = state.to(self.state_dtype).clone()
        self.spec[session] = {}

    def conv(self, session: str, layer: int, x: torch.Tensor, speculative: bool = False) -> torch.Tensor:
        m = self.model
        p = m.layers.index(layer)
        state = self._state(session)
        xs = x.to(m.dtype).t().contiguous()  # (dim, T)
        conv_states = state[p:p + 1].clone()
        y = causal_conv1d_ref(xs, m.weight[p], m.layer_bias(p), conv_states,
                              torch.tensor([0, xs.shape[1]], dtype=torch.int32),
                              has_initial_state=torch.tensor([True]), activation=m.activation)
        if speculative:
            self.spec[session][p] = x.to(m.dtype)
        else:
            state[p] = conv_states[0]
            self.spec[session].pop(p, None)
        return y.t().to(x.dtype)

    def accept(self, session: str, n: int) -> None:
        m = self.model
        state = self._state(session)
        for p, x in self.spec[session].items():
            hist = torch.cat([state[p].to(torch.float32), x[:n].to(torch.float32).t()], dim=1)
            state[p] = hist[:, hist.shape[1] - (m.width - 1):].to(self.state_dtype)
        self.spec[session] = {}
