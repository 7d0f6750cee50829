"""The batching scheduler, pure Python: packing, buckets, ordering, limits, priorities and the delay window."""

import itertools
import random

import pytest

from convserve.kernels import PAD_SLOT_ID
from convserve.service.scheduler import LONE_STEPS, DecodeBatch, PrefillBatch, VerifyBatch

from tests.sched_support import T0, Q, rows_of, sched_config


# ---- packing


@pytest.mark.parametrize("lengths", [[2], [5, 2, 2, 2], [3, 7, 2], [16] * 5])
def test_prefills_of_one_layer_pack_into_one_batch_with_cumulative_query_start_loc(lengths):
    q = Q()
    reqs = [q.add(slot=i + 1, t=t) for i, t in enumerate(lengths)]
    out = q.step()
    assert len(out.prefills) == 1 and not out.decodes
    pb = out.prefills[0]
    assert isinstance(pb, PrefillBatch)
    assert pb.requests == reqs
    assert pb.query_start_loc == list(itertools.accumulate([0] + lengths))
    assert pb.cache_indices == [i + 1 for i in range(len(lengths))]
    assert pb.has_initial_state == [False] * len(lengths)
    assert pb.starts == [0] * len(lengths) and pb.token_offset == 0
    assert out.num_tokens == out.packed_tokens == sum(lengths)
    assert out.finished == reqs


def test_has_initial_state_follows_the_session_layer_state_bits():
    q = Q()
    q.add(slot=1, layer=0, t=4, init=0b01)
    q.add(slot=2, layer=1, t=4, init=0b01)
    q.add(slot=3, layer=0, t=2, init=0)        # the first call on a layer starts from zeros
    out = q.step()
    by_layer = {pb.layer: pb for pb in out.prefills}
    assert by_layer[0].has_initial_state == [True, False]
    assert by_layer[1].has_initial_state == [False]
    # the step marks the layers as having state: the same requests again are continuations / decodes
    assert q.sessions[2].initialized == 0b11 and q.sessions[3].initialized == 0b01


def test_batches_of_several_layers_are_laid_out_one_after_the_other():
    q = Q()
    q.add(1, layer=2, t=3)
    q.add(2, layer=0, t=5)
    q.add(3, layer=2, t=2)
    q.add(4, layer=1, t=4, spec=True, init=0b10)
    q.add(5, layer=1, t=4, spec=True, init=0b10)
    q.add(6, layer=0, t=2, spec=True)
    out = q.step()
    assert [(pb.layer, pb.token_offset, pb.query_start_loc) for pb in out.prefills] == \
        [(0, 0, [0, 5]), (2, 5, [0, 3, 5])]
    assert [(vb.layer, vb.n_tokens, vb.cache_indices, vb.token_offset) for vb in out.verifies] == \
        [(0, 2, [6], 10), (1, 4, [4, 5], 12)]
    assert out.packed_tokens == 20
    assert all(isinstance(v, VerifyBatch) for v in out.verifies)


# ---- decode buckets


@pytest.mark.parametrize("buckets", [(1, 2, 4, 8), (3, 5, 16), (8,), (1, 2, 4, 8, 16, 32, 64, 128, 256)])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_decodes_pad_to_the_smallest_bucket_that_holds_them_with_pad_slots(buckets, n):
    q = Q(decode_buckets=buckets)
    reqs = [q.add(slot=10 + i, init=1) for i in range(n)]
    out = q.step()
    assert len(out.decodes) == 1 and not out.prefills
    db = out.decodes[0]
    assert isinstance(db, DecodeBatch)
    expected_bucket = min(b for b in buckets if b >= n)
    assert db.bucket == expected_bucket and len(db.cache_indices) == expected_bucket
    assert db.cache_indices[:n] == [r.session.slot for r in reqs]
    assert db.cache_indices[n:] == [PAD_SLOT_ID] * (expected_bucket - n)
    assert db.requests == reqs and out.num_padded_rows == expected_bucket - n


