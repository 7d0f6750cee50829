"""One client, many replicas: which replica holds a session, and which replicas are up.

A routed client (``ConvClient([url, url, ...])`` or ``ConvClient("dns://name:port")``) keeps a :class:`Router`:

* **Endpoints.** A list of URLs, or a DNS name whose A/AAAA records are the replicas (a Kubernetes headless
  Service), resolved again every ``resolve_interval_s``. A replica is known by its URL and named by the
  ``X-Convserve-Replica`` header of its answers (the pod's name).
* **Placement.** A session goes to the live replica of highest rendezvous weight ``hash(name, session)``
  (highest-random-weight hashing), computed once and then **kept** in ``placed`` (session -> URL): a replica that
  joins later takes new sessions only, and no placed session ever moves. Hashing on the replica's name, not its
  address, lets clients that reach a replica by different addresses agree on the placement.
* **Health.** Every ``health_interval_s`` each replica's ``GET /readyz`` is asked: 200 is up, anything else (or no
  answer) is down. A request that fails on the network also marks its replica down at once. A down replica takes
  no new sessions, and calls for the sessions already on it raise :class:`ReplicaUnavailable` naming them,
  without a request; they are never moved (their state is on that replica). When it answers again its sessions
  are served again, and the server says whether their state survived (``410 state_lost``, ``404``).

This module holds the state and the rules, without I/O; :mod:`.replicated` drives it from the sync and async
clients. The hashing is the client's own copy of the rule the server uses among its engine processes (the
client side imports no server code).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from convserve.clients.positions import UNSENT_ERRORS
from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import (EngineTimeout, OutcomeUnknown, ReplicaUnavailable, ServiceError,
                                              Unreachable)
from convserve.clients.protocol.ids import REPLICA_HEADER, new_session_id

DNS_SCHEMES = {"dns": "http", "dns+http": "http", "dns+https": "https"}
#: a resolver: host name -> the addresses it names (tests inject one; the default asks the system's resolver)
Resolver = Callable[[str], Sequence[str]]


def routed_url(url):
    """The replicas ``url`` names when it asks for routing over several (a list of URLs, a ``dns://`` URL, or a
    comma-separated list), else None. Without ``url``, ``CONVSERVE_URL`` is read, as the plain client does."""
    if url is None:
        url = os.environ.get("CONVSERVE_URL")
    if isinstance(url, (list, tuple)):
        return list(url)
    if isinstance(url, str):
        if url.split("://", 1)[0].lower() in DNS_SCHEMES:
            return url
        if "," in url:
            return [u.strip() for u in url.split(",") if u.strip()]
    return None


def is_routed(url) -> bool:
    """Whether ``url`` (or, when None, ``CONVSERVE_URL``) asks for routing over several replicas."""
    return routed_url(url) is not None


def weight(session: str, replica: str) -> int:
    """The rendezvous weight of ``session`` on the replica named ``replica``."""
    h = hashlib.blake2b(session.encode(), digest_size=8, key=hashlib.blake2b(replica.encode(), digest_size=32).digest())
    return int.from_bytes(h.digest(), "little")


def rendezvous(session: str, names: Sequence[str]) -> str:
    """The name among ``names`` with the highest weight for ``session`` (ties, which need a 64-bit collision,
    broken by the name, so every client agrees)."""
    return max(names, key=lambda n: (weight(session, n), n))


def system_resolver(host: str) -> list[str]:
    return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})


@dataclass
class Replica:
    url: str
    name: Optional[str] = None      # X-Convserve-Replica, learnt from its answers; the URL until then
    up: bool = False
    listed: bool = True             # still one of the endpoints (a DNS name may drop it)
    why: str = "not checked yet"    # why it is down

    @property
    def key(self) -> str:
        return self.name or self.url


@dataclass
class Endpoints:
    """Where the replicas are: a fixed list, or a DNS name re-resolved on an interval."""

    urls: list = field(default_factory=list)
    dns: Optional[tuple] = None                 # (scheme, host, port, path)
    resolver: Resolver = system_resolver

    @classmethod
    def parse(cls, url: Union[str, Sequence[str], None], resolver: Optional[Resolver] = None) -> "Endpoints":
        url = routed_url(url) or url
        if url is None:
            raise ValueError("give the replicas: a list of URLs, or dns://NAME:PORT")
        if isinstance(url, str):
            u = urllib.parse.urlsplit(url)
            if u.scheme.lower() not in DNS_SCHEMES or not u.hostname:
                raise ValueError(f"{url!r}: a DNS endpoint is dns://HOST:PORT (or dns+https://HOST:PORT)")
            return cls(dns=(DNS_SCHEMES[u.scheme.lower()], u.hostname, u.port or 8000, u.path.rstrip("/")),
                       resolver=resolver or system_resolver)
        urls = [str(x).rstrip("/") for x in url]
        if not urls:
            raise ValueError("give at least one replica URL")
        for x in urls:
            if not x.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {x!r} must start with http:// or https://")
        if len(set(urls)) != len(urls):
            raise ValueError(f"replica URLs repeat: {urls}")
        return cls(urls=urls)

    def describe(self) -> str:
        if self.dns is None:
            return ",".join(self.urls)
        scheme, host, port, path = self.dns
        return f"dns+{scheme}://{host}:{port}{path}"

    def resolve(self) -> list[str]:
        """The replica URLs now (a DNS name is asked again)."""
        if self.dns is None:
            return list(self.urls)
        scheme, host, port, path = self.dns
        out = []
        for addr in self.resolver(host):
            ip = ipaddress.ip_address(addr)
            hostpart = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
            out.append(f"{scheme}://{hostpart}:{port}{path}")
        return sorted(set(out))


class Router:
    """Placement and liveness of the replicas (thread-safe; no I/O)."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints
        self.replicas: dict[str, Replica] = {}
        #: session -> replica URL, kept for the session's life (placement never changes once made)
        self.placed: dict[str, str] = {}
        self.lock = threading.Lock()

    # --- membership and health

    def set_urls(self, urls: Sequence[str]) -> list[str]:
        """Take the endpoints' current URLs; returns the new ones. One that left is kept (down, not listed) while
        sessions are placed on it, so that they raise :class:`ReplicaUnavailable` rather than being moved."""
        with self.lock:
            new = [u for u in urls if u not in self.replicas]
            for u in new:
                self.replicas[u] = Replica(u)
            for u, r in list(self.replicas.items()):
                r.listed = u in urls
                if not r.listed:
                    r.up, r.why = False, "it left the DNS name"
                    if u not in self.placed.values():
                        del self.replicas[u]
            return new

    def urls(self) -> list[str]:
        with self.lock:
            return [u for u, r in self.replicas.items() if r.listed]

    def mark(self, url: str, up: bool, why: str = "", name: Optional[str] = None) -> None:
        with self.lock:
            r = self.replicas.get(url)
            if r is None:
                return
            if name:
                r.name = name
            r.up = up and r.listed
            r.why = "" if r.up else (why or r.why)

    def live(self) -> dict[str, str]:
        """``name -> URL`` of the replicas up (one URL per name: two addresses of one server count once)."""
        with self.lock:
            out: dict[str, str] = {}
            for u, r in sorted(self.replicas.items()):
                if r.up:
                    out.setdefault(r.key, u)
            return out

    def status(self) -> list[dict]:
        with self.lock:
            counts: dict[str, int] = {}
            for u in self.placed.values():
                counts[u] = counts.get(u, 0) + 1
            return [{"url": u, "name": r.name, "up": r.up, "listed": r.listed, "why": r.why,
                     "sessions": counts.get(u, 0)} for u, r in sorted(self.replicas.items())]

    def servers(self) -> list[tuple[str, bool]]:
        """One ``(URL, up)`` per server, sorted by URL, of the listed replicas and those still holding placed
        sessions: what a walk over every server's sessions visits. A server's several addresses count once: an up
        one, listed first (a server back at a new address is walked there, not named down at its old one)."""
        with self.lock:
            held = set(self.placed.values())
            best: dict = {}
            for u, r in sorted(self.replicas.items()):
                if r.listed or u in held:
                    rank = (not r.up, not r.listed, u)
                    if r.key not in best or rank < best[r.key][0]:
                        best[r.key] = (rank, u, r.up)
            return sorted((u, up) for _, u, up in best.values())

    # --- placement

    def new_id(self) -> str:
        """A fresh session id, picked by the client so that it is placed before the server sees it."""
        return new_session_id()

    def place(self, session: str) -> str:
        """The URL of ``session``'s replica: where it was placed, else where it places now (and is kept)."""
        with self.lock:
            url = self.placed.get(session)
            if url is not None:
                return url
        live = self.live()
        if not live:
            raise ReplicaUnavailable(f"no replica is up to take session {session!r} ({self._why()})",
                                     sessions=[session], retry_after=1.0)
        with self.lock:
            return self.placed.setdefault(session, live[rendezvous(session, list(live))])

    def pin(self, session: str, url: Optional[str]) -> Optional[str]:
        """Record ``session`` on ``url`` (a fork lives on its source's replica, whatever its id hashes to; None:
        where it hashes); returns where it was recorded before (None: nowhere)."""
        with self.lock:
            was = self.placed.get(session)
            if url is None:
                self.placed.pop(session, None)
            else:
                self.placed[session] = url
            return was

    def forget(self, session: str) -> None:
        with self.lock:
            self.placed.pop(session, None)

    def where(self, session: str) -> Optional[str]:
        """The URL ``session`` is placed on, or None when it is not placed yet (nothing is recorded)."""
        with self.lock:
            return self.placed.get(session)

    def route(self, session: str) -> str:
        """``place``, and :class:`ReplicaUnavailable` when that replica is down (nothing is sent)."""
        url = self.place(session)
        self._check_up(url, [session])
        return url

    def split(self, sessions: Sequence[str]) -> dict[str, list[int]]:
        """``replica URL -> positions in sessions`` (ascending); :class:`ReplicaUnavailable` naming every session
        of a down replica, before anything is sent."""
        parts: dict[str, list[int]] = {}
        for i, s in enumerate(sessions):
            parts.setdefault(self.place(s), []).append(i)
        with self.lock:
            down = [u for u in parts if not self.replicas.get(u, Replica(u, up=False)).up]
        if down:
            names = [sessions[i] for u in down for i in parts[u]]
            self._check_up(down[0], names)
        return parts

    def _check_up(self, url: str, sessions: list) -> None:
        with self.lock:
            r = self.replicas.get(url)
            if r is not None and r.up:
                return
            why = r.why if r is not None else "it is no longer known"
            label = f"{r.name} ({url})" if r is not None and r.name else url
        raise ReplicaUnavailable(f"replica {label} holding session(s) {', '.join(sessions)[:400]} is unavailable: "
                                 f"{why}. Their state is on that replica: start new sessions (re-prefill), or "
                                 "retry once it is back", sessions=sessions, replica=url, retry_after=1.0)

    def _why(self) -> str:
        with self.lock:
            if not self.replicas:
                return f"{self.endpoints.describe()} named no replica"
            return "; ".join(f"{u}: {r.why}" for u, r in sorted(self.replicas.items()))


