"""Strict requests on the routes that take their arguments in the path: a body on a route that takes none (GET,
DELETE) is a 400 saying so, and a ``{id}`` in a path (or a session in a body) that is not a session id is a 400
naming the rule a create applies; neither changes any state. Over both layouts (the shared ``server``)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from convserve.clients.protocol import wire
from tests.http_api import DIM

#: every route of the routes table that takes no body ({id}: a live session)
BODILESS = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/model"),
            ("GET", "/v1/model/weights"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/{id}"),
            ("GET", "/v1/sessions/{id}/state"), ("DELETE", "/v1/sessions/{id}")]
#: every route with {id} in its path, with a body it would accept
ID_ROUTES = [("GET", "/v1/sessions/{id}", None), ("DELETE", "/v1/sessions/{id}", None),
             ("POST", "/v1/sessions/{id}/fork", {}), ("GET", "/v1/sessions/{id}/state", None),
             ("PUT", "/v1/sessions/{id}/state", {"state": {"dtype": "float32", "shape": [1], "data": b"\0" * 4}}),
             ("POST", "/v1/sessions/{id}/accept", {"tokens": 0})]
#: ids no create accepts, as they appear in a URL path (percent-encoded), and as the server decodes them
BAD_IDS = [("a%20b", "a b"), ("a%21b", "a!b"), ("x" * 129, "x" * 129), ("%C3%A9", "\u00e9")]
#: and in a body, one far longer than the rule: a 400 naming the rule, whatever its length within the body
BODY_BAD_IDS = [*BAD_IDS, ("x" * 70_000, "x" * 70_000)]


def _exists(api, sid) -> bool:
    st, _, _ = api.call("GET", f"/v1/sessions/{sid}")
    assert st in (200, 404)
    return st == 200


@pytest.mark.parametrize("method,route", BODILESS, ids=[f"{m} {r}" for m, r in BODILESS])
def test_a_body_on_a_route_that_takes_none_is_a_400_saying_the_route_takes_no_body(api, method, route):
    sid = api.session()
    path = route.replace("{id}", sid)
    st, obj, _ = api.call(method, path, raw=wire.packb({"session": sid}))
    assert st == 400, obj
    assert obj["error"]["code"] == "bad_request"
    msg = obj["error"]["message"]
    assert f"{method} {route.replace('{id}', '{session}')} takes no body" in msg and "without one" in msg
    assert _exists(api, sid)                           # nothing ran: a DELETE with a body deleted nothing
    api.call("DELETE", f"/v1/sessions/{sid}")


def test_a_delete_with_a_body_is_a_400_and_the_session_still_exists(api):
    sid = api.session()
    before = api.state(sid)
    st, obj, _ = api.call("DELETE", f"/v1/sessions/{sid}", raw=b'{"force": true}',
                          headers={"content-type": "application/json"})
    assert st == 400 and obj["error"]["code"] == "bad_request" and "takes no body" in obj["error"]["message"]
    assert _exists(api, sid) and bool((api.state(sid) == before).all())
    st, _, _ = api.call("DELETE", f"/v1/sessions/{sid}")
    assert st == 204 and not _exists(api, sid)


@pytest.mark.parametrize("method,route", BODILESS, ids=[f"{m} {r}" for m, r in BODILESS])
def test_a_chunked_body_on_a_route_that_takes_none_is_a_400_too(server, api, method, route):
    sid = api.session()
    r = httpx.request(method, server.url + route.replace("{id}", sid), content=iter([b"\x80"]),
                      headers={"accept": "application/json"})
    assert "content-length" not in r.request.headers                     # sent chunked
    assert r.status_code == 400 and "takes no body" in r.json()["error"]["message"], r.content[:300]
    assert _exists(api, sid)
    api.call("DELETE", f"/v1/sessions/{sid}")


@pytest.mark.parametrize("how", ["content-length-0", "empty-chunked"])
def test_an_empty_body_stays_fine_on_the_routes_that_take_none(server, api, how):
    content = b"" if how == "content-length-0" else iter([b""])
    headers = {"content-length": "0"} if how == "content-length-0" else {}
    for method, route in BODILESS:
        sid = api.session()
        r = httpx.request(method, server.url + route.replace("{id}", sid), content=content, headers=headers)
        assert r.status_code in (200, 204), (method, route, r.content[:300])
        if method != "DELETE":
            api.call("DELETE", f"/v1/sessions/{sid}")


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


BODY_ROUTES = [("POST", "/v1/conv", lambda sid, x: {"session": sid, "layer": 0, "x": x}),
               ("POST", "/v1/conv/batch", lambda sid, x: {"sessions": [sid], "layer": 0, "x": x}),
               ("POST", "/v1/accept", lambda sid, x: {"sessions": [sid], "tokens": [1]})]


@pytest.mark.parametrize("method,route,make", BODY_ROUTES, ids=[r for _, r, _ in BODY_ROUTES])
@pytest.mark.parametrize("raw,decoded", BODY_BAD_IDS, ids=["space", "bang", "129-chars", "non-ascii", "70k-chars"])
def test_an_invalid_session_id_in_a_body_is_a_400_naming_the_rule_not_a_404(api, method, route, make, raw,
                                                                            decoded):
    import torch

    st, obj, _ = api.call(method, route, make(decoded, wire.encode_tensor(torch.randn(1, DIM))))
    assert st == 400, obj
    assert obj["error"]["code"] == "bad_request" and "A-Z a-z 0-9" in obj["error"]["message"]


@pytest.mark.parametrize("layers", [[0, 2.0, 5], [False, 2, 5], [0, 2, 5.0]], ids=["float", "bool", "last-float"])
def test_an_import_whose_layers_are_mistyped_is_refused_and_changes_nothing(api, layers):
    from tests.http_api import LAYERS

    assert layers == LAYERS                    # equal in Python: 1.0 == 1 == True, which once let them through
    sid = api.session()
    st, exported, _ = api.call("GET", f"/v1/sessions/{sid}/state")
    assert st == 200
    x = wire.encode_tensor(__import__("tests.http_api", fromlist=["rand_x"]).rand_x(3))
    assert api.call("POST", "/v1/conv", {"session": sid, "layer": LAYERS[0], "x": x})[0] == 200
    before = api.call("GET", f"/v1/sessions/{sid}")[1]["positions"]
    st, obj, _ = api.call("PUT", f"/v1/sessions/{sid}/state", {"layers": layers, "state": exported["state"]})
    assert st == 422 and "layers" in obj["error"]["message"], obj
    assert api.call("GET", f"/v1/sessions/{sid}")[1]["positions"] == before


def test_an_optional_field_given_as_null_is_the_same_as_leaving_it_out(api):
    from tests.http_api import LAYERS, rand_x

    sid = api.session()
    x = wire.encode_tensor(rand_x(2, seed=3))
    st, with_null, _ = api.call("POST", "/v1/conv", {"session": sid, "layer": LAYERS[0], "x": x,
                                                     "speculative": None, "position": None})
    assert st == 200
    other = api.session()
    st, without, _ = api.call("POST", "/v1/conv", {"session": other, "layer": LAYERS[0], "x": x})
    assert st == 200 and with_null["y"]["data"] == without["y"]["data"]
    st, _, _ = api.call("POST", "/v1/conv/batch", {"sessions": [sid, other], "layer": LAYERS[1],
                                                   "x": wire.encode_tensor(rand_x(2, seed=4)), "tokens": None,
                                                   "speculative": None, "position": None})
    assert st == 200
    assert api.call("GET", f"/v1/sessions/{sid}")[1]["positions"] == \
        api.call("GET", f"/v1/sessions/{other}")[1]["positions"]


def test_a_msgpack_x_whose_data_is_a_base64_string_of_any_size_within_the_body_is_read(api):
    """A string ``data`` in a msgpack body is base64, as in JSON: no bound of its own below the body's."""
    import base64

    import torch

    x = torch.randn(768, DIM)                            # 768 x DIM float32: a base64 string past 64 KiB
    enc = wire.encode_tensor(x)
    assert len(base64.b64encode(enc["data"])) > 64 << 10
    ys = []
    for data in (base64.b64encode(enc["data"]).decode(), enc["data"]):
        sids = [api.session() for _ in range(3)]
        st, obj, _ = api.call("POST", "/v1/conv/batch", {"sessions": sids, "layer": 0, "tokens": [256] * 3,
                                                        "x": {**enc, "data": data}})
        assert st == 200, obj
        ys.append(wire.decode_tensor(obj["y"]))
    assert torch.equal(*ys)


