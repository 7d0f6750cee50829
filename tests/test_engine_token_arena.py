"""The token arena: a batch's prefill and verify rows staged at submit (Runner.stage_tokens). Staged or not (the
arena full), a batch gives the same bits; a staged region is never handed out again while its request is pending;
a verify row shorter than its launch is padded on the device; accept commits from the device copy of the x."""

import types

import torch

from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close

KNOBS = dict(slots=16, max_batch_tokens=64, max_batch_size=8, decode_buckets=(1, 2, 4, 8), max_spec_tokens=4)
TOKS, SPEC = [1, 12, 3, 1, 2, 5], [False, False, True, False, True, False]


def _workload(e, arena_full: bool):
    """Three rounds of a mixed batch on every layer, then an accept of its verifies; the ys, tokens rows staged
    and the final states."""
    g = torch.Generator().manual_seed(7)
    sids = [e.create_session() for _ in TOKS]
    if arena_full:                 # every arena row held by a request still pending: nothing can be staged
        e._runner._tok_live = [(0, e._runner.bufs.tok_rows, types.SimpleNamespace(done=False))]
    ys, tok = [], []
    for _ in range(3):
        for lay in LAYERS:
            x = torch.randn(sum(TOKS), DIM, generator=g)
            f = e.submit_batch(sids, lay, x, tokens=TOKS, speculative=SPEC)
            ys.append(f.result(10))
            tok.append(f._req.batch.tok)
        e.accept_batch([sids[2], sids[4]], [2, 1])
    return ys, tok, [e.export_state(s) for s in sids]


def test_a_staged_batch_and_one_packed_from_x_give_the_same_bits():
    runs = []
    for full in (False, True):
        e = make_engine(**KNOBS)
        try:
            runs.append(_workload(e, full))
        finally:
            e.stop(drain=False)
    (y0, t0, s0), (y1, t1, s1) = runs
    assert all(t >= 0 for t in t0) and all(t == -1 for t in t1)
    for a, b in zip(y0, y1):
        assert torch.equal(a, b)
    for a, b in zip(s0, s1):
        assert torch.equal(a, b)


def test_a_staged_region_is_not_reused_while_its_request_is_pending():
    e = make_engine(**KNOBS)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        r = e._runner
        r.bufs.tok_rows = 40                       # a small arena: two of these batches do not fit at once
        sids = [e.create_session() for _ in range(3)]
        for s in sids:
            oracle.new(s)
        toks = [1, 17, 2]                          # 17 prefill tokens + one verify row of 2: 19 arena rows
        spec = [False, False, True]
        go, entered = gate_worker(e)
        x0 = torch.randn(1, DIM)
        f0 = e.submit(sids[0], LAYERS[2], x0)       # the gated step
        want0 = oracle.conv(sids[0], 2, x0)
        assert entered.wait(10)
        xs = [torch.randn(sum(toks), DIM) for _ in range(3)]
        fs = [e.submit_batch(sids, LAYERS[k], x, tokens=toks, speculative=spec) for k, x in enumerate(xs)]
        regions = [(f._req.batch.tok, f._req.batch.tok + 19) for f in fs]
        assert regions[0] == (0, 19) and regions[1] == (19, 38)
        assert fs[2]._req.batch.tok == -1          # would overlap the first, still pending: packed from x
        staged = [r.bufs.h_tok[a:b].clone() for a, b in regions[:2]]
        go.set()
        assert_close(f0.result(10), want0)
        for k, (f, x) in enumerate(zip(fs, xs)):
            want = oracle.batch(sids[:3], k, x, toks, spec)
            assert_close(f.result(10), want, what=f"batch {k}")
        for (a, b), before in zip(regions[:2], staged):
            assert torch.equal(r.bufs.h_tok[a:b], before)   # nobody wrote into them while they were pending
        # done now: the next batch takes the arena from the start again
        f = e.submit_batch(sids, LAYERS[0], torch.randn(sum(toks), DIM), tokens=toks, speculative=spec)
        f.result(10)
        assert f._req.batch.tok == 0
    finally:
        e.stop(drain=False)


def test_a_staged_verify_shorter_than_its_launch_is_padded_on_the_device_and_accepts_from_it():
    """A batch's verify rows (2 tokens) in one launch with a single verify of 4: the launch is 4 long (the
    batch staged in the token arena: no verify slot)."""
    e = make_engine(**KNOBS, verify_slots=False)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = [e.create_session() for _ in range(4)]
        for s in sids:
            oracle.new(s)
            x = torch.randn(3, DIM)
            e.submit(s, LAYERS[1], x).result(10)
            oracle.conv(s, 1, x)
        e._runner.bufs.d_in.fill_(float("nan"))     # stale pad rows must not leak into real outputs
        go, entered = gate_worker(e)
        f0 = e.submit(sids[3], LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(10)
        xv = torch.randn(4, DIM)
        fv = e.submit(sids[0], LAYERS[1], xv, speculative=True)
        xb = torch.randn(4, DIM)
        fb = e.submit_batch(sids[1:3], LAYERS[1], xb, tokens=[2, 2], speculative=True)
        assert fb._req.batch.tok >= 0
        go.set()
        f0.result(10)
        assert_close(fv.result(10), oracle.verify(sids[0], 1, xv))
        want = torch.cat([oracle.verify(sids[1], 1, xb[:2]), oracle.verify(sids[2], 1, xb[2:])])
        assert_close(fb.result(10), want)
        assert e.recent_steps()[-1]["rows"] == 3     # one step: the three verify rows in one launch
        fork = e.fork_session(sids[1])               # the fork accepts from its own copy of the verify's x
        oracle.fork(sids[1], fork)
        e.accept_batch([sids[0], sids[1], sids[2]], [3, 2, 1])
        e.accept(fork, 1)
        for s, n in ((sids[0], 3), (sids[1], 2), (sids[2], 1), (fork, 1)):
            oracle.accept(s, n)
            assert_close(e.export_state(s), oracle.export(s), what=s)
    finally:
        e.stop(drain=False)
