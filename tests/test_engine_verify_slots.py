"""Verify slots and the batched accept as one record: a verify-only batch with one length per row launches from
a verify slot (Runner.take_verify_slot, DecodeLaunchers.run_verify_slot), and an accept_batch of sessions that
hold one pending record commits in one pass (Accepts._accept_uniform_locked). Both must give exactly what the
per-session reference gives: every (rows, k, n accepted in [0, k]) over every layer, with forks between the
verify and the accept, with requests queued behind the accept, with held results and with a failed launch."""

import random

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest, Internal
from convserve.service.engine.buffers import VERIFY_SLOTS
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine, model_x, new_sessions, served
from tests.tolerance import assert_close

KNOBS = dict(slots=40, max_batch_size=16, max_batch_tokens=128, decode_buckets=(1, 2, 4, 8, 16), max_spec_tokens=6,
             verify_graph_tokens=(1, 2, 4, 5))


def _fits(e, rows, k):
    bk = min(b for b in e.config.decode_buckets if b >= rows)
    return bk * k <= e._runner.bufs.vslot_rows and k in e.config.verify_graph_tokens


def _round(e, oracle, sids, k, rng, layers=LAYERS, forks=0):
    """One verify batch per layer (all rows k long), ``forks`` forks of some of the sessions, then one
    accept_batch of the sessions (and one of the forks) with random n in [0, k]; checks y, states, positions."""
    slots_used = []
    for lay in layers:
        x = model_x(e, len(sids) * k)
        f = e.submit_batch(sids, lay, x, tokens=[k] * len(sids), speculative=True)
        slots_used.append(f._req.batch.vbuf)
        want = torch.cat([oracle.verify(s, LAYERS.index(lay), x[i * k:(i + 1) * k]) for i, s in enumerate(sids)])
        assert_close(f.result(10), want, what=f"verify L{lay} rows {len(sids)} k {k}")
    assert all((j >= 0) == _fits(e, len(sids), k) for j in slots_used), slots_used
    made = []
    for src in rng.sample(sids, min(forks, len(sids))):
        dst = e.fork_session(src)
        oracle.fork(src, dst)
        made.append(dst)
    before = {s: e.session_info(s)["positions"] for s in sids + made}
    ns = [rng.randint(0, k) for _ in sids]
    e.accept_batch(sids, ns)
    if made:
        fn = [rng.randint(0, k) for _ in made]
        e.accept_batch(made, fn)
        for s, n in zip(made, fn):
            oracle.accept(s, n)
    for s, n in zip(sids, ns):
        oracle.accept(s, n)
    for s in sids + made:
        assert_close(e.export_state(s), oracle.export(s), what=s)
        assert e.pending_layers(s) == []
    for s, n in zip(sids, ns):
        assert e.session_info(s)["positions"] == [q + n * (lay in layers) for q, lay in zip(before[s], LAYERS)]
    return made


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_verify_slot_batches_and_their_accepts_equal_the_reference(rows, k):
    rng = random.Random(rows * 10 + k)
    with served(rows, **KNOBS) as (e, oracle, sids):
        for s in sids:
            x = torch.randn(3, DIM)                         # a committed state to verify from
            for p, lay in enumerate(LAYERS):
                e.submit(s, lay, x).result(10)
                oracle.conv(s, p, x)
        for r in range(3):
            _round(e, oracle, sids, k, rng, forks=1 if r == 1 else 0)
        _round(e, oracle, sids, k, rng, layers=LAYERS[1:])   # pending on some layers only
        st = e.stats()
        assert st["batch_requests_in_verify_slots"] == (11 if _fits(e, rows, k) else 0)


