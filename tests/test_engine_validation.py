"""Validation: a bad request fails alone, before anything is queued, changing nothing."""

import pytest
import torch

from convserve.clients.protocol.errors import (BadRequest, DtypeUnsupported, NonFinite, ShapeMismatch, UnknownLayer,
    UnknownSession)
from tests.engine_support import DIM, LAYERS


BAD_CONV = {
    "unknown session": (dict(session="nope"), UnknownSession),
    "layer without conv": (dict(layer=2), UnknownLayer),
    "layer not an int": (dict(layer="1"), UnknownLayer),
    "int dtype": (dict(x=torch.ones(2, DIM, dtype=torch.int32)), DtypeUnsupported),
    "float64": (dict(x=torch.ones(2, DIM, dtype=torch.float64)), DtypeUnsupported),
    "wrong dim": (dict(x=torch.ones(2, DIM + 1)), ShapeMismatch),
    "1-d x": (dict(x=torch.ones(DIM)), ShapeMismatch),
    "3-d x": (dict(x=torch.ones(1, 2, DIM)), ShapeMismatch),
    "T = 0": (dict(x=torch.ones(0, DIM)), ShapeMismatch),
    "NaN": (dict(x=torch.tensor([[float("nan")] * DIM])), NonFinite),
    "Inf": (dict(x=torch.full((3, DIM), float("inf"))), NonFinite),
    "not a tensor": (dict(x=[[0.0] * DIM]), BadRequest),
    "verify too long": (dict(x=torch.ones(17, DIM), speculative=True), ShapeMismatch),
    "speculative not a bool": (dict(speculative="yes"), BadRequest),
}


@pytest.mark.parametrize("case", list(BAD_CONV))
def test_a_bad_conv_request_raises_before_queueing_and_changes_no_state(engine, case):
    sid = engine.create_session("s")
    engine.submit(sid, LAYERS[0], torch.randn(3, DIM)).result(10)
    before = engine.export_state(sid)
    kw, err = BAD_CONV[case]
    args = dict(session=sid, layer=LAYERS[0], x=torch.randn(2, DIM), speculative=False)
    args.update(kw)
    with pytest.raises(err) as e:
        engine.submit(args["session"], args["layer"], args["x"], args["speculative"])
    assert e.value.message
    assert engine.stats()["queue_depth"] == 0
    assert torch.equal(engine.export_state(sid), before)
    # the session still works
    engine.submit(sid, LAYERS[0], torch.randn(1, DIM)).result(10)


def test_error_messages_name_expected_and_actual(engine):
    sid = engine.create_session()
    with pytest.raises(ShapeMismatch, match=rf"dim={DIM}\), got \(2, {DIM + 1}\)"):
        engine.submit(sid, LAYERS[0], torch.ones(2, DIM + 1))
    with pytest.raises(DtypeUnsupported, match="got int32"):
        engine.submit(sid, LAYERS[0], torch.ones(2, DIM, dtype=torch.int32))
    with pytest.raises(UnknownLayer, match=r"conv layers are \[1, 4, 6\]"):
        engine.submit(sid, 2, torch.ones(1, DIM))


@pytest.mark.parametrize("state,err", [
    (torch.zeros(3, DIM, 3, dtype=torch.float64), DtypeUnsupported),
    (torch.zeros(3, DIM, 3, dtype=torch.bfloat16), DtypeUnsupported),
    (torch.zeros(2, DIM, 3), ShapeMismatch),
    (torch.zeros(3, DIM, 4), ShapeMismatch),
    (torch.zeros(3, 3, DIM), ShapeMismatch),
    (torch.full((3, DIM, 3), float("nan")), NonFinite),
    ("zeros", BadRequest),
])
def test_a_bad_state_import_is_rejected_and_changes_nothing(engine, state, err):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[1], torch.randn(5, DIM)).result(10)
    before = engine.export_state(sid)
    with pytest.raises(err):
        engine.import_state(sid, state)
    assert torch.equal(engine.export_state(sid), before)


@pytest.mark.parametrize("model_dtype,big", [(torch.bfloat16, 3.4e38), (torch.float16, 7.0e4)])
def test_x_finite_in_its_dtype_but_not_in_the_model_dtype_is_rejected_and_changes_nothing(model_dtype, big):
    from convserve.service.model import ConvModel
    from tests.engine_support import make_engine

    e = make_engine(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=model_dtype, seed=2))
    try:
        sid = e.create_session()
        e.submit(sid, LAYERS[0], torch.randn(3, DIM)).result(10)
        before = e.export_state(sid)
        x = torch.randn(2, DIM)
        x[1, 5] = big                                   # finite as float32, Inf once cast to the model dtype
        assert torch.isfinite(x).all() and not torch.isfinite(x.to(model_dtype)).all()
        with pytest.raises(NonFinite, match="model dtype"):
            e.submit(sid, LAYERS[0], x)
        with pytest.raises(NonFinite):
            e.submit_batch([sid], LAYERS[0], x[1:])
        assert torch.equal(e.export_state(sid), before)
    finally:
        e.stop(drain=False)
