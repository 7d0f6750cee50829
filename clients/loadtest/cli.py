"""convserve-loadtest: drive a running convserve server with virtual sessions and report what a frontend sees.

Examples:

    convserve-loadtest --url http://127.0.0.1:8000 --concurrency 1,8,64,256 --duration 10 --out results/
    convserve-loadtest --scenario mixed --rate 200,400,800 --duration 15 --transport stream --inflight 32
    convserve-loadtest --scenario spec --requests 2000 --verify --verify-sample 0.2
    convserve-loadtest --concurrency 64 --duration 10 --compare results/loadtest.json --regress-pct 10
    convserve-loadtest --scenario frontend --concurrency 1,256 --chunk 512 --spec-k const:4 --duration 10

Exit status: 0 done; 1 errors happened and --fail-on-errors was given, or (with or without it) a step
measured nothing, the server could not be reached during a step (connection errors: it went away, or refused
connections), or sessions could not be confirmed deleted; 2 bad arguments, a --compare baseline of other
settings, or the server could not be reached; 3 --compare found a regression past --regress-pct; 4
--verify found a response that differs from the reference, or checked none; 130 / 143 interrupted by SIGINT /
SIGTERM (the step in progress is cut off and its sessions deleted; the partial results are printed and written).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import platform
import signal
import sys
import time
from typing import Optional, Sequence

from convserve.clients.loadtest.arguments import FROM_SERVER, build_parser, check_args, step_labels
from convserve.clients.loadtest.outcome import EXIT_USAGE, exit_status

def _verify_label(verify, info: dict) -> Optional[str]:
    if verify is None:
        return None
    if verify is FROM_SERVER:
        return f"GET /v1/model/weights (sha256 {info.get('weights_sha256')})"
    return str(verify)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    check_args(parser, args)
    baseline = None
    if args.compare is not None:
        try:
            baseline = json.loads(args.compare.read_text())
        except (OSError, ValueError) as e:
            print(f"convserve-loadtest: --compare {args.compare}: cannot read a JSON result ({e})", file=sys.stderr)
            return EXIT_USAGE
        # checked before the load runs: a run with no step to compare would be wasted
        planned = step_labels(args)
        base = [st.get("label") for st in baseline.get("steps", [])] if isinstance(baseline, dict) else []
        if not set(planned) & set(base):
            print(f"convserve-loadtest: --compare {args.compare}: none of this run's steps {planned} is in the "
                  f"baseline (its steps: {base}); steps are matched by label: run the same --concurrency or "
                  "--rate levels", file=sys.stderr)
            return EXIT_USAGE
    args.baseline = baseline
    try:
        result = _run_loop(run(args), args.loop)
    except SetupError as e:
        print(f"convserve-loadtest: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, asyncio.CancelledError):     # a second interrupt: out now, without results
        return 130
    from rich.console import Console

    from convserve.clients.loadtest import report

    console = Console(width=None if sys.stdout.isatty() else 200)
    report.print_table(result, console)
    if args.out is not None:
        paths = report.write_outputs(result, args.out)
        console.print("wrote " + ", ".join(str(p) for p in paths.values()))
        if "png" not in paths:
            console.print("no loadtest.png: the plot needs matplotlib (pip install 'convserve[loadtest]')",
                          markup=False)
    sig = result.get("interrupted")
    if sig:
        print(f"convserve-loadtest: interrupted by {sig}: the figures above are partial (the step in progress "
              "was cut off; later steps did not run)", file=sys.stderr)
        return 128 + int(getattr(signal, sig))
    return exit_status(result, args, baseline, console)


class SetupError(Exception):
    pass


def _loop_name(kind: str) -> str:
    if kind == "auto":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
        return "uvloop"
    return kind


def _run_loop(coro, kind: str):
    """Run ``coro`` on uvloop (``kind`` "uvloop", or "auto" when it is installed) or asyncio's own loop. The load
    generator is one Python thread whose event loop is most of its cost per request; uvloop's is cheaper (it is
    also what bench/bench_service.py's client runs on)."""
    if _loop_name(kind) == "uvloop":
        try:
            import uvloop
        except ImportError:
            coro.close()
            raise SetupError("--loop uvloop: uvloop is not installed (pip install uvloop, or use --loop asyncio)") \
                from None
        if hasattr(uvloop, "run"):
            return uvloop.run(coro)
        loop = uvloop.new_event_loop()   # uvloop < 0.18
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(coro)
        finally:
            asyncio.set_event_loop(None)
            loop.close()
    return asyncio.run(coro)


