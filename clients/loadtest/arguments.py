"""``convserve-loadtest``'s arguments: the parser, the checks its types cannot make, and the step labels they
give (``--concurrency`` / ``--rate`` levels). The run itself is :mod:`.cli`'s."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

#: ``--verify`` given alone: the reference is built from the server's own weights file (GET /v1/model/weights)
FROM_SERVER = object()


def _int_list(s: str) -> list:
    try:
        vals = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected integers separated by commas, e.g. 1,8,64,256") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected positive integers, e.g. 1,8,64,256")
    return vals


def _float_list(s: str) -> list:
    try:
        vals = [float(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected numbers separated by commas, e.g. 100,200,400") from None
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{s!r}: expected finite positive rates (requests/s), e.g. 100,200,400")
    return vals


def _number(conv, low, *, strict: bool, example: str):
    """An argparse type: a finite ``conv`` (int or float) ``> low`` (``strict``) or ``>= low``."""
    def parse(s: str):
        try:
            v = conv(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r}: expected {'an integer' if conv is int else 'a number'}, "
                                             f"e.g. {example}") from None
        if not math.isfinite(v) or v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(f"{s!r}: expected a finite {'integer' if conv is int else 'number'} "
                                             f"{'>' if strict else '>='} {low}, e.g. {example}")
        return v
    parse.__name__ = conv.__name__
    return parse


def _dist(s: str):
    from convserve.clients.loadtest.dists import DistError, parse

    try:
        return parse(s)
    except DistError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(description: str) -> argparse.ArgumentParser:
    """The command line of ``convserve-loadtest`` (``description``: its ``--help`` text)."""
    from convserve.clients.loadtest.runner import SCENARIOS

    p = argparse.ArgumentParser(prog="convserve-loadtest", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--url", action="append", default=None,
                   help="server URL [env CONVSERVE_URL; default http://127.0.0.1:8000]; repeat it for several "
                        "replicas (sessions are placed on them by the client's rendezvous hashing), or give "
                        "dns://NAME:PORT for the replicas a DNS name lists (a Kubernetes headless Service)")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="the Unix socket of a server on this machine (convserve serve --uds): every call goes "
                        "through it, --url naming only the host")
    g.add_argument("--api-key", default=None, help="API key [env CONVSERVE_API_KEY]")
    g.add_argument("--timeout", type=_number(float, 0, strict=True, example="60"), default=60.0,
                   help="seconds per HTTP call [60]")
    g = p.add_argument_group("workload")
    g.add_argument("--scenario", default="decode-heavy", choices=[*SCENARIOS, "mixed"],
                   help="decode-heavy: short prefills, long decodes; prefill-heavy: long prefills, few decodes; "
                        "mixed: half of the sessions each; spec: decode by speculative verify of k tokens then "
                        "accept; frontend: a continuous-batching frontend, one POST /v1/conv/batch per layer and step "
                        "over every session, the layers in turn [decode-heavy]")
    g.add_argument("--prefill", type=_dist, default=None, metavar="DIST",
                   help="prefill tokens per session, e.g. uniform:64:512, const:128, lognormal:256:0.5, "
                        "choice:16,256 (default: the scenario's)")
    g.add_argument("--decode", type=_dist, default=None, metavar="DIST",
                   help="decode steps per session, e.g. const:32 (default: the scenario's)")
    g.add_argument("--spec-k", type=_dist, default=None, metavar="DIST",
                   help="spec: tokens per speculative verify [const:4]; the tester accepts 0..k of them; frontend: "
                        "decode by speculative verify (off unless given)")
    g.add_argument("--prefill-chunk", "--chunk", type=_number(int, 1, strict=False, example="512"), default=None,
                   help="largest prefill request (frontend: prefill chunk per step), tokens [2048, or the most "
                        "one request may carry by the server's limits]")
    g.add_argument("--sequential-layers", action="store_true",
                   help="send a step's layers one after the other (like a forward pass) instead of together")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("transport")
    g.add_argument("--transport", default=None, choices=["unary", "stream", "ws"],
                   help="unary: POST /v1/conv; stream: POST /v1/conv/stream; ws: /v1/conv/ws [unary]; --scenario "
                        "frontend: unary sends a POST /v1/conv/batch per layer call and POST /v1/accept, ws one "
                        "WebSocket of batch frames with the accept a frame sent without waiting for its answer")
    g.add_argument("--inflight", type=_number(int, 1, strict=False, example="64"), default=None,
                   help="stream/ws: frames in flight per connection [64]")
    g.add_argument("--shm-mib", type=_number(int, 0, strict=False, example="64"), default=0, metavar="MIB",
                   help="frontend: write each layer call's x into a shared-memory arena of this many MiB and send "
                        "its reference instead of the bytes; y comes back there (a server on this host only) "
                        "[0: off]")
    g.add_argument("--shm-sealed", action="store_true",
                   help="with --shm-mib: a sealed memfd (the server maps it) instead of a /dev/shm segment")
    g.add_argument("--connections", type=_number(int, 0, strict=False, example="8"), default=None,
                   help="stream/ws: connections (0: enough for concurrency x layers / inflight) [0]")
    g = p.add_argument_group("load")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--concurrency", type=_int_list, default=None, metavar="N[,N...]",
                   help="closed loop: virtual sessions at once, one step per value [8]")
    m.add_argument("--rate", type=_float_list, default=None, metavar="R[,R...]",
                   help="open loop: Poisson arrivals at R conv requests/s (frontend: R sessions/s), one step per "
                        "value")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--duration", type=_number(float, 0, strict=True, example="10"), default=None,
                   help="seconds per step, warm-up excluded [10]")
    b.add_argument("--requests", type=_number(int, 1, strict=False, example="2000"), default=None,
                   help="measured conv requests per step (frontend: layer calls; a step ends whole), after the "
                        "warm-up")
    g.add_argument("--warmup", type=_number(float, 0, strict=False, example="1"), default=1.0,
                   help="seconds at the start of each step not measured [1]")
    g.add_argument("--grace", type=_number(float, 0, strict=False, example="30"), default=30.0,
                   help="seconds to wait for in-flight work after a step; what is still running then is cancelled "
                        "and its sessions deleted [30]")
    g.add_argument("--max-retries", type=_number(int, 0, strict=False, example="20"), default=20,
                   help="retries of one request on 429/503 [20]")
    g.add_argument("--max-inflight", type=_number(int, 1, strict=False, example="4096"), default=None,
                   help="open loop: steps in flight (frontend: live sessions) before arrivals are dropped as "
                        "client_backlog [4096]")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, help="folder for loadtest.json, loadtest.png, loadtest.html")
    g.add_argument("--compare", type=Path, default=None, metavar="BASELINE.json",
                   help="compare with an earlier run's JSON; exit 3 on a regression past --regress-pct")
    g.add_argument("--compare-loose", action="store_true",
                   help="with --compare: compare even when the baseline ran another workload, transport, mode or "
                        "model (a warning instead of exit 2)")
    g.add_argument("--regress-pct", type=_number(float, 0, strict=False, example="10"), default=10.0,
                   help="a throughput drop or p99 rise of more than this percent is a regression [10]")
    g.add_argument("--verify", type=Path, nargs="?", const=FROM_SERVER, default=None, metavar="WEIGHTS.safetensors",
                   help="check a sample of sessions against a float64 reference of the served weights: alone, "
                        "the server's GET /v1/model/weights (checked against /v1/model's weights_sha256); with a "
                        "file, these weights")
    g.add_argument("--verify-sample", type=float, default=0.1, help="share of sessions verified [0.1]")
    g.add_argument("--fail-on-errors", action="store_true", help="exit 1 when any request failed")
    g.add_argument("--no-progress", action="store_true", help="no live display")
    g = p.add_argument_group("client")
    g.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                   help="event loop of the load generator (auto: uvloop when installed) [auto]")
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse (exit 2) what the argument types cannot see: combinations, and flags that do not apply to the chosen
    scenario, transport or loop (a flag silently ignored would make the run something other than asked); then
    fill in the defaults."""
    if not 0 < args.verify_sample <= 1:         # NaN fails this too
        parser.error(f"--verify-sample {args.verify_sample}: must be in (0, 1], e.g. 0.1")
    if args.shm_sealed and not args.shm_mib:
        parser.error("--shm-sealed needs --shm-mib (the arena's size)")
    if args.uds and args.url and (len(args.url) > 1 or args.url[0].startswith("dns://")):
        parser.error("--uds reaches one server on this machine: give at most one http:// --url with it")
    frontend = args.scenario == "frontend"
    if args.spec_k is not None and args.scenario not in ("spec", "frontend"):
        parser.error(f"--spec-k applies to --scenario spec or frontend, not {args.scenario}: leave it out or choose "
                     "one of those")
    piped = not frontend and args.transport in ("stream", "ws")
    for flag, value in (("--inflight", args.inflight), ("--connections", args.connections)):
        if value is not None and not piped:
            parser.error(f"{flag} applies to --transport stream or ws, not "
                         f"{'--scenario frontend' if frontend else '--transport unary'}: leave it out")
    if args.max_inflight is not None and args.rate is None:
        parser.error("--max-inflight applies to the open loop (--rate), not --concurrency: leave it out")
    if args.shm_mib and not frontend:
        parser.error("--shm-mib applies to --scenario frontend only")
    args.inflight = 64 if args.inflight is None else args.inflight
    args.connections = args.connections or 0
    args.max_inflight = 4096 if args.max_inflight is None else args.max_inflight
    if args.duration is None and args.requests is None:
        args.duration = 10.0
    if args.concurrency is None and args.rate is None:
        args.concurrency = [8]


def step_labels(args) -> list:
    """Each step's label, as results and ``--compare`` match steps by: ``c=N`` (closed loop) or ``rate=R``."""
    if args.concurrency is not None:
        return [f"c={int(c)}" for c in args.concurrency]
    return [f"rate={float(r):g}" for r in args.rate]