@pytest.mark.parametrize("n,max_bucket", [(9, 8), (20, 8), (5, 4)])
def test_decode_rows_of_one_layer_never_exceed_the_largest_bucket(n, max_bucket):
    q = Q(decode_buckets=(1, max_bucket))
    for i in range(n):
        q.add(slot=i + 1, init=1)
    sizes = []
    while q.s.depth:
        out = q.step()
        sizes.append(len(out.decodes[0].requests))
    assert max(sizes) == max_bucket and sum(sizes) == n


def test_decodes_of_different_layers_get_separate_batches():
    q = Q(decode_buckets=(1, 2, 4))
    for i in range(6):
        q.add(slot=i + 1, layer=i % 3, init=0b111)
    out = q.step()
    assert [(db.layer, db.cache_indices) for db in out.decodes] == [(0, [1, 4]), (1, [2, 5]), (2, [3, 6])]


# ---- ordering


@pytest.mark.parametrize("seed", range(6))
def test_a_session_runs_in_arrival_order_and_never_twice_on_one_layer_in_a_step(seed):
    rng = random.Random(seed)
    max_tokens = rng.choice([8, 16, 64])
    q = Q(max_batch_tokens=max_tokens, max_batch_size=rng.choice([2, 4, 32]), decode_buckets=(1, 2, 4))
    submitted = {}
    for _ in range(60):
        slot = rng.randint(1, 5)
        layer = rng.randint(0, 2)
        t = rng.choice([1, 1, 1, 2, 5, 13, 40])
        spec = rng.random() < 0.15
        r = q.add(slot, layer=layer, t=min(t, max_tokens) if spec else t, spec=spec)
        submitted.setdefault(slot, []).append(r)
    completed = {}
    for _ in range(500):
        if not q.s.depth:
            break
        out = q.step()
        seen = set()
        for kind, layer, slot, _a, _b in rows_of(out):
            assert (slot, layer) not in seen, "two rows of one session and layer in one step"
            seen.add((slot, layer))
        for r in out.finished:
            completed.setdefault(r.session.slot, []).append(r)
        # a finished request's session has no unfinished earlier request
        for slot, done in completed.items():
            assert done == submitted[slot][:len(done)]
    assert q.s.depth == 0 and completed == submitted


def test_a_later_request_waits_for_an_earlier_same_layer_request_of_its_session():
    q = Q()
    a = q.add(1, layer=0, t=3)
    b = q.add(1, layer=0, t=1)
    c = q.add(1, layer=1, t=2)   # after b in arrival order: waits too
    d = q.add(2, layer=0, t=2)
    out = q.step()
    assert out.finished == [a, d]
    out = q.step()
    assert out.finished == [b]                 # a decode after a prefill step: a step of its own
    out = q.step()
    assert out.finished == [c]


def test_finished_requests_are_listed_in_arrival_order_across_kinds():
    q = Q()
    r1 = q.add(1, t=7)
    r2 = q.add(2, t=1, init=1)
    r3 = q.add(3, t=3, spec=True)
    r4 = q.add(4, t=1, init=1)
    out = q.step()
    assert out.finished == [r1, r2, r3, r4]


# ---- limits and priorities


@pytest.mark.parametrize("max_rows", [1, 3, 7])
def test_max_batch_size_bounds_the_rows_of_a_step(max_rows):
    q = Q(max_batch_size=max_rows)
    for i in range(10):
        q.add(i + 1, t=2)
    counts = []
    while q.s.depth:
        counts.append(q.step().num_rows)
    assert max(counts) == max_rows and sum(counts) == 10


