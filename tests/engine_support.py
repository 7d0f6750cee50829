"""Shared by the engine tests: a small CPU engine, the per-request reference (Oracle) and the randomized
workload that checks one against the other."""

import contextlib
import random
import threading

import pytest
import torch

from convserve.kernels.reference import causal_conv1d_ref, causal_conv1d_update_ref
from convserve.service.engine import Engine, EngineConfig
from convserve.clients.protocol.errors import BadRequest, UnknownSession
from convserve.service.model import ConvModel
from tests.tolerance import assert_close

DIM = 24
LAYERS = [1, 4, 6]


def make_engine(model=None, device="cpu", **cfg):
    cfg.setdefault("slots", 8)
    cfg.setdefault("max_queue_delay_us", 0)
    e = Engine(model or ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=1),
               EngineConfig(**cfg), device=device)
    e.start()
    return e


class Oracle:
    """Each session's state per layer, advanced by the reference ops one request at a time."""

    def __init__(self, model: ConvModel, state_dtype):
        self.m, self.sd = model, state_dtype
        self.states, self.pending = {}, {}

    def new(self, sid):
        self.states[sid] = torch.zeros(self.m.n_layers, 1, self.m.dim, self.m.width - 1, dtype=self.sd)
        self.pending[sid] = {}

    def _wb(self, p):
        return self.m.weight[p], self.m.layer_bias(p)

    def conv(self, sid, p, x):
        w, b = self._wb(p)
        xm = x.to(self.m.dtype)
        st = self.states[sid][p]
        y = causal_conv1d_ref(xm.T.contiguous(), w, b, st, torch.tensor([0, x.shape[0]], dtype=torch.int32),
                              torch.tensor([0], dtype=torch.int32), torch.tensor([True]), self.m.activation)
        return y.T.to(x.dtype)

    def verify(self, sid, p, x):
        w, b = self._wb(p)
        t = x.shape[0]
        win = torch.zeros(1, t, self.m.dim, self.m.width - 1, dtype=self.sd)
        y = causal_conv1d_update_ref(x.to(self.m.dtype).T.unsqueeze(0).contiguous(), self.states[sid][p], w, b,
                                     self.m.activation, conv_state_indices=torch.tensor([0], dtype=torch.int32),
                                     intermediate_conv_window=win)
        self.pending[sid][p] = win[0]
        return y[0].T.to(x.dtype)

    def batch(self, sids, p, x, toks, spec):
        """The reference y of a batch request: each session's slice of ``x`` as its own conv or verify."""
        out, a = [], 0
        for s, n, sp in zip(sids, toks, spec):
            xi = x[a:a + n]
            out.append(self.verify(s, p, xi) if sp else self.conv(s, p, xi))
            a += n
        return torch.cat(out)

    def accept(self, sid, n):
        for p, win in self.pending[sid].items():
            if n > 0:
                self.states[sid][p][0] = win[n - 1]
        self.pending[sid] = {}

    def export(self, sid):
        return self.states[sid][:, 0]

    def fork(self, src, dst):
        self.states[dst] = self.states[src].clone()
        self.pending[dst] = {p: w.clone() for p, w in self.pending[src].items()}


CONFIGS = {
    # model dtype, state dtype, batching knobs
    "fp32": (torch.float32, torch.float32, dict(max_batch_tokens=16, max_batch_size=6, decode_buckets=(1, 2, 4),
                                                max_queue_delay_us=3000)),
    "bf16-fp32state": (torch.bfloat16, torch.float32, dict(max_batch_tokens=32, max_batch_size=64,
                                                           decode_buckets=(2, 8), max_queue_delay_us=20_000)),
    "fp16": (torch.float16, torch.float16, dict(max_batch_tokens=9, max_batch_size=3, decode_buckets=(1, 4))),
}


