"""The vectorized PyTorch ops (``kernels.torch_ops``) against the float64 reference, on fresh random inputs.

The grid: widths 2-8, odd dims, sequences of 0 tokens, of fewer than ``width - 1`` and long ones, pad rows,
mixed initial state, tokens past the last sequence, three x layouts (contiguous, channel-last, a strided slice),
state dtypes other than x's, and for the update op chunked rows, accepted-token offsets, wider state rows,
intermediate windows, output state lines and stacked weights. Outputs are poisoned with NaN first.
"""

import random

import pytest
import torch

from convserve.kernels import MAX_WIDTH, PAD_SLOT_ID, causal_conv1d_ref, causal_conv1d_update_ref
from convserve.kernels.torch_ops import causal_conv1d_fn_torch, causal_conv1d_update_torch
from tests.tolerance import assert_close

SEED = random.randrange(2**31)
print(f"test_kernels_torch_ops seed={SEED}")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _x(gen, dim, total, layout, dtype):
    if layout == "contiguous":
        return torch.randn(dim, total, generator=gen).to(dtype)
    if layout == "channel_last":
        return torch.randn(total, dim, generator=gen).to(dtype).t()
    return torch.randn(2 * total + 1, dim + 3, generator=gen).to(dtype)[::2, 1:dim + 1][:total].t()


def _same_states(a, b):
    rows = (a != b.to(a.dtype)).flatten(1).any(1).nonzero().flatten().tolist()
    assert not rows, f"state lines {rows} differ from the reference"


@pytest.mark.parametrize("case", range(40))
@pytest.mark.parametrize("layout", ["contiguous", "channel_last", "strided"])
def test_varlen_prefill_matches_reference(case, layout):
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    width = 2 + case % (MAX_WIDTH - 1)
    dim = rng.choice([1, 3, 16, 67])
    dtype = DTYPES[case % 3]
    state_dtype = torch.float32 if case % 5 == 0 else dtype
    n_seq = rng.randint(1, 12)
    lens = [rng.choice([0, 1, width - 2, width - 1, width, rng.randint(1, 40)]) for _ in range(n_seq)]
    lens = [max(0, n) for n in lens]
    tail = rng.choice([0, 0, 3])
    total = sum(lens) + tail
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    lines = 2 * n_seq + 2
    idx = torch.tensor([PAD_SLOT_ID if rng.random() < 0.2 else r for r in rng.sample(range(lines), n_seq)],
                       dtype=torch.int32)
    init = torch.tensor([rng.random() < 0.5 for _ in range(n_seq)])
    x = _x(gen, dim, total, layout, dtype)
    weight = torch.randn(dim, width, generator=gen).to(dtype)
    bias = torch.randn(dim, generator=gen).to(dtype) if case % 4 else None
    states = torch.randn(lines, dim, width - 1 + case % 2, generator=gen).to(state_dtype)
    act = "silu" if case % 3 else None
    use_idx = case % 7 != 0  # None: sequence i uses line i, no pads
    idx_arg = idx if use_idx else None
    st_t, st_r = states.clone(), states.clone()
    out = torch.full_like(x, float("nan"))
    y = causal_conv1d_fn_torch(x, weight, bias, st_t, qsl, idx_arg, init, act, out=out)
    ref = causal_conv1d_ref(x, weight, bias, st_r, qsl, idx_arg, init, act, compute_dtype=torch.float64)
    assert y is out
    assert_close(y, ref, dtype, "output")
    _same_states(st_t, st_r)


def test_prefill_without_state_or_initial_state_matches_reference():
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(9, 20, generator=gen)
    w = torch.randn(9, 4, generator=gen)
    qsl = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    y = causal_conv1d_fn_torch(x, w, None, None, qsl)
    assert_close(y, causal_conv1d_ref(x, w, None, None, qsl, compute_dtype=torch.float64), torch.float32)


