"""What the server's counters say about one leg of ``bench_service.py``: its engine's steps, rows and times
(before and after the leg, from ``/metrics`` or the in-process ``Engine.stats()``), and how the HTTP workers share
the client's connections."""

from __future__ import annotations

import re


def engine_delta(a: dict, b: dict) -> dict:
    steps = b["steps"] - a["steps"]
    if steps <= 0:
        return {}
    return {"steps": steps, "rows_per_step": (b["rows"] - a["rows"]) / steps,
            "kernel_us_per_step": (b["kernel_s"] - a["kernel_s"]) / steps * 1e6,
            "host_us_per_step": (b["host_s"] - a["host_s"]) / steps * 1e6,
            "step_us": (b["step_s"] - a["step_s"]) / steps * 1e6}


def engine_counters(stats: dict) -> dict:
    return {"steps": stats["steps"], "rows": stats["batch_size"]["sum"], "kernel_s": stats["kernel_time_s"],
            "host_s": stats["host_time_s"], "step_s": stats["step_time_s"]}


METRICS = {"steps": "convserve_engine_batch_size_count", "rows": "convserve_engine_batch_size_sum",
           "kernel_s": "convserve_kernel_seconds_total", "host_s": "convserve_engine_host_seconds_total",
           "step_s": "convserve_engine_step_seconds_total"}


def scrape(url: str) -> dict:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for key, name in METRICS.items():        # summed over series: with engine processes one per engine
        out[key] = sum(map(float, re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)))
    return out


def worker_connections(url: str) -> dict:
    """``{worker index: client connections it holds open}`` (each worker's ``convserve_worker_connections``,
    published about once a second); empty with the engine in the HTTP process, or when the scrape fails."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = re.findall(r'^convserve_worker_connections{worker="(\d+)"} ([0-9.eE+-]+)$', text, re.M)
    return {int(w): int(float(v)) for w, v in sorted(found, key=lambda f: int(f[0]))}
