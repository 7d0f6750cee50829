"""The frontend scenario's driver without a server (``clients/loadtest/frontend.py``): what one step admits
within the server's limits, and the order in which joining sessions become live."""

from __future__ import annotations


def _admitted(live, tokens=float("inf"), sessions=float("inf"), per_slice=float("inf"), body=float("inf"), row=0,
              arena=float("inf"), objects=float("inf"), decode_rows=float("inf")):
    import collections
    import types

    from convserve.clients.loadtest.frontend import FrontendDriver, _Live
    from convserve.clients.loadtest.limits import Limits

    lv = [_Live(sid, None, collections.deque(steps), 0.0) for sid, steps in live]
    fake = types.SimpleNamespace(live=lv, limits=Limits(tokens, sessions, per_slice, body, row, arena,
                                                        body_objects=objects, decode_rows=decode_rows))
    work = FrontendDriver._admit(fake)
    return [(v.sid, k, n) for v, k, n in work], {v.sid: list(v.steps) for v in lv}


def test_a_frontend_step_admits_decodes_and_verifies_first_then_prefills_cut_to_the_token_budget():
    live = [("p1", [("prefill", 30), ("decode", 1)]), ("d1", [("decode", 1)]), ("p2", [("prefill", 30)]),
            ("v1", [("verify", 5), ("decode", 1)]), ("p3", [("prefill", 9)])]
    work, left = _admitted(live, tokens=40)
    # the decode and the verify first (6 tokens), then p1's chunk whole (30), then 4 of p2's: p3 waits
    assert work == [("d1", "decode", 1), ("v1", "verify", 5), ("p1", "prefill", 30), ("p2", "prefill", 4)]
    assert left == {"p1": [("decode", 1)], "d1": [], "p2": [("prefill", 26)], "v1": [("decode", 1)],
                    "p3": [("prefill", 9)]}
    # no limits: every session's next piece, as it is
    work, _ = _admitted(live)
    assert sorted(work) == sorted([("p1", "prefill", 30), ("d1", "decode", 1), ("p2", "prefill", 30),
                                   ("v1", "verify", 5), ("p3", "prefill", 9)])
    # at most max_batch_size sessions; a slice at most max_tokens_per_request; a verify that does not fit waits
    work, _ = _admitted(live, sessions=2)
    assert work == [("d1", "decode", 1), ("v1", "verify", 5)]
    work, _ = _admitted(live, per_slice=8)
    assert [n for _, k, n in work if k == "prefill"] == [8, 8, 8]
    work, left = _admitted([("v", [("verify", 5)]), ("d", [("decode", 1)])], tokens=3)
    assert work == [("d", "decode", 1)] and left["v"] == [("verify", 5)]


def test_a_frontend_step_fits_its_x_in_one_block_of_the_shared_memory_arena():
    live = [("d1", [("decode", 1)]), ("v1", [("verify", 4)]), ("p1", [("prefill", 30)]), ("p2", [("prefill", 9)])]
    work, left = _admitted(live, arena=20)
    # x's rows (not the verifies' padded length) against the block: 1 + 4, then 15 of p1's 30; p2 waits
    assert work == [("d1", "decode", 1), ("v1", "verify", 4), ("p1", "prefill", 15)]
    assert left["p1"] == [("prefill", 15)] and left["p2"] == [("prefill", 9)]
    work, left = _admitted([("v", [("verify", 5)]), ("d", [("decode", 1)])], arena=4)
    assert work == [("d", "decode", 1)] and left["v"] == [("verify", 5)]


def test_a_frontend_step_fits_the_body_objects_and_the_largest_decode_bucket():
    from convserve.clients.protocol.wire import BATCH_FIXED_OBJECTS as BODY_FIXED_OBJECTS
    from convserve.clients.protocol.wire import BATCH_SESSION_OBJECTS as BODY_SESSION_OBJECTS

    live = [(f"d{i}", [("decode", 1)]) for i in range(5)] + [("v", [("verify", 3)]), ("p", [("prefill", 1)]),
                                                              ("q", [("prefill", 4)])]
    # objects for 4 sessions' fields
    work, _ = _admitted(live, objects=BODY_FIXED_OBJECTS + 4 * BODY_SESSION_OBJECTS + 2)
    assert [s for s, _, _ in work] == ["d0", "d1", "d2", "d3"]
    # 3 one-token plain rows: 3 decodes, the verify, not the one-token prefill, the 4-token one
    work, left = _admitted(live, decode_rows=3)
    assert work == [("d0", "decode", 1), ("d1", "decode", 1), ("d2", "decode", 1), ("v", "verify", 3),
                    ("q", "prefill", 4)]
    assert left["d3"] == [("decode", 1)] and left["p"] == [("prefill", 1)]


