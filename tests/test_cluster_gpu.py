"""Two engine processes on one GPU (``--devices cuda:0,cuda:0``): sessions on both, unary convs, batches split
across the engines and forks between them, all compared with the float64-style reference."""

from __future__ import annotations

import random

import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.cluster.placement import engine_of
from tests.http_api import DIM, Api, model
from tests.live import LiveServer, Reference
from tests.tolerance import assert_close as assert_rel_close

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_cluster():
    srv = LiveServer(["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
                      "--workers", "2", "--devices", "cuda:0,cuda:0"], timeout=300)
    yield srv
    srv.terminate()


def test_two_engines_on_one_gpu_serve_unary_split_batches_and_forks_like_the_reference(gpu_cluster):
    api, ref, rng = Api(gpu_cluster.url), Reference(model()), random.Random(0)
    info = api.call("GET", "/v1/model")[1]
    assert [e["device"] for e in info["engines"]] == ["cuda:0", "cuda:0"]
    sids = [api.session() for _ in range(12)]
    assert {engine_of(s, 2) for s in sids} == {0, 1}
    for s in sids:
        ref.create(s)
    for step in range(6):
        layer = rng.choice([0, 2, 5])
        tokens = [rng.choice([1, 1, 3, 17]) for _ in sids]
        x = torch.randn(sum(tokens), DIM)
        st, body, _ = api.call("POST", "/v1/conv/batch", {"sessions": sids, "layer": layer, "tokens": tokens,
                                                           "x": wire.encode_tensor(x)})
        assert st == 200, body
        y = wire.decode_tensor(body["y"])
        at = 0
        for s, n in zip(sids, tokens):
            assert_rel_close(y[at:at + n], ref.conv(s, layer, x[at:at + n]))
            at += n
        s = sids[step]
        xs = torch.randn(5, DIM)
        assert_rel_close(api.conv(s, layer, xs)[1], ref.conv(s, layer, xs))
    for src in sids[:4]:                      # forks onto the other engine go through export and import
        new = next(f"f{src}-{i}" for i in range(999) if engine_of(f"f{src}-{i}", 2) != engine_of(src, 2))
        st, body, _ = api.call("POST", f"/v1/sessions/{src}/fork", {"session": new})
        assert st == 201, body
        ref.fork(src, new)
        assert_rel_close(api.state(new), ref.states[new])


def test_decode_batches_go_direct_from_the_page_locked_arena_and_match_the_reference(gpu_cluster):
    """Plain decode batches split over both engines: once the arena's chunks are page-locked (on a thread of
    their own, so the first batches copy), each part is copied to the GPU straight from its arena block and y
    back over it (``batch_requests_direct``)."""
    api, ref = Api(gpu_cluster.url), Reference(model())
    sids = [api.session() for _ in range(40)]
    for s in sids:
        ref.create(s)
    for step in range(40):
        layer = [0, 2, 5][step % 3]
        x = torch.randn(len(sids), DIM)
        st, body, _ = api.call("POST", "/v1/conv/batch", {"sessions": sids, "layer": layer,
                                                           "x": wire.encode_tensor(x)})
        assert st == 200, body
        y = wire.decode_tensor(body["y"])
        for i, s in enumerate(sids):
            assert_rel_close(y[i:i + 1], ref.conv(s, layer, x[i:i + 1]))
    for s in sids:
        assert_rel_close(api.state(s), ref.states[s])
    text = api.http.get("/metrics").text

    def total(name):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    assert total("convserve_engine_arena_chunks_pinned") >= 1
    assert total("convserve_engine_batch_requests_direct_total") >= 40     # of 80 parts: the first ones copy


def test_sealed_client_blocks_go_by_reference_and_direct_from_the_page_locked_segment():
    """A sealed client segment's plain decode batches: the engine process maps the segment, page-locks its chunks,
    and copies x to the GPU straight from the client's block and y back over it (``client_block_requests``, and
    ``batch_requests_direct`` once the chunk is registered), checking x there; a NaN refuses the batch with no
    state written. Prefill batches go by reference too (the engine copies x into a prefill slot); unary convs from
    the segment take the worker's copy."""
    from convserve.clients.client import ConvClient
    from convserve.clients.protocol.errors import NonFinite
    from convserve.clients.protocol.shm import ShmArena

    srv = LiveServer(["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
                      "--workers", "1", "--devices", "cuda:0", "--client-shm"], timeout=300)
    arena = ShmArena(8 << 20, sealed=True)
    try:
        api, ref = Api(srv.url), Reference(model())
        with ConvClient(srv.url, shm=arena) as c:
            sids = [c.create_session() for _ in range(40)]
            for s in sids:
                ref.create(s)
            for step in range(30):
                layer = [0, 2, 5][step % 3]
                tokens = [3 if i % 7 == 0 else 1 for i in range(len(sids))] if step % 5 == 4 else None
                x = torch.randn(sum(tokens or [1] * len(sids)), DIM)
                blk = arena.put(x)
                y = c.conv_batch(sids, layer, blk, tokens=tokens)
                assert y.data_ptr() == blk.data_ptr()
                at = 0
                for s, n in zip(sids, tokens or [1] * len(sids)):
                    assert_rel_close(y[at:at + n], ref.conv(s, layer, x[at:at + n]))
                    at += n
                xs = torch.randn(5, DIM)
                assert_rel_close(c.conv(sids[step], layer, arena.put(xs)), ref.conv(sids[step], layer, xs))
                if step % 5 == 3:        # a NaN in one row: refused after the device's check, no state written
                    bad = torch.randn(len(sids), DIM)
                    bad[step, 3] = float("nan")
                    with pytest.raises(NonFinite):
                        c.conv_batch(sids, layer, arena.put(bad))
            for s in sids:
                assert_rel_close(api.state(s), ref.states[s])
        text = api.http.get("/metrics").text

        def total(name):
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

        # 24 plain decode batches, 6 refused ones and 6 prefill batches (into a prefill slot); no unary conv
        assert total("convserve_engine_client_block_requests_total") == 36
        assert total("convserve_engine_batch_requests_direct_total") >= 15     # of the 24 plain decode batches
        assert total("convserve_engine_arena_chunks_pinned") >= 1
    finally:
        arena.close()
        srv.terminate()
