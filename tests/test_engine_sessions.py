"""Session life cycle: create, delete, fork, evict, and ops ordered after the requests before them."""

import time

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest, PoolExhausted, SessionExists, StateLost, UnknownSession
from tests.engine_support import DIM, LAYERS, Oracle, make_engine
from tests.tolerance import assert_close


def test_sessions_create_delete_and_their_errors(engine):
    assert engine.create_session("a") == "a"
    with pytest.raises(SessionExists):
        engine.create_session("a")
    with pytest.raises(SessionExists):
        engine.fork_session("a", "a")
    auto = engine.create_session()
    assert isinstance(auto, str) and len(auto) == 32
    engine.delete_session("a")
    for call in (lambda: engine.delete_session("a"), lambda: engine.export_state("a"),
                 lambda: engine.fork_session("a"), lambda: engine.accept("a", 0),
                 lambda: engine.submit("a", LAYERS[0], torch.randn(1, DIM))):
        with pytest.raises(UnknownSession):
            call()
    assert engine.create_session("a") == "a"      # the id can be used again
    with pytest.raises(BadRequest):
        engine.create_session("")


def test_the_pool_runs_out_then_frees_on_delete(engine):
    info = engine.model_info()
    assert info["slots"] == {"total": 8, "free": 8}
    ids = [engine.create_session() for _ in range(8)]
    with pytest.raises(PoolExhausted) as e:
        engine.create_session()
    assert e.value.retry_after > 0 and "8" in e.value.message
    with pytest.raises(PoolExhausted):
        engine.fork_session(ids[0])
    engine.delete_session(ids[3])
    assert engine.model_info()["slots"]["free"] == 1
    new = engine.create_session()
    assert torch.count_nonzero(engine.export_state(new)) == 0      # a reused slot starts from zeros


