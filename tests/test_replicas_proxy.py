"""Three replicas behind a real L7 proxy that hashes ``X-Session-Id`` (HAProxy: ``balance hdr(X-Session-Id)`` with
``hash-type consistent``, the Debian package; ``.ci/run`` installs it). Every request of a session lands on one
replica (the ``X-Convserve-Replica`` answers show it) and the results match the reference."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import httpx
import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.model import ConvModel
from tests.live import LiveServer, Reference

HAPROXY = shutil.which("haproxy", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy; "
                                                        ".ci/run does it)")

LAYERS, DIM = [0, 1], 16
ARGS = ["--workers", "0", "--layers", "0,1", "--dim", str(DIM), "--dtype", "float32", "--slots", "128"]
MP = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}

CONFIG = """
global
    maxconn 512
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend convserve
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    # a session's requests all reach one replica; requests without the header (model, health) go round-robin
    balance hdr(X-Session-Id)
    hash-type consistent
{servers}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    replicas = [LiveServer([*ARGS, "--replica-name", f"replica-{i}"]) for i in range(3)]
    port = free_port()
    cfg = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    cfg.write_text(CONFIG.format(port=port, servers="\n".join(
        f"    server replica-{i} 127.0.0.1:{r.port}" for i, r in enumerate(replicas))))
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start: {proc.stdout.read().decode(errors='replace')}")
            time.sleep(0.05)
        yield url, replicas
    finally:
        proc.terminate()
        proc.wait(10)
        for r in replicas:
            r.terminate()


def test_every_request_of_a_session_lands_on_one_replica_and_matches_the_reference(proxied):
    url, _ = proxied
    ref = Reference(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=0))
    http = httpx.Client(base_url=url, headers=MP, timeout=30)
    where: dict[str, set] = {}
    for i in range(30):
        sid = f"proxied-{i}"
        h = {"x-session-id": sid}
        r = http.post("/v1/sessions", headers=h)              # the id in the header alone
        assert r.status_code == 201 and msgpack.unpackb(r.content) == {"session": sid}
        seen = where.setdefault(sid, set())
        seen.add(r.headers["x-convserve-replica"])
        for step, t in enumerate((7, 1, 1, 3)):
            layer = LAYERS[step % 2]
            x = torch.randn(t, DIM)
            r = http.post("/v1/conv", headers=h, content=wire.packb({"session": sid, "layer": layer,
                                                                    "x": wire.encode_tensor(x)}))
            assert r.status_code == 200, r.content
            seen.add(r.headers["x-convserve-replica"])
            y = wire.decode_tensor(msgpack.unpackb(r.content)["y"])
            torch.testing.assert_close(y, ref.conv(sid, layer, x), atol=1e-5, rtol=1e-5)
        r = http.get(f"/v1/sessions/{sid}/state", headers=h)
        seen.add(r.headers["x-convserve-replica"])
        state = wire.decode_tensor(msgpack.unpackb(r.content)["state"])
        torch.testing.assert_close(state, ref.states[sid], atol=1e-5, rtol=1e-5)
        r = http.delete(f"/v1/sessions/{sid}", headers=h)
        assert r.status_code == 204
        seen.add(r.headers["x-convserve-replica"])
    assert all(len(names) == 1 for names in where.values()), where
    used = {next(iter(names)) for names in where.values()}
    assert len(used) >= 2, used                                 # the proxy spreads sessions over the replicas


def test_a_header_that_disagrees_with_the_body_is_a_400_through_the_proxy(proxied):
    url, _ = proxied
    http = httpx.Client(base_url=url, headers=MP, timeout=30)
    r = http.post("/v1/conv", headers={"x-session-id": "a"},
                  content=wire.packb({"session": "b", "layer": 0, "x": wire.encode_tensor(torch.zeros(1, DIM))}))
    assert r.status_code == 400 and "X-Session-Id" in msgpack.unpackb(r.content)["error"]["message"]
    assert r.headers["x-convserve-replica"].startswith("replica-")
