"""Repeated launches replayed as CUDA graphs (``kernels/_replay.py``).

CPU: the generated launcher's choices (launch, note, capture, replay, the capturing stream, the bounds) with
Triton's C launcher and the capture replaced by recorders. GPU: real graphs give the float64 reference's results
and state on fresh contents at the same addresses, in stream order, inside a caller's own graph capture, and
for both ops and layouts."""

import warnings

import pytest
import torch

from convserve.kernels import _launch, causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_update
from convserve.kernels import causal_conv1d_update_ref
from convserve.kernels._launch import LaunchPlan
from convserve.kernels._replay import Replays
from tests.fake_kernel import FakeKernel
from tests.tolerance import assert_close


class _Graph:
    def __init__(self, handle):
        self.handle = handle


class _Rig:
    """A plan set up as on CUDA: the C launcher, the capture, the graph launch and the capturing flag are
    recorders (a graph's launch logs the launches its capture recorded)."""

    def __init__(self, monkeypatch, after=2, keep=2, fail=False, launch_result=0):
        monkeypatch.setattr(_launch, "_raw_stream", lambda index: 1000 + index)
        self.log, self.capturing, self.recorded, self.fail = [], False, [], fail
        self.launch_result, self.streams = launch_result, []
        plan = LaunchPlan(FakeKernel(), (3, 5), (7,), dict(FLAG=True), 4, torch.device("cpu"))
        plan.direct, plan.device_index = True, 0
        plan.const_values = (True,)
        plan.tail = plan.scalars + plan.const_values
        plan.called_as({2: 1}, alias=(0, 3))
        plan.replays = Replays(0, after, keep, capture=self._capture, capturing=self._capturing,
                               launch=self._launch)
        entry = (True, lambda *a: self.log.append(("launch", a[13:-2])), 0xF00, ("meta",), 0, 0)
        plan._aligned = entry
        plan._slow = lambda tensors: self.log.append(("generic", tensors))
        self.plan, self.fast = plan, plan._make_fast(entry, _tensors())

    def _capturing(self, stream):
        self.streams.append(stream)
        return self.capturing

    def _capture(self, device_index, launch_on):
        if self.fail:
            raise RuntimeError("capture refused")
        n = len(self.log)
        launch_on(777)  # what a capture records: the launch, not run
        self.recorded.append(self.log[n:])
        del self.log[n:]
        return _Graph(len(self.recorded) - 1)

    def _launch(self, handle, stream):
        if not self.launch_result:
            self.log.append(("replay", self.recorded[handle]))
        return self.launch_result


def _tensors():
    x, w, o = (torch.empty(64, dtype=torch.bfloat16) for _ in range(3))
    return x, w, w, o


@pytest.mark.parametrize("after", [1, 2, 3])
def test_the_after_th_launch_with_the_same_addresses_is_captured_and_later_ones_replay(monkeypatch, after):
    rig = _Rig(monkeypatch, after=after)
    t = _tensors()
    ptrs = (t[0].data_ptr(), t[1].data_ptr(), t[1].data_ptr(), t[3].data_ptr())
    for _ in range(after):
        rig.fast(*t)
    assert rig.log == [("launch", ptrs)] * after
    assert list(rig.plan.replays.graphs) == [(ptrs[0], ptrs[1], ptrs[3])]
    rig.fast(*t)
    rig.fast(*t)
    assert rig.log[after:] == [("replay", [("launch", ptrs)])] * 2


def test_other_addresses_launch_and_count_on_their_own(monkeypatch):
    rig = _Rig(monkeypatch)
    a, b = _tensors(), _tensors()
    rig.fast(*a)
    rig.fast(*b)
    assert [e[0] for e in rig.log] == ["launch", "launch"] and not rig.plan.replays.graphs
    rig.fast(*a)
    assert len(rig.plan.replays.graphs) == 1
    rig.fast(*b)
    rig.fast(*a)
    rig.fast(*b)
    assert [e[0] for e in rig.log] == ["launch"] * 4 + ["replay"] * 2
    assert rig.log[-2][1][0][1][0] == a[0].data_ptr() and rig.log[-1][1][0][1][0] == b[0].data_ptr()


def test_a_capturing_stream_gets_the_plain_launch_and_no_capture(monkeypatch):
    rig = _Rig(monkeypatch)
    t = _tensors()
    rig.capturing = True
    for _ in range(4):
        rig.fast(*t)
    assert [e[0] for e in rig.log] == ["launch"] * 4 and not rig.plan.replays.graphs
    rig.capturing = False
    rig.fast(*t)  # counted anew: the captures above were refused, not deferred
    rig.fast(*t)
    rig.capturing = True
    rig.fast(*t)  # a graph exists, but the caller's capture must record the launch itself
    assert [e[0] for e in rig.log] == ["launch"] * 7


