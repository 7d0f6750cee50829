"""The convserve command line: `convserve serve [flags]` starts the HTTP service under uvicorn.

Every setting (service/config.py) is a flag (--max-body-bytes), an environment variable
(CONVSERVE_MAX_BODY_BYTES) and a config-file key (--config FILE, TOML or JSON). Flags win over the
environment, which wins over the file.

On SIGTERM (or Ctrl-C) the server stops intake (new connections are refused, idle keep-alive connections are
closed, /readyz and requests that still reach an open connection get 503 not_ready), lets in-flight
requests, streams and WebSockets finish for up to --shutdown-timeout-s in all, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

try:
    from convserve.service.config import ConfigError, Settings, load_settings
except ModuleNotFoundError:             # a client-only install: main() names what is missing
    pass

log = logging.getLogger("convserve.cli")

EXIT_CONFIG = 2
EXIT_FAILED = 1
#: the modules ``convserve serve`` imports that a client-only install (``pip install convserve``) lacks
SERVER_MODULES = ("pydantic", "pydantic_settings", "fastapi", "uvicorn", "prometheus_client", "zmq", "torch",
                  "triton")


def missing_server_modules() -> list:
    """The server's dependencies this Python cannot import (none on a ``convserve[server]`` install)."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):     # a parent package missing, or a stand-in in sys.modules
            return True

    return [m for m in SERVER_MODULES if absent(m)]


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = "CONVSERVE_" + name.upper()
        default = field.default
        if name in ("api_key", "api_key_file") or default is None:
            default = "unset"
        elif isinstance(default, (list, tuple)):         # as the flag takes it: 1,2,4
            default = ",".join(map(str, default))
        help_ = f"{field.description} [env {env}; default {default}]"
        if field.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_)
        else:
            p.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(), help=help_)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convserve", description="Serve the causal depthwise conv1d stage of "
                                "Mamba/hybrid LLMs over HTTP/msgpack.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the HTTP service", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--config", type=Path, default=None, help="TOML or JSON file of settings [env CONVSERVE_CONFIG]")
    s.add_argument("--print-config", action="store_true", help="print the resolved settings as JSON and exit")
    _add_settings_flags(s)
    return p


def build_engine(settings: Settings):
    """The model and the (not yet started) engine the settings describe."""
    import torch

    from convserve.service.engine import Engine, EngineConfig
    from convserve.service.model import ConvModel

    device = settings.resolved_device()
    # CPU: the engine's ops are the process's only heavy torch work; more intra-op threads than that compete with
    # the HTTP loop and the engine thread for the same cores. CUDA: the host side only copies small tensors, where
    # a pool of spinning intra-op threads costs the other processes on the node their cores.
    torch.set_num_threads(settings.cpu_threads if device.startswith("cpu") else 1)
    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    if settings.weights is not None:
        model = ConvModel.from_safetensors(settings.weights, dtype=dtype)
        if model.partial_bias:        # no checkpoint of the families served mixes them: a conversion that lost some?
            log.warning("some conv layers have no conv1d.bias while others do: they are served with zero bias",
                        extra={"without_bias": model.partial_bias, "with_bias": model.bias_layers})
    else:
        model = ConvModel.random(layers=settings.layers, dim=settings.dim, width=settings.width,
                                 dtype=dtype or torch.bfloat16, seed=settings.seed)
    return Engine(model, EngineConfig.from_settings(settings), device=device)


def _redacted(settings: Settings) -> dict:
    d = json.loads(settings.model_dump_json())
    if d.get("api_key"):
        d["api_key"] = "***"
    return d


