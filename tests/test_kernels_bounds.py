"""Every kernel path reads and writes only inside the tensors it is given, and within the launches of one kernel
(their program ids merged) no element of the output or the state is stored by two programs or loaded by a program
other than the one storing it (both checked lane by lane in Triton's interpreter, ``tests/interp_bounds.py``), on
random inputs with odd sizes, pads, tails and both state layouts; and the contract's edges a review found: decode
without indices has no pad rows, repeated state rows are refused by ``validate_data``, a prefill state's 64-bit
offsets, the CPU twin's wider verify buffers."""

from __future__ import annotations

import random

import pytest
import torch

from convserve.kernels import (MAX_WIDTH, PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_update,
                               causal_conv1d_update_ref)
from convserve.kernels.torch_ops import causal_conv1d_fn_torch, causal_conv1d_update_torch
from tests import test_kernels_decode as dec
from tests import test_kernels_prefill as pre
from tests.interp_bounds import bounds_checked, cross_program_conflicts, program_accesses
from tests.tolerance import assert_close

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's bounds check runs on the CPU")

SEED = random.randrange(2**31)
print(f"test_kernels_bounds seed={SEED}")


def races(log, *written) -> list:
    """Cross-program conflicts (``cross_program_conflicts``) over the tensors ``written`` in each kernel's launches
    of the access log (two launches of one kernel are checked as one): a few per kernel and tensor, empty
    when race-free."""
    kernels = sorted({k for k, *_ in log})
    return [(k, i, c[:3]) for k in kernels for i, t in enumerate(written) if t is not None
            for c in [cross_program_conflicts(log, k, t)] if c]


def _tiles(monkeypatch, path):
    """Small tiles, and the tuning that sends a small shape down ``path``."""
    from convserve.kernels import _launch
    if path.startswith("channels_first"):
        monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_first", dict(
            groups=2, min_groups=2, groups_per_thread=1, num_warps=1, tiles_per_row=1, min_t=16,
            max_width=MAX_WIDTH))
    elif path.startswith("channels_last"):
        # the pipelined step loop at every width (stages 4, the default, or 2), or the one-step prefetch (stages
        # 0, which widths past stages_max_width take)
        stages = dict(channels_last_one_step=0, channels_last_stages=2).get(path, 4)
        monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_last", dict(
            num_warps=1, rows_per_step=2, max_chunk=8, min_programs=1, min_elems=0, max_width=MAX_WIDTH,
            stages=stages))
    monkeypatch.setitem(_launch.TUNING, "prefill_heads", dict(block_d=16, elems=64, head_elems=1024, num_warps=1))
    monkeypatch.setattr(pre.prefill_plan, "_PLANS", {})


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("path, layout", [("piece", "strided"), ("piece", "channels_first"),
                                          ("channels_first_body", "channels_first"),
                                          ("channels_last_body", "channels_last"),
                                          ("channels_last_one_step", "channels_last"),
                                          ("channels_last_stages", "channels_last")])
def test_prefill_reads_and_writes_only_its_tensors(path, layout, case, monkeypatch):
    _tiles(monkeypatch, path)
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    width = rng.choice([2, 3, 4, rng.randint(5, MAX_WIDTH)])
    dim = rng.choice([1, 3, 17, 33])
    # an odd token count and a tail past the last sequence: the masked tail tile of every path
    args = pre.random_batch(gen, rng, dim, width, layout, pre.DTYPES[case % 3], "cpu", n_seq=rng.randint(1, 6),
                            max_len=40, tail=rng.choice([0, 1, 3]) + (17 if path != "piece" else 0),
                            long_share=0.5)                      # (the bodies take 16 tokens and more)
    with bounds_checked() as found, program_accesses() as log:
        got = pre.run_both(*args)
    assert not found, found
    assert not races(log, got[0], got[1])
    pre.check(*got, pre.DTYPES[case % 3])
    if path != "piece":
        assert pre._used_bodies(), "the body did not run"


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("lead", [1, 5, 40])
@pytest.mark.parametrize("path, layout", [("piece", "strided"), ("channels_first_body", "channels_first"),
                                          ("channels_last_body", "channels_last")])