def test_a_plan_keeps_at_most_keep_graphs_and_stops_capturing_after_four_times_keep(monkeypatch):
    rig = _Rig(monkeypatch, after=1, keep=2)
    sets = [_tensors() for _ in range(12)]
    for t in sets[:3]:
        rig.fast(*t)
    keys = list(rig.plan.replays.graphs)
    assert len(keys) == 2 and keys[0][0] == sets[1][0].data_ptr()  # the oldest went first
    for t in sets[3:]:
        rig.fast(*t)
    assert rig.plan.replays.captures_left == 0
    last = list(rig.plan.replays.graphs)
    assert [k[0] for k in last] == [sets[6][0].data_ptr(), sets[7][0].data_ptr()]  # the 8th capture was the last
    n = len(rig.log)
    rig.fast(*sets[7])
    rig.fast(*sets[11])
    assert [e[0] for e in rig.log[n:]] == ["replay", "launch"]


def test_a_failed_capture_warns_once_and_leaves_plain_launches(monkeypatch):
    rig = _Rig(monkeypatch, after=1, fail=True)
    t = _tensors()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            rig.fast(*t)
    assert [e[0] for e in rig.log] == ["launch"] * 3
    assert sum("graph capture" in str(c.message) for c in caught) == 1


def test_an_aliased_out_or_an_unaligned_address_takes_the_generic_path_and_never_a_graph(monkeypatch):
    rig = _Rig(monkeypatch, after=1)
    x, w, _, o = _tensors()
    with pytest.raises(ValueError, match="out"):
        rig.fast(x, w, w, x.view(64))
    odd = torch.empty(65, dtype=torch.bfloat16)[1:]  # 2 bytes off 16-byte alignment
    rig.plan._entries[(True, True, True, False)] = rig.plan._aligned
    for _ in range(3):
        rig.fast(x, w, w, odd)
    assert [e[0] for e in rig.log] == ["launch"] * 3 and rig.log[0][1][3] == odd.data_ptr()
    assert not rig.plan.replays.graphs and not rig.plan.replays.counts


def test_the_capture_check_asks_about_the_stream_the_launch_goes_to(monkeypatch):
    rig = _Rig(monkeypatch)
    t = _tensors()
    for _ in range(4):
        rig.fast(*t)
    assert rig.streams and set(rig.streams) == {1000}  # _raw_stream(0) as patched


def test_a_failed_graph_launch_warns_drops_the_graphs_and_launches_plainly(monkeypatch):
    rig = _Rig(monkeypatch, after=1, launch_result=700)
    t = _tensors()
    rig.fast(*t)  # launch, capture
    assert rig.plan.replays.graphs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rig.fast(*t)  # the graph's launch fails: the plain launch instead
        rig.fast(*t)
    assert [e[0] for e in rig.log] == ["launch"] * 3
    assert not rig.plan.replays.graphs and rig.plan.replays.captures_left == 0
    assert sum("error 700" in str(c.message) for c in caught) == 1


def test_replay_off_generates_the_plain_launcher(monkeypatch):
    monkeypatch.setitem(_launch.TUNING, "replay", dict(after=0, keep=16))
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: 1000 + index)
    plan = LaunchPlan(FakeKernel(), (1, 1), (7,), dict(FLAG=True), 4, torch.device("cpu"))
    plan.direct = True
    plan.const_values = (True,)
    plan.tail = plan.scalars + plan.const_values
    log = []
    entry = (True, lambda *a: log.append(a), 1, (), 0, 0)
    monkeypatch.setattr(plan, "_slow", lambda tensors: object())
    monkeypatch.setattr(_launch, "_entry", lambda compiled: entry)
    x = torch.empty(64, dtype=torch.bfloat16)
    plan._first((x,), [x.data_ptr()])
    assert plan.replays is None and plan.fast != plan.__call__
    for _ in range(3):
        plan.fast(x)
    assert len(log) == 3


# --- GPU: real graphs -------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
# a failed capture or graph launch only warns in use; here it fails the test
no_replay_warnings = pytest.mark.filterwarnings("error:convserve")


@pytest.fixture
def fresh_plans(monkeypatch):
    """Both ops' plan caches empty for this test, so that the plans found afterwards are its own."""
    from convserve.kernels.decode import plan as dplan
    from convserve.kernels.prefill import plan as pplan
    monkeypatch.setattr(dplan, "_PLANS", _launch.PlanCache())
    monkeypatch.setattr(pplan, "_PLANS", _launch.PlanCache())
    return dplan, pplan


def _replayed(module) -> bool:
    return any(p.replays is not None and p.replays.graphs for p in _plans(module))


def _decode_case(dim, batch, layout, dtype):
    w = torch.randn(dim, 4, device="cuda", dtype=dtype)
    b = torch.randn(dim, device="cuda", dtype=dtype)
    lines = 2 * batch + 7
    if layout == "pool":
        pool = torch.randn(lines, 3, dim, device="cuda", dtype=dtype).transpose(1, 2)
    else:
        pool = torch.randn(lines, dim, 3, device="cuda", dtype=dtype)
    idx = torch.randperm(lines, device="cuda")[:batch].to(torch.int32)
    x = torch.empty(batch, dim, device="cuda", dtype=dtype)
    out = torch.empty_like(x)
    return w, b, pool, idx, x, out


