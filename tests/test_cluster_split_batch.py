"""A batch split across engines is checked whole first (``split_batch.check_whole``): on every stateless bad
input it must refuse with exactly the error one engine would answer for the whole batch (same class, same
message), checks in the engine's order, so the answer does not depend on how the sessions were placed."""

import numpy as np
import pytest
import torch

from convserve.service.cluster.split_batch import batch_limits, check_whole, whole_model
from tests.engine_support import DIM, LAYERS, make_engine

N = 3
GOOD = dict(layer=LAYERS[0], tokens=None, speculative=None, position=None)

# one bad input per row (several where the order of the checks decides which error answers)
CASES = {
    "repeated session": dict(sids=["a", "a", "c"]),
    "too many sessions": dict(sids=[f"s{i}" for i in range(9)], rows=9),
    "position of the wrong length": dict(position=[0, 0]),
    "a negative position": dict(position=[0, -1, 0]),
    "position not a list": dict(position=3),
    "unknown layer": dict(layer=2),
    "layer not an integer": dict(layer="1"),
    "layer a bool": dict(layer=True),
    "unknown layer and bad x": dict(layer=99, x=torch.zeros(N, DIM + 1)),
    "unknown layer and a repeated session": dict(layer=99, sids=["a", "a", "c"]),
    "bad position and unknown layer": dict(position=[0], layer=99),
    "tokens of the wrong length": dict(tokens=[1, 1]),
    "a zero token count": dict(tokens=[1, 0, 1], rows=2),
    "speculative of the wrong length": dict(speculative=[True]),
    "a verify over max_spec_tokens": dict(tokens=[1, 5, 1], speculative=[False, True, False], rows=7),
    "x of the wrong width": dict(x=torch.zeros(N, DIM + 1)),
    "x of the wrong rows": dict(rows=N + 1),
    "x with a NaN": dict(nan=True),
    "x of an integer dtype": dict(x=torch.zeros(N, DIM, dtype=torch.int32)),
    "over max_batch_tokens": dict(tokens=[40, 30, 1], rows=71),
    "a 1-D x": dict(x=torch.zeros(N * DIM)),
}


def _case(case):
    sids = case.get("sids", ["a", "b", "c"])
    x = case.get("x")
    if x is None:
        x = torch.randn(case.get("rows", len(sids)), DIM)
        if case.get("nan"):
            x[-1, -1] = float("nan")
    args = {**GOOD, **{k: v for k, v in case.items() if k in GOOD}}
    return sids, x, args


@pytest.fixture(scope="module")
def one_engine():
    """One engine holding every session the cases name, so only the stateless checks can refuse."""
    e = make_engine(slots=16, max_batch_size=8, max_batch_tokens=64, max_spec_tokens=4, decode_buckets=(1, 2, 4, 8))
    for s in ["a", "b", "c"] + [f"s{i}" for i in range(9)]:
        e.create_session(s)
    yield e
    e.stop(drain=False)


@pytest.mark.parametrize("name", list(CASES))
def test_a_split_batch_refuses_stateless_bad_input_with_one_engines_error(name, one_engine):
    sids, x, a = _case(CASES[name])
    cfg = one_engine.config
    limits = batch_limits(cfg)
    model = whole_model(one_engine.model_info())
    with pytest.raises(Exception) as split:
        check_whole(sids, x.clone(), a["tokens"], a["speculative"], a["position"], a["layer"], limits, model)
    with pytest.raises(Exception) as one:
        one_engine.submit_batch(sids, a["layer"], x.clone(), tokens=a["tokens"], speculative=a["speculative"],
                                position=a["position"]).result(timeout=10)
    assert type(split.value) is type(one.value), (split.value, one.value)
    assert str(split.value) == str(one.value)


def test_a_good_batch_passes_the_whole_check_as_the_model_dtype():
    e = make_engine()
    try:
        x = torch.randn(4, DIM, dtype=torch.float16)
        xm = check_whole(["a", "b"], x, [3, 1], None, [0, 0], LAYERS[-1], batch_limits(e.config),
                         whole_model(e.model_info()))
        assert xm.dtype == torch.float32 and xm.shape == (4, DIM) and xm.is_contiguous()
        np.testing.assert_array_equal(xm.numpy(), x.to(torch.float32).numpy())
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("tokens, speculative, refused", [
    (None, None, False),                              # 10 plain rows: the prefill launch, past the bucket (4)
    ([1] * 9 + [2], None, False),
    ([1] * 5 + [2], [False] * 5 + [True], True),      # 5 plain one-token rows beside a verify: the decode launch
    ([1] * 4 + [2], [False] * 4 + [True], False),
])
def test_the_whole_check_and_one_engine_agree_on_one_token_rows_past_the_largest_bucket(tokens, speculative, refused):
    e = make_engine(slots=16, max_batch_size=12, max_batch_tokens=64, max_spec_tokens=4, decode_buckets=(1, 2, 4))
    try:
        n = len(tokens or [1] * 10)
        sids = [e.create_session() for _ in range(n)]
        x = torch.randn(sum(tokens or [1] * 10), DIM)
        limits, model = batch_limits(e.config), whole_model(e.model_info())
        if refused:
            with pytest.raises(Exception) as split:
                check_whole(sids, x.clone(), tokens, speculative, None, LAYERS[0], limits, model)
            with pytest.raises(Exception) as one:
                e.submit_batch(sids, LAYERS[0], x.clone(), tokens=tokens, speculative=speculative).result(10)
            assert type(split.value) is type(one.value) and str(split.value) == str(one.value)
            assert "one-token plain rows beside speculative ones" in str(one.value)
        else:
            check_whole(sids, x.clone(), tokens, speculative, None, LAYERS[0], limits, model)
            y = e.submit_batch(sids, LAYERS[0], x.clone(), tokens=tokens, speculative=speculative).result(10)
            assert y.shape == x.shape
    finally:
        e.stop(drain=False)