def test_sessions_a_frontend_step_left_waiting_go_first_at_the_next_one():
    import collections
    import types

    from convserve.clients.loadtest.frontend import FrontendDriver, _Live
    from convserve.clients.loadtest.limits import Limits

    # two one-token rows a step: five decoders (then a one-token prefill, then a decode) share them in turn
    lv = [_Live(f"d{i}", None, collections.deque([("decode", 1)] * 3), 0.0) for i in range(5)]
    lv.append(_Live("p", None, collections.deque([("prefill", 1), ("decode", 1)]), 0.0))
    fake = types.SimpleNamespace(live=lv, limits=Limits(decode_rows=2))
    steps = [[v.sid for v, _, _ in FrontendDriver._admit(fake)] for _ in range(9)]
    assert steps[:3] == [["d0", "d1"], ["d2", "d3"], ["d4", "p"]]
    waits = collections.Counter(s for step in steps for s in step)
    assert all(waits[f"d{i}"] == 3 for i in range(5)) and waits["p"] == 2


def test_a_frontend_step_counts_its_verifies_padded_to_the_longest_as_the_server_does():
    import numpy as np

    from convserve.service.engine.validate import check_padded_verify

    live = [("v1", [("verify", 1)]), ("v8", [("verify", 8)]), ("p", [("prefill", 100)])]
    work, _ = _admitted(live, tokens=16)
    # v1 padded to 8 beside v8: 16 tokens as the server counts them, no room left for the prefill
    assert work == [("v1", "verify", 1), ("v8", "verify", 8)]
    lengths = np.array([n for _, k, n in work if k == "verify"])
    assert check_padded_verify(lengths, sum(n for *_, n in work), 16)[2] == 16
    # a longer verify that would pad the admitted ones past the budget waits; a shorter one is padded to them
    work, left = _admitted(live, tokens=12)
    assert work == [("v1", "verify", 1), ("p", "prefill", 11)] and left["v8"] == [("verify", 8)]
    work, _ = _admitted([("v8", [("verify", 8)]), ("v1", [("verify", 1)]), ("v2", [("verify", 2)])], tokens=17)
    assert [sid for sid, *_ in work] == ["v8", "v1"]


def test_a_frontend_step_fits_its_batch_body_to_max_body_bytes():
    from convserve.clients.loadtest.limits import BODY_FIXED_BYTES, BODY_SESSION_BYTES

    live = [("p1", [("prefill", 30)]), ("d1", [("decode", 1)]), ("v1", [("verify", 5)]), ("p2", [("prefill", 9)])]
    # 10 bytes a token: room for three sessions' fields and 35 tokens; the decode and the verify take 6
    body = BODY_FIXED_BYTES + 3 * BODY_SESSION_BYTES + 35 * 10
    work, left = _admitted(live, body=body, row=10)
    assert work == [("d1", "decode", 1), ("v1", "verify", 5), ("p1", "prefill", 29)]
    assert left["p1"] == [("prefill", 1)] and left["p2"] == [("prefill", 9)]
    # x in shared memory (no rows in the body): only the sessions' fields count
    work, _ = _admitted(live, body=body, row=0)
    assert len(work) == len(live)


def test_sessions_that_join_together_are_live_in_arrival_order_whatever_order_their_creates_answer_in():
    import asyncio
    import itertools

    from convserve.clients.loadtest.frontend import FrontendDriver
    from convserve.clients.loadtest.runner import Aborted

    d = FrontendDriver.__new__(FrontendDriver)
    d.live, n = [], itertools.count()
    d.plan = lambda: [("decode", 1)]

    async def new_session(t0):
        i = next(n)
        await asyncio.sleep(0.05 * (3 - i))            # the first asked answers last
        if i == 1:
            raise Aborted("internal", 500)
        return f"s{i}", None

    d.new_session = new_session
    assert asyncio.run(d._join(4, arrived=[1.0, 2.0, 3.0, 4.0])) == 3
    assert [(v.sid, v.arrived) for v in d.live] == [("s0", 1.0), ("s2", 3.0), ("s3", 4.0)]
