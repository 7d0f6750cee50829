"""``python -m convserve.clients``: a small CLI against a running convserve.

    python -m convserve.clients health                 # /healthz and /readyz
    python -m convserve.clients model                  # GET /v1/model
    python -m convserve.clients conv --tokens 16       # one conv on a fresh session, with random x

``--url`` (or ``CONVSERVE_URL``, default http://127.0.0.1:8000) and ``--api-key`` (or ``CONVSERVE_API_KEY``).
Exit status: 0 on success, 1 when the server answers an error or is not ready, 2 when it cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

import httpx
import numpy as np

from convserve.clients.client import ConvClient, ConvServeError
from convserve.clients.protocol.wire import numpy_dtype


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convserve.clients", description="Talk to a running convserve.")
    p.add_argument("--url", default=None, help="server URL [env CONVSERVE_URL; default http://127.0.0.1:8000]")
    p.add_argument("--api-key", default=None, help="API key [env CONVSERVE_API_KEY]")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("health", help="check /healthz and /readyz")
    sub.add_parser("model", help="show the served model")
    c = sub.add_parser("conv", help="run one conv request with random x and print a summary of y")
    c.add_argument("--session", default=None, help="existing session (default: a new one, deleted afterwards)")
    c.add_argument("--layer", type=int, default=None, help="model layer index (default: the first conv layer)")
    c.add_argument("--tokens", type=int, default=1, help="T, tokens in x")
    c.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    c.add_argument("--seed", type=int, default=0)
    return p


def _random_x(tokens: int, dim: int, dtype: str, seed: int):
    return np.random.default_rng(seed).standard_normal((tokens, dim), dtype=np.float32).astype(numpy_dtype(dtype))


def _summary(y) -> dict:
    f = np.asarray(y, dtype=np.float32)
    return {"shape": list(y.shape), "dtype": str(y.dtype), "mean": float(f.mean()), "std": float(f.std()),
            "first": [round(float(v), 6) for v in f.reshape(-1)[:4]]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with ConvClient(args.url, api_key=args.api_key, timeout=args.timeout) as c:
            if args.command == "health":
                health, ready = c.health(), c.ready()
                print(json.dumps({"url": c.url, "healthy": health, "ready": ready}))
                return 0 if health and ready else 1
            if args.command == "model":
                print(json.dumps(c.model(), indent=2))
                return 0
            info = c.model()
            layer = args.layer if args.layer is not None else info["layers"][0]
            x = _random_x(args.tokens, info["dim"], args.dtype, args.seed)
            session = args.session or c.create_session()
            try:
                t0 = time.perf_counter()
                y = c.conv(session, layer, x)
                ms = (time.perf_counter() - t0) * 1e3
            finally:
                if args.session is None:
                    c.delete_session(session)
            print(json.dumps({"session": session, "layer": layer, "ms": round(ms, 3), "y": _summary(y)}))
            return 0
    except ConvServeError as e:
        print(json.dumps({"status": e.status, "code": e.code, "message": e.message}), file=sys.stderr)
        return 1
    except httpx.TransportError as e:
        print(json.dumps({"error": f"cannot reach the server: {e}"}), file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
