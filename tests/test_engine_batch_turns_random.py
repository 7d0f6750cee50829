"""Randomized: accepts (single or batched, some failing at their turn or withdrawn) queued without waiting, then a
batch of random shape on random sessions sent right behind them (some withdrawn), with single requests on other
sessions from a second thread; the worker parked or not, operations run on callers or not. Outcomes, y, positions,
pending verifies and states equal a reference engine's run of the same calls one after another's answer."""

import collections
from concurrent.futures import Future
import random
import threading
import time

import pytest
import torch

from convserve.clients.protocol.errors import ServiceError
from tests.engine_support import DIM, LAYERS, make_engine
from tests.test_engine_ops_turn import hold

N = 6
STATS = collections.Counter()      # (over the module's runs: the deferred and refused-at-turn paths are taken)


def outcome(fut, t=20):
    try:
        return ("ok", fut.result(t))
    except ServiceError as e:
        return (type(e).__name__, str(e))
    except Exception as e:  # cancelled
        return (type(e).__name__, None)


def submitted(op, *args):
    """The op's future; a refusal at submit (its sessions' earlier ops already ran, so the check was made at once
    rather than at the op's turn) as a future that failed with it: both are the same outcome to a caller."""
    try:
        return op(*args)
    except ServiceError as err:
        fut = Future()
        fut.set_exception(err)
        return fut


def _run(seed, rounds, ops_on_callers, use_hold):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    e, ref = make_engine(slots=256), make_engine(slots=256)
    if ops_on_callers:
        e._ops_on_callers = True
    ids = [f"s{i}" for i in range(N)]
    try:
        for eng in (e, ref):
            for sid in ids:
                eng.create_session(sid)
        for sid in ids:
            for layer in LAYERS:
                x = torch.randn(2, DIM)
                for eng in (e, ref):
                    eng.submit(sid, layer, x).result(10)
        for rnd in range(rounds):
            vlayer = rng.choice(LAYERS)
            ver = rng.sample(ids, rng.randint(1, 3))
            ks = {}
            for sid in ver:
                k = rng.randint(1, 3)
                ks[sid] = k
                x = torch.randn(k, DIM)
                y1 = e.submit(sid, vlayer, x, speculative=True).result(10)
                y2 = ref.submit(sid, vlayer, x, speculative=True).result(10)
                assert torch.equal(y1, y2)
            go = hold(e) if use_hold and rng.random() < 0.5 else None
            pre_export = rng.random() < 0.3
            exp = [e.submit_op("export_state", sid) for sid in ver] if pre_export else []
            accs = []          # (kind, sids, tokens, future)
            if rng.random() < 0.5:
                toks = [rng.randint(0, ks[s] + (1 if pre_export and rng.random() < 0.3 else 0)) for s in ver]
                toks = [min(t, ks[s]) if not pre_export else t for t, s in zip(toks, ver)]
                accs.append(("batch", ver, toks, submitted(e.submit_op, "accept_batch", ver, toks)))
            else:
                for s in ver:
                    t = rng.randint(0, ks[s] + (1 if pre_export and rng.random() < 0.3 else 0))
                    if not pre_export:
                        t = min(t, ks[s])
                    accs.append(("one", [s], [t], submitted(e.submit_op, "accept", s, t)))
            for a in accs:
                if rng.random() < 0.25:
                    a[3].cancel()
            blayer = rng.choice(LAYERS)
            bs = rng.sample(ids, rng.randint(2, N))
            spec = None
            shape = rng.choice(["decode", "mixed", "verifyrow"])
            tokens = None
            if shape != "decode":
                tokens = [rng.randint(1, 3) for _ in bs]
                if shape == "verifyrow":
                    cand = [i for i, s in enumerate(bs) if s not in ver]
                    if cand:
                        spec = [False] * len(bs)
                        spec[rng.choice(cand)] = True
            bx = torch.randn(len(bs) if tokens is None else sum(tokens), DIM)
            kw = {}
            if tokens is not None:
                kw["tokens"] = tokens
            if spec is not None:
                kw["speculative"] = spec
            arrival = None
            try:
                bf = e.submit_batch(bs, blayer, bx, **kw)
            except ServiceError as err:
                bf, arrival = None, err
            bcancel = bf is not None and rng.random() < 0.15 and bf.cancel()
            # noise on sessions outside the batch, from another thread
            noise = [s for s in ids if s not in bs and s not in ver]
            nres = []

            def noisy():
                for s in noise:
                    x = torch.randn(1, DIM)
                    nres.append((s, x, outcome(e.submit(s, LAYERS[0], x))))
            th = threading.Thread(target=noisy)
            th.start()
            if go is not None:
                time.sleep(rng.random() * 0.01)
                go.set()
            th.join()
            for f in exp:
                f.result(20)
            aout = [outcome(a[3]) for a in accs]
            bout = None if bf is None else ("cancelled", None) if bcancel else outcome(bf)
            # the reference, sequentially
            for a, o in zip(accs, aout):
                if o[0] in ("CancelledError",):
                    continue
                try:
                    if a[0] == "batch":
                        ref.accept_batch(a[1], a[2])
                    else:
                        ref.accept(a[1][0], a[2][0])
                    r = "ok"
                except ServiceError as err:
                    r = type(err).__name__
                assert r == o[0], (seed, rnd, "accept", a[:3], o, r)
            STATS["deferred"] += bool(bf is not None and bf._req is not None and bf._req.deferred)
            STATS["refused at its turn"] += bool(bout and isinstance(bout[1], str) and "turn" in bout[1])
            if not bcancel:
                try:
                    yr = ("ok", ref.submit_batch(bs, blayer, bx, **kw).result(10))
                except ServiceError as err:
                    yr = (type(err).__name__, str(err))
                got = ("arrival-" + type(arrival).__name__, str(arrival)) if arrival is not None else bout
                if got[0] != yr[0] and not (got[0] == "arrival-BadRequest" and yr[0] == "BadRequest"):
                    raise AssertionError((seed, rnd, "batch", shape, bs, [o[0] for o in aout], got, yr[0], yr[1]))
                if got[0] == "ok":
                    assert torch.equal(got[1], yr[1]), (seed, rnd, "batch y")
            for s, x, o in nres:
                yr = ref.submit(s, LAYERS[0], x).result(10)
                assert o[0] == "ok" and torch.equal(o[1], yr), (seed, rnd, "noise")
            for sid in ids:
                a, b = e.session_info(sid), ref.session_info(sid)
                assert a["positions"] == b["positions"] and a["pending"] == b["pending"], (seed, rnd, sid, a, b)
                assert torch.equal(e.export_state(sid), ref.export_state(sid)), (seed, rnd, sid, "state")
                if a["pending"]["layers"]:
                    e.accept(sid, 0)
                    ref.accept(sid, 0)
    finally:
        e.stop(drain=False)
        ref.stop(drain=False)


@pytest.mark.parametrize("use_hold", [True, False])
@pytest.mark.parametrize("ops_on_callers", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_pipelined_accepts_and_batches_equal_a_sequential_reference(seed, ops_on_callers, use_hold):
    _run(seed, 10, ops_on_callers, use_hold)


def test_the_random_runs_take_the_deferred_and_refused_paths():
    for seed in range(3):
        _run(100 + seed, 10, False, True)
    assert STATS["deferred"] > 0 and STATS["refused at its turn"] > 0, STATS


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 30))
def test_pipelined_accepts_and_batches_equal_a_sequential_reference_long(seed):
    for oc in (False, True):
        for uh in (True, False):
            _run(seed, 30, oc, uh)
