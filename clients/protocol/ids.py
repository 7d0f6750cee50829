"""Session ids: the one rule both the server and the clients apply.

An id is 1 to 128 characters of ``A-Z a-z 0-9 . _ ~ : -``: the RFC 3986 unreserved set plus ``:``, so an id
goes into a URL path unescaped and into a log line unquoted.
"""

from __future__ import annotations

import re
import uuid

from .errors import BadRequest

MAX_SESSION_ID_LEN = 128
SESSION_ID_PATTERN = r"[A-Za-z0-9._~:-]{1,%d}" % MAX_SESSION_ID_LEN
_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)


def is_session_id(value) -> bool:
    return type(value) is str and _SESSION_ID_RE.fullmatch(value) is not None


def check_session_id(value, what: str = "session") -> str:
    """``value`` when it is a valid session id, else :class:`BadRequest` saying what an id may hold."""
    if not is_session_id(value):
        raise BadRequest(f"{what}: expected a session id of 1 to {MAX_SESSION_ID_LEN} characters from "
                         f"A-Z a-z 0-9 . _ ~ : -, got {value!r:.80}")
    return value


def new_session_id() -> str:
    """A fresh random id (32 hex digits), for sessions created without one."""
    return uuid.uuid4().hex


#: The header a caller behind an L7 proxy sets to the session of a request, so the proxy can hash on it (the server
#: checks it against the session in the path or body: a disagreement is a 400).
SESSION_HEADER = "X-Session-Id"
#: The header on every answer that names the replica that gave it (the setting ``replica_name``: the pod's name).
REPLICA_HEADER = "X-Convserve-Replica"