def _two_slots_in_one_step(e, oracle, sids):
    """Two verify-slot batches (and a packed single verify) in one step, on one layer and on another: each its own
    launch, one after another on the device buffers they share; then one accept of all."""
    go, entered = gate_worker(e)
    f0 = e.submit(sids[-1], LAYERS[2], model_x(e, 1) * 0)
    oracle.conv(sids[-1], 2, model_x(e, 1) * 0)
    assert entered.wait(10)
    a, b, c = sids[:4], sids[4:8], sids[8:10]
    xa, xb, xc, xs = model_x(e, 16), model_x(e, 8), model_x(e, 8), model_x(e, 4)
    fa = e.submit_batch(a, LAYERS[0], xa, tokens=[4] * 4, speculative=True)
    fb = e.submit_batch(b, LAYERS[0], xb, tokens=[2] * 4, speculative=True)
    fs = e.submit(sids[10], LAYERS[0], xs, speculative=True)
    assert fa._req.batch.vbuf >= 0 and fb._req.batch.vbuf >= 0 and fa._req.batch.vbuf != fb._req.batch.vbuf
    go.set()
    f0.result(10)
    assert_close(fa.result(10), torch.cat([oracle.verify(s, 0, xa[4 * i:4 * i + 4]) for i, s in enumerate(a)]))
    assert_close(fb.result(10), torch.cat([oracle.verify(s, 0, xb[2 * i:2 * i + 2]) for i, s in enumerate(b)]))
    assert_close(fs.result(10), oracle.verify(sids[10], 0, xs))
    fc = e.submit_batch(c, LAYERS[1], xc, tokens=[4] * 2, speculative=True)
    assert_close(fc.result(10), torch.cat([oracle.verify(s, 1, xc[4 * i:4 * i + 4]) for i, s in enumerate(c)]))
    rows = e.recent_steps()[-2]["rows"]
    assert rows == 9, rows                        # a's 4, b's 4 and the single verify: one step
    ns = [1, 4, 0, 3, 2, 0, 1, 2, 4, 3, 4]
    e.accept_batch(sids[:11], ns)
    for s, n in zip(sids[:11], ns):
        oracle.accept(s, n)
    for s in sids:
        assert_close(e.export_state(s), oracle.export(s), what=s)


def test_two_verify_slot_batches_in_one_step_equal_the_reference():
    with served(12, **KNOBS) as (e, oracle, sids):
        _two_slots_in_one_step(e, oracle, sids)


@pytest.mark.parametrize("n", ["zero", "full", "mixed"])
def test_a_batched_accept_of_sessions_with_different_pending_records_commits_each_its_own(n):
    """Sessions verified on different layers, or with different lengths: the per-session path, same result."""
    rng = random.Random(5)
    with served(6, **KNOBS) as (e, oracle, sids):
        for lay, group, k in ((LAYERS[0], sids, 3), (LAYERS[1], sids[:3], 3), (LAYERS[2], sids[3:], 2)):
            x = torch.randn(len(group) * k, DIM)
            y = e.submit_batch(group, lay, x, tokens=[k] * len(group), speculative=True).result(10)
            p = LAYERS.index(lay)
            assert_close(y, torch.cat([oracle.verify(s, p, x[i * k:(i + 1) * k]) for i, s in enumerate(group)]))
        ns = {"zero": [0] * 6, "full": [2] * 6, "mixed": [rng.randint(0, 2) for _ in sids]}[n]
        e.accept_batch(sids, ns)
        for s, m in zip(sids, ns):
            oracle.accept(s, m)
            assert_close(e.export_state(s), oracle.export(s), what=s)


def test_an_accept_too_long_for_one_session_commits_nothing():
    e = make_engine(**KNOBS)
    try:
        sids = [e.create_session() for _ in range(4)]
        x = torch.randn(12, DIM)
        e.submit_batch(sids, LAYERS[0], x, tokens=[3] * 4, speculative=True).result(10)
        before = [e.export_state(s) for s in sids]
        with pytest.raises(BadRequest, match=sids[2]):
            e.accept_batch(sids, [3, 3, 4, 0])
        assert [e.pending_layers(s) for s in sids] == [[LAYERS[0]]] * 4
        for s, b in zip(sids, before):
            assert torch.equal(e.export_state(s), b)
        assert [e.session_info(s)["positions"] for s in sids] == [[0, 0, 0]] * 4
    finally:
        e.stop(drain=False)


