"""The engine against the reference run one request at a time, plus its session, error and life-cycle contract.

The randomized test records its seed in the test id; rerun one with ``-k 'seed3'``.
"""

import asyncio
import copy
import random
import threading
import time
import types

import pytest
import torch

from convserve.kernels.reference import causal_conv1d_ref, causal_conv1d_update_ref
from convserve.service.engine import Engine, EngineConfig
from convserve.clients.protocol.errors import (BadRequest, DtypeUnsupported, NonFinite, NotReady, PoolExhausted, QueueFull,
                            RequestTimeout, SessionExists, ShapeMismatch, StateLost, UnknownLayer, UnknownSession)
from convserve.service.model import ConvModel
from tests.conftest import HAS_CUDA
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


@pytest.fixture
def engine():
    e = make_engine()
    yield e
    e.stop(drain=False)


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


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_matches_the_reference_run_request_by_request(config, seed):
    dtype, state_dtype, knobs = CONFIGS[config]
    stats = run_random_workload("cpu", dtype, state_dtype, knobs, seed=1000 * seed + len(config))
    assert stats["steps"] > 0


@pytest.mark.parametrize("width", [2, 3])
def test_engine_matches_the_reference_for_narrow_kernels(width):
    run_random_workload("cpu", torch.float32, torch.float32, CONFIGS["fp32"][2], seed=7, n_ops=120, width=width)