def merged_model(infos: list, names: dict) -> dict:
    """``GET /v1/model`` of a set of replicas as one: the first one's, with ``replicas`` (each live replica's
    ``url``, ``name``, ``weights_sha256``, ``slots``, ``limits`` and ``engines``), ``slots`` their sums, and
    ``limits`` the tightest each replica reports (a request must fit whichever replica its sessions live on).
    ``infos``: ``(url, model)`` pairs of the live replicas that answered; ``names``: url -> replica name.
    Raises :class:`ServiceError` (``replica_mismatch``) when they serve different weights."""
    if len({i.get("weights_sha256") for _, i in infos}) > 1:
        e = ServiceError("the replicas serve different weights: " + ", ".join(
            f"{u}: {i.get('weights_sha256')}" for u, i in infos))
        e.code, e.status = "replica_mismatch", 500
        raise e
    info = dict(infos[0][1])
    limits: dict = {}
    for _, i in infos:
        for k, v in (i.get("limits") or {}).items():
            if v is not None:
                limits[k] = v if limits.get(k) is None else min(limits[k], v)
    if limits or "limits" in info:
        info["limits"] = limits
    slots = [i.get("slots") for _, i in infos]
    if all(slots):
        info["slots"] = {k: sum(sl[k] for sl in slots) for k in ("total", "free")}
    info.pop("engines", None)           # per replica, below
    info["replicas"] = [{"url": u, "name": names.get(u), "weights_sha256": i.get("weights_sha256"),
                         "slots": i.get("slots"), "limits": i.get("limits"), "engines": i.get("engines")}
                        for u, i in infos]
    return info


