"""The output ring: results are views of reused host buffers, reused only when nothing refers to them."""

import pytest
import torch

from tests.engine_support import DIM, LAYERS, Oracle, make_engine
from tests.tolerance import assert_close


def _held_y(held):
    if isinstance(held, torch.Tensor):
        return held
    if isinstance(held, tuple):                # (storage, offset, shape, dtype): a view rebuilt from its storage
        storage, offset, shape, dtype = held
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape)
    return held.result() if hasattr(held, "result") else torch.from_numpy(held)


def test_results_kept_by_callers_are_never_overwritten():
    """A step's results are views of a reused host buffer (the output ring); a buffer is reused only when no
    result, cut or not, refers to it. Callers here keep every result (read and unread futures, cut views, a
    numpy array of one, only a view's storage) across many more steps than the ring has buffers: all must still
    hold their y."""
    e = make_engine(slots=8, max_queue_delay_us=20_000, max_batch_size=8)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sids = [e.create_session() for _ in range(4)]
        for s in sids:
            oracle.new(s)
            x = torch.randn(3, DIM)
            assert_close(e.submit(s, LAYERS[0], x).result(5), oracle.conv(s, 0, x))
        kept = []                              # (what the caller holds, the reference y)
        for step in range(24):                 # more steps than the ring grows to: the last ones get fresh tensors
            batch = []
            for s in sids:
                x = torch.randn(1, DIM)
                batch.append((e.submit(s, LAYERS[0], x), oracle.conv(s, 0, x)))
            for f, want in batch:              # one way of holding per step: each step's buffer is held by it
                f.exception(5)                 # finished, result not cut yet
                if step % 4 == 0:
                    kept.append((f, want))                     # an unread future
                elif step % 4 == 1:
                    kept.append((f.result().numpy(), want))    # a numpy array over the cut view
                elif step % 4 == 2:
                    kept.append((f.result(), want))            # the cut view itself
                else:                                          # only the storage of the cut view
                    y = f.result()
                    kept.append(((y.untyped_storage(), y.storage_offset(), y.shape, y.dtype), want))
                    del y
            del f
            batch.clear()
            if step % 4 == 3:
                for held, want in kept:        # nothing read so far has changed under its holder
                    assert_close(_held_y(held), want)
        for held, want in kept:
            assert_close(_held_y(held), want)
        ring = e._runner.bufs.outputs
        assert ring.fresh > 0 and ring.size == 16     # the held buffers were left to their holders
        # once nothing refers to them, the ring's buffers are reused again
        del held, want
        kept.clear()
        batch.clear()
        fresh = e._runner.bufs.outputs.fresh
        for _ in range(6):
            for s in sids:
                x = torch.randn(1, DIM)
                assert_close(e.submit(s, LAYERS[0], x).result(5), oracle.conv(s, 0, x))
        assert e._runner.bufs.outputs.fresh == fresh and ring.size == 16
    finally:
        e.stop(drain=False)


def test_output_ring_hands_out_a_buffer_again_only_when_nothing_refers_to_it():
    """The ring on its own: each way of keeping a result (the tensor, a view, a numpy array over it, only the
    view's storage) keeps its buffer out of the ring; a buffer comes back once it is let go."""
    from convserve.service.engine import OutputRing
    ring = OutputRing(2, 4, 8, torch.float32, False)

    def hold(kind, buf):
        if kind == "tensor":
            return buf
        view = buf[1:3]
        return {"view": view, "numpy": view.numpy(), "storage": view.untyped_storage()}[kind]

    for kind in ("tensor", "view", "numpy", "storage"):
        first = ring.take(4)
        ptr = first.data_ptr()
        held = hold(kind, first)
        del first
        got = [ring.take(4) for _ in range(3)]     # the other buffer, then fresh tensors: never the held one
        assert all(t.data_ptr() != ptr for t in got), kind
        del got, held
        assert any(ring.take(4).data_ptr() == ptr for _ in range(2)), f"{kind}: the buffer did not come back"


class _Sink:
    """What an engine-process caller passes to ``submit_to``: a result or an error, once."""

    def __init__(self):
        self.calls = []

    def set_result(self, y):
        self.calls.append(("y", y.clone()))

    def set_exception(self, err):
        self.calls.append(("err", err))

    def done(self):
        return bool(self.calls)


