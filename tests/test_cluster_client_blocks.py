"""A plain decode batch, or a verify of one length for every session, whose x lies in a client's sealed segment
goes to its engine process by reference (service/cluster/client_blocks.py): the engine maps the segment, checks
its own copy of x for NaN/Inf, and writes y over the block; the HTTP worker neither copies nor reads x. Real
servers (a worker and a CPU engine process, with and without ``client_shm_direct``, and an in-process engine),
real clients, compared bit for bit."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import torch

from convserve.clients.client import ConvClient
from convserve.clients.protocol.errors import BadRequest, NonFinite
from convserve.clients.protocol.shm import ShmArena
from convserve.service.cluster.client_blocks import ClientBlocks, client_direct
from convserve.service.http.client_shm import RECHECK_S

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc")

DIM = 40
ARGS = ["--layers", "0,3", "--dim", str(DIM), "--dtype", "bfloat16", "--slots", "24", "--client-shm"]
LAYOUTS = {"direct": ["--workers", "1", "--devices", "cpu"],
           "copied": ["--workers", "1", "--devices", "cpu", "--no-client-shm-direct"],
           "in-process": ["--workers", "0"]}


@pytest.fixture(scope="module")
def servers():
    from tests.live import LiveServer

    live = {k: LiveServer([*ARGS, *v]) for k, v in LAYOUTS.items()}
    yield live
    for s in live.values():
        s.terminate()


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _x(t, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, DIM, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_sealed_blocks_give_the_same_bits_in_every_layout_and_decodes_and_verifies_go_by_reference_in_the_model_dtype(
        servers, dtype):
    arenas = {k: ShmArena(1 << 20, sealed=True) for k in servers}
    clients = {k: ConvClient(s.url, shm=arenas[k]) for k, s in servers.items()}
    try:
        sids = {k: [c.create_session() for _ in range(6)] for k, c in clients.items()}
        before = _metric(servers["direct"], "convserve_engine_client_block_requests_total")
        calls = 0
        for step, (tokens, spec) in enumerate([
                (None, None), ([1, 3, 1, 17, 2, 1], None), ([2] * 6, True), (None, None), ([3] * 6, [True] * 6),
                ([1] * 6, None), ([2, 3, 2, 2, 2, 2], [True] * 6), ([2, 1, 1, 1, 5, 1], None), ([4] * 6, True)]):
            x = _x(sum(tokens or [1] * 6), dtype, seed=step)
            layer = 3 * (step % 2)
            ys = {}
            for k, c in clients.items():
                blk = arenas[k].put(x)
                y = c.conv_batch(sids[k], layer, blk, tokens=tokens, speculative=spec)
                assert y.dtype == dtype and y.data_ptr() == blk.data_ptr()    # y is written over the block
                ys[k] = y.clone()
                if spec:
                    c.accept_batch(sids[k], [step % 3, 1, 0, 2, 1, 2])
            # by reference: a batch without verify rows, and a verify of one length for every session
            calls += 1 if not spec else len(set(tokens)) == 1
            one = _x(4, dtype, seed=50 + step)
            for k, c in clients.items():                                      # a single conv of 4 tokens
                y = c.conv(sids[k][step % 6], layer, arenas[k].put(one))
                ys[k + "-conv"] = y.clone()
            assert torch.equal(ys["direct"], ys["in-process"]) and torch.equal(ys["copied"], ys["in-process"])
            assert torch.equal(ys["direct-conv"], ys["in-process-conv"])
            assert torch.equal(ys["copied-conv"], ys["in-process-conv"])
        for i in range(6):
            st = {k: c.export_state(sids[k][i]).state for k, c in clients.items()}
            assert torch.equal(st["direct"], st["in-process"]) and torch.equal(st["copied"], st["in-process"])
        by_ref = _metric(servers["direct"], "convserve_engine_client_block_requests_total") - before
        assert by_ref == (calls if dtype is torch.bfloat16 else 0)     # another dtype is cast in the worker's copy
        assert _metric(servers["copied"], "convserve_engine_client_block_requests_total") == 0
    finally:
        for k, c in clients.items():
            for s in sids.get(k, ()):
                c.delete_session(s)
            c.close()
            arenas[k].close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_x_in_a_sealed_block_is_a_422_and_changes_no_state(servers, layout, value):
    arena = ShmArena(1 << 20, sealed=True)
    with ConvClient(servers[layout].url, shm=arena) as c:
        sids = [c.create_session() for _ in range(3)]
        try:
            c.conv_batch(sids, 0, arena.put(_x(3, torch.bfloat16, seed=1)))
            states = [c.export_state(s).state for s in sids]
            x = _x(3, torch.bfloat16, seed=2)
            x[2, 7] = value
            with pytest.raises(NonFinite):
                c.conv_batch(sids, 0, arena.put(x))
            with pytest.raises(NonFinite):
                c.conv(sids[1], 3, arena.put(x))
            v = _x(6, torch.bfloat16, seed=4)
            v[5, 3] = value
            with pytest.raises(NonFinite):                   # a verify refused leaves no verify to accept
                c.conv_batch(sids, 0, arena.put(v), tokens=[2] * 3, speculative=[True] * 3)
            with pytest.raises(BadRequest, match="no speculative verify"):
                c.accept_batch(sids, [1] * 3)
            for s, before in zip(sids, states):
                assert torch.equal(c.export_state(s).state, before)
            y = c.conv_batch(sids, 0, arena.put(_x(3, torch.bfloat16, seed=3)))     # and the sessions go on
            assert torch.isfinite(y).all()
        finally:
            for s in sids:
                c.delete_session(s)
    arena.close()


BY_REFERENCE = [  # (what, the batch message's fields, sent by reference?)
    ("plain decode", dict(), True),
    ("decode tokens of 1", dict(t=[1, 1, 1]), True),
    ("verify, speculative true", dict(t=[4, 4, 4], sp=True), True),
    ("verify, speculative all true", dict(t=[2, 2, 2], sp=[True, True, True]), True),
    ("decode with positions", dict(po=[3, 3, 3]), False),
    ("verify with positions", dict(t=[4, 4, 4], sp=True, po=[3, 3, 3]), False),
    ("verify of two lengths", dict(t=[4, 2, 4], sp=True), False),
    ("verify without tokens", dict(sp=True), False),
    ("verify and decode rows", dict(t=[4, 1, 4], sp=[True, False, True]), False),
    ("prefill rows", dict(t=[1, 5, 1]), True),
    ("prefill rows, speculative false", dict(t=[1, 5, 1], sp=[False, False, False]), True),
    ("prefill rows with positions", dict(t=[1, 5, 1], po=[3, 3, 3]), False),
    ("prefill and verify rows", dict(t=[1, 5, 2], sp=[False, False, True]), False),
]


@pytest.mark.parametrize("what,fields,want", BY_REFERENCE, ids=[r[0] for r in BY_REFERENCE])
def test_a_worker_sends_by_reference_only_batches_without_verify_rows_and_one_length_verifies_without_positions(
        what, fields, want):
    """A batch with positions is sent again from the same block after a 503 or 504, which the first attempt's y
    may have overwritten: it goes through the worker's copy."""
    from convserve.service.cluster import messages as m
    from convserve.service.cluster.client_blocks import by_reference

    assert by_reference({"k": m.BATCH, **fields}) is want
    assert not by_reference({"k": m.CONV, **fields})


