"""The HTTP layer's engine interface (``service/http/backend.py``) is what the in-process engine and a worker's
stand-in for engine processes (:class:`RemoteEngine`) provide: every member exists on both and takes the same
parameters, so the routes are served by either."""

import inspect

import pytest

from convserve.service.cluster.remote import RemoteEngine
from convserve.service.engine import Engine
from convserve.service.http.backend import EngineAPI

MEMBERS = [n for n, v in vars(EngineAPI).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]


def test_the_interface_lists_the_methods_the_routes_call():
    assert {"submit_async", "submit_batch", "submit_batch_async", "accept_batch", "cancel"} <= set(MEMBERS)


@pytest.mark.parametrize("impl", [Engine, RemoteEngine])
@pytest.mark.parametrize("name", MEMBERS)
def test_the_engine_provides_each_member_with_the_same_parameters(name, impl):
    want = getattr(EngineAPI, name)
    have = getattr(impl, name)
    if isinstance(want, property):
        assert isinstance(have, property) or not callable(have), name
        return
    w = [p.name for p in inspect.signature(want).parameters.values()]
    h = [p.name for p in inspect.signature(have).parameters.values()]
    assert h[:len(w)] == w, f"{name}: the engine takes {h}, the interface says {w}"
