"""Prefill slots: a batch without verify rows (prefill chunks and one-token rows) is staged at submit into a half of
the token arena and launched on its own (Runner.take_prefill_slot, PrefillSlots.run): on CUDA one graph replay per
(slot, layer, token bucket). It must give exactly what each slice sent on its own gives, alone, two in one step
beside the layer's other prefill rows, with held results, with a failed launch and with a withdrawn batch; a batch
that finds no free slot takes the layer's prefill launch instead."""

import random

import pytest
import torch

from convserve.clients.protocol.errors import StateLost, UnknownSession
from convserve.service.engine.buffers import PREFILL_SLOTS
from convserve.service.engine.prefill_slots import token_buckets
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine, model_x, new_sessions, served
from tests.tolerance import assert_close

KNOBS = dict(slots=40, max_batch_size=16, max_batch_tokens=200, decode_buckets=(1, 2, 4, 8, 16), max_spec_tokens=4)


def _batch(e, oracle, sids, lay, toks):
    """Submit one batch without verify rows; returns (future, the reference's y)."""
    x = model_x(e, sum(toks))
    want, a = [], 0
    for s, t in zip(sids, toks):
        want.append(oracle.conv(s, LAYERS.index(lay), x[a:a + t]))
        a += t
    return e.submit_batch(sids, lay, x, tokens=toks), torch.cat(want)


@pytest.mark.parametrize("toks", [[1, 1, 1, 2], [5, 1, 1, 17, 1], [1] * 9 + [30], [64, 3], [100, 90, 1]])
@pytest.mark.parametrize("rounds", [1, 3])
def test_prefill_slot_batches_equal_the_reference(toks, rounds):
    """Rows from a stored state and from zeros (each session's first call on a layer), every layer, several
    rounds (each continuing from the last), the rows' order turned each round."""
    rng = random.Random(len(toks) * 10 + rounds)
    with served(len(toks), **KNOBS) as (e, oracle, sids):
        for s in sids[::2]:                                 # half start from a stored state
            x = model_x(e, 3)
            e.submit(s, LAYERS[0], x).result(10)
            oracle.conv(s, 0, x)
        used = []
        for r in range(rounds):
            t = toks if r % 2 == 0 else toks[::-1]
            for lay in rng.sample(LAYERS, len(LAYERS)):
                f, want = _batch(e, oracle, sids, lay, t)
                used.append(f._req.batch.pbuf)
                assert_close(f.result(10), want, what=f"round {r} layer {lay} {t}")
                del f
        assert min(used) >= 0, used
        assert e.stats()["batch_requests_in_prefill_slots"] == rounds * len(LAYERS)
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=s)


def _in_one_step(e, oracle, sids):
    """Two prefill-slot batches on one layer, a single prefill and a batch with a verify row (the layer's packed
    launches) in one step: each its own launch, one after another on the device buffers they share."""
    go, entered = gate_worker(e)
    f0 = e.submit(sids[-1], LAYERS[2], model_x(e, 1) * 0)
    oracle.conv(sids[-1], 2, model_x(e, 1) * 0)
    assert entered.wait(10)
    fa, wa = _batch(e, oracle, sids[:3], LAYERS[0], [1, 20, 2])
    fb, wb = _batch(e, oracle, sids[3:6], LAYERS[0], [9, 1, 1])
    xs = model_x(e, 11)
    fs = e.submit(sids[6], LAYERS[0], xs)
    ws = oracle.conv(sids[6], 0, xs)
    xv = model_x(e, 7)
    fv = e.submit_batch(sids[7:10], LAYERS[0], xv, tokens=[1, 4, 2], speculative=[False, False, True])
    wv = torch.cat([oracle.conv(sids[7], 0, xv[:1]), oracle.conv(sids[8], 0, xv[1:5]),
                    oracle.verify(sids[9], 0, xv[5:])])
    assert fa._req.batch.pbuf >= 0 and fb._req.batch.pbuf >= 0 and fa._req.batch.pbuf != fb._req.batch.pbuf
    assert fv._req.batch.pbuf == -1
    go.set()
    f0.result(10)
    for f, want in ((fa, wa), (fb, wb), (fs, ws), (fv, wv)):
        assert_close(f.result(10), want)
    assert e.recent_steps()[-1]["rows"] == 10         # a's 3, b's 3, the single, the mixed batch's 3: one step
    e.accept_batch([sids[9]], [1])
    oracle.accept(sids[9], 1)
    for s in sids:
        assert_close(e.export_state(s), oracle.export(s), what=s)


