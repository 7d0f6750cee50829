"""Timestamps for ``bench/lone_trace.py``, in every process of a traced server (imported at start-up through
``PYTHONPATH`` when ``LONE_TRACE_DIR`` is set; it does nothing otherwise).

Each traced function (``TARGETS``) records ``(name, perf_counter_ns)`` on entry and ``(name:end, ...)`` on exit;
``perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for every process of the host. The classes are patched
once their modules are imported (a thread polls ``sys.modules``: the server imports them long after start-up);
each process writes its events to ``<dir>/trace-<pid>.json`` every second. A forked child starts afresh.
"""

import inspect
import json
import os
import sys
import threading
import time

DIR = os.environ.get("LONE_TRACE_DIR")
#: (module, class or None for module functions, functions)
TARGETS = [
    ("convserve.service.http.unary", "_UnaryEndpoint", ["__call__"]),
    ("convserve.service.http.unary", "BatchEndpoint", ["parse", "submit"]),
    ("convserve.service.http.unary", None, ["wait_result", "read_body", "send_bytes", "render"]),
    ("convserve.service.cluster.remote", "RemoteEngine", ["submit_batch_async", "_on_reply", "_flush"]),
    ("convserve.service.cluster.channel", "Channel", ["send"]),
    ("convserve.service.cluster.engine_proc", "EngineProcess", ["_handle", "_answered", "_flush"]),
    ("convserve.service.engine.intake", "Intake", ["submit_batch_to"]),
    ("convserve.service.engine.loop", "Worker", ["_step", "_record_step"]),
    ("convserve.service.engine.runner", "Runner", ["execute"]),
]
EVENTS: list = []


def _wrap(owner, name: str, tag: str) -> None:
    f = getattr(owner, name)
    clock, events = time.perf_counter_ns, EVENTS
    if inspect.iscoroutinefunction(f):
        async def traced(*a, **k):
            events.append((tag, clock()))
            try:
                return await f(*a, **k)
            finally:
                events.append((tag + ":end", clock()))
    else:
        def traced(*a, **k):
            events.append((tag, clock()))
            try:
                return f(*a, **k)
            finally:
                events.append((tag + ":end", clock()))
    setattr(owner, name, traced)


def _patcher() -> None:
    todo = list(TARGETS)
    while todo:
        for t in list(todo):
            mod, cls, names = t
            m = sys.modules.get(mod)
            if m is None or (cls is not None and not hasattr(m, cls)):
                continue
            owner = m if cls is None else getattr(m, cls)
            for n in names:
                if hasattr(owner, n):
                    _wrap(owner, n, f"{cls or mod.rsplit('.', 1)[1]}.{n}")
            todo.remove(t)
        time.sleep(0.01)


def _writer() -> None:
    while True:
        time.sleep(1.0)
        tmp = f"{DIR}/trace-{os.getpid()}.json.tmp"
        with open(tmp, "w") as fh:
            json.dump({"argv": sys.argv[:2], "events": EVENTS[-400_000:]}, fh)
        os.replace(tmp, tmp[:-4])


def _start() -> None:
    EVENTS.clear()
    threading.Thread(target=_patcher, daemon=True).start()
    threading.Thread(target=_writer, daemon=True).start()


if DIR:
    _start()
    os.register_at_fork(after_in_child=_start)
