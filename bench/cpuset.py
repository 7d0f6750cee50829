"""The benchmarks' CPU lists (``--server-cpus`` / ``--client-cpus``), parsed in one place."""

from __future__ import annotations

from typing import Optional


def cpu_set(text: Optional[str]) -> Optional[set]:
    """``"0-7"``, ``"0,1,2"`` or ``"0-3,8-11"`` as a set of CPU numbers; None for None or empty."""
    if not text:
        return None
    out = set()
    for part in str(text).split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out
