"""The server's request limits (``GET /v1/model``'s ``limits``) as the load tester fits its requests to them: the
prefill chunk (``--chunk``, or the largest piece the server takes when it is not given), the budget of the
frontend's batch for one layer, and when replicas that may join make the frontend read them again.

A limit the server does not report is no limit here: against such a server the load tester sends what it would
send to any other (the default chunk, batches of every live session)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from convserve.clients.protocol.wire import BATCH_FIXED_OBJECTS, BATCH_SESSION_OBJECTS, ITEMSIZE

#: the prefill chunk when ``--chunk`` is not given and the server takes one this long
DEFAULT_CHUNK = 2048
#: bytes of a conv or batch body besides x's rows, at most: the map, its keys, the layer and x's header; and, in a
#: batch, per session: its id, token count and speculative flag (both bounds with room over what they encode to)
BODY_FIXED_BYTES, BODY_SESSION_BYTES = 256, 64
#: the name of the client's own limit, beside the server's
ARENA = "--shm-mib arena"


class ChunkError(ValueError):
    """No prefill chunk fits the server's limits, or ``--chunk`` is above what one request may carry."""


@dataclass(frozen=True)
class Limits:
    """What one request may carry; ``math.inf`` where the server reports no limit."""

    batch_tokens: float = math.inf      # max_batch_tokens: every session's tokens of one batch together
    batch_size: float = math.inf        # max_batch_size: sessions in one batch
    slice_tokens: float = math.inf      # max_tokens_per_request: one request, or one session's slice of a batch
    body_bytes: float = math.inf        # max_body_bytes: one body (or stream frame)
    row_bytes: int = 0                  # one token of x in the body (0: x travels in shared memory)
    arena_tokens: float = math.inf      # tokens of x one block of the client's shared-memory arena holds
    arena_bytes: float = math.inf       # that arena's size (--shm-mib)
    body_objects: float = math.inf      # max_body_objects: objects in one body
    decode_rows: float = math.inf       # max_decode_rows: one-token plain rows in one batch

    @classmethod
    def of(cls, info: dict, arena_bytes: Optional[int] = None) -> "Limits":
        """The limits ``GET /v1/model`` reports; with ``arena_bytes`` x travels in a shared-memory arena of that
        size (and takes no room in the body): one call's x must fit in one block of it."""
        lim = info.get("limits") or {}
        token = int(info["dim"]) * ITEMSIZE.get(info.get("dtype"), 4)
        arena = dict(arena_tokens=arena_bytes // token, arena_bytes=arena_bytes) if arena_bytes is not None else {}
        return cls(*(lim.get(k) or math.inf for k in ("max_batch_tokens", "max_batch_size", "max_tokens_per_request",
                                                      "max_body_bytes")),
                   row_bytes=token if arena_bytes is None else 0,
                   body_objects=lim.get("max_body_objects") or math.inf,
                   decode_rows=lim.get("max_decode_rows") or math.inf, **arena)

    def batch_sessions(self) -> float:
        """The most sessions one batch may carry: ``max_batch_size``, and what ``max_body_objects`` leaves room for."""
        if self.body_objects == math.inf:
            return self.batch_size
        return min(self.batch_size, (self.body_objects - BATCH_FIXED_OBJECTS) // BATCH_SESSION_OBJECTS)

    def body_room(self) -> float:
        """Bytes of a body left for the sessions' fields and x's rows."""
        return self.body_bytes - BODY_FIXED_BYTES

    def rows_in(self, room: float) -> float:
        """Tokens of x that fit in ``room`` bytes of a body beside one more session's fields."""
        if room == math.inf:
            return math.inf
        if room < BODY_SESSION_BYTES:
            return 0
        return (room - BODY_SESSION_BYTES) // self.row_bytes if self.row_bytes else math.inf

    def slice_bytes(self, tokens: int) -> int:
        """Bytes one session's slice of ``tokens`` takes in a body."""
        return BODY_SESSION_BYTES + tokens * self.row_bytes

    def largest_slice(self) -> tuple:
        """``(tokens, name, detail)``: the most tokens one request (or one session's slice of a batch) may carry,
        the limit that sets it (the first on a tie: the server's, or this run's ``--shm-mib`` arena) and that
        limit's value in words."""
        body_rows = self.rows_in(self.body_room())
        caps = [(self.slice_tokens, "max_tokens_per_request", f"{self.slice_tokens}"),
                (self.batch_tokens, "max_batch_tokens", f"{self.batch_tokens}"),
                (body_rows, "max_body_bytes", f"{self.body_bytes}: room for {body_rows} tokens of x at "
                                              f"{self.row_bytes} bytes each"),
                (self.arena_tokens, ARENA, f"{self.arena_bytes} bytes: room for {self.arena_tokens} tokens of x "
                                           "in one layer call, all sessions' together")]
        return min(caps, key=lambda c: c[0])


def limit_words(name: str, detail: str) -> str:
    """A limit of :meth:`Limits.largest_slice` in words, for messages."""
    return f"this run's {name} ({detail})" if name == ARENA else f"the server's {name} ({detail})"


def choose_chunk(given: Optional[int], limits: Limits, frontend: bool) -> tuple:
    """``(chunk, why)``: the prefill chunk of the run and why it is that long (for the report).

    ``given`` (``--chunk``) is used as it is; above what one request may carry it is refused (:class:`ChunkError`:
    every longer prefill request would be refused), except in the frontend scenario, whose steps cut each slice
    to the limits anyway. Not given: :data:`DEFAULT_CHUNK`, or less where the server takes less."""
    most, name, detail = limits.largest_slice()
    words = limit_words(name, detail)
    if most < 1:
        fix = ("raise --shm-mib" if name == ARENA else "start the server with a larger --max-body-bytes, or send x in "
               "shared memory (--scenario frontend --shm-mib, a server on this host)")
        raise ChunkError(f"{words[0].upper()}{words[1:]} leaves no room for one token of x: every conv request "
                         f"would be refused; {fix}")
    if given is None:
        return (DEFAULT_CHUNK, "default") if most >= DEFAULT_CHUNK else \
            (int(most), name if name == ARENA else f"server {name}")
    if given <= most:
        return given, "--chunk"
    if frontend:
        return given, f"--chunk; each step cuts a slice to {words}"
    raise ChunkError(f"--chunk {given} is above {words}: every longer prefill request would "
                     f"be refused; use --chunk {int(most)} or less")


#: seconds between the frontend's reads of the limits while replicas may join (some did not answer at the start)
LIMITS_REFRESH_S = 1.0


def replicas_down(url, info: dict) -> tuple:
    """``(down, refresh_s)``: the replica URLs of ``url`` (one or a list) missing from ``info``'s ``replicas``
    (``GET /v1/model`` through the routing client), and how often the frontend reads the limits again: every
    :data:`LIMITS_REFRESH_S` when some did not answer or a URL is a DNS name (replicas may join later), else
    never (None)."""
    if info.get("replicas") is None:
        return [], None
    urls = url if isinstance(url, list) else [url]
    up = {r["url"].rstrip("/") for r in info["replicas"]}
    down = [u for u in urls if "://" in u and not u.startswith("dns") and u.rstrip("/") not in up]
    return down, LIMITS_REFRESH_S if down or any(u.startswith("dns") for u in urls) else None