@pytest.mark.parametrize("multi_layer", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not HAS_CUDA, reason="needs CUDA")])])
def test_decodes_of_several_layers_in_one_step_match_the_reference(multi_layer, device):
    """Sessions decoding on different layers in the same step: one launch for all of them (stacked weights, the
    pool as one table of lines) or one per layer; either way each row gets its own layer's weights and state."""
    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=5, bias=True)
    e = make_engine(model, device=device, max_queue_delay_us=200_000, decode_buckets=(4, 8, 16),
                    multi_layer_decode=multi_layer)
    oracle = Oracle(model, torch.float32)
    try:
        sids = [e.create_session() for _ in range(5)]
        for sid in sids:
            oracle.new(sid)
        gen = torch.Generator().manual_seed(3)
        for rnd in range(3):
            checks = []
            for i, sid in enumerate(sids):           # every session on two layers, one step
                for pos in ((i + rnd) % 3, (i + rnd + 1) % 3):
                    x = torch.randn(2 if rnd == 0 else 1, DIM, generator=gen)
                    checks.append((e.submit(sid, LAYERS[pos], x), oracle.conv(sid, pos, x), f"{sid} L{pos} r{rnd}"))
            for fut, expected, what in checks:
                assert_close(fut.result(30), expected, what=what)
        for sid in sids:
            assert_close(e.export_state(sid), oracle.export(sid), what=f"state {sid}")
        launches = e.stats()["multi_layer_launches"]
        assert (launches > 0) == multi_layer, launches
    finally:
        e.stop(drain=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_on_cuda_matches_the_reference(config, graphs):
    dtype, state_dtype, knobs = CONFIGS[config]
    stats = run_random_workload("cuda", dtype, state_dtype, knobs, seed=11, n_ops=300, use_cuda_graphs=graphs)
    assert stats["steps"] > 16 and stats["kernel_time_s"] > 0     # every 16th step timed (gpu_timing_interval)


# ---- many sessions pipelined from several threads


def test_concurrent_submitters_each_get_their_own_sessions_results(engine):
    model = engine.model_cpu
    oracle = Oracle(model, engine.state_dtype)
    errors = []

    def client(k):
        try:
            rng = random.Random(k)
            sid = engine.create_session(f"c{k}")
            oracle.new(sid)
            futs = []
            for _ in range(25):
                p = rng.randrange(len(LAYERS))
                x = torch.randn(rng.choice([1, 1, 4]), DIM)
                futs.append((engine.submit(sid, LAYERS[p], x), oracle.conv(sid, p, x)))
            for f, exp in futs:
                assert_close(f.result(30), exp)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert engine.stats()["requests"] == 150


def test_async_conv_matches_submit_and_delivers_across_sessions():
    e = make_engine(max_queue_delay_us=500)
    try:
        sids = [e.create_session() for _ in range(5)]
        xs = [torch.randn(3, DIM) for _ in sids]

        async def main():
            return await asyncio.gather(*(e.conv(s, LAYERS[0], x) for s, x in zip(sids, xs)))

        ys = asyncio.run(main())
        oracle = Oracle(e.model_cpu, e.state_dtype)
        for s, x, y in zip(sids, xs, ys):
            oracle.new(s)
            assert_close(y, oracle.conv(s, 0, x))
    finally:
        e.stop()


def test_cancelling_an_awaiting_task_withdraws_its_queued_request():
    e = make_engine(max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()

        async def main():
            task = asyncio.ensure_future(e.conv(sid, LAYERS[0], torch.randn(2, DIM)))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        assert e.stats()["queue_depth"] == 0 and e.stats()["requests_cancelled"] == 1
        assert torch.count_nonzero(e.export_state(sid)) == 0
    finally:
        e.stop(drain=False)


# ---- validation: fails alone, before anything is queued, changing nothing


BAD_CONV = {
    "unknown session": (dict(session="nope"), UnknownSession),
    "layer without conv": (dict(layer=2), UnknownLayer),
    "layer not an int": (dict(layer="1"), UnknownLayer),
    "int dtype": (dict(x=torch.ones(2, DIM, dtype=torch.int32)), DtypeUnsupported),
    "float64": (dict(x=torch.ones(2, DIM, dtype=torch.float64)), DtypeUnsupported),
    "wrong dim": (dict(x=torch.ones(2, DIM + 1)), ShapeMismatch),
    "1-d x": (dict(x=torch.ones(DIM)), ShapeMismatch),
    "3-d x": (dict(x=torch.ones(1, 2, DIM)), ShapeMismatch),
    "T = 0": (dict(x=torch.ones(0, DIM)), ShapeMismatch),
    "NaN": (dict(x=torch.tensor([[float("nan")] * DIM])), NonFinite),
    "Inf": (dict(x=torch.full((3, DIM), float("inf"))), NonFinite),
    "not a tensor": (dict(x=[[0.0] * DIM]), BadRequest),
    "verify too long": (dict(x=torch.ones(17, DIM), speculative=True), ShapeMismatch),
    "speculative not a bool": (dict(speculative="yes"), BadRequest),
}


@pytest.mark.parametrize("case", list(BAD_CONV))
def test_a_bad_conv_request_raises_before_queueing_and_changes_no_state(engine, case):
    sid = engine.create_session("s")
    engine.submit(sid, LAYERS[0], torch.randn(3, DIM)).result(10)
    before = engine.export_state(sid)
    kw, err = BAD_CONV[case]
    args = dict(session=sid, layer=LAYERS[0], x=torch.randn(2, DIM), speculative=False)
    args.update(kw)
    with pytest.raises(err) as e:
        engine.submit(args["session"], args["layer"], args["x"], args["speculative"])
    assert e.value.message
    assert engine.stats()["queue_depth"] == 0
    assert torch.equal(engine.export_state(sid), before)
    # the session still works
    engine.submit(sid, LAYERS[0], torch.randn(1, DIM)).result(10)


def test_error_messages_name_expected_and_actual(engine):
    sid = engine.create_session()
    with pytest.raises(ShapeMismatch, match=rf"dim={DIM}\), got \(2, {DIM + 1}\)"):
        engine.submit(sid, LAYERS[0], torch.ones(2, DIM + 1))
    with pytest.raises(DtypeUnsupported, match="got int32"):
        engine.submit(sid, LAYERS[0], torch.ones(2, DIM, dtype=torch.int32))
    with pytest.raises(UnknownLayer, match=r"conv layers are \[1, 4, 6\]"):
        engine.submit(sid, 2, torch.ones(1, DIM))


@pytest.mark.parametrize("state,err", [
    (torch.zeros(3, DIM, 3, dtype=torch.float64), DtypeUnsupported),
    (torch.zeros(3, DIM, 3, dtype=torch.bfloat16), DtypeUnsupported),
    (torch.zeros(2, DIM, 3), ShapeMismatch),
    (torch.zeros(3, DIM, 4), ShapeMismatch),
    (torch.zeros(3, 3, DIM), ShapeMismatch),
    (torch.full((3, DIM, 3), float("nan")), NonFinite),
    ("zeros", BadRequest),
])
def test_a_bad_state_import_is_rejected_and_changes_nothing(engine, state, err):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[1], torch.randn(5, DIM)).result(10)
    before = engine.export_state(sid)
    with pytest.raises(err):
        engine.import_state(sid, state)
    assert torch.equal(engine.export_state(sid), before)


# ---- speculative rules


def test_a_second_verify_replaces_the_first_and_starts_from_the_committed_state(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sid = engine.create_session()
    oracle.new(sid)
    x0 = torch.randn(4, DIM)
    assert_close(engine.submit(sid, LAYERS[0], x0).result(10), oracle.conv(sid, 0, x0))
    a, b = torch.randn(3, DIM), torch.randn(4, DIM)
    ya = engine.submit(sid, LAYERS[0], a, speculative=True).result(10)
    yb = engine.submit(sid, LAYERS[0], b, speculative=True).result(10)
    assert_close(ya, oracle.verify(sid, 0, a))
    assert_close(yb, oracle.verify(sid, 0, b))     # from the committed state, not after a
    engine.accept(sid, 4)                          # 4 is fine: b (the pending one) has 4 tokens
    oracle.accept(sid, 4)
    assert_close(engine.export_state(sid), oracle.export(sid))


def test_accept_commits_every_verified_layer_at_once_and_zero_discards(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sid = engine.create_session()
    oracle.new(sid)
    for p in range(3):
        x = torch.randn(2, DIM)
        engine.submit(sid, LAYERS[p], x).result(10)
        oracle.conv(sid, p, x)
    committed = engine.export_state(sid)
    for p in (0, 2):
        x = torch.randn(5, DIM)
        engine.submit(sid, LAYERS[p], x, speculative=True).result(10)
        oracle.verify(sid, p, x)
    assert torch.equal(engine.export_state(sid), committed)       # export: the committed state
    fork = engine.fork_session(sid)
    oracle.fork(sid, fork)
    engine.accept(sid, 3)
    oracle.accept(sid, 3)
    assert_close(engine.export_state(sid), oracle.export(sid))
    assert torch.equal(engine.export_state(sid)[1], committed[1])  # layer without a verify: untouched
    engine.accept(fork, 0)                                       # the fork accepts on its own
    assert torch.equal(engine.export_state(fork), committed)


@pytest.mark.parametrize("n,why", [(-1, "integer >= 0"), (True, "integer"), (1.0, "integer"),
                                   (6, "at most 5")])
def test_accept_rejects_a_bad_token_count_and_keeps_the_verify(engine, n, why):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[0], torch.randn(5, DIM), speculative=True).result(10)
    with pytest.raises(BadRequest, match=why):
        engine.accept(sid, n)
    engine.accept(sid, 5)


def test_accept_without_a_pending_verify_is_a_bad_request(engine):
    sid = engine.create_session()
    with pytest.raises(BadRequest, match="no speculative verify"):
        engine.accept(sid, 1)


def test_import_discards_a_pending_verify(engine):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
    engine.import_state(sid, torch.ones(3, DIM, 3))
    engine.submit(sid, LAYERS[0], torch.randn(1, DIM)).result(10)   # no longer pending
    with pytest.raises(BadRequest):
        engine.accept(sid, 1)


# ---- session life cycle


def test_sessions_create_delete_and_their_errors(engine):
    assert engine.create_session("a") == "a"
    with pytest.raises(SessionExists):
        engine.create_session("a")
    with pytest.raises(SessionExists):
        engine.fork_session("a", "a")
    auto = engine.create_session()
    assert isinstance(auto, str) and len(auto) == 32
    engine.delete_session("a")
    for call in (lambda: engine.delete_session("a"), lambda: engine.export_state("a"),
                 lambda: engine.fork_session("a"), lambda: engine.accept("a", 0),
                 lambda: engine.submit("a", LAYERS[0], torch.randn(1, DIM))):
        with pytest.raises(UnknownSession):
            call()
    assert engine.create_session("a") == "a"      # the id can be used again
    with pytest.raises(BadRequest):
        engine.create_session("")


def test_the_pool_runs_out_then_frees_on_delete(engine):
    info = engine.model_info()
    assert info["slots"] == {"total": 8, "free": 8}
    ids = [engine.create_session() for _ in range(8)]
    with pytest.raises(PoolExhausted) as e:
        engine.create_session()
    assert e.value.retry_after > 0 and "8" in e.value.message
    with pytest.raises(PoolExhausted):
        engine.fork_session(ids[0])
    engine.delete_session(ids[3])
    assert engine.model_info()["slots"]["free"] == 1
    new = engine.create_session()
    assert torch.count_nonzero(engine.export_state(new)) == 0      # a reused slot starts from zeros


def test_delete_runs_after_the_requests_submitted_before_it_then_frees_the_slot():
    e = make_engine(max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()
        futs = [e.submit(sid, LAYERS[0], torch.randn(1, DIM)) for _ in range(3)]
        t0 = time.monotonic()
        e.delete_session(sid)
        assert time.monotonic() - t0 < 2          # the waiting delete runs them without the 5 s delay
        assert all(f.result(0).shape == (1, DIM) for f in futs)
        assert e.stats()["queue_depth"] == 0 and e.stats()["slots_in_use"] == 0
    finally:
        e.stop(drain=False)


def test_idle_sessions_are_evicted_and_then_report_state_lost():
    e = make_engine(session_ttl_s=0.15)
    try:
        old = e.create_session("old")
        keep = e.create_session("keep")
        deadline = time.monotonic() + 0.6
        batched = e.create_session("batched")     # used through batch requests only: its last use is the
        e.submit_batch([batched], LAYERS[1], torch.randn(1, DIM)).result(5)   # batch's completion
        while time.monotonic() < deadline:
            e.submit(keep, LAYERS[0], torch.randn(1, DIM)).result(5)
            e.submit_batch([batched], LAYERS[1], torch.randn(1, DIM)).result(5)
            time.sleep(0.02)
        e.export_state(batched)
        e.delete_session(batched)
        with pytest.raises(StateLost):
            e.submit(old, LAYERS[0], torch.randn(1, DIM))
        with pytest.raises(StateLost):
            e.export_state(old)
        with pytest.raises(StateLost):
            e.delete_session(old)
        assert e.stats()["sessions_evicted"] == 1 and e.stats()["slots_in_use"] == 1
        with pytest.raises(UnknownSession):
            e.export_state("never")
        e.create_session("old")                     # re-creating an evicted id is allowed
        e.export_state("old")
    finally:
        e.stop(drain=False)


def test_session_ops_see_the_requests_submitted_before_them():
    e = make_engine(max_queue_delay_us=50_000)     # requests sit in the queue for 50 ms
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sid = e.create_session()
        oracle.new(sid)
        for _ in range(3):
            x = torch.randn(2, DIM)
            e.submit(sid, LAYERS[2], x)
            oracle.conv(sid, 2, x)
        assert_close(e.export_state(sid), oracle.export(sid))
        x = torch.randn(2, DIM)
        e.submit(sid, LAYERS[2], x)
        oracle.conv(sid, 2, x)
        dst = e.fork_session(sid)
        assert_close(e.export_state(dst), oracle.export(sid))
    finally:
        e.stop(drain=False)


# ---- queue bound, cancel, timeout, stop


def test_a_full_queue_raises_queue_full_with_retry_after():
    e = make_engine(max_queue=3, max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()
        futs = [e.submit(sid, LAYERS[0], torch.randn(1, DIM)) for _ in range(3)]
        with pytest.raises(QueueFull) as err:
            e.submit(sid, LAYERS[0], torch.randn(1, DIM))
        assert err.value.retry_after > 0 and err.value.status == 429
        assert e.cancel(futs[2]) and futs[2].cancelled()
        e.submit(sid, LAYERS[0], torch.randn(1, DIM))   # room again
    finally:
        e.stop(drain=False)
    for f in futs[:2]:
        with pytest.raises(NotReady):
            f.result(5)


def test_a_cancelled_request_never_runs():
    e = make_engine(max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()
        fut = e.submit(sid, LAYERS[0], torch.randn(4, DIM))
        assert fut.cancel() and fut.cancelled()
        assert not e.cancel(fut)
        assert torch.count_nonzero(e.export_state(sid)) == 0
        assert e.stats()["requests"] == 0
    finally:
        e.stop(drain=False)


def test_a_request_stuck_behind_a_slow_step_times_out(monkeypatch):
    e = make_engine(request_timeout_s=0.1, max_batch_size=1)
    try:
        real = e._runner.execute

        def slow(out):
            time.sleep(0.3)
            return real(out)

        monkeypatch.setattr(e._runner, "execute", slow)
        a, b = e.create_session(), e.create_session()
        first = e.submit(a, LAYERS[0], torch.randn(1, DIM))
        time.sleep(0.02)
        late = e.submit(b, LAYERS[0], torch.randn(1, DIM))
        first.result(5)
        with pytest.raises(RequestTimeout):
            late.result(5)
        assert torch.count_nonzero(e.export_state(b)) == 0
        assert e.stats()["requests_expired"] == 1
    finally:
        e.stop(drain=False)


def test_stop_with_drain_finishes_queued_work_then_refuses_new_work():
    e = make_engine(max_queue_delay_us=100_000)
    sid = e.create_session()
    futs = [e.submit(sid, LAYERS[i % 3], torch.randn(2, DIM)) for i in range(6)]
    e.stop(drain=True, timeout=30)
    assert all(f.result(0).shape == (2, DIM) for f in futs)
    assert not e.ready
    with pytest.raises(NotReady):
        e.submit(sid, LAYERS[0], torch.randn(1, DIM))
    with pytest.raises(NotReady):
        e.create_session()


def test_not_ready_before_start():
    e = Engine(ConvModel.random(LAYERS, dim=DIM), EngineConfig(slots=2))
    assert not e.ready
    with pytest.raises(NotReady):
        e.create_session()
    assert e.model_info()["slots"] == {"total": 2, "free": 2}
    e.start()
    assert e.ready
    with pytest.raises(RuntimeError):
        e.start()
    e.stop()


# ---- info and stats


def test_model_info_and_stats_report_the_engine(engine):
    info = engine.model_info()
    assert info == {"layers": LAYERS, "dim": DIM, "width": 4, "dtype": "float32", "state_dtype": "float32",
                    "activation": "silu", "slots": {"total": 8, "free": 8}}
    sids = [engine.create_session() for _ in range(3)]
    for s in sids:
        engine.submit(s, LAYERS[0], torch.randn(2, DIM)).result(5)
    futs = [engine.submit(s, LAYERS[0], torch.randn(1, DIM)) for s in sids]
    for f in futs:
        f.result(5)
    st = engine.stats()
    assert st["slots_in_use"] == 3 == st["slots_peak"] and st["slots_free"] == 5
    assert st["requests"] == 6 and st["tokens"] == 9
    assert st["bytes"]["pool"] == 3 * 9 * 3 * DIM * 4
    assert st["batch_size"]["count"] == st["steps"] and st["batch_size"]["sum"] == 6
    assert 0 <= st["pad_ratio"] < 1 and st["decode_rows"] == 3
    assert st["kernel_time_s"] > 0 and st["step_time_s"] >= st["kernel_time_s"]
    assert len(engine.recent_steps()) == st["steps"]


@pytest.mark.parametrize("kw", [dict(slots=0), dict(slots="many"), dict(state_dtype="float64"),
                                dict(max_spec_tokens=0), dict(max_spec_tokens=100, max_batch_tokens=64),
                                dict(decode_buckets=()), dict(session_ttl_s=0), dict(max_queue=0),
                                dict(gpu_timing_interval=0)])
def test_bad_engine_config_is_rejected(kw):
    with pytest.raises(ValueError):
        EngineConfig(**kw)


def test_engine_config_from_settings_like_object():
    class S:
        slots = 32
        max_batch_tokens = 1024
        decode_buckets = [4, 1, 2]
        state_dtype = "float32"
        session_ttl_s = 10.0
        unrelated = "x"

    cfg = EngineConfig.from_settings(S())
    assert cfg.slots == 32 and cfg.decode_buckets == (1, 2, 4) and cfg.state_dtype == torch.float32
    assert cfg.max_batch_tokens == 1024 and cfg.session_ttl_s == 10.0
    assert copy.copy(cfg) == cfg


# ---- the decode staging arena


@pytest.mark.parametrize("rows", [3, 8])
def test_staged_decodes_wrap_the_arena_and_fall_back_when_its_rows_are_held(rows):
    """Decode x is staged into a ring of rows at submit; a run of rows that wraps, rows still held by queued
    requests (those fall back to the per-row pack), and interleaved layers must all give the reference's y."""
    e = make_engine(slots=12, max_queue_delay_us=20_000, max_batch_size=64, decode_buckets=(1, 2, 4, 8, 16))
    try:
        e._runner.bufs.stage_rows = rows           # a tiny ring: wraps every few requests (views past it go unused)
        oracle = Oracle(e.model_cpu, e.state_dtype)
        rng = random.Random(rows)
        sids = [e.create_session() for _ in range(10)]
        for s in sids:
            oracle.new(s)
            for p in range(len(LAYERS)):
                x = torch.randn(2, DIM)
                e.submit(s, LAYERS[p], x).result(5)
                oracle.conv(s, p, x)
        # each round is submitted while the worker is held (a lone caller's requests would otherwise run one
        # at a time as they come, freeing their rows, on a machine where the submitter is the slower thread)
        gate, real = threading.Event(), e._runner.execute

        def held(out):
            gate.wait(10)
            return real(out)

        e._runner.execute = held
        staged = fallback = 0
        for i in range(12):
            batch = []
            gate.clear()
            for s in rng.sample(sids, 10 if i == 0 else rng.randint(1, 10)):   # the first round wraps the ring
                p = rng.randrange(len(LAYERS))
                x = torch.randn(1, DIM)
                f = e.submit(s, LAYERS[p], x)
                staged += f._req.stage >= 0
                fallback += f._req.stage < 0
                batch.append((f, oracle.conv(s, p, x)))
            gate.set()
            for f, want in batch:
                assert_close(f.result(5), want)
        assert staged and fallback
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s))
    finally:
        e.stop(drain=False)


# ---- the output ring


def _held_y(held):
    if isinstance(held, torch.Tensor):
        return held
    if isinstance(held, tuple):                # (storage, offset, shape, dtype): a view rebuilt from its storage
        storage, offset, shape, dtype = held
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape)
    return held.result() if hasattr(held, "result") else torch.from_numpy(held)


def test_results_kept_by_callers_are_never_overwritten():
    """A step's results are views of a reused host buffer (the output ring); a buffer is reused only when no
    result, cut or not, refers to it. Callers here keep every result (read and unread futures, cut views, a
    numpy array of one, only a view's storage) across many more steps than the ring has buffers: all must still
    hold their y."""
    e = make_engine(slots=8, max_queue_delay_us=20_000, max_batch_size=8)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sids = [e.create_session() for _ in range(4)]
        for s in sids:
            oracle.new(s)
            x = torch.randn(3, DIM)
            assert_close(e.submit(s, LAYERS[0], x).result(5), oracle.conv(s, 0, x))
        kept = []                              # (what the caller holds, the reference y)
        for step in range(12):
            batch = []
            for s in sids:
                x = torch.randn(1, DIM)
                batch.append((e.submit(s, LAYERS[0], x), oracle.conv(s, 0, x)))
            for f, want in batch:              # one way of holding per step: each step's buffer is held by it
                f.exception(5)                 # finished, result not cut yet
                if step % 4 == 0:
                    kept.append((f, want))                     # an unread future
                elif step % 4 == 1:
                    kept.append((f.result().numpy(), want))    # a numpy array over the cut view
                elif step % 4 == 2:
                    kept.append((f.result(), want))            # the cut view itself
                else:                                          # only the storage of the cut view
                    y = f.result()
                    kept.append(((y.untyped_storage(), y.storage_offset(), y.shape, y.dtype), want))
                    del y
            del f
            batch.clear()
            if step % 4 == 3:
                for held, want in kept:        # nothing read so far has changed under its holder
                    assert_close(_held_y(held), want)
        for held, want in kept:
            assert_close(_held_y(held), want)
        assert e._runner.bufs.outputs.fresh > 0       # the held buffers were left to their holders
        # once nothing refers to them, the ring's buffers are reused again
        del held, want
        kept.clear()
        batch.clear()
        fresh = e._runner.bufs.outputs.fresh
        for _ in range(6):
            for s in sids:
                x = torch.randn(1, DIM)
                assert_close(e.submit(s, LAYERS[0], x).result(5), oracle.conv(s, 0, x))
        assert e._runner.bufs.outputs.fresh == fresh
    finally:
        e.stop(drain=False)


def test_output_ring_hands_out_a_buffer_again_only_when_nothing_refers_to_it():
    """The ring on its own: each way of keeping a result (the tensor, a view, a numpy array over it, only the
    view's storage) keeps its buffer out of the ring; a buffer comes back once it is let go."""
    from convserve.service.engine import OutputRing
    ring = OutputRing(2, 4, 8, torch.float32, False)

    def hold(kind, buf):
        if kind == "tensor":
            return buf
        view = buf[1:3]
        return {"view": view, "numpy": view.numpy(), "storage": view.untyped_storage()}[kind]

    for kind in ("tensor", "view", "numpy", "storage"):
        first = ring.take(4)
        ptr = first.data_ptr()
        held = hold(kind, first)
        del first
        got = [ring.take(4) for _ in range(3)]     # the other buffer, then fresh tensors: never the held one
        assert all(t.data_ptr() != ptr for t in got), kind
        del got, held
        assert any(ring.take(4).data_ptr() == ptr for _ in range(2)), f"{kind}: the buffer did not come back"


# ---- batch requests: one decode token for each of several sessions, as one request


def _prefilled(e, oracle, n, layer_pos=0, t=3):
    sids = [e.create_session() for _ in range(n)]
    for s in sids:
        oracle.new(s)
        x = torch.randn(t, DIM)
        e.submit(s, LAYERS[layer_pos], x).result(10)
        oracle.conv(s, layer_pos, x)
    return sids


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_a_batch_is_one_request_one_step_and_equals_the_sessions_decoded_one_by_one(rows, xdt):
    e = make_engine(slots=12, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = _prefilled(e, oracle, rows)
        fresh = e.create_session()                    # a session with no state on the layer: the zero state
        oracle.new(fresh)
        sids = sids[:-1] + [fresh] + sids[-1:] if rows > 1 else sids
        sids = sids[:rows]
        before = e.stats()
        x = torch.randn(rows, DIM).to(xdt)
        want = torch.cat([oracle.conv(s, 0, x[i:i + 1]) for i, s in enumerate(sids)])
        y = e.submit_batch(sids, LAYERS[0], x).result(10)
        assert y.shape == (rows, DIM) and y.dtype == xdt
        assert_close(y, want, what="batch y")
        after = e.stats()
        assert after["requests"] - before["requests"] == 1 and after["steps"] - before["steps"] == 1
        assert after["decode_rows"] - before["decode_rows"] == rows
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
        y2 = asyncio.run(e.conv_batch(sids, LAYERS[0], x))      # and through asyncio
        want2 = torch.cat([oracle.conv(s, 0, x[i:i + 1]) for i, s in enumerate(sids)])
        assert_close(y2, want2, what="async batch y")
    finally:
        e.stop(drain=False)


BAD_BATCH = {
    "unknown session": (dict(sessions=["a", "nope"]), UnknownSession, "nope"),
    "repeated session": (dict(sessions=["a", "b", "a"]), BadRequest, "appears twice"),
    "no sessions": (dict(sessions=[]), BadRequest, "1 to 4"),
    "too many rows": (dict(sessions=["a", "b", "c", "d", "e"]), BadRequest, "split the batch"),
    "sessions a string": (dict(sessions="ab"), BadRequest, "list of session ids"),
    "rows differ from sessions": (dict(x=torch.ones(3, DIM)), ShapeMismatch, r"\(2, 24\)"),
    "wrong dim": (dict(x=torch.ones(2, DIM + 1)), ShapeMismatch, "rows >= 1"),
    "float64": (dict(x=torch.ones(2, DIM, dtype=torch.float64)), DtypeUnsupported, "bfloat16"),
    "NaN": (dict(x=torch.full((2, DIM), float("nan"))), NonFinite, "NaN"),
    "layer without conv": (dict(layer=2), UnknownLayer, "no conv"),
    "pending verify": (dict(sessions=["a", "v"]), BadRequest, "accept"),
}


@pytest.mark.parametrize("case", list(BAD_BATCH))
def test_a_bad_batch_is_rejected_whole_before_queueing_and_changes_no_state(case):
    e = make_engine(max_batch_size=4, decode_buckets=(1, 2, 4))
    try:
        for s in ("a", "b", "c", "d", "e", "v"):
            e.create_session(s)
            e.submit(s, LAYERS[0], torch.randn(3, DIM)).result(10)
        e.submit("v", LAYERS[1], torch.randn(2, DIM), speculative=True).result(10)
        before = {s: e.export_state(s) for s in ("a", "b", "c", "d", "e", "v")}
        kw, err, msg = BAD_BATCH[case]
        args = dict(sessions=["a", "b"], layer=LAYERS[0], x=torch.randn(2, DIM))
        args.update(kw)
        n0 = e.stats()["requests"]
        with pytest.raises(err, match=msg):
            e.submit_batch(args["sessions"], args["layer"], args["x"])
        assert e.stats()["queue_depth"] == 0 and e.stats()["requests"] == n0
        for s, st in before.items():
            assert torch.equal(e.export_state(s), st), s
        y = e.submit_batch(["a", "b"], LAYERS[0], torch.randn(2, DIM)).result(10)   # the sessions still work
        assert y.shape == (2, DIM)
    finally:
        e.stop(drain=False)


def test_a_batch_runs_after_its_sessions_earlier_requests_and_before_their_later_ones():
    """A session's prefill, then a batch holding it, then its next decode, all queued at once (a long delay
    window): each sees the one before it, on the same layer and across layers."""
    e = make_engine(slots=12, max_queue_delay_us=300_000, max_batch_size=16, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = _prefilled(e, oracle, 4)
        checks = []
        x = torch.randn(5, DIM)
        checks.append((e.submit(sids[0], LAYERS[0], x), oracle.conv(sids[0], 0, x)))
        x = torch.randn(1, DIM)
        checks.append((e.submit(sids[3], LAYERS[1], x), oracle.conv(sids[3], 1, x)))
        for rnd in range(2):
            xb = torch.randn(3, DIM)
            checks.append((e.submit_batch(sids[:3], LAYERS[0], xb),
                           torch.cat([oracle.conv(s, 0, xb[i:i + 1]) for i, s in enumerate(sids[:3])])))
        x = torch.randn(1, DIM)
        checks.append((e.submit(sids[1], LAYERS[0], x), oracle.conv(sids[1], 0, x)))
        x = torch.randn(2, DIM)
        checks.append((e.submit(sids[2], LAYERS[1], x), oracle.conv(sids[2], 1, x)))
        for i, (f, want) in enumerate(checks):
            assert_close(f.result(10), want, what=f"request {i}")
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


def test_a_cancelled_batch_never_runs_and_its_sessions_go_on():
    e = make_engine(max_queue_delay_us=5_000_000, max_batch_size=4, decode_buckets=(1, 2, 4))
    try:
        sids = [e.create_session() for _ in range(3)]
        slow = e.submit(sids[0], LAYERS[0], torch.randn(4, DIM))     # the batch waits for it (the window)
        fut = e.submit_batch(sids, LAYERS[0], torch.randn(3, DIM))
        assert fut.cancel() and fut.cancelled()
        slow.result(10)
        for s in sids[1:]:
            assert torch.count_nonzero(e.export_state(s)) == 0
        assert e.submit_batch(sids, LAYERS[0], torch.randn(3, DIM)).result(10).shape == (3, DIM)
    finally:
        e.stop(drain=False)


def test_a_batch_whose_session_is_deleted_before_it_runs_fails_whole():
    """The delete runs first (it was posted first); the batch then fails with unknown_session, raised at submit
    or set on its future, and the batch's other sessions keep their state."""
    e = make_engine(max_queue_delay_us=200_000, max_batch_size=4, decode_buckets=(1, 2, 4))
    try:
        sids = [e.create_session() for _ in range(3)]
        for s in sids:
            e.submit(s, LAYERS[0], torch.randn(2, DIM)).result(10)
        before = e.export_state(sids[1])
        e.submit(sids[0], LAYERS[1], torch.randn(2, DIM))             # the delete waits for it
        t = threading.Thread(target=e.delete_session, args=(sids[0],))
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:             # until the delete is posted (or has already run)
            s0 = e._sessions._live.get(sids[0])
            if s0 is None or s0.ops:
                break
            time.sleep(0.001)
        with pytest.raises(UnknownSession, match="deleted"):
            e.submit_batch(sids, LAYERS[0], torch.randn(3, DIM)).result(10)
        t.join(10)
        assert torch.equal(e.export_state(sids[1]), before)
    finally:
        e.stop(drain=False)


def test_batches_take_a_free_batch_slot_else_the_arena_else_their_own_tensor():
    """A batch request's x goes to a batch slot (one replay: copy in, kernel, copy out into the slot's y) while
    one is free; a slot stays taken while a caller still holds the y it returned. With every slot held, batches
    go through the staging arena as one run (starting at row 0 when the run would wrap); with the arena held
    too, the step copies the batch's own x. Every path gives the reference's y."""
    from convserve.service.engine import BATCH_SLOTS

    e = make_engine(slots=12, max_queue_delay_us=0, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sids = _prefilled(e, oracle, 8)

        def run(k, layer_pos=0):
            x = torch.randn(k, DIM)
            want = torch.cat([oracle.conv(s, layer_pos, x[i:i + 1]) for i, s in enumerate(sids[:k])])
            f = e.submit_batch(sids[:k], LAYERS[layer_pos], x)
            y = f.result(10)
            assert_close(y, want)
            return f._req.batch.buf, f._req.stage, y

        kept = []
        for j in range(BATCH_SLOTS):                   # each caller keeps its y: each batch takes a new slot
            buf, stage, y = run(3 + j % 4)
            assert buf == j and stage < 0
            kept.append(y)
        e._runner.bufs.stage_rows = 10                        # a tiny arena: a run of 6 from row 6 would wrap
        bufs, stages = zip(*[run(k)[:2] for k in (6, 6, 3)])
        assert bufs == (-1, -1, -1) and all(t >= 0 for t in stages)
        assert [t % 10 for t in stages] == [0, 0, 6]
        kept.pop(1)                                    # the y of slot 1 is dropped: the slot is free again
        assert run(5)[0] == 1
        e._runner.stage_owner[:10] = [types.SimpleNamespace(done=False)] * 10   # every arena row held by a queued request
        e._runner.slot_owner[:] = [types.SimpleNamespace(done=False)] * BATCH_SLOTS
        buf, stage, _ = run(2, layer_pos=2)
        assert buf < 0 and stage < 0                   # copied from the batch's own x
        st = e.stats()
        assert st["batch_requests"] == BATCH_SLOTS + 5 and st["batch_requests_in_slots"] == BATCH_SLOTS + 1
        for s in sids:
            assert_close(e.export_state(s), oracle.export(s), what=f"state {s}")
    finally:
        e.stop(drain=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_steps_after_start_build_no_new_kernel_variant():
    """Start-up warms every prefill and verify variant a step can take (launches padded to 16 sequences and 16
    tokens, index arrays 16-byte aligned): a mix of prefills of any length and count, verifies of any row count
    and decodes then builds no Triton specialization mid-traffic (each would stall a step for about a second)."""
    knobs = pytest.importorskip("triton.knobs")
    e = make_engine(device="cuda", slots=40, max_batch_tokens=512, max_batch_size=64, max_queue_delay_us=2000,
                    max_spec_tokens=5)
    built = []
    prev = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: built.append(str(kw.get("fn", a[:1]))[:80])
    try:
        rng = random.Random(4)
        sids = [e.create_session() for _ in range(33)]
        for rnd in range(4):
            futs = []
            for sid in rng.sample(sids, rng.randint(1, 33)):
                t = rng.choice([1, 2, 3, 7, 15, 16, 17, 40, 100, 300])
                futs.append(e.submit(sid, LAYERS[rng.randrange(3)], torch.randn(t, DIM)))
            for f in futs:
                f.result(60)
            futs = [e.submit(sid, LAYERS[0], torch.randn(rng.randint(1, 5), DIM), speculative=True)
                    for sid in rng.sample(sids, rng.randint(1, 20))]
            for f in futs:
                f.result(60)
            for sid in sids:
                if e._sessions.get(sid).pending:
                    e.accept(sid, 0)
            k = rng.randint(1, 33)
            e.submit_batch(sids[:k], LAYERS[1], torch.randn(k, DIM)).result(60)
        assert not built, f"kernel variants built after start: {built}"
    finally:
        knobs.runtime.jit_post_compile_hook = prev
        e.stop(drain=False)


def _gate(e):
    """Hold the worker inside its next step until the returned event is set (so requests queue behind it)."""
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


def test_a_batch_never_overtakes_a_request_before_it_whose_later_neighbour_was_withdrawn():
    """Session A: a chunked prefill under way, then a request cancelled, then a batch holding A: the batch still
    waits for the prefill (it waits for every unfinished request before it, not just the last)."""
    e = make_engine(max_batch_tokens=16, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        e.create_session("A")
        oracle.new("A")
        go, entered = _gate(e)
        xp, xb = torch.randn(64, DIM), torch.randn(1, DIM)
        pre = e.submit("A", LAYERS[0], xp)
        assert entered.wait(10)
        assert e.submit("A", LAYERS[1], torch.randn(1, DIM)).cancel()
        fut = e.submit_batch(["A"], LAYERS[0], xb)
        go.set()
        assert_close(pre.result(10), oracle.conv("A", 0, xp))
        assert_close(fut.result(10), oracle.conv("A", 0, xb))
        assert_close(e.export_state("A"), oracle.export("A"))
    finally:
        e.stop(drain=False)


def test_a_request_waits_for_every_batch_of_its_session_before_it_even_when_a_later_one_was_withdrawn():
    e = make_engine(max_batch_tokens=16, max_batch_size=8, decode_buckets=(1, 2, 4, 8))
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        for s in "AB":
            e.create_session(s)
            oracle.new(s)
        go, entered = _gate(e)
        xp, x1, xr = torch.randn(64, DIM), torch.randn(2, DIM), torch.randn(1, DIM)
        pre = e.submit("B", LAYERS[0], xp)                     # the first batch waits for B's prefill
        assert entered.wait(10)
        first = e.submit_batch(["A", "B"], LAYERS[0], x1)
        assert e.submit_batch(["A"], LAYERS[1], torch.randn(1, DIM)).cancel()
        later = e.submit("A", LAYERS[0], xr)
        go.set()
        oracle.conv("B", 0, xp)
        want1 = torch.cat([oracle.conv("A", 0, x1[:1]), oracle.conv("B", 0, x1[1:])])
        pre.result(10)
        assert_close(first.result(10), want1)
        assert_close(later.result(10), oracle.conv("A", 0, xr))
    finally:
        e.stop(drain=False)


def test_a_batch_behind_a_timed_out_session_op_runs_and_the_worker_waits_without_spinning():
    e = make_engine(max_batch_tokens=16, max_batch_size=8, decode_buckets=(1, 2, 4, 8), request_timeout_s=5.0)
    calls = [0]
    real = e._sched.schedule

    def counting(now):
        calls[0] += 1
        return real(now)

    e._sched.schedule = counting
    try:
        e.create_session("A")
        go, entered = _gate(e)
        pre = e.submit("A", LAYERS[0], torch.randn(64, DIM))
        assert entered.wait(10)
        e.config.request_timeout_s = 0.3                       # the export's wait only (the queue keeps 5 s)
        errors = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(RequestTimeout, e.export_state, "A")))
        t.start()
        deadline = time.monotonic() + 5
        while not e._sessions.get("A").ops and time.monotonic() < deadline:
            time.sleep(0.001)
        fut = e.submit_batch(["A"], LAYERS[0], torch.randn(1, DIM))
        t.join(10)
        go.set()
        pre.result(10)
        c0 = calls[0]
        assert fut.result(3).shape == (1, DIM)                 # the op is withdrawn: nothing left to wait for
        assert calls[0] - c0 < 200, calls[0] - c0
        assert errors
    finally:
        e.stop(drain=False)
