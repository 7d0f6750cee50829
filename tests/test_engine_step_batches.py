"""The frontend's step as one request: submit_batch with ``tokens`` and ``speculative`` (prefill chunks, decodes
and verifies of many sessions in one batch) and accept_batch; each slice runs as its own submit would."""

import threading
import time

import pytest
import torch

from convserve.clients.protocol.errors import (BadRequest, PayloadTooLarge, ShapeMismatch, StateLost,
                                               UnknownSession)
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close

KNOBS = dict(slots=16, max_batch_tokens=64, max_batch_size=6, decode_buckets=(1, 2, 4, 8), max_spec_tokens=4)


ROWS = {   # (tokens, speculative) per session
    "decodes only, tokens given": ([1, 1, 1], [False] * 3),
    "prefill chunks only": ([5, 2, 9], [False] * 3),
    "decode + prefill": ([1, 7, 1, 1], [False] * 4),
    "verifies only, one length": ([3, 3, 3], [True] * 3),
    "verifies of different lengths": ([1, 4, 2], [True] * 3),
    "all kinds": ([1, 12, 3, 1, 2], [False, False, True, False, True]),
    "one long prefill": ([40], [False]),
    "one verify": ([4], [True]),
}


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(ROWS))
def test_a_mixed_batch_equals_each_slice_submitted_on_its_own_and_is_one_step(case, xdt):
    toks, spec = ROWS[case]
    e = make_engine(**KNOBS)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = [e.create_session() for _ in toks]
        for i, s in enumerate(sids):
            oracle.new(s)
            if i % 2 == 0:                              # half start from a stored state, half from zeros
                x0 = torch.randn(3, DIM)
                e.submit(s, LAYERS[1], x0).result(10)
                oracle.conv(s, 1, x0)
        x = torch.randn(sum(toks), DIM).to(xdt)
        want = oracle.batch(sids, 1, x, toks, spec)
        before = e.stats()
        y = e.submit_batch(sids, LAYERS[1], x, tokens=toks, speculative=spec).result(10)
        after = e.stats()
        assert y.shape == x.shape and y.dtype == xdt
        assert_close(y, want, what=case)
        assert after["requests"] - before["requests"] == 1 and after["steps"] - before["steps"] == 1
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
        if any(spec):                                  # the verifies are pending; accept_batch commits them
            pend = [s for s, sp in zip(sids, spec) if sp]
            ns = [min(n, 1 + i) for i, (n, sp) in enumerate(zip(toks, spec)) if sp]
            e.accept_batch(pend, ns)
            for s, n in zip(pend, ns):
                oracle.accept(s, n)
            for s in sids:
                assert_close(e.export_state(s), oracle.export(s), what=f"state after accept {s}")
                assert not e._sessions.get(s).pending
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("tokens, spec", [
    (None, None),                                    # a plain decode batch, 10 rows: past the largest bucket (4)
    ([1] * 9 + [6], None),                           # nine one-token rows and a prefill chunk
    ([1] * 5, [False] * 5),                          # tokens and flags given, all plain
], ids=["plain", "with-prefill", "given"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_token_rows_past_the_largest_decode_bucket_run_in_the_prefill_launch(tokens, spec, device):
    """Without verify rows a batch's rows are its layer's prefill launch: any number of one-token rows fits, with the
    answers and states of each slice sent on its own, in one step."""
    e = make_engine(slots=16, max_batch_tokens=64, max_batch_size=12, decode_buckets=(1, 2, 4), max_spec_tokens=4,
                    device=device)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        toks = tokens or [1] * 10
        sids = [e.create_session() for _ in toks]
        for i, s in enumerate(sids):
            oracle.new(s)
            if i % 2:                                   # half start from a stored state, half from zeros
                x0 = torch.randn(2, DIM)
                e.submit(s, LAYERS[0], x0).result(10)
                oracle.conv(s, 0, x0)
        x = torch.randn(sum(toks), DIM)
        want = oracle.batch(sids, 0, x, toks, [False] * len(toks))
        before = e.stats()
        y = e.submit_batch(sids, LAYERS[0], x, tokens=tokens, speculative=spec).result(10)
        after = e.stats()
        assert_close(y, want, what="batch y")
        assert after["steps"] - before["steps"] == 1 and after["decode_rows"] == before["decode_rows"]
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_one_token_rows_beside_verify_rows_past_the_largest_decode_bucket_are_a_413_that_changes_nothing():
    e = make_engine(slots=16, max_batch_tokens=64, max_batch_size=12, decode_buckets=(1, 2, 4), max_spec_tokens=4)
    try:
        sids = [e.create_session() for _ in range(6)]
        for s in sids:
            e.submit(s, LAYERS[0], torch.randn(2, DIM)).result(10)
        before = {s: e.export_state(s) for s in sids}
        with pytest.raises(PayloadTooLarge, match="5 one-token plain rows beside speculative ones"):
            e.submit_batch(sids, LAYERS[0], torch.randn(7, DIM), tokens=[1] * 5 + [2],
                           speculative=[False] * 5 + [True])
        for s in sids:
            assert torch.equal(e.export_state(s), before[s]) and not e._sessions.get(s).pending
        y = e.submit_batch(sids[2:], LAYERS[0], torch.randn(5, DIM), tokens=[1] * 3 + [2],
                           speculative=[False] * 3 + [True]).result(10)   # four fit
        assert y.shape == (5, DIM)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("speculative", [True, [True, True]])
def test_speculative_true_without_tokens_is_one_token_verifies(speculative):
    e = make_engine(**KNOBS)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = [e.create_session() for _ in range(2)]
        for s in sids:
            oracle.new(s)
        x = torch.randn(2, DIM)
        want = oracle.batch(sids, 0, x, [1, 1], [True, True])
        assert_close(e.submit_batch(sids, LAYERS[0], x, speculative=speculative).result(10), want)
        assert all(e._sessions.get(s).pending for s in sids)
        assert torch.count_nonzero(e.export_state(sids[0])) == 0   # the committed state is left alone
    finally:
        e.stop(drain=False)


def test_a_later_verify_in_a_batch_replaces_the_pending_one_and_accept_commits_the_latest():
    e = make_engine(**KNOBS)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = [e.create_session() for _ in range(2)]
        for s in sids:
            oracle.new(s)
        for rnd in range(2):
            x = torch.randn(6, DIM)
            want = oracle.batch(sids, 2, x, [2, 4], [True, True])
            assert_close(e.submit_batch(sids, LAYERS[2], x, tokens=[2, 4], speculative=True).result(10), want)
        e.accept_batch(sids, [2, 3])
        oracle.accept(sids[0], 2)
        oracle.accept(sids[1], 3)
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s))
    finally:
        e.stop(drain=False)


