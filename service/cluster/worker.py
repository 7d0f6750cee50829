"""One HTTP worker process: the ASGI app of :mod:`convserve.service.http` under uvicorn, on the socket the
supervisor bound, with a :class:`.remote.RemoteEngine` as its engine."""

from __future__ import annotations

import os

import msgpack

from .lifeline import exit_now, hold


def main(spec: dict) -> None:
    """The target of one worker process (:mod:`.fork_server`)."""
    from convserve.service import logs
    from convserve.service.cli import run_app
    from convserve.service.http.app import create_app

    from .client_blocks import client_direct
    from .remote import RemoteEngine
    from .split_batch import batch_limits

    import torch

    # a worker's torch work is memory copies of one request at a time: intra-op threads would only spin against
    # the other workers and the engines for the same cores
    torch.set_num_threads(1)
    settings = spec["settings"]
    logs.configure(settings.log_level, secrets=[settings.api_key_value()], access=settings.access_log)
    logs.set_process(f"worker-{spec['index']}")
    hold(spec)
    with open(os.path.join(spec["run_dir"], "model.msgpack"), "rb") as f:
        info = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    engine = RemoteEngine(spec["run_dir"], spec["devices"], spec["index"], spec["generation"], info,
                          settings.shm_bytes, settings.check_finite, settings.engine_reply_timeout(),
                          settings.engine_down_unhealthy_s, settings.engine_stats_timeout_s,
                          limits=batch_limits(settings), client_direct=client_direct(settings, spec["devices"]),
                          workers=spec["workers"])
    app = create_app(settings, engine)
    exit_now(run_app(settings, app, sockets=spec["sockets"]))
