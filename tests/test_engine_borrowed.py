"""``borrowed=True`` (x lies in memory its owner may write while the request runs, a client's shared memory): the
engine reads x only before submit returns, into a copy it checks for NaN/Inf and computes with, so writing x
afterwards changes nothing, and a non-finite x is refused with nothing changed, whichever path the request takes
(a batch slot, a verify or prefill slot, the staging arena, the token arena, a copy of its own)."""

import pytest
import torch

from convserve.clients.protocol.errors import NonFinite
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close

# how the request is sent: (batch?, tokens per session, speculative)
KINDS = {
    "decode batch": (True, [1, 1, 1], False),
    "decode batch of one": (True, [1], False),
    "mixed batch": (True, [3, 1, 2], False),
    "verify batch": (True, [2, 2, 2], True),
    "single decode": (False, [1], False),
    "single prefill": (False, [5], False),
    "single verify": (False, [3], True),
}


def no_staging(e):
    """Every batch slot, verify slot and staging row busy, as under load: a batch is left as it came."""
    r = e._runner
    r.take_slot = lambda req, xm: -1
    r.take_verify_slot = lambda req, xm: -1
    r.take_prefill_slot = lambda req, xm, pre: -1
    r.stage_batch = lambda req, xm: None
    r.stage_tokens = lambda req, xm, pre, ver: False
    r.stage = lambda req, xm: None


@pytest.fixture(params=["staged", "token arena", "unstaged"])
def engine(request):
    e = make_engine(slots=16, max_queue_delay_us=0)
    if request.param == "token arena":       # no slot free: a verify or mixed batch goes to the token arena
        e._runner.take_slot = lambda req, xm: -1
        e._runner.take_verify_slot = lambda req, xm: -1
        e._runner.take_prefill_slot = lambda req, xm, pre: -1
    elif request.param == "unstaged":
        no_staging(e)
    yield e
    e.stop(drain=False)


def submit(e, sids, layer, x, kind):
    is_batch, toks, spec = KINDS[kind]
    if is_batch:
        return e.submit_batch(sids, layer, x, tokens=None if set(toks) == {1} else toks, speculative=spec,
                              borrowed=True)
    return e.submit(sids[0], layer, x, speculative=spec, borrowed=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_writing_borrowed_x_after_submit_does_not_change_the_answer_or_the_state(engine, kind, dtype):
    _b, toks, spec = KINDS[kind]
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = [engine.create_session() for _ in toks]
    other = engine.create_session()
    for s in sids:
        oracle.new(s)
    for p, layer in enumerate(LAYERS):
        go, entered = gate_worker(engine)
        held = engine.submit(other, layer, torch.randn(1, DIM))     # the worker holds this step
        assert entered.wait(5)
        x = torch.randn(sum(toks), DIM).to(dtype)
        want = oracle.batch(sids, p, x.to(engine.model_cpu.dtype), toks, [spec] * len(toks))
        fut = submit(engine, sids, layer, x, kind)
        x.fill_(float("nan"))                    # the owner writes its memory while the request waits
        go.set()
        held.result(5)
        assert_close(fut.result(5).float(), want.float(), dtype=dtype, what=f"{kind}, layer {layer}")
        if spec:
            for s in sids:
                engine.accept(s, toks[0])
                oracle.accept(s, toks[0])
    for s in sids:
        assert_close(engine.export_state(s), oracle.export(s), what=s)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_borrowed_x_is_refused_and_changes_nothing(engine, kind, bad):
    _b, toks, spec = KINDS[kind]
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = [engine.create_session() for _ in toks]
    for s in sids:
        oracle.new(s)
    layer, p = LAYERS[1], 1
    for _ in range(40):                  # more refusals than there are batch slots: none keeps one
        x = torch.randn(sum(toks), DIM)
        x[-1, 3] = bad
        with pytest.raises(NonFinite):
            submit(engine, sids, layer, x, kind)
    x = torch.randn(sum(toks), DIM)
    want = oracle.batch(sids, p, x, toks, [spec] * len(toks))
    assert_close(submit(engine, sids, layer, x, kind).result(5), want, what=kind)
    if spec:
        for s in sids:
            engine.accept(s, toks[0])
            oracle.accept(s, toks[0])
    for s, n in zip(sids, toks):                  # only the one good request moved the sessions
        assert engine.session_info(s)["positions"][p] == n
        assert_close(engine.export_state(s), oracle.export(s), what=s)


def test_a_borrowed_x_in_another_dtype_is_cast_once_and_checked():
    e = make_engine(slots=4)
    try:
        sids = [e.create_session() for _ in range(2)]
        x = torch.randn(2, DIM, dtype=torch.float64)
        x[0, 0] = float("nan")
        with pytest.raises(NonFinite):
            e.submit_batch(sids, LAYERS[0], x.to(torch.float16), borrowed=True)
        oracle = Oracle(e.model_cpu, e.state_dtype)
        for s in sids:
            oracle.new(s)
        x = torch.randn(2, DIM, dtype=torch.float16)
        want = oracle.batch(sids, 0, x, [1, 1], [False, False])
        y = e.submit_batch(sids, LAYERS[0], x, borrowed=True).result(5)
        assert y.dtype == torch.float16
        assert_close(y, want, what="float16 x")
    finally:
        e.stop(drain=False)


def test_a_borrowed_batch_in_a_prefill_slot_is_copied_once_into_the_slot():
    """A batch without verify rows from borrowed memory: its one copy is the slot's (checked there), no copy of
    its own before it."""
    e = make_engine(slots=8)
    try:
        sids = [e.create_session() for _ in range(4)]
        go, entered = gate_worker(e)
        held = e.submit(sids[3], LAYERS[1], torch.randn(1, DIM))     # the worker holds this step
        assert entered.wait(5)
        x = torch.randn(7, DIM)
        fut = e.submit_batch(sids[:3], LAYERS[0], x, tokens=[1, 4, 2], borrowed=True)
        req = fut._req
        assert req.batch.pbuf >= 0
        staged = e._runner.bufs.h_tok[req.batch.tok:req.batch.tok + 7]
        assert req.x.data_ptr() == staged.data_ptr() and torch.equal(req.x, x)
        go.set()
        held.result(5)
        fut.result(5)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("what,knobs,tokens,spec", [
    ("a verify of a length without a verify slot", dict(max_spec_tokens=16), [9] * 3, True),
    ("a verify with verify slots off", dict(verify_slots=False), [3] * 3, True),
    ("a batch without verify rows, prefill slots off", dict(prefill_slots=False), [1, 5, 2], None),
])
def test_a_borrowed_batch_in_the_token_ring_is_copied_once_into_the_ring(what, knobs, tokens, spec):
    """Its one copy is the ring's (checked there), no copy of its own before it."""
    e = make_engine(slots=8, **knobs)
    try:
        sids = [e.create_session() for _ in range(4)]
        go, entered = gate_worker(e)
        held = e.submit(sids[3], LAYERS[1], torch.randn(1, DIM))     # the worker holds this step
        assert entered.wait(5)
        x = torch.randn(sum(tokens), DIM)
        fut = e.submit_batch(sids[:3], LAYERS[0], x, tokens=tokens, speculative=spec, borrowed=True)
        req = fut._req
        assert req.batch.vbuf < 0 and req.batch.pbuf < 0 and req.batch.tok >= 0, what
        staged = e._runner.bufs.h_tok[req.batch.tok:req.batch.tok + len(x)]
        assert req.x.data_ptr() == staged.data_ptr() and torch.equal(req.x, x), what
        go.set()
        held.result(5)
        fut.result(5)
    finally:
        e.stop(drain=False)