def test_a_worker_sends_sealed_blocks_by_reference_only_where_its_engines_copy_them_directly():
    class S:
        client_shm, client_shm_direct, shm_pin = True, True, True

    s = S()
    assert client_direct(s, ["cuda:0"]) and client_direct(s, ["cpu", "cpu"])
    s.shm_pin = False                     # a GPU engine would copy x and y on its own thread: the worker does
    assert not client_direct(s, ["cuda:0"]) and not client_direct(s, ["cpu", "cuda:0"])
    assert client_direct(s, ["cpu"])
    s.client_shm_direct = False
    assert not client_direct(s, ["cpu"])
    s.client_shm_direct, s.client_shm = True, False
    assert not client_direct(s, ["cpu"])


class _Pins:
    """A stand-in for HostPinning: which blocks were asked about, which names were forgotten."""

    def __init__(self, answer: bool):
        self.answer, self.asked, self.forgotten = answer, [], []

    def covers(self, name, base, off, n):
        self.asked.append((name, len(base), off, n))
        return self.answer

    def forget(self, name):
        self.forgotten.append(name)


@pytest.mark.parametrize("pinned", [None, True, False])
def test_an_engines_block_is_the_clients_memory_and_direct_as_its_pinning_says(pinned):
    arena = ShmArena(1 << 16, sealed=True)
    pins = None if pinned is None else _Pins(pinned)
    blocks = ClientBlocks(4, pinning=pins, host_direct=True)
    try:
        x = torch.arange(300, dtype=torch.float32).view(3, 100)
        blk = arena.put(x)
        ref = arena.locate(blk)
        view, direct = blocks.block(ref["key"], ref["offset"], x.numel() * 4)
        assert direct is (True if pinned is None else pinned)
        assert torch.equal(view.view(torch.float32).view(3, 100), x)
        view.view(torch.float32).mul_(-1)                     # y written over x: the client sees it in its block
        assert torch.equal(blk, -x)
        if pins is not None:
            assert pins.asked == [(ref["key"], arena.nbytes, ref["offset"], x.numel() * 4)]
        with pytest.raises(BadRequest, match="run past the end"):
            blocks.block(ref["key"], arena.nbytes - 8, 16)
        assert len(blocks) == 1
    finally:
        arena.close()


