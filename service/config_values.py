"""What one setting's value may be, checked before the settings meet each other (:mod:`.config` has those
checks): lists of integers as flags and variables give them, an API key, the default replica name, a device; and
the error a configuration problem raises (:class:`ConfigError`)."""

from __future__ import annotations

import json
import re
from typing import Any


def int_list(v: Any, name: str) -> Any:
    """Accept ``[1, 2]``, ``"1,2"``, ``"[1, 2]"`` or a single int / ``"4"`` (left as an int)."""
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            try:
                return json.loads(s)
            except ValueError:
                raise ValueError(f"{name}: {v!r} is not a JSON list of integers") from None
        parts = [p.strip() for p in s.split(",") if p.strip()]
        if not parts:
            raise ValueError(f"{name}: empty value")
        try:
            ints = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{name}: {v!r} is not an integer or a comma-separated list of integers") from None
        return ints[0] if len(ints) == 1 and "," not in s else ints
    return v


def check_key(key: str, name: str) -> None:
    """An API key travels in a header (``Authorization: Bearer <key>``): visible ASCII, spaces and tabs only
    between them (a header value's characters). Says nothing of the key itself in the error (it is a secret)."""
    if not re.fullmatch(r"[!-~](?:[ \t!-~]*[!-~])?", key):
        raise ValueError(f"{name}: an API key must be visible ASCII characters (it is sent in an HTTP header); "
                         "generate one with: python -c 'import secrets; print(secrets.token_urlsafe())'")


def default_replica_name() -> str:
    """The pod's name on Kubernetes (HOSTNAME is set to it, and to the container id by Docker), else the host
    name; a stable name for X-Convserve-Replica without configuration."""
    import os
    import socket

    name = os.environ.get("HOSTNAME", "").strip() or socket.gethostname() or "convserve"
    return name if re.fullmatch(r"[!-~]{1,253}", name) else "convserve"


class ConfigError(ValueError):
    """A configuration problem, with a message that says what to change."""


#: one entry of ``device`` / ``devices``
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def one_device(d: str, n_cuda: int) -> str:
    """One entry of ``devices`` as its engine's device: ``cuda`` is ``cuda:0``; an index torch does not see is a
    :class:`ConfigError`."""
    if not d.startswith("cuda"):
        return d
    i = int(d.split(":")[1]) if ":" in d else 0
    if i >= n_cuda:
        raise ConfigError(f"devices: {d} was asked for but torch sees {n_cuda} CUDA device(s); use 'all', cpu, or "
                          "an index below that")
    return f"cuda:{i}"
