"""A conv's x and y in the client's shared memory (clients/protocol/shm.py, service/http/client_shm.py): the
body names a block of a segment instead of carrying the tensor, and y comes back written over it. Real server
(both process layouts, the shared ``server`` fixture), real clients, compared with the per-session reference."""

from __future__ import annotations

import os
import time

import httpx
import msgpack
import numpy as np
import pytest
import torch

from convserve.clients.client import ConvClient
from convserve.clients.protocol import wire
from convserve.clients.protocol.shm import MAX_OFFSET, ShmArena
from convserve.service.http.client_shm import RECHECK_S, ClientSegments
from tests.http_api import DIM, LAYERS, MP, assert_close, model, rand_x, read_stream
from tests.live import LiveServer, Reference

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


@pytest.fixture(params=[False, True], ids=["dev-shm", "sealed"])
def arena(request):
    """A /dev/shm segment (read and written through a descriptor) and a sealed memfd (mapped by the server)."""
    a = ShmArena(1 << 20, sealed=request.param)
    yield a
    a.close()


@pytest.fixture
def session(server, arena):
    """``(client with the arena, reference, a fresh session on both)``; the session is deleted after the test."""
    ref = Reference(model())
    with ConvClient(server.url, shm=arena) as c:
        sid = c.create_session()
        ref.create(sid)
        yield c, ref, sid
        c.delete_session(sid)


def _fill(arena, x):
    blk = arena.put(x)
    assert torch.equal(blk, x) and arena.locate(blk) is not None
    return blk


@pytest.mark.parametrize("tokens", [None, [1, 3, 1, 17, 2], [1, 1, 1, 1, 1]])
def test_batch_in_shared_memory_matches_the_reference_and_answers_in_the_same_block(server, arena, tokens):
    ref = Reference(model())
    with ConvClient(server.url, shm=arena) as c:
        sids = [c.create_session() for _ in range(5)]
        for s in sids:
            ref.create(s)
        for step in range(3):
            for layer in LAYERS:
                toks = tokens or [1] * len(sids)
                x = rand_x(sum(toks), seed=100 * step + layer)
                blk = _fill(arena, x)
                y = c.conv_batch(sids, layer, blk, tokens=tokens)
                assert y.data_ptr() == blk.data_ptr()            # y is the block, written by the server
                a = 0
                for s, n in zip(sids, toks):
                    assert_close(y[a:a + n], ref.conv(s, layer, x[a:a + n]))
                    a += n
        # the state the shared-memory calls left is the one a body call continues from
        plain = ConvClient(server.url)
        x = rand_x(1, seed=7)
        assert_close(plain.conv(sids[0], LAYERS[0], x), ref.conv(sids[0], LAYERS[0], x))
        for s in sids:
            c.delete_session(s)


def test_conv_and_speculative_in_shared_memory(session, arena):
    c, ref, sid = session
    for t in (1, 5, 64):
        x = rand_x(t, seed=t)
        y = c.conv(sid, LAYERS[1], _fill(arena, x))
        assert_close(y, ref.conv(sid, LAYERS[1], x))
    x = rand_x(3, seed=9)
    y = c.conv(sid, LAYERS[1], _fill(arena, x), speculative=True)
    assert_close(y, ref.conv(sid, LAYERS[1], x, speculative=True))
    c.accept(sid, 2)
    ref.accept(sid, 2)
    x = rand_x(2, seed=10)
    assert_close(c.conv(sid, LAYERS[1], _fill(arena, x)), ref.conv(sid, LAYERS[1], x))


def test_numpy_blocks_round_trip(session, arena):
    c, ref, sid = session
    x = rand_x(4, seed=3)
    blk = arena.empty((4, DIM), "float32")
    blk[:] = x.numpy()
    y = c.conv(sid, LAYERS[0], blk)
    assert isinstance(y, np.ndarray) and y.ctypes.data == blk.ctypes.data
    assert_close(torch.from_numpy(y), ref.conv(sid, LAYERS[0], x))


