"""Direct decode batches (``Engine.submit_batch_to(..., direct=True)``): x read in place and y written over it, as
an engine process does with its workers' page-locked arena blocks. Run on the CPU here (the same runner code), and
on the GPU as a ``gpu`` test, against the float64-style reference."""

import concurrent.futures as cf
import os
import pathlib
import time

import pytest
import torch

from convserve.clients.protocol.errors import NonFinite
from tests.engine_support import DIM, LAYERS, Oracle, make_engine
from tests.tolerance import assert_close

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Sink:
    """What an engine process gives ``submit_batch_to``: a result or an error, once."""

    def __init__(self):
        self.fut = cf.Future()

    def set_result(self, y):
        self.fut.set_result(y)

    def set_exception(self, err):
        self.fut.set_exception(err)

    def done(self):
        return self.fut.done()


def _engine(device, dtype):
    from convserve.service.model import ConvModel

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=dtype, seed=3)
    return make_engine(model, device=device, slots=40, max_batch_size=32, decode_buckets=(1, 4, 8, 32))


def _sessions(e, n):
    """``n`` new sessions of ``e`` and an :class:`Oracle` that knows them."""
    oracle = Oracle(e.model_cpu, e.state_dtype)
    sids = [e.create_session() for _ in range(n)]
    for s in sids:
        oracle.new(s)
    return oracle, sids


def _host(n, dtype, device):
    """A poisoned host block (pinned on CUDA, as a registered arena is)."""
    t = torch.empty(n, DIM, dtype=dtype, pin_memory=device == "cuda")
    t.fill_(float("nan"))
    return t


def _submit(e, sids, layer, x, direct, position=None, tokens=None):
    sink = Sink()
    e.submit_batch_to(sink, sids, layer, x, tokens, None, position, False, direct)
    return sink.fut.result(30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 29])
def test_a_direct_decode_batch_writes_y_over_x_and_equals_the_reference(device, dtype, rows):
    e = _engine(device, dtype)
    try:
        oracle, sids = _sessions(e, rows)
        before = e.stats()
        for step in range(3):
            layer = step % len(LAYERS)
            block = _host(rows + 2, dtype, device)
            x = block[1:rows + 1]                      # an interior block of a larger arena
            x.copy_(torch.randn(rows, DIM).to(dtype))
            want = torch.cat([oracle.conv(s, layer, x[i:i + 1].clone()) for i, s in enumerate(sids)])
            y = _submit(e, sids, LAYERS[layer], x, True)
            assert y.data_ptr() == x.data_ptr(), "y is not over x"
            assert_close(y, want, what=f"direct y, step {step}")
            assert torch.isnan(block[0]).all() and torch.isnan(block[rows + 1]).all(), "wrote outside its block"
        after = e.stats()
        assert after["batch_requests_direct"] - before["batch_requests_direct"] == 3
        assert after["batch_requests_in_slots"] == before["batch_requests_in_slots"]
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("device", DEVICES)
def test_direct_is_ignored_where_it_cannot_hold_and_those_batches_still_match(device):
    """A mixed batch, an x in another dtype than the model's: the usual path (y a copy, x untouched)."""
    e = _engine(device, torch.float32)
    try:
        oracle, sids = _sessions(e, 4)
        x = torch.randn(7, DIM)
        keep = x.clone()
        want = oracle.batch(sids, 0, x, [1, 3, 1, 2], [False] * 4)
        y = _submit(e, sids, LAYERS[0], x, True, tokens=[1, 3, 1, 2])
        assert y.data_ptr() != x.data_ptr() and torch.equal(x, keep)
        assert_close(y, want, what="mixed batch")
        x16 = torch.randn(4, DIM).to(torch.float16)
        keep = x16.clone()
        want = torch.cat([oracle.conv(s, 0, x16[i:i + 1]) for i, s in enumerate(sids)])
        y = _submit(e, sids, LAYERS[0], x16, True)
        assert y.dtype == torch.float16 and torch.equal(x16, keep)
        assert_close(y, want, what="cast batch")
        assert e.stats()["batch_requests_direct"] == 0
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("device", DEVICES)
def test_a_repeat_of_a_direct_batch_gets_the_kept_y_after_x_memory_was_reused(device):
    """Kept answers (``position``) are copies: the caller reuses its block once answered."""
    e = _engine(device, torch.float32)
    try:
        oracle, sids = _sessions(e, 5)
        x = _host(5, torch.float32, device)
        x.copy_(torch.randn(5, DIM))
        want = torch.cat([oracle.conv(s, 0, x[i:i + 1].clone()) for i, s in enumerate(sids)])
        y = _submit(e, sids, LAYERS[0], x, True, position=[0] * 5).clone()
        assert_close(y, want, what="first")
        x.fill_(float("nan"))                          # the block goes back to the caller's arena
        again = _submit(e, sids, LAYERS[0], torch.randn(5, DIM), True, position=[0] * 5)
        assert torch.equal(again, y)
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_a_non_finite_direct_x_is_refused_and_changes_nothing():
    e = _engine("cpu", torch.float32)
    try:
        sids = [e.create_session() for _ in range(3)]
        x = torch.randn(3, DIM)
        x[1, 5] = float("inf")
        before = [e.export_state(s).clone() for s in sids]
        with pytest.raises(NonFinite):
            _submit(e, sids, LAYERS[0], x, True)
        assert all(torch.equal(e.export_state(s), b) for s, b in zip(sids, before))
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direct_layer", [0, 1, 2])
def test_a_direct_batch_in_one_step_with_other_launches_leaves_their_results_in_place(device, direct_layer):
    """One step: single decodes and a prefill on other layers, a batch in a batch slot, and the direct batch on
    the first, a middle or the last decode launch: every y where it belongs."""
    from tests.engine_support import gate_worker

    e = _engine(device, torch.bfloat16)
    try:
        oracle, S = _sessions(e, 14)
        go, entered = gate_worker(e)
        first = e.submit(S[13], LAYERS[0], torch.randn(1, DIM).to(torch.bfloat16))
        assert entered.wait(10)
        steps = e.stats()["steps"]
        others = [p for p in range(3) if p != direct_layer]
        xs = {k: torch.randn(n, DIM).to(torch.bfloat16) for k, n in (("a", 1), ("b", 5), ("f", 1), ("n", 3))}
        fa = e.submit(S[0], LAYERS[others[0]], xs["a"])
        fb = e.submit(S[1], LAYERS[others[1]], xs["b"])
        ff = e.submit(S[5], LAYERS[others[0]], xs["f"])
        block = _host(6, torch.bfloat16, device)
        xd = block[1:5]
        xd.copy_(torch.randn(4, DIM).to(torch.bfloat16))
        xd_in = xd.clone()
        sd, sn = Sink(), Sink()
        direct_sids = S[2:5] + [S[9]]
        e.submit_batch_to(sd, direct_sids, LAYERS[direct_layer], xd, None, None, None, False, True)
        e.submit_batch_to(sn, S[6:9], LAYERS[others[1]], xs["n"], None, None, None, False, False)
        go.set()
        first.result(10)
        got = {"a": fa.result(10), "b": fb.result(10), "f": ff.result(10), "n": sn.fut.result(10)}
        yd = sd.fut.result(10)
        end = time.monotonic() + 5                     # (a step's stats are recorded after its delivery)
        while e.stats()["steps"] - steps < 2 and time.monotonic() < end:
            time.sleep(0.005)
        time.sleep(0.05)
        assert e.stats()["steps"] - steps == 2, "the held step and one more"
        assert yd.data_ptr() == xd.data_ptr()
        assert_close(got["a"], oracle.conv(S[0], others[0], xs["a"]), what="single decode")
        assert_close(got["b"], oracle.conv(S[1], others[1], xs["b"]), what="prefill")
        assert_close(got["f"], oracle.conv(S[5], others[0], xs["f"]), what="second single decode")
        assert_close(got["n"], torch.cat([oracle.conv(s, others[1], xs["n"][i:i + 1])
                                          for i, s in enumerate(S[6:9])]), what="slot batch")
        assert_close(yd, torch.cat([oracle.conv(s, direct_layer, xd_in[i:i + 1])
                                    for i, s in enumerate(direct_sids)]), what="direct batch")
    finally:
        e.stop(drain=False)


