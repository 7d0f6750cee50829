"""A batch with no verify rows runs every row as a prefill row: its one-token rows are length-1 sequences of the
layer's one varlen prefill launch (from the session's state, or from zeros on a layer without one), so the
step is one prefill launch and no decode launch, and y and the states equal each slice run on its own."""

import pytest
import torch

from convserve.service.model import ConvModel
from tests.engine_support import LAYERS, Oracle, make_engine
from tests.tolerance import assert_close

KNOBS = dict(slots=16, max_batch_tokens=96, max_batch_size=8, decode_buckets=(1, 2, 4, 8), max_spec_tokens=4)

ROWS = {   # tokens per session, no verify rows
    "decodes around a prefill": [1, 7, 1, 1, 3],
    "one-token rows and one 2-token row": [1, 1, 1, 2, 1, 1],
    "a 2-token row first": [2, 1, 1],
    "one prefill, one decode": [9, 1],
}


class Launches:
    """Counts a runner's prefill launches (the layer's, a prefill slot's) and its decode launches (a layer's, a
    batch slot's)."""

    def __init__(self, runner):
        self.prefill = self.decode = 0
        dec, ps = runner.decode, runner.prefill_slots

        def count(f, kind):
            def wrapped(*a, **kw):
                setattr(self, kind, getattr(self, kind) + 1)
                return f(*a, **kw)
            return wrapped

        runner.prefill_fn = count(runner.prefill_fn, "prefill")
        if ps is not None:
            ps.run = count(ps.run, "prefill")
        dec.run, dec.run_slot = count(dec.run, "decode"), count(dec.run_slot, "decode")


def _engine(dim, width, bias, prefill_slots=True):
    model = ConvModel.random(LAYERS, dim=dim, width=width, dtype=torch.float32, seed=dim + width, bias=bias)
    return make_engine(model, **KNOBS, prefill_slots=prefill_slots)


# the token ring's launch (prefill_slots off) at one shape, a prefill slot's at every one
@pytest.mark.parametrize("dim,width,bias,prefill_slots", [(7, 4, True, True), (7, 4, True, False),
                                                          (33, 3, False, True), (16, 2, True, True)])
@pytest.mark.parametrize("case", list(ROWS))
def test_a_batch_of_decodes_and_prefills_equals_each_slice_on_its_own(case, dim, width, bias, prefill_slots):
    toks = ROWS[case]
    e = _engine(dim, width, bias, prefill_slots)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    p = LAYERS[1]
    try:
        sids = [e.create_session() for _ in toks]
        for i, s in enumerate(sids):
            oracle.new(s)
            if i % 2 == 0:                              # half continue from a stored state, half start from zeros
                x0 = torch.randn(3 + i, dim)
                e.submit(s, p, x0).result(10)
                oracle.conv(s, 1, x0)
        for rnd in range(2):                            # the second round continues from the first's states
            t = toks if rnd == 0 else toks[::-1]
            x = torch.randn(sum(t), dim)
            want = oracle.batch(sids, 1, x, t, [False] * len(t))
            before = e.stats()
            y = e.submit_batch(sids, p, x, tokens=t).result(10)
            after = e.stats()
            assert y.shape == x.shape
            assert_close(y, want, what=f"{case} round {rnd}")
            assert after["steps"] - before["steps"] == 1
            assert after["batch_requests"] - before["batch_requests"] == 1
            for s in sids:
                assert_close(e.export_state(s), oracle.export(s), what=f"state {s} round {rnd}")
        prior = [3 + i if i % 2 == 0 else 0 for i in range(len(toks))]
        assert [e.session_info(s)["positions"][1] for s in sids] == \
            [a + b + c for a, b, c in zip(prior, toks, toks[::-1])]
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("toks,spec,launches", [
    ([1, 5, 1, 1], None, (1, 0)),                      # decodes + a prefill: one prefill launch
    ([1, 1, 2], None, (1, 0)),
    ([1, 1, 1], None, (0, 1)),                         # a plain decode batch: its batch slot
    ([1, 5, 1, 2], [False, False, False, True], (1, 1)),   # with a verify row: the decode rows' launch
])
@pytest.mark.parametrize("prefill_slots", [True, False])
def test_a_batch_without_verify_rows_is_one_prefill_launch(toks, spec, launches, prefill_slots):
    e = make_engine(**KNOBS, prefill_slots=prefill_slots)
    try:
        sids = [e.create_session() for _ in toks]
        dim = e.model_cpu.dim
        n = Launches(e._runner)
        x = torch.randn(sum(toks), dim)
        e.submit_batch(sids, LAYERS[0], x, tokens=toks, speculative=spec).result(10)
        assert (n.prefill, n.decode) == launches
    finally:
        e.stop(drain=False)
