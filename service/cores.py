"""The CPUs this process may use: its affinity mask, no more than its cgroup's CPU limit (a container's
``docker --cpus``, a Kubernetes CPU limit). ``workers: auto`` and ``engine_busy_poll_us: auto`` are sized from it."""

from __future__ import annotations

from typing import Optional

#: where a container's CPU limit is read: cgroup v2's cpu.max ("<quota> <period>" or "max <period>"), else v1's
CGROUP_CPU_FILES = ("/sys/fs/cgroup/cpu.max", ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                                               "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def _cgroup_cpus() -> Optional[float]:
    """The CPUs this process's cgroup may use (``docker --cpus 2``, a Kubernetes CPU limit), or None when it has
    no limit or none can be read."""
    v2, (quota_v1, period_v1) = CGROUP_CPU_FILES
    try:
        with open(v2) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(quota_v1) as f, open(period_v1) as g:
                quota, period = f.read().strip(), g.read().strip()
        except (OSError, ValueError):
            return None
    if quota in ("max", "-1"):
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), no more than its cgroup's CPU limit (rounded up)."""
    import math
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = _cgroup_cpus()
    return cores if limit is None else max(1, min(cores, math.ceil(limit)))