#: Allocations (net of frees) between young-generation collections while a sweep runs; CPython's default is 700.
GC_THRESHOLD0 = 50_000


class _QuietGC:
    """Cyclic GC settings for the measured part of a run, restored on exit.

    With CPython's defaults the collector's cost per request grows with the concurrency: a request's objects
    (coroutines, futures, buffers, tensors) live as long as it is in flight, so at a few hundred sessions every
    young-generation collection finds thousands of them alive and promotes them, and the promotions soon trigger
    a full collection that also walks every object of the imported libraries (bench/NOTES.md has the
    measurement). So: freeze what exists after setup (it is never garbage) out of the collector's
    sight, and collect the young generation every ``GC_THRESHOLD0`` allocations instead of every 700 (cycles are
    still collected, only less often)."""

    def __enter__(self):
        import gc

        self.threshold = gc.get_threshold()
        self.frozen_before = gc.get_freeze_count()
        gc.collect()
        gc.freeze()
        gc.set_threshold(max(GC_THRESHOLD0, self.threshold[0]), *self.threshold[1:])
        return self

    def __exit__(self, *exc):
        import gc

        gc.set_threshold(*self.threshold)
        if not self.frozen_before:   # else the caller had frozen objects of its own: leave the freeze alone
            gc.unfreeze()
        return False