class Server:
    """uvicorn's server, with a drain before its shutdown and a clean exit code on SIGTERM."""

    def __new__(cls, config, svc):
        import uvicorn

        class _Server(uvicorn.Server):
            def __init__(self, config, svc):
                super().__init__(config)
                self.svc = svc
                self.loop: Optional[asyncio.AbstractEventLoop] = None
                self.bound_port: Optional[int] = None
                self.failed = False

            async def startup(self, sockets=None):
                self.loop = asyncio.get_running_loop()
                await super().startup(sockets)
                serving = getattr(self.svc.engine, "serving", None)   # a worker process's (service/cluster/health.py)
                if serving is not None:
                    serving(lambda: len(self.server_state.connections))
                if self.servers and self.servers[0].sockets:
                    host, port = self.servers[0].sockets[0].getsockname()[:2]
                    self.bound_port = port
                    path = getattr(self.svc.settings, "uds", None)
                    uds = {"uds": str(path)} if path is not None else {}
                    log.info("listening", extra={"host": host, "port": port, "url": f"http://{host}:{port}", **uds})

            def handle_exit(self, sig, frame):
                if self.loop is not None and not self.svc.draining:
                    self.loop.call_soon_threadsafe(self.svc.start_draining)
                super().handle_exit(sig, frame)
                # A graceful stop on SIGTERM or Ctrl-C (SIGINT) is the normal end: exit 0 instead of re-raising the
                # signal (uvicorn re-raises each signal it caught once it has shut down)
                if sig in (signal.SIGTERM, signal.SIGINT) and sig in self._captured_signals:
                    self._captured_signals.remove(sig)

            def fatal(self, exc):
                self.failed = True
                self.should_exit = True

            async def shutdown(self, sockets=None):
                self.svc.start_draining()
                for server in self.servers:  # stop accepting connections now, not after the streams end
                    server.close()
                # one shutdown_timeout_s for the whole drain, from the signal (svc.drain_deadline): what the streams
                # took is not granted again to uvicorn's wait, nor to the engine's stop after it (else a stream held
                # open drains for twice the budget, past the supervisor's grace)
                await self.svc.wait_pipelines(max(self.svc.drain_deadline - time.monotonic(), 0.0))
                self.config.timeout_graceful_shutdown = max(self.svc.drain_deadline - time.monotonic(), 0.1)
                await super().shutdown(sockets)

        return _Server(config, svc)


def bind_socket(settings: Settings, listen: bool = True):
    """The listening socket (shared by every worker process, which inherit it). ``listen=False``: bound only (the
    port is ours, connections are still refused); the caller calls ``listen(settings.backlog)`` once it serves."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(settings.backlog)
    sock.set_inheritable(True)
    return sock


def cannot_listen(settings: Settings, e: OSError) -> str:
    """The one line ``serve`` ends with when :func:`bind_socket` fails (the port is taken, or not ours), whichever
    the layout (engine processes, or ``--workers 0``); the exit status is 2."""
    import errno

    log.error("cannot listen", extra={"host": settings.host, "port": settings.port, "error": str(e)})
    if isinstance(e, socket.gaierror):            # a --host that is no address and no name that resolves
        fix = "--host must be an address of this machine or a name that resolves to one (0.0.0.0 for every " \
              "interface, 127.0.0.1 for this machine only)"
    elif e.errno == errno.EADDRNOTAVAIL:
        fix = "the address is not one of this machine's: pick another --host (0.0.0.0 for every interface)"
    elif e.errno == errno.EACCES:
        fix = "a port below 1024 needs privileges: pick another --port (--port 0 picks a free one)"
    elif e.errno == errno.EADDRINUSE:
        fix = "stop what holds it or pick another --port (--port 0 picks a free one)"
    else:
        fix = "check --host and --port"
    return f"cannot listen on {settings.host}:{settings.port} ({e.strerror or e}); {fix}"


#: descriptors a process needs besides its connections: the listening socket, logs, the engine links, the shared
#: memory, the prometheus files, the parser threads
FD_RESERVE = 256
#: the WebSocket layer's largest message, in units of max_body_bytes (see serve's uvicorn.Config)
WS_MESSAGE_LIMIT = 2


def ensure_fd_limit(max_connections: int) -> None:
    """Raise this process's soft descriptor limit (inherited by its children) to hold ``max_connections`` plus
    :data:`FD_RESERVE`, up to the hard limit; :class:`ConfigError` when the hard limit is lower. Above the limit
    ``accept`` fails with EMFILE and the server stops accepting, health probes included."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ConfigError(f"max_connections: {max_connections} connections need {need} file descriptors, "
                              f"above this process's hard limit of {hard}; lower --max-connections or raise the "
                              "limit (ulimit -n, LimitNOFILE=, the container's nofile ulimit)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