@pytest.mark.parametrize("max_tokens", [1, 4, 10, 64])
@pytest.mark.parametrize("t", [2, 3, 17, 100])
def test_a_prefill_longer_than_the_budget_runs_in_chunks_that_continue_from_state(max_tokens, t):
    q = Q(max_batch_tokens=max_tokens)
    r = q.add(1, t=t)
    chunks = []
    while q.s.depth:
        out = q.step()
        assert out.num_tokens <= max_tokens
        pb = out.prefills[0]
        n = pb.query_start_loc[1]
        chunks.append((pb.starts[0], n, pb.has_initial_state[0], r in out.finished))
    assert [c[0] for c in chunks] == list(range(0, t, max_tokens))
    assert sum(c[1] for c in chunks) == t
    assert [c[2] for c in chunks] == [False] + [True] * (len(chunks) - 1)
    assert [c[3] for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_decodes_and_verifies_go_before_an_earlier_prefill_and_the_prefill_takes_what_is_left():
    q = Q(max_batch_tokens=16)
    p = q.add(1, t=100)
    ds = [q.add(2 + i, init=1) for i in range(4)]
    v = q.add(9, t=3, spec=True)
    out = q.step()
    assert [r for db in out.decodes for r in db.requests] == ds
    assert out.verifies[0].requests == [v]
    assert out.prefills[0].requests == [p] and out.prefills[0].query_start_loc == [0, 16 - 4 - 3]
    assert out.num_tokens == 16 and out.finished == ds + [v]


@pytest.mark.parametrize("older,newer", [(0, 300), (3, 300), (5, 8), (7, 300)])
def test_newer_decodes_cannot_take_the_rows_of_an_older_prefill(older, newer):
    """A full row budget of decodes that arrived after a prefill leaves it a row; decodes that arrived before it
    still go first."""
    q = Q(max_batch_size=8, decode_buckets=(1, 2, 4, 8), max_batch_tokens=1000)
    old = [q.add(100 + i, layer=i % 2, init=0b11) for i in range(older)]
    p = q.add(1, t=50)
    new = [q.add(200 + i, layer=i % 2, init=0b11) for i in range(newer)]
    out = q.step()
    took = {id(r) for db in out.decodes for r in db.requests}
    assert all(id(r) in took for r in old)
    assert [r for pb in out.prefills for r in pb.requests] == [p]
    assert out.num_rows == min(8, older + 1 + newer)
    assert sum(id(r) in took for r in new) == out.num_rows - older - 1


def test_older_decodes_that_fill_the_step_still_go_before_a_prefill():
    q = Q(max_batch_size=4, decode_buckets=(1, 2, 4), max_batch_tokens=1000)
    old = [q.add(100 + i, init=0b1) for i in range(4)]
    p = q.add(1, t=50)
    out = q.step()
    assert [r for db in out.decodes for r in db.requests] == old and not out.prefills
    assert p in q.step().finished


def test_a_decode_after_its_own_sessions_prefill_does_not_jump_it():
    q = Q(max_batch_tokens=8)
    p = q.add(1, layer=0, t=20)
    d = q.add(1, layer=1, t=1, init=0b10)
    out = q.step()
    assert rows_of(out) == [("prefill", 0, 1, 0, 8)] and out.finished == []
    q.step()
    out = q.step()
    assert out.finished == [p, d]


def test_a_small_request_that_does_not_fit_blocks_its_session_for_the_step():
    q = Q(max_batch_tokens=4)
    a = q.add(1, layer=0, t=3, spec=True)
    b = q.add(2, layer=0, t=3, spec=True)
    c = q.add(2, layer=1, t=1, init=0b10)   # would fit, but b of the same session did not
    out = q.step()
    assert out.finished == [a]
    out = q.step()
    assert out.finished == [b, c]


# ---- delay window and time


@pytest.mark.parametrize("delay_us", [0, 50, 1000])
def test_the_queue_runs_once_the_oldest_request_has_waited_the_delay(delay_us):
    q = Q(max_queue_delay_us=delay_us)
    assert not q.s.ready(T0) and q.s.next_deadline() is None
    q.add(1, at=T0)
    q.add(2, at=T0 + 1e-5)
    assert q.s.next_deadline() == pytest.approx(T0 + delay_us * 1e-6)
    if delay_us:
        assert not q.s.ready(T0 + delay_us * 1e-6 / 2)
    assert q.s.ready(T0 + delay_us * 1e-6)


def test_a_lone_caller_runs_without_the_delay_once_the_window_keeps_bringing_nothing():
    q = Q(max_queue_delay_us=10_000_000)
    for i in range(LONE_STEPS):                  # a fresh scheduler waits the window
        q.add(1, at=T0)
        assert not q.s.ready(T0)
        assert len(q.step().finished) == 1
    q.add(1, at=T0)                              # LONE_STEPS one-row steps in a row: a lone request runs at once
    assert q.s.ready(T0)
    q.add(2, at=T0)                              # not alone: the window again
    assert not q.s.ready(T0)
    assert len(q.step().finished) == 2           # a step of two rows: the window again, even for a lone request
    q.add(1, at=T0)
    assert not q.s.ready(T0)
    assert q.s.ready(T0 + 10)


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_a_steady_loop_runs_once_the_queue_holds_its_usual_rows_without_the_window(rows):
    """A session sending its layers' decodes together (or a few steady callers): after LONE_STEPS steps of R
    rows, a queue of exactly R rows runs at once; fewer or more wait the window, and a step of another size
    brings the window back."""
    q = Q(max_queue_delay_us=10_000_000)

    def queue(n):
        for layer in range(n):
            q.add(1, layer=layer, at=T0)

    for _ in range(LONE_STEPS):                  # a fresh scheduler waits the window, however steady
        queue(rows)
        assert not q.s.ready(T0)
        assert len(q.step().finished) == rows
    queue(rows - 1)
    assert not q.s.ready(T0)                     # not all of the usual rows yet
    q.add(1, layer=rows - 1, at=T0)
    assert q.s.ready(T0)                         # all of them: no window
    q.add(2, at=T0)
    assert not q.s.ready(T0)                     # more than usual: someone else came, the window gathers them
    assert len(q.step().finished) == rows + 1    # a step of another size: the window again
    queue(rows + 1)
    assert not q.s.ready(T0)
    assert q.s.ready(T0 + 10)


@pytest.mark.parametrize("fill", ["rows", "tokens"])
def test_a_queue_that_fills_a_step_runs_without_waiting(fill):
    q = Q(max_queue_delay_us=10_000_000, max_batch_size=4, max_batch_tokens=64)
    if fill == "rows":
        for i in range(3):
            q.add(i + 1)
        assert not q.s.ready(T0)
        q.add(9)
    else:
        q.add(1, t=63)
        assert not q.s.ready(T0)
        q.add(2, t=1)
    assert q.s.ready(T0)


def test_a_chunked_prefill_under_way_continues_without_the_delay():
    q = Q(max_queue_delay_us=10_000_000, max_batch_tokens=4)
    q.add(1, t=3)
    q.add(2, t=10)                           # 13 queued tokens >= 4: ready at once
    assert q.s.ready(T0)
    q.step(T0)
    q.step(T0)
    assert q.s.depth == 1 and q.s.ready(T0)  # the rest of slot 2's prefill


@pytest.mark.parametrize("timeout", [0.5, 2.0])
def test_requests_that_never_started_within_the_timeout_expire(timeout):
    q = Q(request_timeout_s=timeout, max_batch_tokens=4)
    old = q.add(1, at=T0)
    running = q.add(2, t=8, at=T0 + 0.1)     # started in the first step: never expires
    q.step(T0 + 0.1 - 1e-3)                  # takes `old` (1 token) and 3 tokens of `running`
    late = q.add(3, at=T0 + 0.2)
    out = q.step(T0 + 0.2 + timeout + 1e-3)
    assert out.expired == [late]
    assert rows_of(out) == [("prefill", 0, 2, 3, 7)]
    assert q.s.depth == 1 and old.started and running.started


# ---- cancel and session barriers


def test_a_cancelled_request_never_runs_and_later_ones_of_its_session_do():
    q = Q()
    a = q.add(1, t=3)
    b = q.add(1, t=1)
    assert q.s.cancel(a) and not q.s.cancel(a)
    assert q.s.depth == 1 and q.s.queued_tokens == 1
    out = q.step()
    assert out.finished == [b]
    assert not q.s.cancel(b)


def test_a_started_request_cannot_be_cancelled():
    q = Q(max_batch_tokens=2)
    r = q.add(1, t=5)
    q.step()
    assert not q.s.cancel(r)
    assert q.s.depth == 1


def test_drain_withdraws_everything_not_started():
    q = Q(max_batch_tokens=2)
    r = q.add(1, t=5)
    q.step()
    others = [q.add(2), q.add(3, t=3)]
    assert q.s.drain() == others
    assert q.s.depth == 1


def test_a_session_barrier_holds_back_its_later_requests_only():
    q = Q()
    a = q.add(1)
    b = q.add(1, layer=1)
    c = q.add(2)
    q.sessions[1].barrier = a.seq
    out = q.step()
    assert out.finished == [a, c]
    out = q.step()
    assert out.empty
    q.sessions[1].barrier = None
    assert q.step().finished == [b]


def test_a_verify_that_can_never_fit_a_step_is_refused_at_once():
    q = Q(max_batch_tokens=8)
    with pytest.raises(ValueError, match="max_batch_tokens=8"):
        q.add(1, t=9, spec=True)
    assert q.s.depth == 0


@pytest.mark.parametrize("kw", [dict(max_batch_tokens=0), dict(max_batch_size=0), dict(decode_buckets=()),
                                dict(decode_buckets=(0, 4)), dict(max_queue_delay_us=-1),
                                dict(request_timeout_s=0)])
def test_bad_scheduler_config_is_rejected(kw):
    with pytest.raises(ValueError):
        sched_config(**kw)


# ---- batch requests (one decode token for each of several sessions, one request)


class _Op:
    def __init__(self, done, cancelled=False):
        self.future = type("F", (), {"done": lambda _self: done})()
        self.cancelled = cancelled


@pytest.mark.parametrize("rows,buckets", [(1, (1, 4)), (3, (1, 4)), (4, (1, 4)), (5, (2, 8))])
def test_a_batch_request_is_one_decode_launch_padded_to_its_bucket(rows, buckets):
    q = Q(decode_buckets=buckets, max_batch_size=16)
    b = q.add_batch(range(1, rows + 1), layer=2)
    out = q.step()
    assert len(out.decodes) == 1 and not out.prefills and not out.verifies
    db = out.decodes[0]
    assert isinstance(db, DecodeBatch)
    assert db.requests == [b] and db.cache_indices is None and db.rows == rows and db.layer == 2
    assert db.bucket == min(x for x in buckets if x >= rows)
    assert out.num_rows == out.num_tokens == rows and out.num_padded_rows == db.bucket - rows
    assert out.finished == [b] and b.started and q.s.depth == 0


def test_a_queued_batch_request_runs_without_the_delay_window():
    q = Q(max_queue_delay_us=10_000_000)
    q.add(slot=9, layer=1)                       # another layer: the batch has layer 0's decode launch alone
    assert not q.s.ready(T0 + 1)
    q.add_batch([1, 2])
    assert q.s.ready(T0 + 1)
    out = q.step()
    assert out.num_rows == 3
    assert not q.s.ready(T0 + 1)


def test_a_batch_request_counts_its_rows_against_max_batch_size():
    q = Q(max_batch_size=4, decode_buckets=(1, 2, 4), max_queue_delay_us=10_000_000)
    q.add(slot=7)
    q.add(slot=8, layer=1)
    b = q.add_batch([1, 2, 3], layer=2)          # 2 + 3 rows > 4: the batch waits for the next step
    out = q.step()
    assert out.num_rows == 2 and b not in out.finished
    out = q.step()
    assert out.finished == [b] and out.num_rows == 3


def test_a_batch_request_has_its_layer_launch_to_itself():
    """One decode launch per layer per step (the launch's buffers are the layer's): single decodes of the same
    layer after a batch wait a step; those of other layers join it."""
    q = Q(max_batch_size=16, decode_buckets=(1, 2, 4, 8))
    b = q.add_batch([1, 2], layer=0)
    same = q.add(slot=5, layer=0, init=0b11)
    other = q.add(slot=6, layer=1, init=0b11)
    out = q.step()
    assert set(out.finished) == {b, other}
    assert q.step().finished == [same]
    first = q.add(slot=7, layer=0, init=0b11)    # and behind single decodes of its layer it waits likewise
    b2 = q.add_batch([3, 4], layer=0)
    assert q.step().finished == [first]
    assert q.step().finished == [b2]


def test_a_batch_request_waits_for_its_sessions_earlier_requests_and_ops():
    q = Q(max_batch_size=16, decode_buckets=(1, 2, 4, 8), max_batch_tokens=64, max_queue_delay_us=10_000_000)
    pre = q.add(slot=1, t=5)
    b = q.add_batch([1, 2], layer=0, waits=[pre])
    out = q.step()
    assert out.finished == [pre]                 # not in the same step: the batch waits until pre is done
    assert q.step().finished == []
    pre.done = True
    assert q.step().finished == [b]
    b2 = q.add_batch([3], wait_ops=[_Op(False)])
    assert q.s.ready(T0 + 1)                     # a new batch runs a step at once...
    assert q.step().finished == []
    assert not q.s.ready(T0 + 0.5)               # ...but a blocked one does not keep the queue ready
    b2.batch.wait_ops = [_Op(True)]
    assert q.step().finished == [b2]
    b3 = q.add_batch([4], wait_ops=[_Op(False, cancelled=True)])   # an op withdrawn (timed out) waits for nothing
    assert q.step().finished == [b3]


def test_a_batch_whose_checks_wait_for_their_turn_is_not_taken_before_they_passed_even_behind_withdrawn_ops():
    """An op withdrawn (its caller timed out) counts as done for the batches behind it at once, before the engine
    made their checks at their turn (``turns``): the scheduler holds such a batch until the engine has."""
    q = Q(max_batch_size=16, decode_buckets=(1, 2, 4, 8))
    b = q.add_batch([1, 2], wait_ops=[_Op(False, cancelled=True)])
    b.batch.turns = 2
    assert q.step().finished == []
    b.batch.turns = 1
    assert q.step().finished == []
    b.batch.turns = 0
    assert q.step().finished == [b]


def test_requests_after_a_batch_request_wait_until_it_is_done_others_do_not():
    q = Q(max_batch_size=16, decode_buckets=(1, 2, 4, 8))
    b = q.add_batch([1, 2], layer=0)
    later = q.add_after(1, layer=1, t=3)         # its session is in the batch: next step, after it
    free = q.add_after(3, layer=1, t=3)          # not in the batch: runs now
    out = q.step()
    assert set(out.finished) == {b, free}
    assert q.step().finished == []               # the batch is not done until the engine delivered it
    b.done = True
    assert q.step().finished == [later]


def test_a_cancelled_or_expired_batch_request_leaves_the_counts_and_never_runs():
    q = Q(request_timeout_s=1.0, max_queue_delay_us=10_000_000)
    b = q.add_batch([1, 2, 3])
    assert q.s.cancel(b) and q.s.depth == 0 and not q.s.ready(T0 + 1)
    assert q.step().finished == []
    old = q.add_batch([4, 5], at=T0 - 10)
    out = q.step()
    assert out.expired == [old] and out.finished == [] and q.s.depth == 0 and not q.s.ready(T0 + 1)
    assert q.s._rows == 0 and q.s.queued_tokens == 0