async def run(args) -> dict:
    import httpx

    from convserve.clients.client import AsyncConvClient
    from convserve.clients.loadtest.dists import parse
    from convserve.clients.loadtest.frontend import FrontendDriver
    from convserve.clients.loadtest.limits import (ARENA, LIMITS_REFRESH_S, ChunkError, Limits, choose_chunk,
                                                  limit_words, replicas_down)
    from convserve.clients.loadtest.runner import Driver, Workload, auto_connections, make_transport
    from convserve.clients.loadtest.stats import Recorder
    from convserve.clients.loadtest.verify import Verifier, VerifyError, served_weights
    from convserve.clients.protocol.errors import ServiceError

    frontend = args.scenario == "frontend"
    if frontend and args.transport not in (None, "unary", "ws"):
        raise SetupError(f"--transport {args.transport} does not apply to --scenario frontend: it sends one POST "
                         "/v1/conv/batch per layer call (unary), or one batch frame on a WebSocket (ws); choose one "
                         "of those")
    if frontend and args.transport == "ws" and args.url and (len(args.url) > 1 or args.url[0].startswith("dns://")):
        raise SetupError("--transport ws keeps the frontend on one WebSocket to one server; over several replicas "
                         "leave it out (its POSTs are split across replicas)")
    args.transport = args.transport or "unary"
    mode = "closed" if args.concurrency is not None else "open"
    levels = args.concurrency if mode == "closed" else args.rate
    labels = step_labels(args)
    top = max(levels)
    n_conn = max(8, min(1024, int(top) * 4 if mode == "closed" else args.max_inflight))
    url = args.url[0] if args.url and len(args.url) == 1 else args.url     # several: the routing client
    shm = None
    if args.shm_mib:
        if not frontend or isinstance(url, list):          # None: the default URL, one server
            raise SetupError("--shm-mib applies to --scenario frontend against one server on this host")
        from convserve.clients.protocol.shm import ShmArena

        shm = ShmArena(args.shm_mib << 20, sealed=args.shm_sealed)
    uds = {"uds": args.uds} if args.uds else {}          # (one server: check_args)
    client = AsyncConvClient(url, api_key=args.api_key, timeout=args.timeout, max_connections=n_conn, shm=shm,
                             **uds)
    quiet_gc = interrupted = None
    try:
        try:
            info = await client.model()
        except (httpx.HTTPError, OSError) as e:
            raise SetupError(f"cannot reach the server at {client.url} ({type(e).__name__}: {e}); start one with "
                             "`convserve serve` or pass --url") from None
        except ServiceError as e:
            raise SetupError(f"GET {client.url}/v1/model answered {e.status} {e.code}: {e.message}") from None
        if shm is not None and info.get("client_shm") is False:
            raise SetupError(f"the server at {client.url} does not take tensors in shared memory (it was started "
                             "without --client-shm, or its host has no /dev/shm): start it with --client-shm on a "
                             "host with /dev/shm, or leave --shm-mib out")
        limits = Limits.of(info, shm and shm.nbytes)
        try:    # the chunk fits what the server takes (the frontend's batches are fitted step by step)
            chunk, chunk_why = choose_chunk(args.prefill_chunk, limits, frontend)
        except ChunkError as e:
            raise SetupError(str(e)) from None
        wl = Workload(args.scenario, args.prefill, args.decode, args.spec_k or parse("const:4"), chunk,
                      "sequential" if args.sequential_layers or frontend else "parallel",
                      frontend_spec=frontend and args.spec_k is not None)
        served = info.get("limits") or {}
        most = served.get("max_spec_tokens")
        if wl.spec and most is not None and wl.spec_k.max > most:
            per_request = served.get("max_tokens_per_request")
            bound = "" if per_request is None or most < per_request else \
                f" and --max-tokens-per-request (which bounds it: {per_request})"
            raise SetupError(f"--spec-k draws verifies of up to {wl.spec_k.max} tokens, above the server's "
                             f"max_spec_tokens ({most}): every verify would be refused; lower --spec-k to {most} or "
                             f"less, or start the server with a larger --max-spec-tokens{bound}")
        slice_most, slice_name, slice_detail = limits.largest_slice()
        if wl.spec and wl.spec_k.max > slice_most:
            raise SetupError(f"--spec-k draws verifies of up to {wl.spec_k.max} tokens, above what one session's "
                             f"slice may carry ({limit_words(slice_name, slice_detail)}): those verifies would "
                             f"be refused or never sent; lower --spec-k to {int(slice_most)} or less, "
                             + ("raise --shm-mib" if slice_name == ARENA else "start the server with larger limits, "
                                "or send x in shared memory (--shm-mib)"))
        down, refresh_s = replicas_down(url, info)
        if down:
            print(f"convserve-loadtest: {len(down)} of {len(url)} replicas did not answer at the start "
                  f"({', '.join(down)}); the run uses the others (the routing client retries them later"
                  f"; their limits are read again every {LIMITS_REFRESH_S:g} s)", file=sys.stderr)
        verifier = None
        if args.verify is not None:
            try:
                if args.verify is FROM_SERVER:
                    source = served_weights(await client.model_weights(), info)
                else:
                    source = str(args.verify)
                verifier = Verifier(source, info, args.verify_sample, args.seed)
            except VerifyError as e:
                raise SetupError(str(e)) from None
            except ServiceError as e:
                raise SetupError(f"GET {client.url}/v1/model/weights answered {e.status} {e.code}: {e.message}; "
                                 "pass --verify WEIGHTS.safetensors to check against a file") from None
        config = {
            "url": client.url, "model": info, "workload": wl.describe(),
            "prefill_chunk": {"tokens": chunk, "why": chunk_why},
            "transport": ("batch-ws" if args.transport == "ws" else "batch") + ("+shm" if shm is not None else "")
            if frontend else args.transport,
            "mode": mode, "levels": levels, "duration_s": args.duration, "requests": args.requests,
            "warmup_s": args.warmup, "inflight": args.inflight if args.transport != "unary" and not frontend else None,
            "connections": args.connections or None, "max_retries": args.max_retries, "seed": args.seed,
            "max_inflight": args.max_inflight if mode == "open" else None, "grace_s": args.grace,
            "verify": _verify_label(args.verify, info), "verify_sample": args.verify_sample,
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "client": {"host": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
                       "loop": type(asyncio.get_running_loop()).__module__.split(".")[0]},
        }
        if getattr(args, "baseline", None) is not None:
            _check_baseline(config, args.baseline, args.compare, args.compare_loose)
        steps = []
        interrupted = _Interrupts()
        quiet_gc = _QuietGC().__enter__()
        last = None                         # the previous level's driver
        for i, level in enumerate(levels):
            if interrupted.signal is not None:
                break
            conc = int(level) if mode == "closed" else None
            conns = 1 if frontend else \
                args.connections or auto_connections(args.transport, conc, len(info["layers"]), args.inflight)
            transport = make_transport(client, args.transport, conns, args.inflight)
            label = labels[i]
            rec = Recorder(0.0)
            kw = dict(seed=args.seed + i, max_retries=args.max_retries, verifier=verifier, max_requests=args.requests)
            kw["refresh_limits_s"] = refresh_s
            drv = FrontendDriver(client, info, wl, rec, frames=transport if args.transport == "ws" else None,
                                 **kw) if frontend else Driver(client, transport, info, wl, rec, **kw)
            if last is not None:
                drv.limits = last.limits            # what the level before learned (replicas that joined)
            last = drv
            # the step starts once its driver is built (its random pool takes a while): the warm-up, the byte
            # counters' mark and the deadline all count from here
            start = time.perf_counter()
            rec.measure_from = start + args.warmup
            deadline = None if args.duration is None else start + args.warmup + args.duration
            snap = {}

            def mark():
                snap["sent"], snap["recv"] = client.bytes_sent, client.bytes_received

            loop = asyncio.get_running_loop()
            handle = loop.call_at(loop.time() + args.warmup, mark) if args.warmup > 0 else None
            if handle is None:
                mark()
            progress = None if args.no_progress else asyncio.ensure_future(
                _progress(label, rec, start, args.warmup, args.duration, drv))
            loop_task = asyncio.ensure_future(drv.closed_loop(conc, deadline, args.grace) if mode == "closed" else
                                              drv.open_loop(float(level), deadline, args.grace, args.max_inflight))
            interrupted.task = loop_task
            try:
                await asyncio.wait({loop_task})     # SIGINT / SIGTERM cancel it (see _Interrupts)
                if not loop_task.cancelled() and loop_task.exception() is not None:
                    raise loop_task.exception()
            finally:
                loop_done = time.perf_counter()     # before the cleanup's deletes: they are not load
                interrupted.task = None
                if progress is not None:
                    progress.cancel()
                    try:
                        await progress
                    except asyncio.CancelledError:
                        pass
                await drv.cleanup()     # work cut off by --grace or the interrupt: cancelled, sessions deleted
                await transport.close()
                if handle is not None:
                    handle.cancel()
            # the measured window's end: the deadline; else (--requests) the last conv answer, not the sessions'
            # final deletes nor the cleanup; after an interrupt, the signal
            if interrupted.signal is not None:
                end = interrupted.at
            elif deadline is not None:
                end = deadline
            else:
                end = rec.last_conv_done or loop_done
            if not snap:
                mark()
            summary = rec.summary(min(end, time.perf_counter()), client.bytes_sent - snap["sent"],
                                  client.bytes_received - snap["recv"])
            st = {"label": label, "mode": mode, "concurrency": conc, "rate": None if conc else float(level),
                  "transport": config["transport"], "connections": conns if args.transport != "unary" else None,
                  **summary}
            st["cut_off"] = {"tasks_cancelled": drv.cancelled, "sessions_deleted": drv.cleanup_deleted,
                             "sessions_not_deleted": len(drv.cleanup_failed), "not_deleted": drv.cleanup_failed}
            if interrupted.signal is not None:
                st["interrupted"] = True
            if drv.mismatch_examples:
                st["verify"]["examples"] = drv.mismatch_examples[:5]
            steps.append(st)
        out = {"config": config, "steps": steps}
        if interrupted.signal is not None:
            out["interrupted"] = signal.Signals(interrupted.signal).name
        return out
    finally:
        if interrupted is not None:
            interrupted.close()
        if quiet_gc is not None:
            quiet_gc.__exit__(None, None, None)
        await client.aclose()
        if shm is not None:
            shm.close()