def test_prefill_slot_batches_in_one_step_with_the_layers_other_prefill_rows():
    with served(12, **KNOBS) as (e, oracle, sids):
        _in_one_step(e, oracle, sids)


def test_a_held_prefill_slot_result_is_never_overwritten():
    """Callers that keep their y hold their prefill slots: the next batches take the other slot, then the layer's
    prefill launch; every kept y keeps its values, and once let go the slots serve again."""
    with served(4, **KNOBS) as (e, oracle, sids):
        kept, used = [], []
        for i in range(PREFILL_SLOTS + 2):
            f, want = _batch(e, oracle, sids, LAYERS[i % len(LAYERS)], [1, 6, 1, 3])
            used.append(f._req.batch.pbuf)
            y = f.result(10)
            kept.append((y[1:], want[1:]))                  # a view of the slot's y
            del f
        assert sorted(used[:PREFILL_SLOTS]) == list(range(PREFILL_SLOTS)) and used[PREFILL_SLOTS:] == [-1, -1]
        for y, want in kept:
            assert_close(y, want)
        kept.clear()
        del y
        f, want = _batch(e, oracle, sids, LAYERS[0], [2, 2, 2, 2])
        assert f._req.batch.pbuf >= 0
        assert_close(f.result(10), want)


def test_a_batch_of_max_batch_tokens_takes_a_prefill_slot_at_the_top_bucket():
    """A half of the token arena holds the largest batch (max_batch_tokens rounded up to 16)."""
    with served(2, **KNOBS) as (e, oracle, sids):
        top = e.config.max_batch_tokens
        assert e._runner.bufs.tok_half == -(-top // 16) * 16
        for toks in ([top - 1, 1], [1, top - 1]):
            f, want = _batch(e, oracle, sids, LAYERS[1], toks)
            assert f._req.batch.pbuf >= 0
            assert_close(f.result(10), want)
            del f


def test_with_prefill_slots_off_every_batch_takes_the_layers_prefill_launch():
    with served(3, **KNOBS, prefill_slots=False) as (e, oracle, sids):
        assert e._runner.prefill_slots is None and e._runner.bufs.pslot_y is None     # no y buffers held
        f, want = _batch(e, oracle, sids, LAYERS[0], [1, 5, 2])
        assert f._req.batch.pbuf == -1
        assert_close(f.result(10), want)
        assert e.stats()["batch_requests_in_prefill_slots"] == 0


def test_a_failed_prefill_slot_launch_drops_its_sessions_and_frees_its_slot():
    """The launch may have written the rows' states: the batch answers 410 state_lost and its sessions are
    dropped (never a retryable error over a state that moved); the slot then serves the next batches."""
    e = make_engine(**KNOBS)
    try:
        sids = [e.create_session() for _ in range(3)]
        ps = e._runner.prefill_slots
        real = ps.run

        def boom(*a):
            raise RuntimeError("injected launch failure")

        ps.run = boom
        f = e.submit_batch(sids, LAYERS[1], model_x(e, 8), tokens=[1, 5, 2])
        assert f._req.batch.pbuf >= 0
        with pytest.raises(StateLost):
            f.result(10)
        for s in sids:
            with pytest.raises(StateLost):
                e.export_state(s)
        ps.run = real
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sids = new_sessions(e, oracle, 3)
        for _ in range(PREFILL_SLOTS + 1):                 # every slot serves again
            f, want = _batch(e, oracle, sids, LAYERS[1], [2, 1, 4])
            assert f._req.batch.pbuf >= 0
            assert_close(f.result(10), want)
            del f
    finally:
        e.stop(drain=False)


def test_a_refused_or_withdrawn_prefill_slot_batch_frees_its_slot():
    """A batch refused at enqueue (an unknown session) and one cancelled while queued give their prefill slots back
    and change no state; the slots then serve the next batches."""
    with served(3, **KNOBS) as (e, oracle, sids):
        for _ in range(PREFILL_SLOTS + 1):
            with pytest.raises(UnknownSession):
                e.submit_batch(sids + ["nobody"], LAYERS[0], model_x(e, 8), tokens=[2] * 4)
        go, entered = gate_worker(e)
        f0 = e.submit(sids[0], LAYERS[2], torch.zeros(1, DIM))
        oracle.conv(sids[0], 2, torch.zeros(1, DIM))
        assert entered.wait(10)
        fc = e.submit_batch(sids, LAYERS[0], model_x(e, 6), tokens=[2] * 3)
        assert fc._req.batch.pbuf >= 0 and fc.cancel()
        go.set()
        f0.result(10)
        used = []
        for _ in range(PREFILL_SLOTS):
            f, want = _batch(e, oracle, sids, LAYERS[0], [3, 1, 2])
            used.append(f._req.batch.pbuf)
            assert_close(f.result(10), want)
            del f
        assert min(used) >= 0
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=s)


