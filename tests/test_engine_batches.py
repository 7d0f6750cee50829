"""Batch requests: one decode token for each of several sessions, as one request."""

import asyncio
import threading
import time
import types

import pytest
import torch

from convserve.clients.protocol.errors import (BadRequest, DtypeUnsupported, NonFinite, PayloadTooLarge,
    RequestTimeout, ShapeMismatch, UnknownLayer, UnknownSession)
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close


def _prefilled(e, oracle, n, layer_pos=0, t=3):
    sids = [e.create_session() for _ in range(n)]
    for s in sids:
        oracle.new(s)
        x = torch.randn(t, DIM)
        e.submit(s, LAYERS[layer_pos], x).result(10)
        oracle.conv(s, layer_pos, x)
    return sids


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_a_batch_is_one_request_one_step_and_equals_the_sessions_decoded_one_by_one(rows, xdt):
    e = make_engine(slots=12, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = _prefilled(e, oracle, rows)
        fresh = e.create_session()                    # a session with no state on the layer: the zero state
        oracle.new(fresh)
        sids = sids[:-1] + [fresh] + sids[-1:] if rows > 1 else sids
        sids = sids[:rows]
        before = e.stats()
        x = torch.randn(rows, DIM).to(xdt)
        want = torch.cat([oracle.conv(s, 0, x[i:i + 1]) for i, s in enumerate(sids)])
        y = e.submit_batch(sids, LAYERS[0], x).result(10)
        assert y.shape == (rows, DIM) and y.dtype == xdt
        assert_close(y, want, what="batch y")
        after = e.stats()
        assert after["requests"] - before["requests"] == 1 and after["steps"] - before["steps"] == 1
        assert after["decode_rows"] - before["decode_rows"] == rows
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
        y2 = asyncio.run(e.conv_batch(sids, LAYERS[0], x))      # and through asyncio
        want2 = torch.cat([oracle.conv(s, 0, x[i:i + 1]) for i, s in enumerate(sids)])
        assert_close(y2, want2, what="async batch y")
    finally:
        e.stop(drain=False)


BAD_BATCH = {
    "unknown session": (dict(sessions=["a", "nope"]), UnknownSession, "nope"),
    "repeated session": (dict(sessions=["a", "b", "a"]), BadRequest, "appears twice"),
    "no sessions": (dict(sessions=[]), BadRequest, "1 to 4"),
    "too many rows": (dict(sessions=["a", "b", "c", "d", "e"]), PayloadTooLarge, "split the batch"),
    "sessions a string": (dict(sessions="ab"), BadRequest, "list of session ids"),
    "rows differ from sessions": (dict(x=torch.ones(3, DIM)), ShapeMismatch, r"\(2, 24\)"),
    "wrong dim": (dict(x=torch.ones(2, DIM + 1)), ShapeMismatch, "rows >= 1"),
    "float64": (dict(x=torch.ones(2, DIM, dtype=torch.float64)), DtypeUnsupported, "bfloat16"),
    "NaN": (dict(x=torch.full((2, DIM), float("nan"))), NonFinite, "NaN"),
    "layer without conv": (dict(layer=2), UnknownLayer, "no conv"),
    "pending verify": (dict(sessions=["a", "v"]), BadRequest, "accept"),
}


@pytest.mark.parametrize("case", list(BAD_BATCH))
def test_a_bad_batch_is_rejected_whole_before_queueing_and_changes_no_state(case):
    e = make_engine(max_batch_size=4, decode_buckets=(1, 2, 4))
    try:
        for s in ("a", "b", "c", "d", "e", "v"):
            e.create_session(s)
            e.submit(s, LAYERS[0], torch.randn(3, DIM)).result(10)
        e.submit("v", LAYERS[1], torch.randn(2, DIM), speculative=True).result(10)
        before = {s: e.export_state(s) for s in ("a", "b", "c", "d", "e", "v")}
        kw, err, msg = BAD_BATCH[case]
        args = dict(sessions=["a", "b"], layer=LAYERS[0], x=torch.randn(2, DIM))
        args.update(kw)
        n0 = e.stats()["requests"]
        with pytest.raises(err, match=msg):
            e.submit_batch(args["sessions"], args["layer"], args["x"])
        assert e.stats()["queue_depth"] == 0 and e.stats()["requests"] == n0
        for s, st in before.items():
            assert torch.equal(e.export_state(s), st), s
        y = e.submit_batch(["a", "b"], LAYERS[0], torch.randn(2, DIM)).result(10)   # the sessions still work
        assert y.shape == (2, DIM)
    finally:
        e.stop(drain=False)


def test_a_batch_runs_after_its_sessions_earlier_requests_and_before_their_later_ones():
    """A session's prefill, then a batch holding it, then its next decode, all queued at once (a long delay
    window): each sees the one before it, on the same layer and across layers."""
    e = make_engine(slots=12, max_queue_delay_us=300_000, max_batch_size=16, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = _prefilled(e, oracle, 4)
        checks = []
        x = torch.randn(5, DIM)
        checks.append((e.submit(sids[0], LAYERS[0], x), oracle.conv(sids[0], 0, x)))
        x = torch.randn(1, DIM)
        checks.append((e.submit(sids[3], LAYERS[1], x), oracle.conv(sids[3], 1, x)))
        for rnd in range(2):
            xb = torch.randn(3, DIM)
            checks.append((e.submit_batch(sids[:3], LAYERS[0], xb),
                           torch.cat([oracle.conv(s, 0, xb[i:i + 1]) for i, s in enumerate(sids[:3])])))
        x = torch.randn(1, DIM)
        checks.append((e.submit(sids[1], LAYERS[0], x), oracle.conv(sids[1], 0, x)))
        x = torch.randn(2, DIM)
        checks.append((e.submit(sids[2], LAYERS[1], x), oracle.conv(sids[2], 1, x)))
        for i, (f, want) in enumerate(checks):
            assert_close(f.result(10), want, what=f"request {i}")
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_a_cancelled_batch_never_runs_and_its_sessions_go_on():
    e = make_engine(max_queue_delay_us=5_000_000, max_batch_size=4, decode_buckets=(1, 2, 4))
    try:
        sids = [e.create_session() for _ in range(3)]
        slow = e.submit(sids[0], LAYERS[0], torch.randn(4, DIM))     # the batch waits for it (the window)
        fut = e.submit_batch(sids, LAYERS[0], torch.randn(3, DIM))
        assert fut.cancel() and fut.cancelled()
        slow.result(10)
        for s in sids[1:]:
            assert torch.count_nonzero(e.export_state(s)) == 0
        assert e.submit_batch(sids, LAYERS[0], torch.randn(3, DIM)).result(10).shape == (3, DIM)
    finally:
        e.stop(drain=False)


def test_a_batch_whose_session_is_deleted_before_it_runs_fails_whole():
    """The delete runs first (it was posted first); the batch then fails with unknown_session, raised at submit
    or set on its future, and the batch's other sessions keep their state."""
    e = make_engine(max_queue_delay_us=200_000, max_batch_size=4, decode_buckets=(1, 2, 4))
    try:
        sids = [e.create_session() for _ in range(3)]
        for s in sids:
            e.submit(s, LAYERS[0], torch.randn(2, DIM)).result(10)
        before = e.export_state(sids[1])
        e.submit(sids[0], LAYERS[1], torch.randn(2, DIM))             # the delete waits for it
        t = threading.Thread(target=e.delete_session, args=(sids[0],))
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:             # until the delete is posted (or has already run)
            s0 = e._sessions._live.get(sids[0])
            if s0 is None or s0.ops:
                break
            time.sleep(0.001)
        with pytest.raises(UnknownSession, match="deleted"):
            e.submit_batch(sids, LAYERS[0], torch.randn(3, DIM)).result(10)
        t.join(10)
        assert torch.equal(e.export_state(sids[1]), before)
    finally:
        e.stop(drain=False)


def test_batches_take_a_free_batch_slot_else_the_arena_else_their_own_tensor():
    """A batch request's x goes to a batch slot (one replay: copy in, kernel, copy out into the slot's y) while
    one is free; a slot stays taken while a caller still holds the y it returned. With every slot held, batches
    go through the staging arena as one run (starting at row 0 when the run would wrap); with the arena held
    too, the step copies the batch's own x. Every path gives the reference's y."""
    from convserve.service.engine import BATCH_SLOTS

    e = make_engine(slots=12, max_queue_delay_us=0, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = _prefilled(e, oracle, 8)

        def run(k, layer_pos=0):
            x = torch.randn(k, DIM)
            want = torch.cat([oracle.conv(s, layer_pos, x[i:i + 1]) for i, s in enumerate(sids[:k])])
            f = e.submit_batch(sids[:k], LAYERS[layer_pos], x)
            y = f.result(10)
            assert_close(y, want)
            return f._req.batch.buf, f._req.stage, y

        kept = []
        for j in range(BATCH_SLOTS):                   # each caller keeps its y: each batch takes a new slot
            buf, stage, y = run(3 + j % 4)
            assert buf == j and stage < 0
            kept.append(y)
        e._runner.bufs.stage_rows = 10                        # a tiny arena: a run of 6 from row 6 would wrap
        bufs, stages = zip(*[run(k)[:2] for k in (6, 6, 3)])
        assert bufs == (-1, -1, -1) and all(t >= 0 for t in stages)
        assert [t % 10 for t in stages] == [0, 0, 6]
        kept.pop(1)                                    # the y of slot 1 is dropped: the slot is free again
        assert run(5)[0] == 1
        e._runner.stage_owner[:10] = [types.SimpleNamespace(done=False)] * 10   # every arena row held by a queued request
        e._runner.slot_owner[:] = [types.SimpleNamespace(done=False)] * BATCH_SLOTS
        buf, stage, _ = run(2, layer_pos=2)
        assert buf < 0 and stage < 0                   # copied from the batch's own x
        st = e.stats()
        assert st["batch_requests"] == BATCH_SLOTS + 5 and st["batch_requests_in_slots"] == BATCH_SLOTS + 1
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_a_batch_never_overtakes_a_request_before_it_whose_later_neighbour_was_withdrawn():
    """Session A: a chunked prefill under way, then a request cancelled, then a batch holding A: the batch still
    waits for the prefill (it waits for every unfinished request before it, not just the last)."""
    e = make_engine(max_batch_tokens=16, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        e.create_session("A")
        oracle.new("A")
        go, entered = gate_worker(e)
        xp, xb = torch.randn(64, DIM), torch.randn(1, DIM)
        pre = e.submit("A", LAYERS[0], xp)
        assert entered.wait(10)
        assert e.submit("A", LAYERS[1], torch.randn(1, DIM)).cancel()
        fut = e.submit_batch(["A"], LAYERS[0], xb)
        go.set()
        assert_close(pre.result(10), oracle.conv("A", 0, xp))
        assert_close(fut.result(10), oracle.conv("A", 0, xb))
        assert_close(e.export_state("A"), oracle.export("A"))
    finally:
        e.stop(drain=False)


def test_a_request_waits_for_every_batch_of_its_session_before_it_even_when_a_later_one_was_withdrawn():
    e = make_engine(max_batch_tokens=16, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        for s in "AB":
            e.create_session(s)
            oracle.new(s)
        go, entered = gate_worker(e)
        xp, x1, xr = torch.randn(64, DIM), torch.randn(2, DIM), torch.randn(1, DIM)
        pre = e.submit("B", LAYERS[0], xp)                     # the first batch waits for B's prefill
        assert entered.wait(10)
        first = e.submit_batch(["A", "B"], LAYERS[0], x1)
        assert e.submit_batch(["A"], LAYERS[1], torch.randn(1, DIM)).cancel()
        later = e.submit("A", LAYERS[0], xr)
        go.set()
        oracle.conv("B", 0, xp)
        want1 = torch.cat([oracle.conv("A", 0, x1[:1]), oracle.conv("B", 0, x1[1:])])
        pre.result(10)
        assert_close(first.result(10), want1)
        assert_close(later.result(10), oracle.conv("A", 0, xr))
    finally:
        e.stop(drain=False)


def test_a_batch_behind_a_timed_out_session_op_runs_and_the_worker_waits_without_spinning():
    e = make_engine(max_batch_tokens=16, max_batch_size=8, decode_buckets=(1, 2, 4, 8), request_timeout_s=5.0)
    calls = [0]
    real = e._sched.schedule

    def counting(now):
        calls[0] += 1
        return real(now)

    e._sched.schedule = counting
    try:
        e.create_session("A")
        go, entered = gate_worker(e)
        pre = e.submit("A", LAYERS[0], torch.randn(64, DIM))
        assert entered.wait(10)
        e.config.request_timeout_s = 0.3                       # the export's wait only (the queue keeps 5 s)
        errors = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(RequestTimeout, e.export_state, "A")))
        t.start()
        deadline = time.monotonic() + 5
        while not e._sessions.get("A").ops and time.monotonic() < deadline:
            time.sleep(0.001)
        fut = e.submit_batch(["A"], LAYERS[0], torch.randn(1, DIM))
        t.join(10)
        go.set()
        pre.result(10)
        c0 = calls[0]
        assert fut.result(3).shape == (1, DIM)                 # the op is withdrawn: nothing left to wait for
        assert calls[0] - c0 < 200, calls[0] - c0
        assert errors
    finally:
        e.stop(drain=False)