def _snapshot(e, sids):
    return {s: (e.export_state(s), dict(e._sessions.get(s).pending)) for s in sids}


def _same(e, snap):
    for s, (st, pend) in snap.items():
        assert torch.equal(e.export_state(s), st), s
        assert e._sessions.get(s).pending == pend, s


BAD = {   # kwargs over the good call: sessions a, b; tokens [2, 1]; x (3, DIM); layer LAYERS[0]
    "unknown session": (dict(sessions=["a", "nope"]), UnknownSession, "nope"),
    "evicted session": (dict(sessions=["a", "gone"]), StateLost, "evicted"),
    "repeated session": (dict(sessions=["a", "a"]), BadRequest, "appears twice"),
    "too many sessions": (dict(sessions=list("abcdefg"), tokens=[1] * 7, x=torch.randn(7, DIM)), PayloadTooLarge,
                          "max_batch_size"),
    "tokens too short": (dict(tokens=[2]), BadRequest, "one integer per session"),
    "tokens not a list": (dict(tokens="21"), BadRequest, "list of 2 integers"),
    "tokens of floats": (dict(tokens=[2.0, 1]), BadRequest, r"tokens\[0\]"),
    "tokens of bools": (dict(tokens=[True, 1]), BadRequest, r"tokens\[0\]"),
    "a zero-token slice": (dict(tokens=[3, 0]), BadRequest, ">= 1"),
    "speculative too short": (dict(speculative=[True]), BadRequest, "one boolean per session"),
    "speculative not a bool": (dict(speculative="yes"), BadRequest, "boolean"),
    "speculative of ints": (dict(speculative=[1, 0]), BadRequest, r"speculative\[0\]"),
    "x rows differ from sum(tokens)": (dict(x=torch.randn(4, DIM)), ShapeMismatch, r"sum\(tokens\)"),
    "more tokens than a step": (dict(tokens=[60, 5], x=torch.randn(65, DIM)), PayloadTooLarge,
                                "max_batch_tokens"),
    "verify longer than max_spec_tokens": (dict(tokens=[5, 1], x=torch.randn(6, DIM), speculative=[True, False]),
                                           BadRequest, "max_spec_tokens"),
    "plain slice on a pending verify": (dict(sessions=["a", "v"]), BadRequest, "accept"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_mixed_batch_is_rejected_whole_before_queueing_and_changes_no_state(case):
    e = make_engine(**KNOBS)
    try:
        names = list("abcdefg") + ["v"]
        for s in names + ["gone"]:
            e.create_session(s)
            e.submit(s, LAYERS[0], torch.randn(3, DIM)).result(10)
        e.submit("v", LAYERS[1], torch.randn(2, DIM), speculative=True).result(10)
        with e._lock:                                  # as the TTL eviction does
            g = e._sessions.get("gone")
            e._sessions.remove(g, evicted=True)
            e.pool.free(g.slot)
        snap = _snapshot(e, names)
        kw, err, msg = BAD[case]
        args = dict(sessions=["a", "b"], x=torch.randn(3, DIM), tokens=[2, 1], speculative=None)
        args.update(kw)
        n0 = e.stats()["requests"]
        with pytest.raises(err, match=msg):
            e.submit_batch(args["sessions"], LAYERS[0], args["x"], tokens=args["tokens"],
                           speculative=args["speculative"])
        assert e.stats()["queue_depth"] == 0 and e.stats()["requests"] == n0
        _same(e, snap)
        y = e.submit_batch(["a", "b"], LAYERS[0], torch.randn(3, DIM), tokens=[2, 1]).result(10)
        assert y.shape == (3, DIM)                     # the sessions still work
    finally:
        e.stop(drain=False)


BAD_ACCEPT = {
    "unknown session": ((["v", "nope"], [1, 1]), UnknownSession, "nope"),
    "repeated session": ((["v", "v"], [1, 1]), BadRequest, "appears twice; an accept names each session once"),
    "no pending verify": ((["v", "a"], [1, 1]), BadRequest, "no speculative verify"),
    "more than the verify's tokens": ((["v", "w"], [1, 4]), BadRequest, "at most 3"),
    "tokens too short": ((["v", "w"], [1]), BadRequest, "one integer per session"),
    "tokens negative": ((["v", "w"], [1, -1]), BadRequest, r"tokens\[1\]"),
    "tokens not a list": ((["v", "w"], 1), BadRequest, "list of 2 integers"),
    "no sessions": (([], []), BadRequest, "got none"),
}


@pytest.mark.parametrize("case", list(BAD_ACCEPT))
def test_a_bad_accept_batch_commits_nothing(case):
    e = make_engine(**KNOBS)
    try:
        for s in ("a", "v", "w"):
            e.create_session(s)
            e.submit(s, LAYERS[0], torch.randn(3, DIM)).result(10)
        e.submit_batch(["v", "w"], LAYERS[1], torch.randn(5, DIM), tokens=[2, 3], speculative=True).result(10)
        snap = _snapshot(e, ["a", "v", "w"])
        (sids, ns), err, msg = BAD_ACCEPT[case]
        with pytest.raises(err, match=msg):
            e.accept_batch(sids, ns)
        _same(e, snap)
        e.accept_batch(["v", "w"], [2, 3])             # still pending: a good accept commits
        assert not e._sessions.get("v").pending and not e._sessions.get("w").pending
    finally:
        e.stop(drain=False)


def test_a_mixed_batch_runs_after_its_sessions_earlier_requests_and_ops_and_before_their_later_ones():
    """Queued behind a held step: singles, then a batch (prefill, decode, verify rows) holding their sessions,
    then an accept_batch of the verify (it commits what the batch's verify computed) and later singles and a
    second batch; each sees the one before it."""
    e = make_engine(**KNOBS)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = [e.create_session() for _ in range(4)]
        for s in sids:
            oracle.new(s)
        checks = []
        go, entered = gate_worker(e)
        x = torch.randn(2, DIM)
        checks.append((e.submit(sids[3], LAYERS[2], x), oracle.conv(sids[3], 2, x)))   # the held step
        assert entered.wait(10)
        for s, p, t in ((sids[0], 0, 3), (sids[1], 0, 1), (sids[2], 1, 2)):
            x = torch.randn(t, DIM)
            checks.append((e.submit(s, LAYERS[p], x), oracle.conv(s, p, x)))
        toks, spec = [4, 1, 3], [False, False, True]
        x = torch.randn(8, DIM)
        checks.append((e.submit_batch(sids[:3], LAYERS[0], x, tokens=toks, speculative=spec),
                       oracle.batch(sids[:3], 0, x, toks, spec)))
        done = threading.Event()
        t = threading.Thread(target=lambda: (e.accept_batch([sids[2]], [2]), done.set()))
        t.start()
        deadline = time.monotonic() + 5
        while not e._sessions.get(sids[2]).ops and time.monotonic() < deadline:
            time.sleep(0.001)
        oracle.accept(sids[2], 2)
        for s, p, t_ in ((sids[0], 0, 1), (sids[1], 1, 5)):
            x = torch.randn(t_, DIM)
            checks.append((e.submit(s, LAYERS[p], x), oracle.conv(s, p, x)))
        x = torch.randn(3, DIM)
        checks.append((e.submit_batch(sids[:2], LAYERS[0], x, tokens=[1, 2]),
                       oracle.batch(sids[:2], 0, x, [1, 2], [False, False])))
        go.set()
        for i, (f, want) in enumerate(checks):
            assert_close(f.result(10), want, what=f"request {i}")
        t.join(10)
        assert done.is_set()
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_a_cancelled_or_failed_batch_leaves_no_pending_verify():
    e = make_engine(max_queue_delay_us=5_000_000, **{k: v for k, v in KNOBS.items()})
    try:
        sids = [e.create_session() for _ in range(2)]
        go, entered = gate_worker(e)
        e.submit(sids[0], LAYERS[2], torch.randn(2, DIM))
        assert entered.wait(10)
        fut = e.submit_batch(sids, LAYERS[0], torch.randn(4, DIM), tokens=[3, 1], speculative=[True, False])
        assert e._sessions.get(sids[0]).pending
        assert fut.cancel()
        assert not e._sessions.get(sids[0]).pending
        go.set()
        y = e.submit_batch(sids, LAYERS[0], torch.randn(4, DIM), tokens=[3, 1]).result(10)   # plain rows now ok
        assert y.shape == (4, DIM)
    finally:
        e.stop(drain=False)


def test_a_step_serves_every_batch_and_single_of_a_layer_with_one_launch_per_kind():
    """Single prefills and verifies queued with a mixed batch on the same layer go into one prefill launch and
    one verify launch (rows of different lengths padded), the batch's decode rows into the decode launch."""
    e = make_engine(**dict(KNOBS, max_batch_size=12, max_queue_delay_us=5_000_000))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    launches = []
    real = e._runner.execute

    def spy(out):
        launches.append([(kind, b.layer) for kind, bs in (("p", out.prefills), ("d", out.decodes),
                                                          ("v", out.verifies)) for b in bs])
        return real(out)

    try:
        sids = [e.create_session() for _ in range(7)]
        for s in sids:
            oracle.new(s)
        go, entered = gate_worker(e)
        x = torch.randn(1, DIM)
        held = e.submit(sids[6], LAYERS[2], x)
        oracle.conv(sids[6], 2, x)
        assert entered.wait(10)
        e._runner.execute = spy
        checks = []
        for s, t, sp in ((sids[0], 5, False), (sids[1], 2, True)):
            x = torch.randn(t, DIM)
            checks.append((e.submit(s, LAYERS[0], x, speculative=sp),
                           oracle.verify(s, 0, x) if sp else oracle.conv(s, 0, x)))
        toks, spec = [1, 6, 4, 1], [False, False, True, False]
        x = torch.randn(12, DIM)
        checks.append((e.submit_batch(sids[2:6], LAYERS[0], x, tokens=toks, speculative=spec),
                       oracle.batch(sids[2:6], 0, x, toks, spec)))
        go.set()
        held.result(10)
        for f, want in checks:
            assert_close(f.result(10), want)
        assert sorted(launches[0]) == [("d", 0), ("p", 0), ("v", 0)], launches
    finally:
        e.stop(drain=False)