def test_a_closed_arena_is_refused_and_swept_and_at_most_max_segments_stay_mapped():
    pins = _Pins(True)
    blocks = ClientBlocks(2, pinning=pins)
    arenas = [ShmArena(1 << 14, sealed=True) for _ in range(3)]
    refs = [a.locate(a.put(torch.ones(4))) for a in arenas]
    try:
        for r in refs:
            blocks.block(r["key"], r["offset"], 16)
        assert len(blocks) == 2 and pins.forgotten == [refs[0]["key"]]    # least recently used dropped first
        arenas[1].close()
        time.sleep(RECHECK_S * 2)
        with pytest.raises(BadRequest):
            blocks.block(refs[1]["key"], refs[1]["offset"], 16)
        blocks.sweep()
        assert len(blocks) == 1 and refs[1]["key"] in pins.forgotten
        view, _ = blocks.block(refs[2]["key"], refs[2]["offset"], 16)
        assert torch.equal(view.view(torch.float32), torch.ones(4))
    finally:
        for a in arenas:
            a.close()


@pytest.mark.parametrize("offset", [1, 3, 64])
def test_a_block_at_an_offset_not_aligned_to_its_dtype_is_copied_and_answered(servers, offset):
    """Any byte offset is a valid reference: one the engine could not view as x's dtype takes the worker's copy."""
    from convserve.clients.protocol import wire

    arena = ShmArena(1 << 16, sealed=True)
    try:
        api = {k: ConvClient(s.url) for k, s in servers.items() if k != "copied"}
        sids = {k: [c.create_session() for _ in range(2)] for k, c in api.items()}
        x = _x(2, torch.bfloat16, seed=offset)
        raw = arena._bytes[offset:offset + x.numel() * 2]
        ys = {}
        for k, c in api.items():
            raw[:] = x.view(-1).view(torch.uint8).numpy()
            body = {"sessions": sids[k], "layer": 0,
                    "x": {"dtype": "bfloat16", "shape": [2, DIM], "shm": {"key": arena.key, "offset": offset}}}
            r = httpx.post(servers[k].url + "/v1/conv/batch", content=wire.packb(body),
                           headers={"content-type": "application/msgpack"})
            assert r.status_code == 200, r.content[:300]
            ys[k] = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.bfloat16).view(2, DIM)
        assert torch.equal(ys["direct"], ys["in-process"])
        for k, c in api.items():
            for s in sids[k]:
                c.delete_session(s)
            c.close()
    finally:
        arena.close()