def test_a_tensor_outside_the_arena_travels_in_the_body(session, arena):
    c, ref, sid = session
    x = rand_x(2, seed=1)
    y = c.conv(sid, LAYERS[0], x)                             # not in the arena
    assert y.data_ptr() != x.data_ptr()
    assert_close(y, ref.conv(sid, LAYERS[0], x))
    assert wire.encode_tensor(x, arena)["data"] is not None


def _raw_conv(server, sid, xmap, path="/v1/conv"):
    body = {"session": sid, "layer": LAYERS[0], "x": xmap} if path == "/v1/conv" else \
        {"sessions": [sid], "layer": LAYERS[0], "x": xmap}
    r = httpx.post(server.url + path, content=wire.packb(body), headers=MP)
    return r.status_code, msgpack.unpackb(r.content)


@pytest.mark.parametrize("path", ["/v1/conv", "/v1/conv/batch"])
@pytest.mark.parametrize("case, needle", [
    ("bad key", "convserve-client-"),
    ("server's own memory", "convserve-client-"),
    ("no segment", "no shared-memory segment"),
    ("past the end", "past the end"),
    ("data and shm", "a tensor map is"),
    ("extra field", "a tensor map is"),
    ("negative offset", "integer from 0 to"),
    ("offset past int64", "integer from 0 to"),      # once a 500 (OverflowError, then EINVAL, in the read)
    ("largest offset", "past the end"),
    ("ref not a map", "must be a map"),
])
def test_a_bad_reference_is_one_400_and_changes_nothing(server, arena, path, case, needle):
    ref = Reference(model())
    with ConvClient(server.url) as c:
        sid = c.create_session()
        ref.create(sid)
        blk = _fill(arena, rand_x(1, seed=5))
        good = wire.encode_tensor(blk, arena)
        shm = dict(good["shm"])
        xmap = dict(good)
        if case == "bad key":
            xmap["shm"] = {**shm, "key": "../etc/passwd"}
        elif case == "server's own memory":
            xmap["shm"] = {**shm, "key": f"convserve-{os.getpid()}-arena"}
        elif case == "no segment":
            xmap["shm"] = {**shm, "key": "convserve-client-no-such-segment"}
        elif case == "past the end":
            xmap["shm"] = {**shm, "offset": arena.nbytes - 64}
        elif case == "data and shm":
            xmap["data"] = wire.encode_tensor(rand_x(1))["data"]
        elif case == "extra field":
            xmap["bytes"] = 4 * DIM
        elif case == "negative offset":
            xmap["shm"] = {**shm, "offset": -64}
        elif case == "offset past int64":
            xmap["shm"] = {**shm, "offset": (1 << 64) - 1}
        elif case == "largest offset":
            xmap["shm"] = {**shm, "offset": MAX_OFFSET}
        elif case == "ref not a map":
            xmap["shm"] = [shm["key"], shm["offset"]]
        st, obj = _raw_conv(server, sid, xmap, path)
        assert st == 400 and obj["error"]["code"] == "bad_request", obj
        assert needle in obj["error"]["message"], obj
        x = rand_x(2, seed=6)                                     # the session is where it was
        assert_close(c.conv(sid, LAYERS[0], x), ref.conv(sid, LAYERS[0], x))
        c.delete_session(sid)


def test_stream_frames_in_shared_memory(server, arena):
    ref = Reference(model())
    with ConvClient(server.url) as c:
        sids = [c.create_session() for _ in range(2)]
    for s in sids:
        ref.create(s)
    frames, blocks, want = [], {}, {}
    for i in range(6):
        s, layer = sids[i % 2], LAYERS[i % 3]
        x = rand_x(1 + i, seed=20 + i)
        blocks[i] = _fill(arena, x)
        want[i] = ref.conv(s, layer, x)
        frames.append({"id": i, "session": s, "layer": layer, "x": wire.encode_tensor(blocks[i], arena)})
    frames.append({"id": 99, "sessions": sids, "layer": LAYERS[0],
                   "x": wire.encode_tensor(_fill(arena, rand_x(2, seed=30)), arena)})
    with httpx.stream("POST", server.url + "/v1/conv/stream", content=b"".join(map(wire.packb, frames)),
                      headers=MP, timeout=30) as r:
        out = {f["id"]: f for f in read_stream(r)}
    for i, blk in blocks.items():
        assert out[i]["y"]["shm"] == frames[i]["x"]["shm"]
        assert_close(blk, want[i])                                # y over x in the client's block
    assert "shm" in out[99]["y"]
    with ConvClient(server.url) as c:
        for s in sids:
            c.delete_session(s)