def test_delete_runs_after_the_requests_submitted_before_it_then_frees_the_slot():
    e = make_engine(max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()
        futs = [e.submit(sid, LAYERS[0], torch.randn(1, DIM)) for _ in range(3)]
        t0 = time.monotonic()
        e.delete_session(sid)
        assert time.monotonic() - t0 < 2          # the waiting delete runs them without the 5 s delay
        assert all(f.result(0).shape == (1, DIM) for f in futs)
        assert e.stats()["queue_depth"] == 0 and e.stats()["slots_in_use"] == 0
    finally:
        e.stop(drain=False)


def test_idle_sessions_are_evicted_and_then_report_state_lost():
    e = make_engine(session_ttl_s=0.15)
    try:
        old = e.create_session("old")
        keep = e.create_session("keep")
        deadline = time.monotonic() + 0.6
        batched = e.create_session("batched")     # used through batch requests only: its last use is the
        e.submit_batch([batched], LAYERS[1], torch.randn(1, DIM)).result(5)   # batch's completion
        while time.monotonic() < deadline:
            e.submit(keep, LAYERS[0], torch.randn(1, DIM)).result(5)
            e.submit_batch([batched], LAYERS[1], torch.randn(1, DIM)).result(5)
            time.sleep(0.02)
        e.export_state(batched)
        e.delete_session(batched)
        with pytest.raises(StateLost):
            e.submit(old, LAYERS[0], torch.randn(1, DIM))
        with pytest.raises(StateLost):
            e.export_state(old)
        with pytest.raises(StateLost):
            e.delete_session(old)
        assert e.stats()["sessions_evicted"] == 1 and e.stats()["slots_in_use"] == 1
        with pytest.raises(UnknownSession):
            e.export_state("never")
        e.create_session("old")                     # re-creating an evicted id is allowed
        e.export_state("old")
    finally:
        e.stop(drain=False)


def test_session_ops_see_the_requests_submitted_before_them():
    e = make_engine(max_queue_delay_us=50_000)     # requests sit in the queue for 50 ms
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sid = e.create_session()
        oracle.new(sid)
        for _ in range(3):
            x = torch.randn(2, DIM)
            e.submit(sid, LAYERS[2], x)
            oracle.conv(sid, 2, x)
        assert_close(e.export_state(sid), oracle.export(sid))
        x = torch.randn(2, DIM)
        e.submit(sid, LAYERS[2], x)
        oracle.conv(sid, 2, x)
        dst = e.fork_session(sid)
        assert_close(e.export_state(dst), oracle.export(sid))
    finally:
        e.stop(drain=False)


def _pending_source(e, oracle):
    """A session with verifies of 3 and 2 tokens pending on two layers and none on the third."""
    oracle.new("src")
    e.create_session("src")
    for p, layer in enumerate(LAYERS):
        x = torch.randn(4, DIM)
        e.submit("src", layer, x).result(10)
        oracle.conv("src", p, x)
        oracle.states["src"][p][0] = e.export_state("src")[p]
    for p, t in ((0, 3), (2, 2)):
        x = torch.randn(t, DIM)
        assert_close(e.submit("src", LAYERS[p], x, speculative=True).result(10), oracle.verify("src", p, x))


@pytest.mark.parametrize("n", [0, 1, 2])
def test_a_session_moved_to_another_engine_keeps_its_pending_verifies(n):
    """export_for_move then import_state on a second engine (what a named fork across engine processes does): the
    copy accepts its verifies as the source accepts its own."""
    a, b = make_engine(), make_engine()
    oracle = Oracle(a.model_cpu, torch.float32)
    try:
        _pending_source(a, oracle)
        state, positions, pending, spec = a.submit_op("export_for_move", "src").result(10)
        assert pending == [[0, 3], [2, 2]] and tuple(spec.shape) == (2, 3, DIM)
        b.create_session("moved")
        b.import_state("moved", state, positions=positions, pending=pending, spec=spec)
        assert b.session_info("moved")["pending"] == a.session_info("src")["pending"]
        assert b.session_info("moved")["positions"] == a.session_info("src")["positions"] == [4, 4, 4]
        a.accept("src", n)
        b.accept("moved", n)
        assert torch.equal(b.export_state("moved"), a.export_state("src"))
        x = torch.randn(1, DIM)
        assert torch.equal(b.submit("moved", LAYERS[2], x).result(10), a.submit("src", LAYERS[2], x).result(10))
    finally:
        a.stop(drain=False)
        b.stop(drain=False)


@pytest.mark.parametrize("pending,spec_shape", [
    ([[0, 3]], (2, 3, DIM)),                 # one record, two x
    ([[0, 4]], (1, 3, DIM)),                 # more tokens than its x
    ([[3, 1]], (1, 3, DIM)),                 # no such layer
    ([[0, 1], [0, 2]], (2, 3, DIM)),         # one layer twice
    ([[0, 17]], (1, 17, DIM)),               # past max_spec_tokens (16)
    ([[0, 0]], (1, 3, DIM)),                 # no token
    ([[0, 1]], (1, 3, DIM + 1)),             # another width of x
    ([["0", 1]], (1, 3, DIM)),
    ([0, 1], (2, 3, DIM)),                   # not pairs
    ([[0, 1]], None),                        # no x
])
def test_a_moved_session_whose_verifies_do_not_fit_is_refused_and_nothing_changes(engine, pending, spec_shape):
    assert engine.config.max_spec_tokens == 16
    engine.create_session("moved")
    before = engine.export_state("moved")
    spec = None if spec_shape is None else torch.randn(spec_shape)
    with pytest.raises(BadRequest, match="pending: expected"):
        engine.import_state("moved", torch.randn_like(before), positions=[1, 1, 1], pending=pending, spec=spec)
    assert torch.equal(engine.export_state("moved"), before)
    assert engine.session_info("moved")["pending"] == {"layers": [], "tokens": []}


@pytest.mark.parametrize("withdrawn", [False, True])
def test_a_verify_queued_behind_a_moved_sessions_import_replaces_its_imported_verify(withdrawn):
    """A request for the new id can arrive once the target engine has created it, before its import ran: a verify
    then queued on a layer the import brings a verify for replaces that one, as on the source; withdrawn, it
    leaves the imported one pending."""
    for _ in range(3):      # until the verify comes while the import is still queued (this test's case)
        if _verify_behind_a_queued_import(withdrawn):
            return
    pytest.fail("the import ran before the verify came in three tries")


def _verify_behind_a_queued_import(withdrawn: bool) -> bool:
    a, b = make_engine(), make_engine()
    oracle = Oracle(a.model_cpu, torch.float32)
    try:
        _pending_source(a, oracle)
        state, positions, pending, spec = a.submit_op("export_for_move", "src").result(10)
        b.create_session("moved")
        slow = b.submit("moved", LAYERS[1], torch.randn(3000, DIM))    # holds the import op back
        imp = b.submit_op("import_state", "moved", state, positions, pending, spec)
        xv = torch.randn(2, DIM)
        v = b.submit("moved", LAYERS[0], xv, speculative=True)
        if not v._req.deferred:            # a loaded box ran the import first: not this case
            return False
        if withdrawn:
            assert v.cancel()
        slow.result(60), imp.result(60)
        if not withdrawn:
            v.result(60)
        want = {"layers": [LAYERS[0], LAYERS[2]], "tokens": [3 if withdrawn else 2, 2]}
        assert b.session_info("moved")["pending"] == want
        before = b.export_state("moved").clone()
        b.accept("moved", 2)
        a.accept("src", 2)
        after = b.export_state("moved")
        if withdrawn:                      # the imported verify committed, as the source's did
            assert torch.equal(after, a.export_state("src"))
        else:                              # the later verify's first 2 tokens
            assert_close(after[0], torch.cat([before[0], xv.t()], dim=1)[:, -3:])
            assert torch.equal(after[2], a.export_state("src")[2])
        assert b.session_info("moved")["positions"] == [6, 4, 6]
        return True
    finally:
        a.stop(drain=False)
        b.stop(drain=False)
