"""Error messages for the commonest wrong bodies say what the server saw and how to fix it."""

from __future__ import annotations

import msgpack
import pytest

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest
from convserve.service.http.replica import _disagree


def test_a_json_body_read_as_msgpack_says_to_send_content_type_json():
    # a request without Content-Type is read as msgpack: a JSON body sent that way must be told so, not
    # "the body holds more than one msgpack object"
    with pytest.raises(BadRequest, match="looks like JSON; send it with Content-Type: application/json"):
        wire.unpackb(b'{"session": "s1"}', 1 << 20)


def test_a_body_that_is_not_msgpack_is_not_called_several_objects():
    with pytest.raises(BadRequest, match="not one msgpack map .*starts with a int and 4 more bytes"):
        wire.unpackb(b"hello", 1 << 20)


def test_two_msgpack_maps_in_one_body_still_point_to_the_stream_route():
    with pytest.raises(BadRequest, match="more than one msgpack object.*/v1/conv/stream"):
        wire.unpackb(msgpack.packb({"a": 1}) + msgpack.packb({"b": 2}), 1 << 20)


def test_the_session_header_mismatch_message_reads_cleanly():
    msg = str(_disagree("other", "s1", "the body"))
    assert "the server acts on the body" in msg and "the the" not in msg