#: the smallest block glibc maps on its own (given back to the system when freed), and the largest it allows
MMAP_MIN, MMAP_MAX = 1 << 20, 32 << 20
#: mallopt's parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def tune_malloc(keep_bytes: int) -> None:
    """glibc raises its mmap threshold to the size of each mmapped block freed (up to 32 MiB), after which large
    bodies are carved from the heap and their pages stay resident after they are freed: a few 60 MiB bodies left
    the RSS 10 % higher for good. Fixed thresholds (which also turn that adaptation off) bound what stays: blocks
    of ``keep_bytes / 2`` or more (at least 1 MiB) get their own mapping, given back when freed, and free memory
    at the top of each of glibc's heaps is given back past ``keep_bytes`` (free blocks inside a heap stay, as
    always), so the bodies of a steady stream of requests reuse memory that is already paged in instead of faulting
    in fresh pages every time."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(M_MMAP_THRESHOLD, min(max(keep_bytes // 2, MMAP_MIN), MMAP_MAX))
        if keep_bytes:
            libc.mallopt(M_TRIM_THRESHOLD, keep_bytes)
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not glibc: nothing to tune
        pass


def run_app(settings: Settings, app, sockets=None) -> int:
    """Serve ``app`` under uvicorn until SIGTERM (on ``sockets`` when given, else on the settings' address)."""
    import uvicorn

    from convserve.service import logs
    from convserve.service.gcfreeze import thaw
    from convserve.service.http.conn import droppable_ws_protocol, guarded_protocol

    # the HTTP protocol is uvicorn's, with a header timeout, a header size limit and the connection cap
    # (service/http/conn.py): uvicorn has no header timeout, and its limit_concurrency counts a connection only
    # once its headers are complete, so it is left unset. The WebSocket layer's message limit is above
    # max_body_bytes: a message over max_body_bytes reaches the stream, which answers the frames before it, then
    # sends the 413 frame and closes 1009; the layer itself would close at once, dropping those answers
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, loop="auto", ws=droppable_ws_protocol(), lifespan="on",
        http=guarded_protocol(settings, on_close=app.state.metrics.connection_closed),
        log_config=logs.log_config(settings.log_level, settings.access_log), access_log=False, server_header=False,
        timeout_graceful_shutdown=max(settings.shutdown_timeout_s, 0.1),
        ws_max_size=WS_MESSAGE_LIMIT * settings.max_body_bytes, ws_per_message_deflate=False,
        backlog=settings.backlog, timeout_keep_alive=settings.keep_alive_s,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    tune_malloc(settings.heap_keep_bytes)
    app.state.freeze_gc = True     # this process serves until it exits: see service/gcfreeze.py
    server = Server(config, app.state.svc)
    app.state.on_fatal = server.fatal
    server.run(sockets=sockets)
    thaw()                         # the interpreter's exit sees every object again (service/gcfreeze.py)
    if server.failed or app.state.svc.failed is not None:
        return EXIT_FAILED
    return 0


def serve(settings: Settings, key_on_command_line: bool = False) -> int:
    """Run the server until it stops; its exit status. The state directory's lock is released on every return."""
    held: list = []                     # descriptors kept open while the server runs (the state directory's lock)
    try:
        return _serve(settings, key_on_command_line, held)
    finally:
        for fd in held:
            os.close(fd)


def _serve(settings: Settings, key_on_command_line: bool, held: list) -> int:
    from convserve.service import logs

    logs.configure(settings.log_level, secrets=[settings.api_key_value()], access=settings.access_log)
    try:
        devices = settings.resolved_devices()
        ensure_fd_limit(settings.max_connections)
    except ConfigError as e:
        print(f"convserve: {e}", file=sys.stderr)
        return EXIT_CONFIG
    workers = settings.resolved_workers(len(devices))
    if workers > 0:
        logs.set_process("supervisor")
    if key_on_command_line:     # after set_process: every line of a multi-process server names its process
        log.warning("the API key was given with --api-key, which every user of this machine can read in the "
                    "process list; use --api-key-file or CONVSERVE_API_KEY instead")
    log.info("starting", extra={"settings": _redacted(settings), "workers": workers, "engines": devices})
    if settings.state_dir is not None:
        from convserve.service.snapshots import lock_state_dir, prepare_state_dir

        try:
            # held (open) until this process exits: the engine processes and workers are its children
            held.append(lock_state_dir(settings.state_dir))
            prepare_state_dir(settings.state_dir, len(devices) if workers > 0 else 1)
        except OSError as e:
            log.error("cannot use the state directory", extra={"state_dir": str(settings.state_dir),
                                                               "error": str(e)})
            from convserve.service.snapshots import StateDirInUse

            fix = "" if isinstance(e, StateDirInUse) else (   # (its message says what to do)
                "; give --state-dir a directory this user can create and write (it is created if missing), on a "
                "persistent volume")
            print(f"convserve: state_dir: cannot use {settings.state_dir}: {e.strerror or e}{fix}", file=sys.stderr)
            return EXIT_CONFIG
    if workers > 0:
        from convserve.service.cluster.supervisor import Supervisor

        supervisor = Supervisor(settings, devices, workers)
        rc = supervisor.run()
        if supervisor.timed_out:
            print(f"convserve: {supervisor.start_error}", file=sys.stderr)
            return rc
        if rc == 2:
            print(f"convserve: {supervisor.start_error or 'the engine could not be built; see the log above'}",
                  file=sys.stderr)
            return EXIT_CONFIG
        return _stopped(rc)
    # --workers 0: the engine in this process, beside the HTTP loop
    from convserve.service.unix_listener import bind_unix, cannot_listen_unix

    sys.setswitchinterval(settings.gil_switch_interval_us * 1e-6)
    try:       # before the model is built, as the supervisor does: a taken port is one line and exit 2
        sock = bind_socket(settings)
    except OSError as e:
        print(f"convserve: {cannot_listen(settings, e)}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        unix = bind_unix(settings)
    except OSError as e:
        sock.close()
        print(f"convserve: {cannot_listen_unix(settings, e)}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return _serve_here(settings, devices, sock, unix)
    finally:
        if unix is not None:
            unix.close()


def _serve_here(settings: Settings, devices: list, sock, unix) -> int:
    """``--workers 0``: build the engine and serve it on ``sock`` (and ``unix``, a :class:`UnixListener`)."""
    from convserve.service.http.app import create_app

    try:
        engine = build_engine(settings.model_copy(update={"device": devices[0]}))
    except (ConfigError, ValueError, OSError) as e:
        log.error("cannot build the model", extra={"error": str(e)})
        print(f"convserve: cannot build the model: {e}", file=sys.stderr)
        sock.close()
        return EXIT_CONFIG
    snapshots = None
    if settings.state_dir is not None:
        from convserve.service.snapshots import Snapshotter

        snapshots = Snapshotter(engine, settings, 0, 1, devices[0])
    app = create_app(settings, engine, snapshots=snapshots)
    rc = run_app(settings, app, sockets=[sock] + ([unix.sock] if unix is not None else []))
    if app.state.svc.failed is not None:      # the engine's start failed (its state pool, its warm-up): as a build
        print(f"convserve: the engine cannot start: {app.state.svc.failed}", file=sys.stderr)
        return EXIT_CONFIG
    if rc == 0 and snapshots is not None and snapshots.final_failed:
        rc = EXIT_FAILED         # the sessions since the last good snapshot are lost: say so to whatever restarts us
    return _stopped(rc)


def _stopped(rc: int) -> int:
    """The last log line of a serve that ran: ``stopped``, or, for a non-zero exit (a process that failed to stop
    cleanly, a final snapshot not written), an error saying so."""
    if rc == 0:
        log.info("stopped")
    else:
        log.error("stopped with a failure (see the errors above: a process did not stop cleanly, or a final "
                  "snapshot was not written)", extra={"exit_code": rc})
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    missing = missing_server_modules()
    if missing:
        print(f"convserve: the server's dependencies are not installed (no module {', '.join(map(repr, missing))}): "
              "pip install 'convserve[server]' (the client and convserve-loadtest work without them)",
              file=sys.stderr)
        return EXIT_CONFIG
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
        try:
            settings = load_settings(overrides, args.config)
        except ConfigError as e:
            print(f"convserve: {e}", file=sys.stderr)
            return EXIT_CONFIG
        if args.print_config:
            try:
                devices = settings.resolved_devices()
            except ConfigError as e:      # CUDA asked for on a machine without it: what serve would say
                print(f"convserve: {e}", file=sys.stderr)
                return EXIT_CONFIG
            # what "auto" and unset resolve to on this machine (the engine settles the rest at start, logged)
            derived = {"devices": devices, "workers": settings.resolved_workers(len(devices)),
                       "engine_reply_timeout_s": settings.engine_reply_timeout(),
                       "engine_busy_poll_us": settings.resolved_busy_poll_us(len(devices))}
            print(json.dumps({**_redacted(settings), "derived": derived}, indent=2))
            return 0
        return serve(settings, key_on_command_line="api_key" in overrides)
    return EXIT_CONFIG  # pragma: no cover - argparse requires a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