def test_tokens_before_a_nonzero_first_query_start_loc_are_zeros_and_nothing_is_read_outside(path, layout, lead,
                                                                                           case, monkeypatch):
    """``query_start_loc[0] > 0`` breaks the contract (``validate_data`` refuses it); without the check every path
    still reads only its tensors (no ``query_start_loc[-1]``, no ``cache_indices[-1]``) and writes zeros before
    it, as the reference does."""
    _tiles(monkeypatch, path)
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    width, dim = rng.choice([2, 4, 6]), rng.choice([3, 17])
    x, w, b, states, qsl, idx, init = pre.random_batch(gen, rng, dim, width, layout, torch.float32, "cpu",
                                                       n_seq=rng.randint(1, 4), max_len=40, tail=lead + 17,
                                                       long_share=0.5)
    qsl = qsl + lead                        # the first lead tokens belong to no sequence
    with bounds_checked() as found:
        got = pre.run_both(x, w, b, states, qsl, idx, init)
    assert not found, found
    pre.check(*got, torch.float32)
    assert torch.equal(got[0][:, :lead], torch.zeros(dim, lead))


@pytest.mark.parametrize("dim, T", [(3, 17), (5, 19), (1, 33)])
def test_the_channels_first_bodys_tail_tile_reads_nothing_past_x(dim, T, monkeypatch):
    """The last tile holds a few elements (dim * T = 3, 5, 1 past a multiple of the 16-element tile): its groups
    past the array's end read no taps there either."""
    _tiles(monkeypatch, "channels_first_body")
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(dim, T, generator=gen)
    w, b = torch.randn(dim, 4, generator=gen), torch.randn(dim, generator=gen)
    states = torch.randn(3, dim, 3, generator=gen)
    qsl, idx = torch.tensor([0, T // 2, T], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    init = torch.tensor([True, False])
    with bounds_checked() as found:
        got = pre.run_both(x, w, b, states, qsl, idx, init)
    assert not found, found
    pre.check(*got, torch.float32)
    assert "_channels_first_body_kernel" in pre._used_bodies()


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("path", ["dense", "chunked", "pairs"])
def test_decode_reads_and_writes_only_its_tensors(path, case, monkeypatch):
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan
    monkeypatch.setitem(_launch.TUNING, "decode_short", dict(max_positions=0 if path == "chunked" else 8,
                                                             block_d=32, num_warps=1))
    monkeypatch.setitem(_launch.TUNING, "decode", dict(block_d=32, num_warps=1))
    monkeypatch.setitem(_launch.TUNING, "decode_pairs", dict(on=path == "pairs", block_p=16, num_warps=1))
    monkeypatch.setattr(plan, "_PLANS", {})
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    width, dim = rng.choice([2, 3, 4]), rng.choice([8, 38] if path == "pairs" else [1, 7, 38])
    seqlen = 1 if path == "pairs" else rng.choice([1, 2, 3])
    dtype = torch.bfloat16 if path == "pairs" else dec.DTYPES[case % 3]
    batch, lines = rng.randint(1, 5), 9
    x = dec.make_x(batch, dim, seqlen, "3d" if seqlen > 1 else "2d", dtype, "cpu", gen)
    if path == "pairs":   # the window-contiguous layout, exactly width - 1 wide
        state = torch.randn(lines, dim, width - 1, generator=gen).to(dtype)
    else:
        state = dec.pool_layout(lines, dim, width - 1 + rng.choice([0, 2]), dtype, "cpu", gen)
    w = torch.randn(dim, width, generator=gen).to(dtype)
    b = torch.randn(dim, generator=gen).to(dtype)
    rows = rng.sample(range(lines), batch)
    idx = torch.tensor([PAD_SLOT_ID if rng.random() < 0.25 else r for r in rows], dtype=torch.int32)
    with bounds_checked() as found, program_accesses() as log:
        y, st_k, ref, st_r, _, _ = dec.run_both(x, state, w, b, conv_state_indices=idx)
    assert not found, found
    assert not races(log, y, st_k)
    assert_close(y, ref, dtype, "output")
    dec.assert_states_equal(st_k, st_r)
    assert {p.fn.__name__ for p in plan._PLANS.values()} == {f"_{path}_kernel"}


@pytest.mark.parametrize("path", ["dense", "chunked", "pairs"])
def test_decode_without_indices_has_no_pad_rows_whatever_pad_slot_id(path, monkeypatch):
    """Row b is state row b; ``pad_slot_id`` marks pads among indices only (row 1 here is not a pad)."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan
    monkeypatch.setitem(_launch.TUNING, "decode_short", dict(max_positions=0 if path == "chunked" else 8,
                                                             block_d=32, num_warps=1))
    monkeypatch.setitem(_launch.TUNING, "decode_pairs", dict(on=path == "pairs", block_p=16, num_warps=1))
    monkeypatch.setattr(plan, "_PLANS", {})
    gen = torch.Generator().manual_seed(SEED)
    dtype = torch.bfloat16 if path == "pairs" else torch.float32
    x = torch.randn(3, 8, generator=gen).to(dtype)
    state = torch.randn(3, 8, 3, generator=gen).to(dtype)
    w = torch.randn(8, 4, generator=gen).to(dtype)
    y, st_k, ref, st_r, _, _ = dec.run_both(x, state, w, None, pad_slot_id=1)
    assert_close(y, ref, dtype, "output")
    dec.assert_states_equal(st_k, st_r)
    assert y[1].abs().sum() > 0


def test_validate_data_refuses_two_rows_writing_one_state_row():
    gen = torch.Generator().manual_seed(SEED)
    w, states = torch.randn(8, 4, generator=gen), torch.zeros(6, 8, 3)
    x, qsl = torch.randn(8, 6, generator=gen), torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    for fn in (causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_fn_torch):
        with pytest.raises(ValueError, match="distinct"):
            fn(x, w, None, states, qsl, torch.tensor([1, 4, 1], dtype=torch.int32), validate_data=True)
        # an empty sequence or a pad may share a row: neither writes it
        fn(x, w, None, states, qsl, torch.tensor([1, 1, 3], dtype=torch.int32), validate_data=True)
        fn(x, w, None, states, torch.tensor([0, 2, 4, 6], dtype=torch.int32),
           torch.tensor([PAD_SLOT_ID, 2, PAD_SLOT_ID], dtype=torch.int32), validate_data=True)
    xd = torch.randn(3, 8, 2, generator=gen)
    for fn in (causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_update_torch):
        with pytest.raises(ValueError, match="distinct"):
            fn(xd, states.clone(), w, conv_state_indices=torch.tensor([2, 5, 2]), validate_data=True)
        # a verify into intermediate windows leaves the live rows alone: reading one row twice is fine
        fn(xd, states.clone(), w, conv_state_indices=torch.tensor([2, 5, 2]), validate_data=True,
           intermediate_conv_window=torch.zeros(3, 2, 8, 3))
        # two windows saved to one row race too; a pad row's, or one past the tokens, are not saved
        with pytest.raises(ValueError, match="distinct"):
            fn(xd, states.clone(), w, conv_state_indices=torch.tensor([0, 1, 2]), validate_data=True,
               output_state_indices=torch.tensor([[3, 4], [5, 3], [-1, -1]]))
        fn(xd, states.clone(), w, conv_state_indices=torch.tensor([0, PAD_SLOT_ID, 2]), validate_data=True,
           output_state_indices=torch.tensor([[3, 4, 5], [3, 4, -1], [-1, -1, 4]]))


def test_prefill_state_with_a_dim_stride_past_two_to_the_31_bytes_stays_64_bit():
    """A state row's channel offsets overflow int32 (dim stride 2**30 + 8 elements: 4 GiB of address space, only
    a few pages of it touched)."""
    gen = torch.Generator().manual_seed(SEED)
    width, dim, stride = 4, 3, 2**30 + 8
    buf = torch.empty(2 * stride + 64, dtype=torch.float16)
    cs = buf.as_strided((1, dim, width - 1), (0, stride, 1))
    for d in range(dim):
        cs[0, d].copy_(torch.randn(width - 1, generator=gen))
    before = torch.stack([cs[0, d].clone() for d in range(dim)])[None]
    x = torch.randn(dim, 10, generator=gen).to(torch.float16)
    w = torch.randn(dim, width, generator=gen).to(torch.float16)
    qsl, idx = torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    init = torch.tensor([True])
    ref_state = before.float()
    ref = causal_conv1d_ref(x, w, None, ref_state, qsl, idx, init, None, compute_dtype=torch.float64)
    with bounds_checked() as found:
        y = causal_conv1d_fn(x, w, None, cs, qsl, idx, init, None)
    assert not found, found
    assert_close(y, ref, torch.float16, "output")
    assert torch.equal(torch.stack([cs[0, d] for d in range(dim)])[None], ref_state.to(torch.float16))


def test_a_channels_last_prefill_with_a_token_stride_past_int32_offsets_stays_64_bit(monkeypatch):
    """The channels-last body computes a chunk's offsets in int32: a token stride whose chunk reaches past 2**31
    elements (here 2**31 // 6 + 64: the chunk's fourth step starts past it) takes the piece kernel, whose offsets go
    64-bit, instead. x lies in 5 GB of address space, only a few pages of it touched."""
    _tiles(monkeypatch, "channels_last_body")            # chunks of 8 tokens, 2 a step
    gen = torch.Generator().manual_seed(SEED)
    width, dim, tokens, stride = 4, 256, 8, 2**31 // 6 + 64
    buf = torch.empty((tokens - 1) * stride + dim, dtype=torch.float16)
    x = buf.as_strided((dim, tokens), (1, stride))
    dense = torch.randn(dim, tokens, generator=gen).to(torch.float16)
    for t in range(tokens):
        x[:, t].copy_(dense[:, t])
    w = torch.randn(dim, width, generator=gen).to(torch.float16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    out = torch.full((tokens, dim), float("nan"), dtype=torch.float16).t()
    ref = causal_conv1d_ref(dense, w, None, None, qsl, None, None, None, compute_dtype=torch.float64)
    with bounds_checked() as found:
        causal_conv1d_fn(x, w, None, None, qsl, None, None, None, out=out)
    assert not found, found
    assert_close(out, ref, torch.float16, "output")


@pytest.mark.parametrize("extra", ["intermediate_conv_window", "output_state_indices"])
def test_the_cpu_twin_takes_verify_buffers_longer_than_the_tokens(extra):
    gen = torch.Generator().manual_seed(SEED)
    batch, dim, seqlen, width = 2, 8, 3, 4
    x = torch.randn(batch, dim, seqlen, generator=gen)
    w = torch.randn(dim, width, generator=gen)
    state = torch.randn(6, dim, width - 1, generator=gen)
    idx = torch.tensor([0, 1])
    if extra == "intermediate_conv_window":
        kw = dict(intermediate_conv_window=torch.zeros(batch, seqlen + 2, dim, width - 1))
    else:
        kw = dict(output_state_indices=torch.tensor([[2, 3, 4, -1], [5, -1, -1, -1]]))
    outs = []
    for fn in (causal_conv1d_update_ref, causal_conv1d_update_torch):
        st = state.clone()
        k = {n: v.clone() for n, v in kw.items()}
        y = fn(x, st, w, None, "silu", conv_state_indices=idx, **k)
        outs.append((y, st, k))
    (y0, s0, k0), (y1, s1, k1) = outs
    assert_close(y1, y0, torch.float32, "output")
    assert torch.equal(s0, s1) and all(torch.equal(k0[n], k1[n]) for n in k0)     # copies: bit for bit


@pytest.mark.parametrize("path", ["dense", "chunked", "pairs"])
def test_the_race_check_sees_two_decode_rows_writing_one_state_row(path, monkeypatch):
    """The access log of the checks above is live: repeated state rows (a caller error ``validate_data`` refuses)
    are two programs storing one row."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan
    monkeypatch.setitem(_launch.TUNING, "decode_short", dict(max_positions=0 if path == "chunked" else 8,
                                                             block_d=32, num_warps=1))
    monkeypatch.setitem(_launch.TUNING, "decode_pairs", dict(on=path == "pairs", block_p=16, num_warps=1))
    monkeypatch.setattr(plan, "_PLANS", {})
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(3, 8, generator=gen).to(torch.bfloat16)
    state = (torch.randn(4, 8, 3, generator=gen).to(torch.bfloat16) if path == "pairs"
             else dec.pool_layout(4, 8, 3, torch.bfloat16, "cpu", gen))
    w = torch.randn(8, 4, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(x)
    with program_accesses() as log:
        causal_conv1d_update(x, state, w, None, conv_state_indices=torch.tensor([2, 0, 2], dtype=torch.int32),
                             out=out)
    (found,) = races(log, out, state)
    assert found[0] == f"_{path}_kernel" and found[1] == 1 and found[2][0][0] == "store"