class _Interrupts:
    """SIGINT and SIGTERM while the load runs: the first one cancels the step in progress (its work is cut off and
    its sessions deleted, as after --grace) and no further step starts, so the partial results are reported; a
    second one cancels everything at once (no results, sessions may be left)."""

    def __init__(self):
        self.signal: Optional[int] = None
        self.at: Optional[float] = None     # perf_counter() at the first signal
        self.task: Optional[asyncio.Task] = None
        self.main = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, self._on, sig)
                self.installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
                pass

    def _on(self, sig: int) -> None:
        if self.signal is not None:
            print(f"convserve-loadtest: {signal.Signals(sig).name} again: stopping now, without cleanup",
                  file=sys.stderr)
            self.main.cancel()
            return
        self.signal, self.at = sig, time.perf_counter()
        print(f"convserve-loadtest: {signal.Signals(sig).name}: stopping the step, deleting its sessions and "
              "reporting what was measured (again to stop at once)", file=sys.stderr)
        if self.task is not None:
            self.task.cancel()

    def close(self) -> None:
        for sig in self.installed:
            self.loop.remove_signal_handler(sig)


def _check_baseline(config: dict, baseline: dict, path, loose: bool) -> None:
    """Refuse (or with ``loose``, warn about) a ``--compare`` baseline that measured something else: another
    workload, transport, loop, model shape or client setting; warn when only the measurement's length differs."""
    from convserve.clients.loadtest.report import config_differences

    hard, soft = config_differences(config, baseline.get("config") or {})
    if hard and not loose:
        raise SetupError(f"--compare {path}: the baseline ran something else, so its figures are not comparable: "
                         + "; ".join(hard) + ". Run with the baseline's settings, or pass --compare-loose to compare "
                         "anyway")
    for d in (hard + soft):
        print(f"convserve-loadtest: warning: --compare {path}: {d}", file=sys.stderr)


async def _progress(label, rec, start, warmup, duration, drv) -> None:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    console = Console(stderr=True)

    def render():
        now = time.perf_counter()
        lv = rec.live(now)
        t = Table.grid(padding=(0, 2))
        phase = "warm-up" if now < start + warmup else ("draining" if drv.stopping else "measuring")
        el = now - start
        total = f"/{warmup + duration:.0f}s" if duration is not None else "s"
        errs = dict(rec.errors)
        t.add_row(f"[bold]{label}[/bold]", f"{phase} {el:.1f}{total}", f"requests {rec.ok_total}",
                  f"errors {sum(errs.values())}" + (f" ({', '.join(f'{k} {v}' for k, v in errs.items())})"
                                                    if errs else ""),
                  f"retries {sum(rec.retries.values())}", f"{lv['req_per_s']:.0f} req/s",
                  f"p50 {lv['p50_ms']:.2f} ms", f"p99 {lv['p99_ms']:.2f} ms")
        return t

    with Live(render(), console=console, refresh_per_second=4, transient=False) as live:
        while True:
            await asyncio.sleep(0.25)
            live.update(render())