def test_off_by_default():
    srv = LiveServer(["--layers", "0,2,5", "--dim", str(DIM), "--dtype", "float32", "--workers", "0"])
    try:
        with ShmArena(1 << 16) as arena, ConvClient(srv.url) as c:
            sid = c.create_session()
            st, obj = _raw_conv(srv, sid, wire.encode_tensor(_fill(arena, rand_x(1)), arena))
            assert st == 400 and "--client-shm" in obj["error"]["message"]      # names the fix
    finally:
        srv.terminate()


# ------------------------------------------------------------------------------------------- units


def test_arena_blocks_are_aligned_and_wrap_around():
    with ShmArena(4096) as a:
        b1 = a.empty((3, 5), torch.float32)
        b2 = a.empty((10,), torch.bfloat16)
        assert a.locate(b1)["offset"] == 0 and a.locate(b2)["offset"] == 64
        b3 = a.empty((1000,), torch.float32)                      # 4000 bytes: from the start again
        assert a.locate(b3)["offset"] == 0
        assert a.locate(b3[::2]) is None                          # not contiguous: sent in the body
        assert a.locate(torch.zeros(4)) is None
        with pytest.raises(ValueError):
            a.empty((2000,), torch.float32)
    with pytest.raises(ValueError, match="closed"):
        a.empty((1,), torch.float32)
    with pytest.raises(ValueError, match="closed"):
        a.locate(b3)                                              # a block of the closed arena
    assert not os.path.exists(a.path)


def test_server_reopens_a_segment_recreated_under_its_key_and_keeps_at_most_max_segments_open(tmp_path):
    segs = ClientSegments(max_segments=1, root=str(tmp_path))
    (tmp_path / "convserve-client-a").write_bytes(np.arange(64, dtype=np.float32).tobytes())
    ref = {"key": "convserve-client-a", "offset": 0}
    assert segs.view(ref, "float32", (4,), "torch", "x").tolist() == [0, 1, 2, 3]
    os.unlink(tmp_path / "convserve-client-a")
    (tmp_path / "convserve-client-a").write_bytes(np.full(64, 7, dtype=np.float32).tobytes())
    assert segs.view(ref, "float32", (4,), "torch", "x").tolist() == [7] * 4
    (tmp_path / "convserve-client-b").write_bytes(bytes(256))
    assert segs.view({"key": "convserve-client-b", "offset": 4}, "float32", (2,), "torch", "x").tolist() == [0, 0]
    assert len(segs) == 1


def test_a_segment_shrunk_or_unlinked_by_its_client_is_a_400_or_still_answered_never_a_crash(tmp_path):
    """The server reads and writes a client's segment through its descriptor, never through a mapping, so a
    client that truncates its segment mid-request gets an error, not a SIGBUS of the server."""
    from convserve.clients.protocol.errors import BadRequest

    segs = ClientSegments(max_segments=4, root=str(tmp_path))
    path = tmp_path / "convserve-client-a"
    path.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    ref = {"key": "convserve-client-a", "offset": 128}
    x = segs.view(ref, "float32", (8,), "torch", "x")
    assert x.tolist() == list(range(32, 40))
    reply = segs.reply_to(ref)
    os.truncate(path, 16)                                         # the client shrinks it under the request
    with pytest.raises(BadRequest, match="past the end"):
        segs.view(ref, "float32", (8,), "torch", "x")
    os.unlink(path)                                               # and unlinks it: y still has its descriptor
    assert reply.write(x * 2)["shm"] == ref
    assert reply.fd == -1