def health_result(status_code: int, headers) -> tuple[bool, str, Optional[str]]:
    """``(up, why, name)`` of a replica from its ``GET /readyz`` answer."""
    # lower case: httpx's headers ignore case, the async client's lean pool keeps lower-case keys
    name = headers.get(REPLICA_HEADER.lower()) if headers is not None else None
    if status_code == 200:
        return True, "", name
    return False, f"GET /readyz answered {status_code}", name


# --- batches split over replicas


def offsets(n_sessions: int, tokens: Optional[Sequence[int]]) -> list[int]:
    """Row offsets of each session's slice of a batch's x, plus the total."""
    out = [0]
    for i in range(n_sessions):
        out.append(out[-1] + (1 if tokens is None else int(tokens[i])))
    return out


def _cat(parts: list):
    if wire._is_torch(parts[0]):
        import torch

        return torch.cat(parts)
    import numpy as np

    return np.concatenate(parts)


@dataclass
class BatchPart:
    url: str
    positions: list          # positions in the batch's sessions
    sessions: list
    x: object
    tokens: Optional[list]
    speculative: object


def maybe_applied(e: BaseException) -> bool:
    """Whether a call to a replica that ended with ``e`` may have been applied there: it was sent and got no answer
    that says it was not (a network failure after the connect, ``504 engine_timeout``, ``OutcomeUnknown``, an
    interrupted call, an error that says ``maybe_applied``); a session it may have created or forked stays placed
    on that replica."""
    if not isinstance(e, Exception):
        return True
    if isinstance(e, ReplicaUnavailable):   # a network failure: unsent when the connect failed, or none was made
        return e.__cause__ is not None and not isinstance(e.__cause__, (*UNSENT_ERRORS, Unreachable))
    return isinstance(e, (OutcomeUnknown, EngineTimeout)) or \
        (isinstance(e, ServiceError) and e.extra.get("maybe_applied") is True)


