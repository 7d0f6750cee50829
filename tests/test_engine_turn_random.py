"""One session's random run of convs (some with a position, some wrong), verifies, accepts, imports, exports and
infos, sent without waiting (queued behind a held worker, so every conv after the first operation is checked at
its turn) answers exactly as the same calls made one at a time, each waiting for its answer: the same results and
errors, and the same positions, pending verifies and state after."""

import random

import pytest
import torch

from tests.engine_support import DIM, LAYERS, make_engine
from tests.test_engine_ops_turn import hold, prefilled


def plan(seed: int, e) -> list:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(len(LAYERS), DIM, e.model_cpu.width - 1, generator=g)
    steps = []
    for _ in range(24):
        kind = rng.choice(["conv", "conv", "conv", "verify", "verify", "accept", "import", "export", "info"])
        p, n = rng.randrange(2), rng.choice([1, 1, 2, 3])
        # a position as an offset from the true one (found by the one-at-a-time run); None: none
        off = rng.choice([None, 0, 0, 0, 1, -1])
        steps.append((kind, p, n, off, rng.randrange(4), torch.randn(n, DIM, generator=g)))
    return steps, state


def run(steps, state, positions=None):
    """The steps on a fresh engine: one at a time, each waiting for its answer, noting the conv positions sent
    (``positions`` None: the layer's true position plus the step's offset), or all sent at once behind a held
    worker with those ``positions``. Returns (answers, (positions, pending) after, state after, positions)."""
    pipelined = positions is not None
    sent = positions if pipelined else []
    e = make_engine()
    try:
        torch.manual_seed(0)
        a = prefilled(e)
        go = hold(e) if pipelined else None
        futs = []
        for i, (kind, p, n, off, k, x) in enumerate(steps):
            if not pipelined:
                sent.append(None if off is None or kind not in ("conv", "verify")
                            else max(0, e.session_info(a)["positions"][p] + off))
            try:
                if kind in ("conv", "verify"):
                    f = e.submit(a, LAYERS[p], x, speculative=kind == "verify", position=sent[i])
                elif kind == "accept":
                    f = e.submit_op("accept", a, k)
                elif kind == "import":
                    f = e.submit_op("import_state", a, state)
                else:
                    f = e.submit_op("export_state" if kind == "export" else "session_info", a)
            except Exception as err:  # noqa: BLE001 - refused at submit
                f = err
            if not pipelined and not isinstance(f, Exception):
                try:
                    f.result(10)
                except Exception:  # noqa: BLE001 - read below
                    pass
            futs.append(f)
        if go is not None:
            go.set()
        out = []
        for f in futs:
            try:
                if isinstance(f, Exception):
                    raise f
                r = f.result(10)
            except Exception as err:  # noqa: BLE001
                out.append(type(err).__name__)
                continue
            out.append((r["positions"], r["pending"]) if isinstance(r, dict) else r)
        info = e.session_info(a)
        return out, (info["positions"], info["pending"]), e.export_state(a), sent
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("seed", range(16))
def test_calls_sent_without_waiting_answer_as_calls_made_one_at_a_time(seed):
    e = make_engine()
    try:
        steps, state = plan(seed, e)
    finally:
        e.stop(drain=False)
    ref, ref_end, ref_state, sent = run(steps, state)
    got, got_end, got_state, _ = run(steps, state, sent)
    for i, (r, g) in enumerate(zip(ref, got)):
        if isinstance(r, torch.Tensor):
            assert isinstance(g, torch.Tensor) and torch.allclose(r, g, atol=1e-5), (i, steps[i][0], g)
        else:
            assert r == g, (i, steps[i][:5], r, g)
    assert got_end == ref_end
    assert torch.allclose(got_state, ref_state, atol=1e-5)
