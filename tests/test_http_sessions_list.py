"""``GET /v1/sessions?cursor=&limit=`` refuses what the server could not have handed out: ``limit`` is plain ASCII
digits from 1 to ``sessions_page_max`` (1000 on the shared server), ``cursor`` a session id (the ``next`` of a
page is the last id of that page), each given at most once. A refusal is one 400 naming the rule and changes no
state; a cursor that is a well-formed id no session has (deleted since) still pages on."""

import uuid

import pytest

from tests.http_api import Api

PAGE_MAX = 1000          # the default sessions_page_max of the shared server


def ids(api: Api) -> list:
    st, page, _ = api.call("GET", f"/v1/sessions?limit={PAGE_MAX}")
    assert st == 200, page
    return sorted(s["session"] for s in page["sessions"])


@pytest.mark.parametrize("limit", ["%205", "5%20", "+5", "-5", "1_0", "5.0", "1e2", "0x10", "%E0%A5%AB", "%EF%BC%95",
                                   "%D9%A5", "", "0", "1001", "9" * 5000],
                         ids=["leading-space", "trailing-space", "plus", "minus", "underscore", "float", "exponent",
                              "hex", "devanagari-5", "fullwidth-5", "arabic-indic-5", "empty", "zero", "past-max",
                              "5000-digits"])
def test_a_limit_that_is_not_plain_ascii_digits_within_the_range_is_400_naming_the_range(api, limit):
    before = ids(api)
    st, err, _ = api.call("GET", f"/v1/sessions?limit={limit}")
    assert st == 400 and err["error"]["code"] == "bad_request", err
    msg = err["error"]["message"]
    assert "limit" in msg and f"1 to {PAGE_MAX}" in msg and "digits" in msg, msg
    assert ids(api) == before


@pytest.mark.parametrize("limit, n", [("1", 1), ("05", 5), (str(PAGE_MAX), PAGE_MAX)])
def test_a_limit_of_ascii_digits_within_the_range_is_taken(api, limit, n):
    for i in range(2):
        api.session(f"lim-{uuid.uuid4().hex[:8]}-{i}")
    st, page, _ = api.call("GET", f"/v1/sessions?limit={limit}")
    assert st == 200, page
    assert 1 <= len(page["sessions"]) <= n


@pytest.mark.parametrize("cursor", ["a%20b", "a+b", "%00", "a" * 5000, "a" * 129, "%C3%A9t%C3%A9", "a%2Fb", "a%0Ab",
                                    ""],
                         ids=["space", "plus-space", "nul", "5000-chars", "129-chars", "non-ascii", "slash",
                              "newline", "empty"])
def test_a_cursor_that_no_page_could_have_handed_out_is_400_naming_the_rule(api, cursor):
    before = ids(api)
    st, err, _ = api.call("GET", f"/v1/sessions?cursor={cursor}&limit=5")
    assert st == 400 and err["error"]["code"] == "bad_request", err
    msg = err["error"]["message"]
    assert "cursor" in msg and "'next'" in msg and "A-Z a-z 0-9 . _ ~ : -" in msg, msg
    assert ids(api) == before


def test_a_well_formed_cursor_of_a_deleted_session_still_pages_on_after_it(api):
    prefix = "cur" + uuid.uuid4().hex[:6]
    a, b, c = (api.session(f"{prefix}-{i}") for i in range(3))
    assert api.call("DELETE", f"/v1/sessions/{b}")[0] == 204
    st, page, _ = api.call("GET", f"/v1/sessions?cursor={b}&limit={PAGE_MAX}")
    assert st == 200, page
    got = [s["session"] for s in page["sessions"]]
    assert c in got and a not in got and b not in got


@pytest.mark.parametrize("query, name", [("limit=5&limit=6", "limit"), ("cursor=a&cursor=b", "cursor"),
                                         ("limit=5&cursor=a&limit=5", "limit")])
def test_a_listing_parameter_given_twice_is_400_naming_it(api, query, name):
    st, err, _ = api.call("GET", f"/v1/sessions?{query}")
    assert st == 400 and err["error"]["code"] == "bad_request", err
    assert f"'{name}'" in err["error"]["message"] and "once" in err["error"]["message"], err