def _plans(module):
    """Every LaunchPlan in an op's plan cache (prefill's entries are tuples of them)."""
    found, todo = [], list(module._PLANS.values())
    while todo:
        v = todo.pop()
        if isinstance(v, LaunchPlan):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            todo.extend(v)
    return found


@gpu
@no_replay_warnings
@pytest.mark.parametrize("layout", ["pool", "window-contiguous"])
@pytest.mark.parametrize("dim,batch,dtype", [(4096, 8, torch.bfloat16), (1000, 3, torch.float32),
                                             (8192, 256, torch.float16)])
def test_decode_replays_match_the_reference_on_fresh_contents_at_the_same_addresses(layout, dim, batch, dtype,
                                                                                      fresh_plans):
    dplan = fresh_plans[0]
    w, b, pool, idx, x, out = _decode_case(dim, batch, layout, dtype)
    state = pool.detach().cpu().clone()
    for step in range(6):
        x.copy_(torch.randn(batch, dim, device="cuda"))
        idx.copy_(torch.randperm(pool.shape[0], device="cuda")[:batch])  # the indices change too, in place
        out.fill_(float("nan"))
        y = causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=idx, out=out)
        ref = causal_conv1d_update_ref(x.cpu(), state, w.cpu(), b.cpu(), "silu", conv_state_indices=idx.cpu(),
                                       compute_dtype=torch.float64)
        assert y is out
        assert_close(out, ref, dtype, what=f"step {step}")
        assert torch.equal(pool.cpu(), state), f"state after step {step}"
    assert _replayed(dplan), "no call was replayed"


@gpu
@no_replay_warnings
def test_replays_run_in_order_on_the_callers_stream(fresh_plans):
    w, b, pool, idx, x, out = _decode_case(2048, 16, "pool", torch.float32)
    side = torch.cuda.Stream()
    state = pool.detach().cpu().clone()
    outs = []
    with torch.cuda.stream(side):
        for step in range(5):
            # a slow producer on the same stream: the replay must wait for it, as a launch would
            x.copy_(torch.randn(16, 2048, device="cuda") + torch.randn(4096, 4096, device="cuda").sum() * 0)
            causal_conv1d_update(x, pool, w, b, None, conv_state_indices=idx, out=out)
            outs.append((x.clone(), out.clone()))
    side.synchronize()
    assert _replayed(fresh_plans[0]), "no call was replayed"
    for xs, ys in outs:
        ref = causal_conv1d_update_ref(xs.cpu(), state, w.cpu(), b.cpu(), None, conv_state_indices=idx.cpu(),
                                       compute_dtype=torch.float64)
        assert_close(ys, ref, torch.float32)


@gpu
@no_replay_warnings
def test_a_callers_graph_capture_records_the_launch_after_replays_began(fresh_plans):
    w, b, pool, idx, x, out = _decode_case(1024, 4, "pool", torch.float32)
    for _ in range(4):  # replays begin
        causal_conv1d_update(x.normal_(), pool, w, b, "silu", conv_state_indices=idx, out=out)
    torch.cuda.synchronize()
    assert _replayed(fresh_plans[0])
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=idx, out=out)
    torch.cuda.synchronize()
    state = pool.detach().cpu().clone()
    for _ in range(3):
        x.normal_()
        out.fill_(float("nan"))
        g.replay()
        ref = causal_conv1d_update_ref(x.cpu(), state, w.cpu(), b.cpu(), "silu", conv_state_indices=idx.cpu(),
                                       compute_dtype=torch.float64)
        assert_close(out, ref, torch.float32)
        assert torch.equal(pool.cpu(), state)


@gpu
@no_replay_warnings
@pytest.mark.parametrize("layout", ["channels-first", "channels-last"])
@pytest.mark.parametrize("lens", [[1], [300, 5, 1024], [4195]])
def test_prefill_replays_match_the_reference_on_fresh_contents(layout, lens, fresh_plans):
    pplan = fresh_plans[1]
    dim, total = 2048, sum(lens)
    w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(16, 3, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    x = (torch.empty(dim, total, device="cuda", dtype=torch.bfloat16) if layout == "channels-first"
         else torch.empty(total, dim, device="cuda", dtype=torch.bfloat16).t())
    out = torch.empty_like(x)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    idx = torch.arange(len(lens), dtype=torch.int32, device="cuda") + 2
    init = torch.ones(len(lens), dtype=torch.bool, device="cuda")
    state = pool.detach().cpu().clone()
    for step in range(5):
        x.copy_(torch.randn(dim, total, device="cuda"))
        init.copy_(torch.rand(len(lens), device="cuda") < 0.5)
        out.fill_(float("nan"))
        causal_conv1d_fn(x, w, b, pool, qsl, idx, init, "silu", out=out)
        ref = causal_conv1d_ref(x.cpu(), w.cpu(), b.cpu(), state, qsl.cpu(), idx.cpu(), init.cpu(), "silu",
                                compute_dtype=torch.float64)
        assert_close(out, ref, torch.bfloat16, what=f"step {step}")
        assert torch.equal(pool.cpu(), state), f"state after step {step}"
    assert _replayed(pplan), "no call was replayed"
