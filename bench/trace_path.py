"""Where a unary conv's time goes between the HTTP worker and the engine process and back: time stamps along the
path, per request, in every server process.

    python bench/trace_path.py                                              # CUDA: 8 workers, 1 session
    python bench/trace_path.py --device cpu --workers 1 --server-arg=--dim=64
    python bench/trace_path.py -- --server-arg=--max-queue-delay-us=0      # more bench_workers flags after --

The product code has no trace points. This copies the package's ``service`` folder into a temporary directory,
adds them there (each one an ``os.write`` of a line: ~2 µs), and runs ``bench/bench_workers.py --legs unary``
with that copy first on ``PYTHONPATH`` (the server subprocesses inherit it). A patch that no longer matches the
source fails loudly. The points (monotonic ns, comparable across processes):

* worker, route: ``r_in`` (the ASGI call), ``r_body`` (body read), ``r_res`` (the engine's y in hand), ``r_out``
  (answer written to the transport);
* worker, engine link: ``w_conv0`` (RemoteEngine._conv entered), ``w_sent`` (its message sent; taken after the
  send returns, so a sender descheduled inside the send shows ``w_sent`` after the engine's ``e_recv``);
* engine process: ``e_recv`` (its message read), ``e_sub`` (queued in the engine), ``step0`` (the step that ran
  it started), ``e_ans`` (y written into the block, the answer queued), ``e_sent`` (the answer sent);
* worker: ``w_ans`` (the answer read by the worker's loop).

Prints p50/p90 of each segment, the rows per step, the wait from a step's last arrival to its start (the
batching window) and the client's own p50 for comparison.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEADER = '''
import os as _os, time as _time
_TRF = None
def _T(tag, a=0, b=0):
    global _TRF
    if _TRF is None:
        _TRF = _os.open(_os.path.join(_os.environ["TRACE_PATH_DIR"], f"{_os.getpid()}.txt"),
                        _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND)
    _os.write(_TRF, f"{tag} {a} {b} {_time.perf_counter_ns()}\\n".encode())
'''

PATCHES = {
    "cluster/remote.py": [
        # request ids unique across the workers (each counts its own from 1): the engine's points carry them
        ("        self._ids = itertools.count(1)\n",
         "        self._ids = itertools.count(1 + _os.getpid() * 10_000_000)\n"),
        ("        epoch = self._target(e)\n        link = self.links[e]\n        dtype = out_dtype = x.dtype",
         ("        _t0 = _time.perf_counter_ns()\n        epoch = self._target(e)\n        link = self.links[e]\n"
          "        dtype = out_dtype = x.dtype")),
        ("        head.update(i=mid, e=epoch, d=name, n=n)\n",
         "        head.update(i=mid, e=epoch, d=name, n=n)\n        _T('w_conv0', mid, _t0)\n"),
        ("                link.channel.send([self._packer.pack(q[0] if len(q) == 1 else q)])\n",
         ("                link.channel.send([self._packer.pack(q[0] if len(q) == 1 else q)])\n"
          "                for _h in q: _T('w_sent', _h.get('i'), len(q))\n")),
        ("        p = link.pending.pop(head[\"i\"], None)\n",
         "        _T('w_ans', head['i'])\n        p = link.pending.pop(head[\"i\"], None)\n"),
    ],
    "http/unary.py": [
        ("        svc = self.svc\n        scope[ROUTE_SCOPE_KEY] = self.route\n",
         "        _t0 = _time.perf_counter_ns()\n        svc = self.svc\n        scope[ROUTE_SCOPE_KEY] = self.route\n"),
        ("            fut = self.submit(await svc.decode(len(body), self.parse, scope, body))\n",
         ("            _t1 = _time.perf_counter_ns()\n"
          "            fut = self.submit(await svc.decode(len(body), self.parse, scope, body))\n"
          "            _mid = getattr(fut, 'mid', -1)\n            _T('r_in', _mid, _t0)\n            _T('r_body', _mid, _t1)\n")),
        ("            y = await wait_result(self.engine, fut, receive)\n",
         "            y = await wait_result(self.engine, fut, receive)\n            _T('r_res', _mid)\n"),
        ("            await send_bytes(send, 200, out, ct)\n",
         "            await send_bytes(send, 200, out, ct)\n            _T('r_out', _mid)\n"),
    ],
    "cluster/engine_proc.py": [
        ("        ident, head = frames[0], msgpack.unpackb(frames[1], raw=False)\n",
         ("        _t0 = _time.perf_counter_ns()\n        ident, head = frames[0], msgpack.unpackb(frames[1], raw=False)\n"
          "        for _h in (head if isinstance(head, list) else [head]): _T('e_recv', _h.get('i'), _t0)\n")),
        ("        except BaseException:\n            self.inflight.pop(key, None)\n            raise\n",
         "        except BaseException:\n            self.inflight.pop(key, None)\n            raise\n        _T('e_sub', ans.mid)\n"),
        ("        ans.finished = True\n        self.inflight.pop((ans.ident, ans.mid), None)\n",
         ("        ans.finished = True\n        self.inflight.pop((ans.ident, ans.mid), None)\n"
          "        _T('e_ans', ans.mid, getattr(self.engine, '_trace_t0', 0))\n")),
        ("            send([ident, body], copy=False)\n",
         "            send([ident, body], copy=False)\n            for _r in replies: _T('e_sent', _r.get('i'), len(replies))\n"),
    ],
    "engine/loop.py": [
        ("        t0 = time.perf_counter_ns()\n        self._runner.state_written = False\n",
         "        t0 = time.perf_counter_ns()\n        self._trace_t0 = t0\n        self._runner.state_written = False\n"),
    ],
}
ORDER = ["r_in", "r_body", "w_conv0", "w_sent", "e_recv", "e_sub", "step0", "e_ans", "e_sent", "w_ans", "r_res",
         "r_out"]
STARTS = ("w_conv0", "r_in", "r_body", "e_recv")       # their time is the line's second number


def patched_package(dest: Path) -> Path:
    """A copy of ``convserve`` under ``dest`` with the trace points; returns the folder to put on PYTHONPATH."""
    pkg = dest / "convserve"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "src" / "convserve" / "__init__.py", pkg)
    for d in ("clients", "kernels", "state_pool"):
        os.symlink(ROOT / d, pkg / d)
    shutil.copytree(ROOT / "service", pkg / "service")
    for rel, pairs in PATCHES.items():
        p = pkg / "service" / rel
        s = p.read_text()
        for old, new in pairs:
            if old not in s:
                raise SystemExit(f"trace_path: {rel} no longer has the line this patches:\n{old}")
            s = s.replace(old, new, 1)
        if rel != "engine/loop.py":
            mark = "\nfrom __future__ import annotations\n"
            i = s.index(mark) + len(mark)
            s = s[:i] + HEADER + s[i:]
        p.write_text(s)
    return dest


def analyse(trace_dir: Path, skip: float = 0.2) -> dict:
    ev: dict = collections.defaultdict(dict)
    for f in glob.glob(str(trace_dir / "*.txt")):
        with open(f) as lines:
            for line in lines:
                tag, a, b, t = line.split()
                a, b, t = int(a), int(b), int(t)
                if tag in STARTS:
                    ev[a][tag] = b
                elif tag == "e_ans":
                    ev[a]["e_ans"], ev[a]["step0"] = t, b
                else:
                    ev[a][tag] = t
    rows = [e for _m, e in sorted(ev.items()) if all(k in e for k in ORDER)]
    rows = rows[int(len(rows) * skip):]                # the warm-up
    out: dict = {"requests": len(rows), "segments_us": {}}
    if not rows:
        return out

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    for a, b in itertools.pairwise(ORDER):
        d = [(e[b] - e[a]) / 1e3 for e in rows]
        out["segments_us"][f"{a}->{b}"] = {"p50": statistics.median(d), "p90": pct(d, 0.9)}
    tot = [(e["r_out"] - e["r_in"]) / 1e3 for e in rows]
    out["route_us"] = {"p50": statistics.median(tot), "p90": pct(tot, 0.9)}
    by_step = collections.defaultdict(list)
    for e in rows:
        by_step[e["step0"]].append(e)
    out["rows_per_step"] = dict(sorted(collections.Counter(len(v) for v in by_step.values()).items()))
    wait = [(s - max(e["e_sub"] for e in es)) / 1e3 for s, es in by_step.items()]
    out["last_arrival_to_step_us"] = {"p50": statistics.median(wait), "p90": pct(wait, 0.9)}
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="engine device (bench_workers' default: cuda if present)")
    ap.add_argument("--workers", type=int, default=8, help="HTTP worker processes [8]")
    ap.add_argument("--concurrency", type=int, default=1, help="sessions [1]")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--server-cpus", default=None)
    ap.add_argument("--client-cpus", default=None)
    ap.add_argument("--out", default=None, help="JSON path for the breakdown")
    args = ap.parse_args(argv)
    import json

    with tempfile.TemporaryDirectory(prefix="convserve-trace-") as tmp:
        tmp = Path(tmp)
        pkg = patched_package(tmp / "pkg")
        tdir = tmp / "trace"
        tdir.mkdir()
        cmd = [sys.executable, str(ROOT / "bench" / "bench_workers.py"), "--legs", "unary", "--workers",
               str(args.workers), "--concurrency", str(args.concurrency), "--duration", str(args.duration),
               "--client-procs", "1", "--out", str(tmp / "w.json")]
        cmd += ["--device", args.device] if args.device else []
        cmd += [f"--server-arg={a}" for a in args.server_arg]
        cmd += ["--server-cpus", args.server_cpus] if args.server_cpus else []
        cmd += ["--client-cpus", args.client_cpus] if args.client_cpus else []
        env = dict(os.environ, TRACE_PATH_DIR=str(tdir),      # (the bench drops CONVSERVE_* from the server's env)
                   PYTHONPATH=os.pathsep.join([str(pkg), *filter(None, [os.environ.get("PYTHONPATH")])]))
        subprocess.run(cmd + extra, env=env, check=True)
        res = analyse(tdir)
        client = json.loads((tmp / "w.json").read_text())["results"][f"workers={args.workers}"]["unary"]
        res["client"] = next(iter(client.values()))
    print(f"{res['requests']} requests traced; client p50 {res['client']['p50_ms'] * 1e3:.0f} us, "
          f"route (r_in -> r_out) p50 {res.get('route_us', {}).get('p50', float('nan')):.0f} us")
    for k, v in res["segments_us"].items():
        print(f"  {k:<18} p50 {v['p50']:8.1f} us   p90 {v['p90']:8.1f} us")
    if "rows_per_step" in res:
        print(f"  rows per step {res['rows_per_step']}; a step's last arrival -> its start p50 "
              f"{res['last_arrival_to_step_us']['p50']:.0f} us, p90 {res['last_arrival_to_step_us']['p90']:.0f} us")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
