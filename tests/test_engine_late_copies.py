"""A verify's late copy: an attempt that sat in the server (a stalled HTTP worker) while its retry ran, reaching
the engine after the session moved on. A retry (nothing sent on the session since) runs; a copy after another
verify, a conv or an operation is refused (409, nothing run), so it neither replaces a later verify nor stands
after an accept as a verify nobody sent. The committed state is checked against the reference."""

from __future__ import annotations

import pytest
import torch

from convserve.clients.protocol.errors import PositionMismatch
from tests.engine_support import DIM, LAYERS, make_engine
from tests.tolerance import assert_close

L0 = LAYERS[0]


def _verify(e, kind, sid, other, x, rid):
    if kind == "conv":
        return e.submit(sid, L0, x, speculative=True, position=0, request_id=rid).result(10)
    return e.submit_batch([sid, other], L0, torch.cat([x, x]), tokens=[len(x)] * 2, speculative=True,
                          position=[0, 0], request_id=rid).result(10)


@pytest.mark.parametrize("kind", ["conv", "batch"])
@pytest.mark.parametrize("between", ["verify", "accept", "conv", "export"])
def test_a_verify_sent_again_after_the_session_moved_on_is_refused_and_the_later_state_stands(kind, between):
    e = make_engine(max_spec_tokens=4)
    try:
        sid, other = e.create_session(), e.create_session()
        verified = [sid] if kind == "conv" else [sid, other]
        v1, v2 = torch.randn(3, DIM), torch.randn(3, DIM)
        y1 = _verify(e, kind, sid, other, v1, "v1")
        assert torch.equal(_verify(e, kind, sid, other, v1, "v1")[:3], y1[:3])   # its retry: runs again
        if between == "verify":
            _verify(e, kind, sid, other, v2, "v2")
        elif between == "accept":
            e.accept_batch(verified, [2] * len(verified))
        elif between == "conv":
            e.accept_batch(verified, [0] * len(verified))
            e.submit(sid, L0, torch.randn(1, DIM), position=0).result(10)
        else:
            e.export_state(sid)
        before = e.export_state(sid)
        info = e.session_info(sid)
        # (after an accept or a conv the committed position moved too: refused by its position as well)
        with pytest.raises(PositionMismatch, match="late copy" if between in ("verify", "export") else None):
            _verify(e, kind, sid, other, v1, "v1")
        assert_close(e.export_state(sid), before, torch.float32)
        assert e.session_info(sid)["pending"] == info["pending"]
        if between == "verify":                        # the accept commits v2's tokens, not v1's
            e.accept_batch(verified, [2] * len(verified))
            ref = make_engine(max_spec_tokens=4)
            try:
                r = ref.create_session()
                ref.submit(r, L0, v2[:2]).result(10)
                assert_close(e.export_state(sid)[0], ref.export_state(r)[0], torch.float32)
            finally:
                ref.stop(drain=False)
    finally:
        e.stop(drain=False)


def test_verifies_without_a_request_id_are_not_held_to_it():
    e = make_engine(max_spec_tokens=4)
    try:
        sid = e.create_session()
        x = torch.randn(2, DIM)
        e.submit(sid, L0, x, speculative=True).result(10)
        e.submit(sid, L0, torch.randn(2, DIM), speculative=True).result(10)
        e.submit(sid, L0, x, speculative=True).result(10)          # no id: a new verify each time, as before
    finally:
        e.stop(drain=False)
