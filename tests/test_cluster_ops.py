"""Session operations in an engine process, with real processes: they keep their place among their session's
convs and operations as the engine process received them, and do not make other sessions wait. The requests are
sent on a socket of the test's own, straight to engine 0 (messages of :mod:`convserve.service.cluster.messages`),
so their order on arrival is the test's."""

from __future__ import annotations

import itertools
import time

import msgpack
import pytest
import torch

from convserve.service.cluster import messages as m
from tests.http_api import DIM, Api, assert_close, model
from tests.live import LiveServer, Reference

#: one engine; prefills run in chunks of 16 tokens, so a long one keeps its session's operations waiting
ARGS = ["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
        "--workers", "1", "--devices", "cpu", "--shutdown-timeout-s", "5", "--max-prefill-tokens-per-step", "16",
        "--max-tokens-per-request", "4096", "--max-batch-tokens", "4096"]


class EngineLink:
    """A DEALER socket to one engine process of a live server."""

    def __init__(self, srv: LiveServer, engine: int = 0):
        import zmq

        run_dir = next(r["run_dir"] for r in srv.logs if r.get("msg") == "listening" and "run_dir" in r)
        self.epoch = Api(srv.url).call("GET", "/readyz")[1]["engines"][engine]["epoch"]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(m.endpoint(run_dir, engine))
        self.ids = itertools.count(1)
        self.replies: dict = {}

    def close(self):
        self.sock.close(0)
        self.ctx.term()

    def conv(self, sid: str, layer: int, x: torch.Tensor, speculative: bool = False, position=None) -> int:
        mid = next(self.ids)
        head = {"k": m.CONV, "i": mid, "e": self.epoch, "s": sid, "l": layer, "sp": speculative, "po": position,
                "d": "float32", "n": x.shape[0]}
        self.sock.send_multipart([msgpack.packb(head), x.contiguous().numpy().tobytes()])
        return mid

    def op(self, name: str, *args) -> int:
        mid = next(self.ids)
        self.sock.send_multipart([msgpack.packb({"k": m.OP, "i": mid, "e": self.epoch, "f": name,
                                                 "a": list(args)})])
        return mid

    def op_with_state(self, name: str, sid: str, state: torch.Tensor) -> int:
        mid = next(self.ids)
        self.sock.send_multipart([msgpack.packb({"k": m.OP, "i": mid, "e": self.epoch, "f": name, "a": [sid],
                                                 "d": "float32", "sh": list(state.shape)}),
                                  state.contiguous().numpy().tobytes()])
        return mid

    def answered(self) -> set:
        """The requests answered so far (what has arrived is read, nothing is waited for)."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            head = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
            for h in head if isinstance(head, list) else [head]:
                self.replies[h["i"]] = (h, frames[1] if len(frames) > 1 else None)
        return set(self.replies)

    def reply(self, mid: int, timeout: float = 30.0):
        """``(head, data frame or None)`` of request ``mid``."""
        deadline = time.monotonic() + timeout
        while mid not in self.replies:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(left * 1e3), f"no answer to request {mid}"
            frames = self.sock.recv_multipart()
            head = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
            for h in head if isinstance(head, list) else [head]:
                self.replies[h["i"]] = (h, frames[1] if len(frames) > 1 else None)
        return self.replies.pop(mid)

    def state(self, mid: int) -> torch.Tensor:
        head, data = self.reply(mid)
        assert "err" not in head, head
        return torch.frombuffer(bytearray(data), dtype=getattr(torch, head["d"])).view(*head["sh"])


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(ARGS)
    yield srv
    srv.kill()


@pytest.fixture
def link(server):
    lk = EngineLink(server)
    yield lk
    lk.close()


def _busy(api: Api, link: EngineLink, n: int = 8, tokens: int = 4096) -> list:
    """``n`` sessions, each with a long prefill (``tokens / 16`` steps) and an export behind it: operations
    that wait while the prefills take turns."""
    sids = [api.session() for _ in range(n)]
    convs = [link.conv(s, 0, torch.randn(tokens, DIM)) for s in sids]
    exports = [link.op("export_state", s) for s in sids]
    return convs + exports


def test_an_export_sees_the_convs_received_before_it_and_none_received_after(server, link):
    api, ref = Api(server.url), Reference(model())
    sid = api.session()
    ref.create(sid)
    others = _busy(api, link)
    x1, x2 = torch.randn(3, DIM), torch.randn(2, DIM)
    before = link.conv(sid, 0, x1)
    export = link.op("export_state", sid)
    after = link.conv(sid, 0, x2)
    ref.conv(sid, 0, x1)
    assert_close(link.state(export), ref.states[sid])
    info = link.reply(link.op("session_info", sid))[0]["ok"]
    assert info["positions"] == [5, 0, 0]
    for mid in (before, after, *others):
        assert "err" not in link.reply(mid)[0]


def test_operations_on_one_session_run_in_the_order_received(server, link):
    api = Api(server.url)
    sid = api.session()
    others = _busy(api, link)
    link.conv(sid, 0, torch.randn(3, DIM))              # the operations below wait for it
    state = torch.randn(3, DIM, 3)
    mid_import = link.op_with_state("import_state", sid, state)
    export = link.op("export_state", sid)
    delete = link.op("delete_session", sid)
    info = link.op("session_info", sid)
    assert "err" not in link.reply(mid_import)[0]
    assert_close(link.state(export), state)             # after the import, before the delete
    assert "err" not in link.reply(delete)[0]
    assert link.reply(info)[0]["err"] == "unknown_session"
    for mid in others:
        link.reply(mid)


def test_a_create_does_not_wait_for_the_operations_of_other_sessions(server, link):
    api = Api(server.url)
    others = _busy(api, link)
    t0 = time.monotonic()
    created = link.reply(link.op("create_session", f"fresh-{time.monotonic_ns()}"))[0]
    took = time.monotonic() - t0
    waiting = set(others) - link.answered()
    assert "err" not in created and took < 0.5, took
    assert waiting, "the other sessions' operations were done already: the test proves nothing"
    for mid in others:
        link.reply(mid)


# A conv received while an operation of its session is queued is checked at its turn (after that operation),
# with the error the check at submit gives when it fails there. A long prefill keeps the operations queued.

def test_a_conv_received_after_a_queued_accept_is_checked_for_a_pending_verify_at_its_turn(server, link):
    api = Api(server.url)
    sid = api.session()
    long = link.conv(sid, 0, torch.randn(2048, DIM))
    v1 = link.conv(sid, 0, torch.randn(3, DIM), speculative=True)
    acc = link.op("accept", sid, 2)
    conv = link.conv(sid, 0, torch.randn(1, DIM), position=2050)     # after the accept: no verify pending
    v2 = link.conv(sid, 2, torch.randn(2, DIM), speculative=True)
    refused = link.conv(sid, 2, torch.randn(1, DIM), position=0)     # v2 is pending at its turn
    for mid in (long, v1, acc, conv, v2):
        assert "err" not in link.reply(mid)[0]
    head = link.reply(refused)[0]
    assert head["err"] == "bad_request" and "un-accepted speculative verify" in head["m"], head
    info = link.reply(link.op("session_info", sid))[0]["ok"]
    assert info["positions"] == [2051, 0, 0]                          # the refused conv applied nothing
    assert info["pending"] == {"layers": [2], "tokens": [2]}


def test_a_conv_received_after_a_queued_import_is_checked_against_the_imported_positions(server, link):
    api = Api(server.url)
    sid = api.session()
    long = link.conv(sid, 0, torch.randn(2048, DIM))
    imp = link.op_with_state("import_state", sid, torch.randn(3, DIM, 3))
    stale = link.conv(sid, 0, torch.randn(1, DIM), position=2048)     # the position before the import
    fresh = link.conv(sid, 0, torch.randn(1, DIM), position=0)
    for mid in (long, imp, fresh):
        assert "err" not in link.reply(mid)[0]
    head = link.reply(stale)[0]
    assert head["err"] == "position_mismatch" and head["x"]["position"] == 0, head
    assert link.reply(link.op("session_info", sid))[0]["ok"]["positions"] == [1, 0, 0]


def test_a_create_received_after_a_queued_delete_of_that_id_creates_it_again(server, link):
    api = Api(server.url)
    sid = api.session()
    long = link.conv(sid, 0, torch.randn(2048, DIM))
    delete = link.op("delete_session", sid)
    create = link.op("create_session", sid)
    again = link.op("create_session", sid)                            # behind the first: the id exists then
    for mid in (long, delete):
        assert "err" not in link.reply(mid)[0]
    assert link.reply(create)[0]["ok"] == sid
    assert link.reply(again)[0]["err"] == "session_exists"
    assert link.reply(link.op("session_info", sid))[0]["ok"]["positions"] == [0, 0, 0]
