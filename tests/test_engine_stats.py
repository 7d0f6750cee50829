"""model_info() and stats() report the engine."""

import torch

from tests.engine_support import DIM, LAYERS


def test_model_info_and_stats_report_the_engine(engine):
    info = engine.model_info()
    sha = info.pop("weights_sha256")
    assert info == {"layers": LAYERS, "dim": DIM, "width": 4, "dtype": "float32", "state_dtype": "float32",
                    "activation": "silu", "bias_layers": LAYERS, "seed": 1, "slots": {"total": 8, "free": 8}}
    assert len(sha) == 64 and sha == engine.model_cpu.weights_sha256()
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
