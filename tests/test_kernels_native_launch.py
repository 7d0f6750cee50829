"""Our own kernel launcher (kernels/_native_launch.py): the parameter block it packs per plan and writes the
addresses into per call, checked through its recorder on the CPU; on a GPU, that plans launch through it and
still match the reference."""

from __future__ import annotations

import shutil
import struct

import pytest
import torch

from convserve.kernels import _native_launch as nl

needs_cc = pytest.mark.skipif(not any(shutil.which(c) for c in ("gcc", "cc", "clang")), reason="no C compiler")


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("CONVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cvcache")))
    nl._state.pop("module", None)
    mod = nl.load_module()
    assert mod is not None, "the C launcher did not build"
    mod.use_recorder()
    yield mod
    nl._state.clear()
    mp.undo()


@pytest.mark.parametrize("n_ptrs", [1, 3, 8])
@pytest.mark.parametrize("folded", [(), (1,), (0, 2)])
@needs_cc
def test_a_plan_packs_its_scalars_once_and_writes_the_addresses_into_their_slots(recorder, n_ptrs, folded):
    scalars = [("i32", -7), ("i64", 1 << 40), ("i1", True), ("i32", 4096), ("u64", (1 << 64) - 3),
               ("fp32", 0.5), ("i16", -2)]
    types = ["*bf16"] * n_ptrs + [t for t, _ in scalars]
    values = [None] * n_ptrs + [v for _, v in scalars]
    for i in folded:        # scalars the compiled kernel does not take (constexprs, or specialized to 1)
        types[n_ptrs + i] = "constexpr"
    slots, ptr_slots = nl.pack_parameters(types, values, n_ptrs)
    plan = recorder.make(0xABC0, 5, 3, 1, 128, 4096, slots, ptr_slots)
    addrs = [0x7F00_0000_0000 + 256 * k for k in range(n_ptrs)]
    recorder.launch(plan, 0x55, *addrs)
    function, grid, block, shared, stream, raw = recorder.last()
    assert (function, grid, block, shared, stream) == (0xABC0, (5, 3, 1), 128, 4096, 0x55)
    taken = [(t, v) for t, v in zip(types[n_ptrs:], values[n_ptrs:]) if t != "constexpr"]
    assert len(raw) == 8 * (n_ptrs + len(taken) + 2)
    got = [raw[8 * i:8 * i + 8] for i in range(len(raw) // 8)]
    assert [struct.unpack("<Q", g)[0] for g in got[:n_ptrs]] == addrs
    for g, (t, v) in zip(got[n_ptrs:], taken):
        fmt = nl._PACK[t]
        assert struct.unpack(fmt, g[:struct.calcsize(fmt)])[0] == v
        assert g[struct.calcsize(fmt):] == b"\0" * (8 - struct.calcsize(fmt))
    assert got[-2:] == [b"\0" * 8, b"\0" * 8]          # Triton's scratch pointers: NULL


@needs_cc
def test_a_launch_with_the_wrong_number_of_addresses_or_a_bad_address_raises_and_launches_nothing(recorder):
    slots, ptr_slots = nl.pack_parameters(["*fp32", "*fp32", "i32"], [None, None, 3], 2)
    plan = recorder.make(1, 1, 1, 1, 32, 0, slots, ptr_slots)
    recorder.launch(plan, 0, 16, 32)
    before = recorder.last()
    with pytest.raises(TypeError, match="takes 2 addresses"):
        recorder.launch(plan, 0, 16)
    with pytest.raises((OverflowError, TypeError)):
        recorder.launch(plan, 0, 16, -1)
    with pytest.raises(TypeError):
        recorder.launch(plan, 0, 16, "x")
    assert recorder.last() == before


@pytest.mark.parametrize("types, values, n_ptrs", [
    (["i32", "*fp32"], [None, None], 1),            # a tensor argument that is not a pointer
    (["constexpr", "*fp32"], [None, None], 1),      # a tensor folded into the kernel
    (["*fp32", "fp16"], [None, 1.0], 1),            # a scalar type it does not pack
    (["*fp32", "i32"], [None, 1 << 40], 1),         # a value that does not fit its type
])
def test_parameters_it_cannot_pack_leave_the_plan_on_tritons_launcher(types, values, n_ptrs):
    assert nl.pack_parameters(types, values, n_ptrs) is None


def test_native_launch_switched_off_or_on_an_untested_triton_is_not_used(monkeypatch):
    monkeypatch.setattr(nl, "_state", {})
    monkeypatch.setenv("CONVSERVE_NATIVE_LAUNCH", "0")
    assert nl.enabled() is False
    monkeypatch.setattr(nl, "_state", {})
    monkeypatch.delenv("CONVSERVE_NATIVE_LAUNCH")
    monkeypatch.setattr(nl, "TESTED_TRITON", ("0.0.",))
    assert nl.enabled() is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 7, 256])
def test_on_a_gpu_decode_and_prefill_plans_launch_through_it_and_match_the_reference(batch):
    import triton

    from convserve.kernels import causal_conv1d_fn, causal_conv1d_update
    from convserve.kernels._launch import PlanCache
    from convserve.kernels.decode import plan as dplan
    from convserve.kernels.prefill import plan as pplan
    from convserve.kernels.reference import causal_conv1d_ref, causal_conv1d_update_ref

    if not triton.__version__.startswith(nl.TESTED_TRITON):
        pytest.skip(f"triton {triton.__version__} is not in TESTED_TRITON")
    assert nl.enabled()
    dev, dim, w = "cuda", 1024 + 8, 4
    weight = torch.randn(dim, w, device=dev)
    bias = torch.randn(dim, device=dev)
    pool = torch.randn(300, dim, w - 1, device=dev)
    idx = torch.randperm(300, device=dev)[:batch].to(torch.int32)
    for _ in range(3):                                      # the first calls compile and build the fast path
        x = torch.randn(batch, dim, device=dev)
        state_ref = pool.clone()
        want = causal_conv1d_update_ref(x, state_ref, weight, bias, "silu", conv_state_indices=idx,
                                        compute_dtype=torch.float64)
        out = torch.full_like(x, float("nan"))
        causal_conv1d_update(x, pool, weight, bias, "silu", conv_state_indices=idx, out=out)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool, state_ref, atol=1e-5, rtol=1e-5)
    assert any(getattr(p, "native", False) for p in _plans(dplan._PLANS)), "no decode plan launched natively"

    T = 3 * batch + 5
    qsl = torch.tensor([0, batch, 2 * batch + 1, T], dtype=torch.int32, device=dev)
    ci = torch.tensor([5, 9, 11], dtype=torch.int32, device=dev)
    init = torch.tensor([True, False, True], device=dev)
    for _ in range(3):
        x = torch.randn(dim, T, device=dev)
        states = pool.clone()
        want = causal_conv1d_ref(x, weight, bias, states, qsl, ci, init, "silu", compute_dtype=torch.float64)
        out = torch.full_like(x, float("nan"))
        causal_conv1d_fn(x, weight, bias, pool, qsl, ci, init, "silu", out=out)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool, states, atol=1e-5, rtol=1e-5)
    assert any(getattr(p, "native", False) for p in _plans(pplan._PLANS)), "no prefill plan launched natively"
    assert isinstance(dplan._PLANS, PlanCache)


def _plans(cache):
    for v in cache.values():
        for p in v if isinstance(v, tuple) else (v,):
            if isinstance(p, tuple):
                yield from p
            else:
                yield p