def test_an_accept_with_verifies_queued_after_it_commits_the_ones_before_it():
    """A verify batch queued after the accept (the worker held): the accept commits the first verify, the
    second stays pending and a later accept commits it."""
    with served(5, **KNOBS) as (e, oracle, sids):
        go, entered = gate_worker(e)
        f0 = e.submit(sids[0], LAYERS[2], torch.zeros(1, DIM))
        oracle.conv(sids[0], 2, torch.zeros(1, DIM))
        assert entered.wait(10)
        x1, x2 = torch.randn(10, DIM), torch.randn(10, DIM)
        f1 = e.submit_batch(sids, LAYERS[0], x1, tokens=[2] * 5, speculative=True)
        acc = e.submit_op("accept_batch", sids, [1, 2, 0, 1, 2])
        f2 = e.submit_batch(sids, LAYERS[0], x2, tokens=[2] * 5, speculative=True)
        go.set()
        f0.result(10)
        want1 = torch.cat([oracle.verify(s, 0, x1[2 * i:2 * i + 2]) for i, s in enumerate(sids)])
        assert_close(f1.result(10), want1)
        acc.result(10)
        for s, n in zip(sids, [1, 2, 0, 1, 2]):
            oracle.accept(s, n)
        want2 = torch.cat([oracle.verify(s, 0, x2[2 * i:2 * i + 2]) for i, s in enumerate(sids)])
        assert_close(f2.result(10), want2)
        assert [e.pending_layers(s) for s in sids] == [[LAYERS[0]]] * 5
        e.accept_batch(sids, [2, 0, 1, 2, 1])
        for s, n in zip(sids, [2, 0, 1, 2, 1]):
            oracle.accept(s, n)
            assert_close(e.export_state(s), oracle.export(s), what=s)


def test_a_held_verify_slot_result_is_never_overwritten():
    """Callers that keep their y hold their verify slots: the next batches take the other slot, then the token
    arena; every kept y keeps its values, and once let go the slots serve again."""
    with served(4, **KNOBS) as (e, oracle, sids):
        kept, used = [], []
        for i in range(VERIFY_SLOTS + 2):
            lay = LAYERS[i % len(LAYERS)]
            x = torch.randn(16, DIM)
            f = e.submit_batch(sids, lay, x, tokens=[4] * 4, speculative=True)
            used.append(f._req.batch.vbuf)
            y = f.result(10)
            want = torch.cat([oracle.verify(s, i % len(LAYERS), x[4 * j:4 * j + 4]) for j, s in enumerate(sids)])
            kept.append((y[1:], want[1:]))                 # a view of the slot's y
        assert sorted(used[:VERIFY_SLOTS]) == list(range(VERIFY_SLOTS)) and used[VERIFY_SLOTS:] == [-1, -1]
        for y, want in kept:
            assert_close(y, want)
        kept.clear()
        del y
        f = e.submit_batch(sids, LAYERS[0], torch.randn(16, DIM), tokens=[4] * 4, speculative=True)
        assert f._req.batch.vbuf >= 0
        f.result(10)


def test_a_failed_verify_slot_launch_fails_its_batch_and_frees_its_slot():
    e = make_engine(**KNOBS)
    try:
        sids = [e.create_session() for _ in range(3)]
        real = e._runner.decode.run_verify_slot

        def boom(*a):
            raise RuntimeError("injected launch failure")

        e._runner.decode.run_verify_slot = boom
        f = e.submit_batch(sids, LAYERS[1], torch.randn(6, DIM), tokens=[2] * 3, speculative=True)
        assert f._req.batch.vbuf >= 0
        with pytest.raises(Internal):
            f.result(10)
        assert [e.pending_layers(s) for s in sids] == [[]] * 3          # nothing left to accept
        with pytest.raises(BadRequest):
            e.accept_batch(sids, [1, 1, 1])
        e._runner.decode.run_verify_slot = real
        for _ in range(VERIFY_SLOTS + 1):                  # every slot serves again
            f = e.submit_batch(sids, LAYERS[1], torch.randn(6, DIM), tokens=[2] * 3, speculative=True)
            assert f._req.batch.vbuf >= 0
            f.result(10)
            del f
        e.accept_batch(sids, [2, 1, 0])
    finally:
        e.stop(drain=False)


