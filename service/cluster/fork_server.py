"""How the supervisor starts its children: forked from multiprocessing's fork server, which has imported torch once.

A child started by ``spawn`` imports torch itself, a few seconds of one core each time: at start-up for every
engine and worker, and again for every restart after a crash, while its sessions wait. The fork server is a fresh
interpreter (started, like a spawned child, with nothing of the supervisor's memory, threads or descriptors) that
imports :data:`PRELOAD` and then forks a child per start, so a child begins with torch imported and shares its
pages with the others. It imports modules only: no CUDA call, no thread, no state a fork could not carry; each
child initializes its device after the fork, as a spawned one did.

The fork server is a child of the supervisor. It exits once no process holds the write end of its pipe: the
supervisor, and each child until it closes its copy (:func:`.lifeline.hold`), so in effect with the supervisor,
``kill -9`` included. It blocks SIGTERM and ignores SIGINT (:mod:`.fork_server_preload`). The children are the fork
server's, and it reports their exits to the supervisor, so :func:`.lifeline.hold` watches both. A child takes its
environment and its stdout and stderr from the fork server, which took the supervisor's when it started (one
fork server serves every supervisor run in one Python process): what a child needs from the supervisor's current
state comes in its spec.
"""

from __future__ import annotations

import multiprocessing as mp

#: what the fork server imports before its first fork: the libraries the children need that take long to import
#: (not ours, and nothing that reads per-run settings from the environment at import time, as prometheus-client
#: does)
PRELOAD = ("convserve.service.cluster.fork_server_preload", "torch", "triton", "numpy", "msgpack", "zmq", "fastapi",
           "uvicorn", "pydantic_settings")


def context():
    """The multiprocessing context children are started from: the fork server, or ``spawn`` on a platform
    without one."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
