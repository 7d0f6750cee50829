"""The runner: decodes staged into the arena at submit (wrapping, held rows falling back), and start-up
warming every kernel variant a step can take (``gpu``).
"""

import random
import threading

import pytest
import torch

from tests.conftest import HAS_CUDA
from tests.engine_support import DIM, LAYERS, Oracle, make_engine
from tests.tolerance import assert_close


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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_steps_after_start_build_no_new_kernel_variant():
    """Start-up warms every prefill and verify variant a step can take (launches padded to 16 sequences and 16
    tokens, index arrays 16-byte aligned; the prefill slots' token buckets): a mix of prefills of any length and
    count, verifies of any row count, decodes and batches from both prefill slots then builds no Triton
    specialization mid-traffic (each would stall a step for about a second)."""
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
            toks = [rng.choice([1, 1, 2, 9, 13]) for _ in range(k)]    # a mixed batch: verify rows padded
            spec = [t <= 5 and rng.random() < 0.5 for t in toks]
            e.submit_batch(sids[:k], LAYERS[2], torch.randn(sum(toks), DIM), tokens=toks, speculative=spec).result(60)
            if any(spec):
                e.accept_batch([s for s, f in zip(sids, spec) if f], [0] * sum(spec))
            for lay in LAYERS:                  # batches without verify rows: each slot (held y), every layer
                toks = [rng.choice([1, 2, 9, 40]) for _ in range(k)]
                ys = [e.submit_batch(sids[:k], lay, torch.randn(sum(toks), DIM), tokens=toks).result(60)
                      for _ in range(2)]
                del ys
        assert not built, f"kernel variants built after start: {built}"
    finally:
        knobs.runtime.jit_post_compile_hook = prev
        e.stop(drain=False)
