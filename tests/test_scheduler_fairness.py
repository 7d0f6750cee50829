"""The scheduler under a flood of long prefills: the per-step prefill budget, decodes that never wait behind a
prefill, prefills that take turns and never starve, and a first one-token request that is a decode."""

import functools

import pytest

from convserve.service.engine import EngineConfig
from tests.sched_support import T0, Q, rows_of


@functools.lru_cache(maxsize=None)     # the grid's tests only read the run: one run per grid point
def _simulate(n_prefill, prefill_len, budget, n_decoders, layers, max_rows=256):
    """Closed-loop clients against the scheduler, one step a millisecond (no request expires): each prefill
    session has requests of ``prefill_len`` tokens on layers 0, 1, ... queued (two at a time); each decoder
    session submits a one-token decode on its next layer as soon as its previous one finished. Runs long enough
    for every prefill session to finish a request when prefills get only every other step. Returns what each
    step took."""
    steps = 2 * -(-n_prefill * prefill_len // budget) + 50
    q = Q(max_prefill_tokens_per_step=budget, max_batch_tokens=8192, max_batch_size=max_rows)
    pre = {s: [] for s in range(1, n_prefill + 1)}
    nxt = dict.fromkeys(pre, 0)
    dec = {}
    record = []
    for i in range(n_decoders):
        slot = 100 + i
        dec[slot] = q.add(slot, layer=0, t=1)
    for step in range(steps):
        for s, lst in pre.items():
            while sum(1 for r in lst if not r.done) < 2:
                lst.append(q.add(s, layer=nxt[s] % layers, t=prefill_len, at=T0 + step * 1e-3))
                nxt[s] += 1
        queued_decodes = [r for r in dec.values() if not r.done]
        out = q.step(T0 + step * 1e-3)
        assert not out.expired
        for r in out.finished:
            r.done = True
        record.append((out, queued_decodes))
        for slot, r in dec.items():
            if r.done:
                dec[slot] = q.add(slot, layer=(r.layer + 1) % layers, t=1, at=T0 + step * 1e-3)
    return q, pre, record


GRID = [  # n_prefill, prefill_len, budget, n_decoders, layers
    (1, 37, 16, 1, 1), (3, 1000, 100, 5, 4), (8, 8192, 256, 1, 4), (8, 300, 64, 20, 2), (2, 5, 128, 3, 3),
    (16, 512, 48, 8, 4),
]


@pytest.mark.parametrize("n_prefill,prefill_len,budget,n_decoders,layers", GRID)
def test_a_flood_of_prefills_never_delays_a_decode_past_the_next_step(n_prefill, prefill_len, budget, n_decoders,
                                                                      layers):
    _q, _pre, record = _simulate(n_prefill, prefill_len, budget, n_decoders, layers)
    for out, queued in record:
        taken = {r for db in out.decodes for r in db.requests}
        assert all(r in taken for r in queued), f"step {out.step}: a queued decode was left for a later step"


def _prefill_tokens(out) -> int:
    return sum(pb.query_start_loc[-1] for pb in out.prefills)


@pytest.mark.parametrize("n_prefill,prefill_len,budget,n_decoders,layers", GRID)
def test_prefill_tokens_of_a_step_stay_within_the_budget_and_prefills_run_every_other_step_at_least(
        n_prefill, prefill_len, budget, n_decoders, layers):
    _q, _pre, record = _simulate(n_prefill, prefill_len, budget, n_decoders, layers)
    took = [_prefill_tokens(out) for out, _queued in record]
    assert all(t <= budget for t in took), max(took)
    assert all(a or b for a, b in zip(took, took[1:])), "two steps in a row without prefill while prefills wait"


@pytest.mark.parametrize("n_prefill,prefill_len,budget,n_decoders,layers", GRID)
def test_decodes_queued_during_a_prefill_step_run_in_a_step_without_prefill(n_prefill, prefill_len, budget,
                                                                            n_decoders, layers):
    _q, _pre, record = _simulate(n_prefill, prefill_len, budget, n_decoders, layers)
    for (prev, _), (out, queued) in zip(record, record[1:]):
        if queued and prev.prefills:
            assert not out.prefills, out.step


@pytest.mark.parametrize("n_prefill,prefill_len,budget,n_decoders,layers", GRID)
def test_prefilling_sessions_take_turns_and_none_starves(n_prefill, prefill_len, budget, n_decoders, layers):
    _q, pre, record = _simulate(n_prefill, prefill_len, budget, n_decoders, layers)
    served = {s: [] for s in pre}
    for out, _queued in record:
        for pb in out.prefills:
            for r in pb.requests:
                served[r.session.slot].append(out.step)
    for s, steps in served.items():
        gaps = [b - a for a, b in zip([-1] + steps, steps + [len(record)])]
        # round robin: a session waits for at most each other session's turn once, and prefills run in every
        # other step at least
        assert max(gaps) <= 2 * n_prefill, (s, max(gaps))
    assert all(any(r.done for r in lst) for lst in pre.values())


@pytest.mark.parametrize("n_prefill,prefill_len,budget,n_decoders,layers", GRID)
def test_a_sessions_requests_and_chunks_run_in_order(n_prefill, prefill_len, budget, n_decoders, layers):
    _q, pre, record = _simulate(n_prefill, prefill_len, budget, n_decoders, layers)
    done = {s: [] for s in pre}
    pos = {}                                          # request -> next token its chunks must start at
    touched = set()                                   # (session, layer) that ran a chunk: they have state
    for out, _queued in record:
        for pb in out.prefills:
            for i, r in enumerate(pb.requests):
                assert pb.starts[i] == pos.get(r, 0), "a chunk does not continue where the last one ended"
                assert pb.has_initial_state[i] == ((r.session.slot, r.layer) in touched)
                touched.add((r.session.slot, r.layer))
                pos[r] = pb.starts[i] + pb.query_start_loc[i + 1] - pb.query_start_loc[i]
        for r in out.finished:
            if r.session.slot in done:
                done[r.session.slot].append(r.seq)
    for s, seqs in done.items():
        assert seqs == sorted(seqs) and seqs == [r.seq for r in pre[s][:len(seqs)]]


def test_a_new_sessions_short_prefill_goes_before_long_ones_already_under_way():
    q = Q(max_prefill_tokens_per_step=64)
    longs = [q.add(s, t=4096) for s in (1, 2, 3)]
    for _ in range(5):
        q.step()
    short = q.add(9, t=40)
    out = q.step()
    assert out.prefills[0].requests[0] is short and short in out.finished
    assert out.prefills[0].requests[1] in longs           # the rest of the budget goes on to the turn's next


def test_a_first_one_token_request_on_a_layer_is_a_decode_and_gives_the_layer_state():
    q = Q()
    first = q.add(1, layer=2, t=1, init=0)
    out = q.step()
    assert rows_of(out) == [("decode", 2, 1, 0, 1)] and out.finished == [first]
    assert q.sessions[1].initialized == 0b100
    q.add(1, layer=2, t=5)                                # continues from the state the decode wrote
    out = q.step()
    assert out.prefills[0].has_initial_state == [True]


def test_a_first_one_token_request_waits_for_its_sessions_earlier_prefill():
    q = Q(max_prefill_tokens_per_step=16)
    p = q.add(1, layer=0, t=40)
    d = q.add(1, layer=1, t=1)
    out = q.step()
    assert [r for db in out.decodes for r in db.requests] == [] and p.scheduled_tokens == 16
    while d not in out.finished:
        out = q.step()
    assert p in out.finished or p.scheduled_tokens == p.n_tokens


@pytest.mark.parametrize("budget", [4, 16, 100])
def test_a_queue_holding_the_prefill_budget_runs_without_the_delay_window(budget):
    q = Q(max_queue_delay_us=10_000_000, max_prefill_tokens_per_step=budget)
    q.add(1, t=budget - 2)
    assert not q.s.ready(T0)
    q.add(2, t=2)
    assert q.s.ready(T0)


@pytest.mark.parametrize("value,device,dim,expected", [
    ("auto", "cpu", 1024, 256), ("auto", "cpu", 4096, 64), ("auto", "cpu", 1 << 20, 16), ("auto", "cuda", 1024, 4096),
    ("auto", "cuda", 256, 8192), ("auto", None, 1024, 8192), (100, "cpu", 1024, 100), (10_000, "cuda", 64, 8192)])
def test_the_prefill_budget_resolves_by_device_and_dim_within_max_batch_tokens(value, device, dim, expected):
    cfg = EngineConfig(max_prefill_tokens_per_step=value)
    assert cfg.prefill_budget(device, dim) == expected
    assert cfg.scheduler_config(device, dim).max_prefill_tokens_per_step == expected


@pytest.mark.parametrize("value", [0, -5, "some", 2.5, True])
def test_a_bad_prefill_budget_is_rejected(value):
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step"):
        EngineConfig(max_prefill_tokens_per_step=value)