@pytest.mark.parametrize("case", range(40))
def test_update_matches_reference(case):
    rng = random.Random(SEED + 1000 + case)
    gen = torch.Generator().manual_seed(SEED + 1000 + case)
    width = 2 + case % (MAX_WIDTH - 1)
    dim = rng.choice([1, 5, 32, 67])
    dtype = DTYPES[case % 3]
    batch = rng.randint(1, 10)
    seqlen = rng.choice([None, 1, 2, 4])
    mode = ["live", "live", "windows", "osi"][case % 4]
    spec = mode != "live" or seqlen is not None
    groups = 2 if case % 6 == 5 else None
    lines = 2 * (2 * batch + 3)
    state_len = width - 1 + (rng.choice([0, 2]) if seqlen and mode == "live" else (3 if spec else 0))
    if mode == "live" and seqlen:
        state_len = max(state_len, width - 1)
    state_dtype = torch.float32 if case % 5 == 0 else dtype
    states = torch.randn(lines, dim, state_len, generator=gen).to(state_dtype)
    x = torch.randn(batch, dim, seqlen, generator=gen).to(dtype) if seqlen else torch.randn(batch, dim,
                                                                                            generator=gen).to(dtype)
    T = seqlen or 1
    if groups:
        weight = torch.randn(groups, dim, width, generator=gen).to(dtype)
        bias = torch.randn(groups, dim, generator=gen).to(dtype)
    else:
        weight = torch.randn(dim, width, generator=gen).to(dtype)
        bias = torch.randn(dim, generator=gen).to(dtype) if case % 4 else None
    rows = rng.sample(range(lines), batch)
    csi = torch.tensor([PAD_SLOT_ID if rng.random() < 0.2 else r for r in rows], dtype=torch.int32)
    kw = dict(conv_state_indices=csi if case % 7 else None)
    if kw["conv_state_indices"] is None:
        states = torch.randn(batch * (groups or 1), dim, state_len, generator=gen).to(state_dtype)
    if state_len > width - 1 and rng.random() < 0.7:
        kw["num_accepted_tokens"] = torch.tensor([rng.randint(1, state_len - width + 2) for _ in range(batch)],
                                                 dtype=torch.int32)
    if mode == "windows":
        kw["intermediate_conv_window"] = torch.full((batch, T, dim, width - 1), float("nan"), dtype=state_dtype)
    if mode == "osi":
        free = [line for line in range(states.shape[0]) if line not in rows]
        rng.shuffle(free)
        osi = [[free.pop() if free and rng.random() < 0.8 else -1 for _ in range(T)] for _ in range(batch)]
        kw["output_state_indices"] = torch.tensor(osi, dtype=torch.int32)
    act = "silu" if case % 3 else None
    kw_r = {k: (v.clone() if k == "intermediate_conv_window" else v) for k, v in kw.items()}
    st_t, st_r = states.clone(), states.clone()
    out = torch.full_like(x, float("nan"))
    y = causal_conv1d_update_torch(x, st_t, weight, bias, act, out=out, **kw)
    ref = causal_conv1d_update_ref(x, st_r, weight, bias, act, compute_dtype=torch.float64, **kw_r)
    assert y is out
    assert_close(y, ref, dtype, "output")
    _same_states(st_t, st_r)
    if mode == "windows":
        a, r = kw["intermediate_conv_window"], kw_r["intermediate_conv_window"]
        live = (csi != PAD_SLOT_ID) if kw["conv_state_indices"] is not None else torch.ones(batch, dtype=torch.bool)
        assert torch.equal(a[live], r[live])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_rows_scattered_through_numpy_are_what_index_copy_writes(dtype, layout):
    from convserve.kernels.torch_ops import _scatter_rows

    g = torch.Generator().manual_seed(3)
    base = torch.randn(9, 5, 3, generator=g).to(dtype)
    dst = base if layout == "contiguous" else torch.randn(9, 3, 5, generator=g).to(dtype).transpose(1, 2)
    src = torch.randn(4, 5, 3, generator=g).to(dtype)
    idx = torch.tensor([7, 0, 4, 2])
    want = dst.clone().index_copy_(0, idx, src)
    _scatter_rows(dst, idx, src)
    assert torch.equal(dst, want)



@pytest.mark.parametrize("fast, twins", [
    ("causal_conv1d_fn", [causal_conv1d_ref, causal_conv1d_fn_torch]),
    ("causal_conv1d_update", [causal_conv1d_update_ref, causal_conv1d_update_torch]),
])
def test_the_references_and_torch_twins_take_every_argument_of_the_triton_op(fast, twins):
    """Drop-in: each parameter of the Triton op, by name and position, is a parameter of its twins."""
    import inspect

    import convserve.kernels as K

    want = list(inspect.signature(getattr(K, fast)).parameters.items())
    for twin in twins:
        got = inspect.signature(twin).parameters
        names = list(got)
        for i, (name, p) in enumerate(want):
            assert name in got, (twin.__name__, name)
            if p.kind is p.POSITIONAL_OR_KEYWORD:
                assert names[i] == name, (twin.__name__, i, name)


def test_validate_data_in_the_twins_refuses_an_index_outside_the_pool_as_the_triton_op_does():
    gen = torch.Generator().manual_seed(SEED)
    dim, width = 8, 4
    w = torch.randn(dim, width, generator=gen)
    states = torch.zeros(4, dim, width - 1)
    x = torch.randn(dim, 5, generator=gen)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    bad = torch.tensor([1, 7], dtype=torch.int32)                    # 7: outside the pool's 4 lines
    for fn in (causal_conv1d_ref, causal_conv1d_fn_torch):
        with pytest.raises(ValueError, match="cache_indices"):
            fn(x, w, None, states, qsl, bad, validate_data=True)
    xd = torch.randn(2, dim, generator=gen)
    for fn in (causal_conv1d_update_ref, causal_conv1d_update_torch):
        with pytest.raises(ValueError, match="conv_state_indices"):
            fn(xd, states, w, conv_state_indices=bad, validate_data=True)
