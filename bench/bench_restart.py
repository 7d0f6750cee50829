"""How long ``convserve serve`` takes to start, and to come back after an engine or a worker is killed.

    python bench/bench_restart.py --out bench/results/restart-<gpu>-<date>.json [--base TREE] [--rounds 3]
                                  [--server-arg=--workers=4 ...]

Per round, one server of each tree (this one, and ``--base``'s, alternating which goes first): the seconds from
the command to ``/readyz`` 200 (``start``); from ``kill -9`` of engine 0 to ``/readyz`` 200 with a new engine 0
(``engine_back``); from ``kill -9`` of worker 0 to the log line of its successor's ``ready`` (``worker_back``);
from SIGTERM to the exit (``stop``); and the CPU seconds the server's processes had used when it was first ready
(``start_cpu_s``: the supervisor and every process below it, from ``/proc``, the reaped ones through their
parents' counts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_service as bs  # noqa: E402


def _readyz(url: str) -> dict:
    try:
        r = httpx.get(url + "/readyz", timeout=5)
        return {"code": r.status_code, **r.json()}
    except (httpx.HTTPError, ValueError):
        return {"code": None}


def _until(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise RuntimeError("timed out")


def _tree_cpu(root: int) -> float:
    """CPU seconds of process ``root`` and every live process below it, with what their reaped children used."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0))[1]
        todo += [c for c, (pp, _) in stats.items() if pp == p]
    return total / os.sysconf("SC_CLK_TCK")


def run_one(tree: Path, device: str, server_args: list) -> dict:
    env = {"PYTHONPATH": os.pathsep.join([str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "convserve.service", "serve", "--host", "127.0.0.1", "--port", "0", "--device",
           device, *server_args]
    t0 = time.monotonic()
    srv = bs.Proc(cmd, env=env)
    url = f"http://127.0.0.1:{srv.port}"
    try:
        _until(lambda: _readyz(url)["code"] == 200, 600)
        out = {"start": time.monotonic() - t0, "start_cpu_s": _tree_cpu(srv.proc.pid)}
        victim = _readyz(url)["engines"][0]["pid"]
        os.kill(victim, signal.SIGKILL)

        def engine_back():
            r = _readyz(url)
            return r["code"] == 200 and r["engines"][0]["pid"] != victim

        out["engine_back"] = _until(engine_back, 600)
        workers = [json.loads(x) for x in srv.lines if '"worker process started"' in x]
        w0 = next(int(w["pid"]) for w in workers if w.get("worker") == 0)
        n_ready = sum('"msg":"ready"' in x and '"proc":"worker-0"' in x for x in srv.lines)
        os.kill(w0, signal.SIGKILL)
        out["worker_back"] = _until(
            lambda: sum('"msg":"ready"' in x and '"proc":"worker-0"' in x for x in list(srv.lines)) > n_ready, 600)
    finally:
        t2 = time.monotonic()
        srv.stop()
    out["stop"] = time.monotonic() - t2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", help="another source tree to alternate with this one (its src/ on PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if bs.torch.cuda.is_available() else "cpu")
    ap.add_argument("--server-arg", action="append", default=[], help="an argument for convserve serve")
    args = ap.parse_args()
    root = HERE.parent
    trees = [("this", root)] + ([("base", Path(args.base).resolve())] if args.base else [])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    torch = bs.torch
    out = {"env": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": commit,
                   "cpus": os.cpu_count(), "server_args": args.server_arg}, "runs": []}
    for rnd in range(args.rounds):
        for label, tree in (trees if rnd % 2 == 0 else trees[::-1]):
            r = {"tree": label, "round": rnd, **run_one(tree, args.device, args.server_arg)}
            out["runs"].append(r)
            print(json.dumps(r), flush=True)
    summary = {}
    for label, _ in trees:
        rs = [r for r in out["runs"] if r["tree"] == label]
        summary[label] = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0] if k not in ("tree", "round")}
    out["median"] = summary
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
