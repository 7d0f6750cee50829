"""Strict requests on the routes that take their arguments in the path: a ``{id}`` in a path that is not a session
id is a 400 naming the rule a create applies, and changes no state. Over both layouts (the shared ``server``)."""

from __future__ import annotations

import uuid

import pytest

from convserve.clients.protocol import wire

#: every route with {id} in its path, with a body it would accept
ID_ROUTES = [("GET", "/v1/sessions/{id}", None), ("DELETE", "/v1/sessions/{id}", None),
             ("POST", "/v1/sessions/{id}/fork", {}), ("GET", "/v1/sessions/{id}/state", None),
             ("PUT", "/v1/sessions/{id}/state", {"state": {"dtype": "float32", "shape": [1], "data": b"\0" * 4}}),
             ("POST", "/v1/sessions/{id}/accept", {"tokens": 0})]
#: ids no create accepts, as they appear in a URL path (percent-encoded), and as the server decodes them
BAD_IDS = [("a%20b", "a b"), ("a%21b", "a!b"), ("x" * 129, "x" * 129), ("%C3%A9", "\u00e9")]


def _exists(api, sid) -> bool:
    st, _, _ = api.call("GET", f"/v1/sessions/{sid}")
    assert st in (200, 404)
    return st == 200


@pytest.mark.parametrize("method,route,body", ID_ROUTES, ids=[f"{m} {r}" for m, r, _ in ID_ROUTES])
@pytest.mark.parametrize("raw,decoded", BAD_IDS, ids=["space", "bang", "129-chars", "non-ascii"])
def test_an_invalid_session_id_in_a_path_is_a_400_naming_the_rule_create_applies(api, method, route, body, raw,
                                                                                 decoded):
    st, created, _ = api.call("POST", "/v1/sessions", {"session": decoded})
    assert st == 400                                   # create refuses this id ...
    rule = created["error"]["message"].split(": ", 1)[1]
    st, obj, _ = api.call(method, route.replace("{id}", raw), body)
    assert st == 400, obj                              # ... and so does every route naming it in its path
    assert obj["error"]["code"] == "bad_request"
    assert obj["error"]["message"] == f"the session id in the path: {rule}"


def test_a_fork_of_an_invalid_path_id_creates_nothing(api):
    new = uuid.uuid4().hex
    st, obj, _ = api.call("POST", "/v1/sessions/a%20b/fork", {"session": new})
    assert st == 400 and "the session id in the path" in obj["error"]["message"]
    assert not _exists(api, new)
