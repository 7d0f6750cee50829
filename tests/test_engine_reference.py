"""The engine against the reference run one request at a time: randomized workloads of every kind of request,
on the CPU and (marked ``gpu``) on CUDA with and without graphs.

The randomized test records its seed in the test id; rerun one with ``-k 'seed3'``.
"""


import pytest
import torch

from convserve.service.model import ConvModel
from tests.conftest import HAS_CUDA
from tests.engine_support import CONFIGS, DIM, LAYERS, Oracle, make_engine, run_random_workload
from tests.tolerance import assert_close


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