def split_batch(parts: dict[str, list[int]], sessions, x, tokens, speculative) -> list[BatchPart]:
    """One :class:`BatchPart` per replica, x's rows and the per-session fields cut to its sessions."""
    off = offsets(len(sessions), tokens)
    out = []
    for url, pos in parts.items():
        xs = _cat([x[off[i]:off[i + 1]] for i in pos]) if len(pos) > 1 else x[off[pos[0]]:off[pos[0] + 1]]
        spec = speculative if speculative is None or isinstance(speculative, bool) else \
            [speculative[i] for i in pos]
        out.append(BatchPart(url, pos, [sessions[i] for i in pos], xs,
                             None if tokens is None else [int(tokens[i]) for i in pos], spec))
    return out


def part_position(position, part: BatchPart):
    """The ``position`` list of a batch (one per session, or None) cut to ``part``'s sessions."""
    return None if position is None else [position[i] for i in part.positions]


def join_batch(n_sessions: int, tokens, parts: list[BatchPart], ys: list):
    """y of the whole batch, in the order of its sessions, from each part's y."""
    slices: list = [None] * n_sessions
    for part, y in zip(parts, ys):
        at = 0
        for i in part.positions:
            n = 1 if tokens is None else int(tokens[i])
            slices[i] = y[at:at + n]
            at += n
    return _cat(slices)


def batch_failure(parts: list[BatchPart], outcomes: list) -> Optional[BaseException]:
    """The error to raise for a batch whose parts ended with ``outcomes`` (a result or an exception each), or None.
    The error carries ``applied``: the sessions whose part ran, since parts on other replicas are not undone."""
    errors = [(p, o) for p, o in zip(parts, outcomes) if isinstance(o, BaseException)]
    if not errors:
        return None
    applied = [s for p, o in zip(parts, outcomes) if not isinstance(o, BaseException) for s in p.sessions]
    part, err = errors[0]
    if isinstance(err, ReplicaUnavailable) and len(errors) > 1:
        down = [s for p, o in errors if isinstance(o, ReplicaUnavailable) for s in o.sessions]
        err.sessions = down
    try:
        err.applied = applied
    except AttributeError:  # pragma: no cover - an exception type with slots
        pass
    return err



class SessionsWalk:
    """The walk of a replicated ``list_sessions`` page over the servers (``Router.servers``, sorted by URL): from
    the one its cursor names on, each up server's pages in turn, until one has sessions or the last is done. A
    cursor is the ``next`` of the page before: ``"<URL> <that server's cursor>"`` (``"<URL> "``: its first page).
    A server down (or failing on the network) is passed over and named in the page's ``unavailable``."""

    def __init__(self, servers: Sequence[tuple], cursor: Optional[str]):
        self.walk, self.inner, self.i, self.skipped = list(servers), None, 0, []
        if cursor is not None:
            url, sep, inner = str(cursor).partition(" ")
            urls = [u for u, _up in self.walk]
            if not sep or url not in urls:
                raise ValueError(f"cursor {cursor!r} is not a 'next' of this client's list_sessions (or its replica "
                                 "left): start again from None")
            self.i, self.inner = urls.index(url), inner or None

    def server(self) -> Optional[str]:
        """The URL to ask next (``self.inner``: its cursor), passing over the servers down; None: none left."""
        while self.i < len(self.walk) and not self.walk[self.i][1]:
            self.failed()
        return self.walk[self.i][0] if self.i < len(self.walk) else None

    def failed(self) -> None:
        self.skipped.append(self.walk[self.i][0])
        self.i, self.inner = self.i + 1, None

    def page(self, page: dict) -> Optional[dict]:
        """The page to return for the server's ``page`` (its infos tagged with ``replica``), or None to go on to
        the next server (this one had no more sessions)."""
        url = self.walk[self.i][0]
        for info in page["sessions"]:
            info["replica"] = url
        inner = page.get("next")
        if inner is not None:
            nxt = f"{url} {inner}"
        else:
            nxt = f"{self.walk[self.i + 1][0]} " if self.i + 1 < len(self.walk) else None
        if page["sessions"] or nxt is None or inner is not None:
            return {"sessions": page["sessions"], "next": nxt, "unavailable": self.skipped}
        self.i, self.inner = self.i + 1, None
        return None

    def done(self) -> dict:
        return {"sessions": [], "next": None, "unavailable": self.skipped}