@pytest.mark.parametrize("prefill_slots", [True, False])
def test_a_step_of_prefill_slot_batches_is_a_prefill_step_for_isolation(prefill_slots):
    """A decode queued during a step that held only a prefill batch runs in the next step alone, before a long
    single prefill queued beside it (the scheduler's isolation), whichever launch the batch took."""
    e = make_engine(**KNOBS, prefill_slots=prefill_slots)
    try:
        sids = [e.create_session() for _ in range(5)]
        go, entered = gate_worker(e)
        fb = e.submit_batch(sids[:3], LAYERS[0], model_x(e, 9), tokens=[3, 3, 3])      # held in its step
        assert entered.wait(10)
        assert (fb._req.batch.pbuf >= 0) == prefill_slots
        fd = e.submit(sids[3], LAYERS[1], model_x(e, 1))
        fp = e.submit(sids[4], LAYERS[1], model_x(e, 50))
        go.set()
        for f in (fb, fd, fp):
            f.result(10)
        assert [(s["rows"], s["tokens"]) for s in e.recent_steps()[-3:]] == [(3, 9), (1, 1), (1, 50)]
    finally:
        e.stop(drain=False)


def test_a_step_failing_after_its_prefill_slots_launched_drops_only_their_sessions():
    """The slots' launches run first: a failure in the step's packing after them (nothing else launched) drops
    the slot batch's sessions (410 state_lost) and gives the other rows a retryable error, their sessions kept."""
    from convserve.clients.protocol.errors import Internal

    with served(5, **KNOBS) as (e, oracle, sids):
        go, entered = gate_worker(e)
        f0 = e.submit(sids[4], LAYERS[2], model_x(e, 1))
        assert entered.wait(10)
        fb = e.submit_batch(sids[:3], LAYERS[0], model_x(e, 9), tokens=[3, 3, 3])
        fs = e.submit(sids[3], LAYERS[1], model_x(e, 7))
        assert fb._req.batch.pbuf >= 0

        def boom(out):
            raise RuntimeError("injected failure after the prefill slots' launches")

        e._runner._pack_tokens = boom
        go.set()
        f0.result(10)
        with pytest.raises(StateLost):
            fb.result(10)
        with pytest.raises(Internal):
            fs.result(10)
        for s in sids[:3]:
            with pytest.raises(StateLost):
                e.export_state(s)
        assert_close(e.export_state(sids[3]), oracle.export(sids[3]))      # untouched: still zeros


