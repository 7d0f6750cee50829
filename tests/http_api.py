"""What the test_http_* modules share: the served model, raw wire calls, stream framing and metric reads.

The ``server`` and ``api`` fixtures (tests/conftest.py) run one server with :data:`SERVER_ARGS` per test worker.
"""

from __future__ import annotations

import random
import time

import httpx
import msgpack
import torch

from convserve.clients.protocol import wire
from convserve.service.model import ConvModel
from tests.live import Reference

LAYERS = [0, 2, 5]
DIM, WIDTH = 32, 4
MAX_TOKENS = 256
MAX_BODY = 1 << 20
#: room for every test module sharing the server (and the fuzz's creates, which it deletes)
SLOTS = 1024
MP = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
ATOL, RTOL = 1e-6, 1e-5
SERVER_ARGS = ["--layers", "0,2,5", "--dim", str(DIM), "--width", str(WIDTH), "--dtype", "float32",
               "--slots", str(SLOTS), "--max-tokens-per-request", str(MAX_TOKENS), "--max-body-bytes", str(MAX_BODY),
               "--max-batch-tokens", "1024", "--max-queue-delay-us", "500", "--stream-window", "32",
               "--client-shm"]


def model():
    return ConvModel.random(LAYERS, dim=DIM, width=WIDTH, dtype=torch.float32, seed=0)


class Api:
    """Raw msgpack/JSON calls; every answer is ``(status, decoded body, headers)``."""

    def __init__(self, url: str, headers: dict | None = None, layers=LAYERS):
        self.layers = layers
        self.http = httpx.Client(base_url=url, headers={**MP, **(headers or {})}, timeout=30)

    def call(self, method, path, body=None, *, raw: bytes | None = None, headers=None):
        content = raw if raw is not None else (wire.packb(body) if body is not None else None)
        r = self.http.request(method, path, content=content, headers=headers)
        return r.status_code, self.decode(r), r.headers

    @staticmethod
    def decode(r: httpx.Response):
        if not r.content:
            return None
        if "json" in r.headers.get("content-type", ""):
            return r.json()
        return msgpack.unpackb(r.content)

    def session(self, sid=None) -> str:
        st, obj, _ = self.call("POST", "/v1/sessions", {"session": sid} if sid else None)
        assert st == 201, obj
        return obj["session"]

    def conv(self, sid, layer, x, speculative=False):
        st, obj, h = self.call("POST", "/v1/conv", {"session": sid, "layer": layer, "x": wire.encode_tensor(x),
                                                     "speculative": speculative})
        if st != 200:
            return st, obj, h
        return st, wire.decode_tensor(obj["y"]).clone(), h

    def state(self, sid) -> torch.Tensor:
        st, obj, _ = self.call("GET", f"/v1/sessions/{sid}/state")
        assert st == 200, obj
        assert obj["layers"] == self.layers
        return wire.decode_tensor(obj["state"]).clone()

    def free_slots(self) -> int:
        return self.call("GET", "/v1/model")[1]["slots"]["free"]


def conv_at(api: Api, sid, layer, x, position=None, speculative=False):
    """POST /v1/conv, with ``position`` when given: ``(status, y)`` on 200, else ``(status, error body)``."""
    body = {"session": sid, "layer": layer, "x": wire.encode_tensor(x), "speculative": speculative}
    if position is not None:
        body["position"] = position
    st, obj, _ = api.call("POST", "/v1/conv", body)
    return st, (wire.decode_tensor(obj["y"]).clone() if st == 200 else obj)


def rand_x(t, dtype=torch.float32, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(t, DIM, generator=g).to(dtype)


def assert_close(got, want):
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


def make_frames(sessions, n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sid = rng.choice(sessions)
        out.append({"id": i, "session": sid, "layer": rng.choice(LAYERS),
                    "x": rand_x(rng.choice([1, 1, 1, 3, 16]), seed=seed * 10000 + i)})
    return out


def check_stream_results(frames, results, sessions):
    ref = Reference(model())
    expected = {f["id"]: ref.conv(f["session"], f["layer"], f["x"]) for f in frames}
    by_id = {f["id"]: f for f in frames}
    assert sorted(r["id"] for r in results) == sorted(by_id)
    last_seen: dict = {}
    for r in results:
        assert "y" in r, r
        f = by_id[r["id"]]
        # results of one session come back in the order sent
        assert r["id"] > last_seen.get(f["session"], -1)
        last_seen[f["session"]] = r["id"]
        assert_close(wire.decode_tensor(r["y"]), expected[r["id"]])
    return ref


def pack_frames(frames):
    return b"".join(wire.packb({**f, "x": wire.encode_tensor(f["x"])}) for f in frames)


def read_stream(resp) -> list:
    u = msgpack.Unpacker()
    out = []
    for chunk in resp.iter_raw():
        u.feed(chunk)
        out.extend(u)
    return out


def metric(url, name) -> float:
    """Metric ``name`` in /metrics, summed over its series (an engine counter has one per engine process)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics").text.splitlines()
              if line.startswith((name + " ", name + "{"))]
    if not values:
        raise AssertionError(f"no {name} in /metrics")
    return sum(values)


def wait_metric(url, name, at_least, timeout=5.0) -> float:
    deadline = time.monotonic() + timeout
    while (v := metric(url, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return v


SLOW = ["--layers", "0,1", "--dim", "16", "--dtype", "float32", "--max-queue-delay-us", "1500000"]


def slow_model():
    return ConvModel.random([0, 1], dim=16, width=4, dtype=torch.float32, seed=0)