@pytest.fixture
def shm_dir():
    """A directory where the server puts its run directory: ``/dev/shm`` (tmpfs) when there is one."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.gpu
def test_a_direct_batch_from_a_registered_shared_mapping_matches_the_reference(shm_dir):
    """What an engine process does: an arena file's mapping page-locked with cudaHostRegister (:mod:`.pinned`),
    blocks of it as x, y written back over them by the GPU's copies."""
    from convserve.service.cluster.shm import ArenaMap, map_file

    tmp_path = shm_dir

    e = _engine("cuda", torch.bfloat16)
    from convserve.service.cluster.pinned import HostPinning

    pin = HostPinning(str(e.device))
    arenas = ArenaMap(str(tmp_path), pinning=pin)
    map_file(str(tmp_path / "arena-w0-g1"), 3 << 20, create=True)
    arena = arenas.tensor("arena-w0-g1")
    try:
        oracle, sids = _sessions(e, 29)
        nbytes = 29 * DIM * 2
        assert not arenas.direct("arena-w0-g1", 4096, nbytes)        # first use: registered on the thread
        end = time.monotonic() + 10
        while not arenas.direct("arena-w0-g1", 4096, nbytes) and time.monotonic() < end:
            time.sleep(0.01)
        assert (pin.pinned, pin.failed) == (1, 0)
        for step in range(4):
            off = 4096 + step * 2 * nbytes
            x = arena[off:off + nbytes].view(torch.bfloat16).view(29, DIM)
            x.copy_(torch.randn(29, DIM).to(torch.bfloat16))
            want = torch.cat([oracle.conv(s, step % 3, x[i:i + 1].clone()) for i, s in enumerate(sids)])
            y = _submit(e, sids, LAYERS[step % 3], x, arenas.direct("arena-w0-g1", off, nbytes))
            assert y.data_ptr() == x.data_ptr()
            assert_close(y, want, what=f"step {step}")
        assert e.stats()["batch_requests_direct"] == 4
    finally:
        e.stop(drain=False)