@pytest.mark.parametrize("method,route,allowed", [
    ("POST", "/v1/sessions/{s}/state", ["GET", "PUT"]), ("PATCH", "/v1/sessions", ["GET", "POST"]),
    ("PATCH", "/v1/sessions/{s}", ["DELETE", "GET"]), ("GET", "/v1/conv", ["POST"]),
    ("PUT", "/v1/accept", ["POST"])])
def test_a_405_lists_every_method_of_the_path_in_allow_and_in_its_message(api, method, route, allowed):
    sid = api.session()
    st, obj, headers = api.call(method, route.format(s=sid))
    assert st == 405 and obj["error"]["code"] == "method_not_allowed", obj
    assert sorted(m.strip() for m in headers["allow"].split(",")) == allowed
    assert ", ".join(allowed) in obj["error"]["message"]
    assert _exists(api, sid)


@pytest.mark.parametrize("make", [
    lambda sid: ("/v1/conv", {"session": sid, "layer": 0, "x": {"dtype": "float32", "shape": [1] * 60_000,
                                                                  "data": b""}}),
    lambda sid: ("/v1/conv", {"session": sid, "layer": 0, "x": {"dtype": "f" * 60_000, "shape": [1], "data": b""}}),
    lambda sid: ("/v1/conv", {"session": sid, "layer": "9" * 60_000, "x": {"dtype": "float32", "shape": [1, DIM],
                                                                           "data": b"\0" * 4 * DIM}}),
    lambda sid: ("/v1/conv/batch", {"sessions": [sid], "layer": 0, "tokens": ["1" * 60_000],
                                    "x": {"dtype": "float32", "shape": [1, DIM], "data": b"\0" * 4 * DIM}}),
    lambda sid: ("/v1/conv/batch", {"sessions": [sid], "layer": 0, "speculative": "t" * 60_000,
                                    "x": {"dtype": "float32", "shape": [1, DIM], "data": b"\0" * 4 * DIM}}),
], ids=["shape", "dtype", "layer", "tokens", "speculative"])
def test_an_error_quotes_a_bad_value_cut_short_not_the_whole_value(api, make):
    sid = api.session()
    route, body = make(sid)
    r = api.http.post(route, content=wire.packb(body))
    assert 400 <= r.status_code < 500 and len(r.content) < 1000, (r.status_code, len(r.content))
    assert api.call("GET", f"/v1/sessions/{sid}")[1]["positions"] == [0] * len(api.layers)


@pytest.mark.parametrize("route", ["/v1/sessions", "/v1/sessions/{s}/fork"])
@pytest.mark.parametrize("raw,ct", [(b"\xc0", wire.MEDIA_TYPE), (b"\xc4\x00", wire.MEDIA_TYPE),
                                    (b"null", "application/json"), (b"[]", "application/json")],
                         ids=["msgpack-nil", "msgpack-empty-bin", "json-null", "json-list"])
def test_a_create_or_fork_body_that_is_no_map_is_a_400_and_creates_nothing(api, route, raw, ct):
    sid = api.session()
    ids = (lambda: sorted(s["session"] for s in api.call("GET", "/v1/sessions?limit=1000")[1]["sessions"]))
    before = ids()
    st, obj, _ = api.call("POST", route.format(s=sid), raw=raw, headers={"content-type": ct})
    assert st == 400 and "must be a map" in obj["error"]["message"], obj
    assert ids() == before
    for ok in (b"", wire.packb({})):                 # an empty body, or an empty map: the server picks the id
        st, obj, _ = api.call("POST", route.format(s=sid), raw=ok)
        assert st == 201, obj
        api.call("DELETE", f"/v1/sessions/{obj['session']}")
