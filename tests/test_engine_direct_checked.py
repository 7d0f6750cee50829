"""Direct decode batches whose x its owner may write meanwhile (``submit_batch_to(..., direct=True,
borrowed=True)``, a client's sealed block in an engine process): nothing reads x before the step, whose launch
checks its own copy for NaN/Inf and writes no state unless it is finite; a refused batch fails with ``422
non_finite`` after its step, its tokens given back. On the CPU here, and on the GPU (a captured graph) as ``gpu``
tests, against the float64-style reference."""

import random
import time

import pytest
import torch

from convserve.clients.protocol.errors import NonFinite
from tests.engine_support import DIM, LAYERS, gate_worker
from tests.test_engine_direct import DEVICES, Sink, _engine, _host, _sessions
from tests.tolerance import assert_close

SPECIALS = [float("nan"), float("inf"), -float("inf")]


def _submit(e, sids, layer, x, position=None):
    sink = Sink()
    e.submit_batch_to(sink, sids, layer, x, None, None, position, False, True, True)
    return sink.fut.result(30)


def _block(rows, dtype, device, seed, bad_row=None, special=float("nan")):
    """x in an interior block of a poisoned arena; ``bad_row``: one element of that row made ``special``."""
    g = torch.Generator().manual_seed(seed)
    arena = _host(rows + 2, dtype, device)
    x = arena[1:rows + 1]
    x.copy_(torch.randn(rows, DIM, generator=g).to(dtype))
    if bad_row is not None:
        x[bad_row, seed % DIM] = special
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8, 29])
@pytest.mark.parametrize("special", SPECIALS, ids=["nan", "inf", "-inf"])
def test_a_non_finite_row_refuses_the_whole_batch_after_its_step_and_no_state_changes(device, dtype, rows,
                                                                                      special):
    e = _engine(device, dtype)
    rng = random.Random(rows)
    try:
        oracle, sids = _sessions(e, rows)
        before = e.stats()
        for step in range(4):
            layer = step % len(LAYERS)
            good = _block(rows, dtype, device, seed=step)
            bad = _block(rows, dtype, device, seed=100 + step, bad_row=rng.randrange(rows), special=special)
            with pytest.raises(NonFinite, match="NaN or Inf"):
                _submit(e, sids, LAYERS[layer], bad)
            assert not bad.any(), "a refused batch's block holds zeros (its launch's pad rows' y)"
            for s in sids:
                assert_close(e.export_state(s), oracle.export(s), what=f"state after the refusal, step {step}")
            assert [e.session_info(s)["positions"][layer] for s in sids] == [step // len(LAYERS)] * rows
            want = torch.cat([oracle.conv(s, layer, good[i:i + 1].clone()) for i, s in enumerate(sids)])
            y = _submit(e, sids, LAYERS[layer], good)
            assert y.data_ptr() == good.data_ptr()
            assert_close(y, want, what=f"y, step {step}")
        after = e.stats()
        assert after["batch_requests_direct"] - before["batch_requests_direct"] == 8   # the refused ones too
        # served: the good batches only; the refused ones are failed requests, their tokens not counted
        assert after["requests"] - before["requests"] == 4 and after["tokens"] - before["tokens"] == 4 * rows
        assert after["requests_failed"] - before["requests_failed"] == 4
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("device", DEVICES)
def test_with_positions_a_borrowed_batch_is_checked_at_submit_so_a_pipelined_follower_gets_a_409(device):
    """A refusal after the step would come after a follower's position check had counted the refused tokens: a
    batch with positions is copied and checked at submit instead, and the follower at the next position is a
    409, not applied onto a state without the refused token."""
    from convserve.clients.protocol.errors import PositionMismatch

    e = _engine(device, torch.float32)
    try:
        oracle, sids = _sessions(e, 3)
        before = e.stats()["batch_requests_direct"]
        with pytest.raises(NonFinite):
            _submit(e, sids, LAYERS[0], _block(3, torch.float32, device, seed=4, bad_row=1), position=[0] * 3)
        with pytest.raises(PositionMismatch):
            _submit(e, sids, LAYERS[0], _block(3, torch.float32, device, seed=5), position=[1] * 3)
        x = _block(3, torch.float32, device, seed=6)
        want = torch.cat([oracle.conv(s, 0, x[i:i + 1].clone()) for i, s in enumerate(sids)])
        assert_close(_submit(e, sids, LAYERS[0], x, position=[0] * 3), want, what="the batch at position 0")
        assert e.stats()["batch_requests_direct"] == before
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_leftovers_in_a_launchs_pad_rows_refuse_nothing(device):
    """A refused batch of 7 rows leaves its NaN row in the launch's buffer; a batch of 5 in the same bucket (8)
    has that row among its pads, which the check must skip."""
    e = _engine(device, torch.float32)
    try:
        oracle, sids = _sessions(e, 7)
        with pytest.raises(NonFinite):
            _submit(e, sids, LAYERS[1], _block(7, torch.float32, device, seed=1, bad_row=6))
        x = _block(5, torch.float32, device, seed=2)
        want = torch.cat([oracle.conv(s, 1, x[i:i + 1].clone()) for i, s in enumerate(sids[:5])])
        assert_close(_submit(e, sids[:5], LAYERS[1], x), want, what="batch over the leftover pad")
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("device", DEVICES)
def test_a_refused_batch_in_one_step_leaves_the_steps_other_launches_applied(device):
    """One step: a refused checked batch, a finite checked batch on another layer and a single decode on the
    third: only the refused one fails, and only its sessions keep their state."""
    e = _engine(device, torch.bfloat16)
    try:
        oracle, S = _sessions(e, 13)
        go, entered = gate_worker(e)
        first = e.submit(S[12], LAYERS[2], torch.randn(1, DIM).to(torch.bfloat16))
        assert entered.wait(10)
        steps = e.stats()["steps"]
        bad = _block(4, torch.bfloat16, device, seed=5, bad_row=2)
        good = _block(3, torch.bfloat16, device, seed=6)
        good_in = good.clone()
        single = torch.randn(1, DIM).to(torch.bfloat16)
        sb, sg = Sink(), Sink()
        e.submit_batch_to(sb, S[0:4], LAYERS[0], bad, None, None, None, False, True, True)
        e.submit_batch_to(sg, S[4:7], LAYERS[1], good, None, None, None, False, True, True)
        fs = e.submit(S[9], LAYERS[2], single)
        go.set()
        first.result(10)
        with pytest.raises(NonFinite):
            sb.fut.result(10)
        yg, ys = sg.fut.result(10), fs.result(10)
        end = time.monotonic() + 5
        while e.stats()["steps"] - steps < 2 and time.monotonic() < end:
            time.sleep(0.005)
        assert e.stats()["steps"] - steps == 2, "the held step and one more"
        assert_close(yg, torch.cat([oracle.conv(s, 1, good_in[i:i + 1]) for i, s in enumerate(S[4:7])]),
                     what="checked batch")
        assert_close(ys, oracle.conv(S[9], 2, single), what="single decode")
        for s in S[:12]:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_with_check_finite_off_a_borrowed_direct_batch_is_not_checked():
    from convserve.service.model import ConvModel
    from tests.engine_support import make_engine

    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=3)
    e = make_engine(model, device="cpu", slots=8, max_batch_size=8, decode_buckets=(1, 4, 8), check_finite=False)
    try:
        sids = [e.create_session() for _ in range(2)]
        y = _submit(e, sids, LAYERS[0], _block(2, torch.float32, "cpu", seed=3, bad_row=0))
        assert not torch.isfinite(y).all()              # applied as sent: the operator turned the check off
    finally:
        e.stop(drain=False)