def _wait(sink, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while not sink.calls and time.monotonic() < deadline:
        time.sleep(0.001)
    return sink.calls


def test_a_sink_gets_each_result_once_and_a_withdrawn_request_never_reaches_it():
    from convserve.clients.protocol.errors import UnknownSession
    from tests.engine_support import gate_worker

    e = make_engine()
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        a = e.create_session()
        oracle.new(a)
        for t in (3, 1, 1):                                   # a prefill, then decodes, each to its own sink
            x = torch.randn(t, DIM)
            sink = _Sink()
            assert e.submit_to(sink, a, LAYERS[0], x) is not None
            (kind, y), = _wait(sink)
            assert kind == "y"
            assert_close(y, oracle.conv(a, 0, x))
        b = e.create_session()
        oracle.new(b)
        sink = _Sink()
        e.submit_batch_to(sink, [a, b], LAYERS[1], torch.randn(2, DIM))
        (kind, y), = _wait(sink)
        assert kind == "y" and y.shape == (2, DIM)
        go, entered = gate_worker(e)                          # hold the worker: the next request stays queued
        held = _Sink()
        e.submit_to(held, b, LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(5)
        sink = _Sink()
        req = e.submit_to(sink, a, LAYERS[2], torch.randn(1, DIM))
        positions = e.session_info(a)["positions"]
        assert e.withdraw(req) and not e.withdraw(req)
        assert e.session_info(a)["positions"][2] == positions[2] - 1      # its token given back
        go.set()
        assert _wait(held)[0][0] == "y"
        assert sink.calls == []
        gone = _Sink()
        e.submit_to(gone, a, LAYERS[0], torch.randn(1, DIM))
        e.delete_session(a)                                   # runs after it: the conv still gets its answer
        assert _wait(gone)[0][0] == "y"
        with pytest.raises(UnknownSession):
            e.submit_to(_Sink(), a, LAYERS[0], torch.randn(1, DIM))
    finally:
        e.stop(drain=False)


def test_packed_steps_results_held_by_callers_are_never_overwritten():
    """Steps with prefill or verify tokens copy their results into the packed ring (2 buffers): a caller that
    keeps its y (unread, cut, or only a view) across more such steps than the ring holds keeps its values; the
    steps after those get fresh tensors, and once the results are let go the ring's buffers serve again. A
    prefill-only batch and a verify-only batch (no verify slot) are one run of a ring buffer (a view, no
    gather)."""
    e = make_engine(slots=12, max_batch_size=8, max_batch_tokens=64, max_spec_tokens=4, verify_slots=False,
                    prefill_slots=False)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sids = [e.create_session() for _ in range(3)]
        for s in sids:
            oracle.new(s)
        ring = e._runner.bufs.packed_outputs
        kept = []
        for step in range(6):
            toks = [2 + step % 3, 3, 5]
            x = torch.randn(sum(toks), DIM)
            want, a = [], 0
            for s, t in zip(sids, toks):
                want.append(oracle.conv(s, 0, x[a:a + t]))
                a += t
            f = e.submit_batch(sids, LAYERS[0], x, tokens=toks)
            f.exception(10)
            if step % 2:
                y = f.result()
                if step == 1:                                    # the ring is not full yet: a view of it
                    assert any(y.untyped_storage().data_ptr() == ring.buf(i).data_ptr() for i in range(ring.size))
                kept.append((y[1:], torch.cat(want)[1:]))          # a view of the cut view
            else:
                kept.append((f, torch.cat(want)))                # an unread future
            del f
        for held, want in kept:
            assert_close(_held_y(held), want)
        assert ring.fresh > 0                                    # the held buffers were left to their holders
        kept.clear()
        del held, want
        x = torch.randn(12, DIM)                                 # a verify-only batch: one run, as a view
        yv = e.submit_batch(sids, LAYERS[1], x, tokens=[4, 4, 4], speculative=True).result(10)
        assert any(yv.untyped_storage().data_ptr() == ring.buf(i).data_ptr() for i in range(ring.size))
        assert_close(yv, torch.cat([oracle.verify(s, 1, x[4 * i:4 * i + 4]) for i, s in enumerate(sids)]))
        del yv
        fresh = ring.fresh
        e.accept_batch(sids, [0, 0, 0])
        for s in sids:
            oracle.accept(s, 0)
        for _ in range(4):
            toks = [3, 2, 4]
            x = torch.randn(9, DIM)
            want, a = [], 0
            for s, t in zip(sids, toks):
                want.append(oracle.conv(s, 0, x[a:a + t]))
                a += t
            assert_close(e.submit_batch(sids, LAYERS[0], x, tokens=toks).result(10), torch.cat(want))
        assert ring.fresh == fresh                               # nothing held: the ring serves every step
    finally:
        e.stop(drain=False)