def test_a_sweep_closes_the_descriptors_of_unlinked_or_replaced_segments_only(tmp_path):
    segs = ClientSegments(max_segments=8, root=str(tmp_path))
    for k in "abc":
        (tmp_path / f"convserve-client-{k}").write_bytes(bytes(256))
        segs.view({"key": f"convserve-client-{k}", "offset": 0}, "float32", (4,), "torch", "x")
    os.unlink(tmp_path / "convserve-client-a")                     # a client closed its arena
    os.unlink(tmp_path / "convserve-client-b")                     # and one made a new one under the same key
    (tmp_path / "convserve-client-b").write_bytes(bytes(256))
    assert segs.sweep() == 2 and len(segs) == 1
    assert segs.sweep() == 0


def _memfd(name: str, nbytes: int, seals: int):
    import fcntl

    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_sealed_arena_cannot_be_resized_so_its_mapping_cannot_fault():
    """What makes the server's mapping safe: the client itself cannot shrink (or grow) its sealed segment."""
    with ShmArena(1 << 16, sealed=True) as a:
        fd = int(a.key.split(".")[2])
        for size in (16, 1 << 17):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        assert os.fstat(fd).st_size == 1 << 16


def test_sealed_segments_are_mapped_once_written_in_place_and_refused_once_closed():
    from convserve.clients.protocol.errors import BadRequest

    segs = ClientSegments(max_segments=4)
    b = ShmArena(1 << 16, sealed=True)                 # another arena: the sweep drops its mapping once closed
    segs.view(b.locate(b.put(torch.zeros(4))), "float32", (4,), "torch", "x")
    a = ShmArena(1 << 16, sealed=True)
    x = a.put(torch.arange(16, dtype=torch.float32))
    ref = a.locate(x)
    got = segs.view(ref, "float32", (16,), "torch", "x")
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()      # the server's own mapping of the block
    x[3] = -1.0
    assert got[3] == -1.0                                              # a view, not a copy (borrowed x)
    assert segs.view(ref, "float32", (16,), "torch", "x") is not got and len(segs) == 2
    segs.reply_to(ref).write(x * 3)
    assert torch.equal(got, x) and x[0] == 0 and x[5] == 15           # y over x, seen by the client's block
    assert segs.sweep() == 0
    a.close()                    # refused within RECHECK_S (one stat then), not only after the next sweep
    time.sleep(RECHECK_S * 1.5)
    with pytest.raises(BadRequest, match="cannot be opened|is not sealed segment"):
        segs.view(ref, "float32", (16,), "torch", "x")
    assert len(segs) == 1
    b.close()
    assert segs.sweep() == 1 and len(segs) == 0


def test_a_sealed_key_naming_an_unsealed_or_other_descriptor_or_a_bad_form_is_a_400():
    from convserve.clients.protocol.errors import BadRequest
    from convserve.clients.protocol.shm import SEALED_PREFIX

    segs = ClientSegments(max_segments=4)
    pid = os.getpid()
    fd = _memfd(SEALED_PREFIX + "abc", 4096, 0)                       # named right, but resizable
    other = _memfd(SEALED_PREFIX + "xyz", 4096, 0)
    try:
        cases = [
            (f"{SEALED_PREFIX}{pid}.{fd}.abc", "not sealed against resizing"),
            (f"{SEALED_PREFIX}{pid}.{other}.abc", "is not sealed segment"),     # another memfd's number
            (f"{SEALED_PREFIX}{pid}.999999.abc", "cannot be opened"),
            (f"{SEALED_PREFIX}{pid}.abc", "<pid>.<fd>.<tag>"),
            (f"{SEALED_PREFIX}0{pid}.{fd}.abc", "<pid>.<fd>.<tag>"),         # one key per segment: no leading 0
            (f"{SEALED_PREFIX}{pid}.0{fd}.abc", "<pid>.<fd>.<tag>"),
            (f"{SEALED_PREFIX}+{pid}.{fd}.abc", "must name a segment"),
            (f"{SEALED_PREFIX}{pid}.{chr(0x0660 + fd % 10)}.abc", "must name a segment"),   # a non-ASCII digit
        ]
        for key, needle in cases:
            with pytest.raises(BadRequest, match=needle):
                segs.view({"key": key, "offset": 0}, "float32", (4,), "torch", "x")
        assert len(segs) == 0
    finally:
        os.close(fd)
        os.close(other)