def test_a_refused_or_withdrawn_verify_slot_batch_frees_its_slot():
    """A batch refused at enqueue (an unknown session) and one cancelled while queued give their verify slots back
    and leave nothing pending; the slots then serve the next batches."""
    from convserve.clients.protocol.errors import UnknownSession

    e = make_engine(**KNOBS)
    try:
        sids = [e.create_session() for _ in range(3)]
        for _ in range(VERIFY_SLOTS + 1):
            with pytest.raises(UnknownSession):
                e.submit_batch(sids + ["nobody"], LAYERS[0], torch.randn(8, DIM), tokens=[2] * 4, speculative=True)
        go, entered = gate_worker(e)
        f0 = e.submit(sids[0], LAYERS[2], torch.zeros(1, DIM))
        assert entered.wait(10)
        fc = e.submit_batch(sids, LAYERS[0], torch.randn(6, DIM), tokens=[2] * 3, speculative=True)
        assert fc._req.batch.vbuf >= 0 and fc.cancel()
        go.set()
        f0.result(10)
        assert [e.pending_layers(s) for s in sids] == [[]] * 3
        used = []
        for _ in range(VERIFY_SLOTS):
            f = e.submit_batch(sids, LAYERS[0], torch.randn(6, DIM), tokens=[2] * 3, speculative=True)
            used.append(f._req.batch.vbuf)
            f.result(10)
            del f
        assert min(used) >= 0
        e.accept_batch(sids, [2, 0, 1])
    finally:
        e.stop(drain=False)


def test_a_verify_slot_batch_with_positions():
    """A position-carrying verify batch in a verify slot: its y is right, the positions do not move until accept
    (then by each n), and afterwards the old position is refused."""
    from convserve.clients.protocol.errors import PositionMismatch

    with served(4, **KNOBS) as (e, oracle, sids):
        x = torch.randn(16, DIM)
        f = e.submit_batch(sids, LAYERS[1], x, tokens=[4] * 4, speculative=True, position=[0] * 4)
        assert f._req.batch.vbuf >= 0
        y = f.result(10)
        assert_close(y, torch.cat([oracle.verify(s, 1, x[4 * i:4 * i + 4]) for i, s in enumerate(sids)]))
        assert [e.session_info(s)["positions"][1] for s in sids] == [0] * 4
        e.accept_batch(sids, [4, 3, 2, 1])
        for s, n in zip(sids, [4, 3, 2, 1]):
            oracle.accept(s, n)
        assert [e.session_info(s)["positions"][1] for s in sids] == [4, 3, 2, 1]
        with pytest.raises(PositionMismatch):
            e.submit_batch(sids, LAYERS[1], x, tokens=[4] * 4, speculative=True, position=[0] * 4)
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=s)


@pytest.mark.gpu
@pytest.mark.parametrize("use_graphs", [True, False])
def test_verify_slot_batches_on_cuda_equal_the_reference(use_graphs):
    """On CUDA: lengths with a verify-slot launch per (slot, layer, bucket) (a graph replayed, or with graphs off
    the same ops eagerly) and lengths without (the token arena), with the model's fp32 and bf16 and an fp32
    state; y, the committed states and the positions as the reference."""
    from convserve.service.model import ConvModel

    for dtype, sdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=dtype, seed=3)
        e = make_engine(model, device="cuda", use_cuda_graphs=use_graphs, state_dtype=sdtype,
                        **{**KNOBS, "slots": 64, "verify_graph_tokens": (2, 4)})
        oracle = Oracle(e.model_cpu, e.state_dtype)
        rng = random.Random(7)
        try:
            if use_graphs:
                assert (0, 0, 16, 4) in e._runner.decode._graphs and (1, 2, 8, 2) in e._runner.decode._graphs
                assert not any(len(k) == 4 and k[3] == 5 for k in e._runner.decode._graphs)
            for rows in (1, 5, 13):
                sids = new_sessions(e, oracle, rows)
                for k in (4, 2, 5, 1):
                    _round(e, oracle, sids, k, rng, forks=1)
            sids = new_sessions(e, oracle, 12)
            _two_slots_in_one_step(e, oracle, sids)
        finally:
            e.stop(drain=False)