def run_random_workload(device, dtype, state_dtype, knobs, seed, n_ops=220, width=4,
                        use_cuda_graphs=True):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = ConvModel.random(LAYERS, dim=DIM, width=width, dtype=dtype, seed=seed, bias=seed % 2 == 0)
    e = make_engine(model, device=device, slots=12, state_dtype=state_dtype, max_spec_tokens=5,
                    use_cuda_graphs=use_cuda_graphs, **knobs)
    oracle = Oracle(model, state_dtype)
    checks = []          # (future, expected y, what)
    try:
        sids = []
        for op_i in range(n_ops):
            r = rng.random()
            if not sids or (r < 0.06 and len(sids) < 10):
                sid = e.create_session(f"s{op_i}" if rng.random() < 0.5 else None)
                oracle.new(sid)
                sids.append(sid)
                continue
            sid = rng.choice(sids)
            layer_pos = rng.randrange(len(LAYERS))
            layer = LAYERS[layer_pos]
            xdt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
            pending = bool(oracle.pending[sid])
            if r < 0.10 and len(sids) < 10:
                dst = e.fork_session(sid)
                oracle.fork(sid, dst)
                sids.append(dst)
            elif r < 0.14:
                got = e.export_state(sid)
                assert got.dtype == state_dtype
                assert_close(got, oracle.export(sid), what=f"export {sid} op {op_i}")
            elif r < 0.16:
                st = torch.randn(len(LAYERS), DIM, width - 1).to(state_dtype)
                e.import_state(sid, st)
                oracle.states[sid][:, 0] = st
                oracle.pending[sid] = {}
            elif r < 0.18 and len(sids) > 1:
                e.delete_session(sid)
                sids.remove(sid)
                with pytest.raises(UnknownSession):
                    e.submit(sid, layer, torch.randn(1, DIM))
            elif pending and r < 0.40:
                n = rng.randint(0, min(w.shape[0] for w in oracle.pending[sid].values()))
                e.accept(sid, n)
                oracle.accept(sid, n)
            elif pending and r < 0.45:
                with pytest.raises(BadRequest, match="accept"):
                    e.submit(sid, layer, torch.randn(1, DIM))
            elif r < 0.62:
                t = rng.randint(1, 5)
                x = torch.randn(t, DIM).to(xdt)
                checks.append((e.submit(sid, layer, x, speculative=True), oracle.verify(sid, layer_pos, x),
                               f"verify {sid} L{layer} T{t} op {op_i}"))
            elif r < 0.72:                           # a batch: one token for each of several sessions
                free = [x for x in sids if not oracle.pending[x]]
                k = rng.randint(1, max(1, min(e.max_batch_rows(), len(sids))))
                rows = rng.sample(sids, min(k, len(sids)))
                x = torch.randn(len(rows), DIM).to(xdt)
                if any(oracle.pending[x_] for x_ in rows):
                    with pytest.raises(BadRequest, match="accept"):
                        e.submit_batch(rows, layer, x)
                    rows = rng.sample(free, min(k, len(free)))
                    if not rows:
                        continue
                    x = x[:len(rows)]
                expected = torch.cat([oracle.conv(sid_, layer_pos, x[i:i + 1]) for i, sid_ in enumerate(rows)])
                checks.append((e.submit_batch(rows, layer, x), expected,
                               f"batch {rows} L{layer} op {op_i}"))
            elif not pending:
                t = rng.choice([1, 1, 1, 1, 2, 3, 7, 20, 41])
                x = torch.randn(t, DIM).to(xdt)
                checks.append((e.submit(sid, layer, x), oracle.conv(sid, layer_pos, x),
                               f"conv {sid} L{layer} T{t} op {op_i}"))
        for fut, expected, what in checks:
            y = fut.result(60)
            assert y.dtype == expected.dtype and y.shape == expected.shape, what
            assert_close(y, expected, what=what)
        for sid in sids:
            assert_close(e.export_state(sid), oracle.export(sid), what=f"final state {sid}")
        stats = e.stats()
        assert stats["requests"] == len(checks)
        assert stats["slots_in_use"] == len(sids)
        return stats
    finally:
        e.stop(drain=False)


def hold_first_step(e):
    """Hold the engine's next step (on whichever thread runs it) until the returned ``go`` is set; ``entered`` is
    set once it is held."""
    go, entered = threading.Event(), threading.Event()
    real, first = e._runner.execute, [True]

    def held(out):
        if first[0]:
            first[0] = False
            entered.set()
            go.wait(10)
        return real(out)

    e._runner.execute = held
    return go, entered


def gate_worker(e):
    """Hold the worker inside its next step until the returned event is set (so requests queue behind it). Every
    step runs on the worker from here on (no caller steps, see Worker._step_here_locked)."""
    e._caller_tokens = 0
    return hold_first_step(e)


@contextlib.contextmanager
def served(n: int, **knobs):
    """An engine made with ``knobs``, its per-session reference and ``n`` sessions in both: ``(engine, oracle,
    session ids)``; the engine is stopped after."""
    e = make_engine(**knobs)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        yield e, oracle, new_sessions(e, oracle, n)
    finally:
        e.stop(drain=False)


def new_sessions(e, oracle: Oracle, n: int) -> list:
    """``n`` new sessions, in the engine and in its reference; their ids."""
    sids = [e.create_session() for _ in range(n)]
    for s in sids:
        oracle.new(s)
    return sids


def model_x(e, rows: int) -> torch.Tensor:
    """A random x of ``rows`` rows in the engine's model dtype (y then comes back in it, and is compared at its
    tolerance)."""
    return torch.randn(rows, DIM).to(e.model_cpu.dtype)