def test_a_copy_into_a_slot_that_fails_gives_the_slot_back():
    with served(3, **KNOBS) as (e, oracle, sids):
        r = e._runner
        real = r._copy_tokens

        def boom(*a):
            raise MemoryError("injected failure of the copy into the token ring")

        r._copy_tokens = boom
        for _ in range(PREFILL_SLOTS + 1):
            with pytest.raises(MemoryError):
                e.submit_batch(sids, LAYERS[0], model_x(e, 6), tokens=[1, 3, 2])
        r._copy_tokens = real
        used = []
        for _ in range(PREFILL_SLOTS):               # every slot serves again, and nothing was applied before
            f, want = _batch(e, oracle, sids, LAYERS[0], [2, 1, 3])
            used.append(f._req.batch.pbuf)
            assert_close(f.result(10), want)
            del f
        assert min(used) >= 0


@pytest.mark.parametrize("top,want", [
    (16, (16,)), (48, (16, 32, 48)), (512, (16, 32, 64, 128, 256, 512)),
    (1040, (16, 32, 64, 128, 256, 512, 1024, 1040)),
    (8192, (16, 32, 64, 128, 256) + tuple(range(512, 8193, 512))),
])
def test_token_buckets_are_powers_of_two_then_steps_then_the_top(top, want):
    assert token_buckets(top) == want


@pytest.mark.gpu
@pytest.mark.parametrize("use_graphs", [True, False])
def test_prefill_slot_batches_on_cuda_equal_the_reference(use_graphs):
    """On CUDA: one launch per (slot, layer, token bucket) (a graph replayed, or with graphs off the same ops
    eagerly), with the model's fp32 and bf16 and an fp32 state; y and the states as the reference, over token
    counts on and between the buckets."""
    from convserve.service.model import ConvModel

    for dtype, sdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=dtype, seed=3)
        e = make_engine(model, device="cuda", use_cuda_graphs=use_graphs, state_dtype=sdtype, **KNOBS)
        oracle = Oracle(e.model_cpu, e.state_dtype)
        rng = random.Random(7)
        try:
            ps = e._runner.prefill_slots
            assert ps.n_graphs == (PREFILL_SLOTS * len(LAYERS) * len(ps.buckets) if use_graphs else 0)
            sids = new_sessions(e, oracle, 12)
            for n_rows in (1, 4, 12):
                for _ in range(3):
                    toks = [rng.choice([1, 1, 2, 7, 16, 33]) for _ in range(n_rows)]
                    for lay in LAYERS:
                        f, want = _batch(e, oracle, sids[:n_rows], lay, toks)
                        assert (f._req.batch.pbuf >= 0) == (max(toks) > 1)   # else a plain decode batch
                        assert_close(f.result(10), want, what=f"{toks} layer {lay}")
                        del f
            for s in sids:
                assert_close(e.export_state(s), oracle.export(s), what=s)
            sids = new_sessions(e, oracle, 12)
            _in_one_step(e, oracle, sids)
        finally:
            e.stop(drain=False)


@pytest.mark.parametrize("argv,want", [([], (True, True)), (["--no-prefill-slots"], (False, True)),
                                       (["--no-verify-slots", "--prefill-slots"], (True, False))])
def test_the_slots_are_serve_settings(argv, want, capsys):
    import json

    from convserve.service.cli import main as cli_main
    from convserve.service.config import Settings
    from convserve.service.engine.config import EngineConfig

    assert cli_main(["serve", "--print-config", *argv]) == 0
    printed = json.loads(capsys.readouterr().out)
    cfg = EngineConfig.from_settings(Settings(**{k: v for k, v in printed.items() if k in Settings.model_fields}))
    assert (cfg.prefill_slots, cfg.verify_slots) == want
