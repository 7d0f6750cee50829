"""causal_conv1d_fn (Triton) against causal_conv1d_ref run in float64, on fresh random inputs.

Without CUDA the kernel runs in Triton's interpreter, so shapes stay small; the grid still covers odd dims,
T = 1, T < width - 1, long T, widths 2-8, both x layouts (channels-first, channels-last) and a strided slice,
varlen batches with pads and mixed initial state, for each kernel module of ``kernels/prefill/``: the piece kernel,
and each body (with tiles shrunk so small shapes take it) followed by the heads pass. Outputs are poisoned with
NaN before each run so an unwritten element fails.
"""

import random

import pytest
import torch

from convserve.kernels import MAX_WIDTH, MIN_WIDTH, PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_ref
from convserve.kernels.prefill import plan as prefill_plan
from tests.tolerance import assert_close

SEED = random.randrange(2**31)  # fresh every run; printed on failure through the test ids below
print(f"test_kernels_prefill seed={SEED}")


def make_x(dim, total, layout, dtype, device, gen):
    """x (dim, total) in one of three memory orders."""
    if layout == "channels_first":  # T contiguous: the benchmark card's contiguous (dim, T)
        return torch.randn(dim, total, generator=gen).to(device, dtype)
    if layout == "channels_last":  # dim contiguous, x.stride(0) == 1: serving stacks
        return torch.randn(total, dim, generator=gen).to(device, dtype).t()
    if layout == "strided":  # a non-contiguous slice of a larger channels-last buffer
        return torch.randn(2 * total, dim + 3, generator=gen).to(device, dtype)[::2, 1:dim + 1].t()
    raise ValueError(layout)


def run_both(x, weight, bias, states, qsl, idx, init, activation="silu"):
    """Run the kernel (output poisoned first) and the float64 reference on copies of the same state."""
    st_k = states.clone() if states is not None else None
    st_r = states.clone().cpu() if states is not None else None
    out = torch.full_like(x, float("nan"))
    y = causal_conv1d_fn(x, weight, bias, st_k, qsl, idx, init, activation, out=out)
    assert y is out
    ref = causal_conv1d_ref(x.cpu(), weight.cpu(), bias.cpu() if bias is not None else None,
                            st_r, qsl.cpu().contiguous(), idx.cpu().contiguous() if idx is not None else None,
                            init.cpu().contiguous() if init is not None else None,
                            activation, compute_dtype=torch.float64)
    return y, st_k, ref, st_r


def check(y, st_k, ref, st_r, x_dtype, state_dtype=None):
    assert_close(y, ref, x_dtype, "output")
    if st_k is not None:
        # States are copies of inputs: exact, after the same cast.
        diff = (st_k.cpu() != st_r.to(st_k.dtype)).flatten(1).any(1).nonzero().flatten().tolist()
        assert not diff, f"state rows {diff} differ from the reference"


DIMS = [1, 7, 64, 257]
TS = [1, 2, 3, 8, 129, 1031]
LAYOUTS = ["channels_first", "channels_last", "strided"]
GRID = [(d, t, w, lay) for d in DIMS for t in TS for w in (2, 3, 4) for lay in LAYOUTS
        if not (d >= 64 and t == 1031)]
# The corner dim >= 64 x T = 1031 is about 40 % of the grid's time in the interpreter (the channels-first body at
# the default tiles). There the full width x layout product is replaced by a Latin square: each of the two dims
# still meets every width and every layout at T = 1031 (the body included), and every (width, layout) pair at
# T = 1031 is still run in full by dims 1 and 7 -- pairwise coverage of dim, T, width and layout is kept.
GRID += [(64, 1031, w, lay) for w, lay in zip((2, 3, 4), LAYOUTS)]
GRID += [(257, 1031, w, lay) for w, lay in zip((4, 2, 3), LAYOUTS)]
GRID += [(33, t, w, lay) for t in (1, 3, 6, 70) for w in range(5, MAX_WIDTH + 1) for lay in LAYOUTS]
# a dim past every tile size
GRID += [(4096 + 32, t, w, lay) for t, w in ((1, 4), (3, 4), (9, 2), (17, 3)) for lay in LAYOUTS]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dim,T,width,layout", GRID)
def test_single_sequence_with_initial_state_matches_reference(dim, T, width, layout, kernel_device):
    gen = torch.Generator().manual_seed(SEED + dim * 1000 + T * 10 + width)
    dtype = DTYPES[(dim + T + width) % 3]
    x = make_x(dim, T, layout, dtype, kernel_device, gen)
    weight = torch.randn(dim, width, generator=gen).to(kernel_device, dtype)
    bias = torch.randn(dim, generator=gen).to(kernel_device, dtype)
    states = torch.randn(3, dim, width - 1, generator=gen).to(kernel_device, dtype)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=kernel_device)
    idx = torch.tensor([1], dtype=torch.int32, device=kernel_device)
    init = torch.tensor([True], device=kernel_device)
    check(*run_both(x, weight, bias, states, qsl, idx, init), dtype)


def random_batch(gen, rng, dim, width, layout, dtype, device, n_seq, max_len, state_dtype=None, lines=None,
                 tail=0, long_share=1 / 7):
    """A varlen batch: about long_share of the sequences draw a length in [1, max_len], the rest are short
    (0 to width tokens); a quarter are pads; tail tokens past the last sequence."""
    short = [0, 1, 2, width - 2, width - 1, width]
    lens = [rng.randint(1, max_len) if rng.random() < long_share else rng.choice(short) for _ in range(n_seq)]
    lens = [max(0, n) for n in lens]
    total = sum(lens) + tail
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lines = lines or 2 * n_seq + 3
    rows = rng.sample(range(lines), n_seq)
    idx = [PAD_SLOT_ID if rng.random() < 0.25 else r for r in rows]
    idx = torch.tensor(idx, dtype=torch.int32, device=device)
    init = torch.tensor([rng.random() < 0.5 for _ in range(n_seq)], device=device)
    x = make_x(dim, max(total, 1), layout, dtype, device, gen)[:, :total]
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype)
    states = torch.randn(lines, dim, width - 1, generator=gen).to(device, state_dtype or dtype)
    return x, weight, bias, states, qsl, idx, init


@pytest.mark.parametrize("case", range(12))
@pytest.mark.parametrize("layout", ["channels_first", "channels_last", "strided"])
def test_varlen_batch_with_pads_and_mixed_initial_state_matches_reference(case, layout, kernel_device):
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    width = 2 + case % 3 if case < 9 else rng.randint(5, MAX_WIDTH)
    dim = rng.choice([1, 5, 64, 130])
    dtype = DTYPES[case % 3]
    args = random_batch(gen, rng, dim, width, layout, dtype, kernel_device, n_seq=rng.randint(1, 9), max_len=300)
    check(*run_both(*args), dtype)


def _used_bodies():
    """Names of the body kernels in the plans made so far (empty: the piece kernel ran)."""
    return {p.fn.__name__ for body, *_ in prefill_plan._PLANS.values() for p in body}


@pytest.fixture
def small_channels_first_tiles(monkeypatch):
    """Make the channels-first body (flat groups of 8 elements, then the heads pass) apply to small shapes, with
    tiles of 16 elements (so most tiles straddle two channel rows) and narrow heads-pass programs."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_first", dict(
        groups=2, min_groups=2, groups_per_thread=1, num_warps=1, tiles_per_row=1, min_t=16, max_width=MAX_WIDTH))
    monkeypatch.setitem(_launch.TUNING, "prefill_heads", dict(block_d=16, elems=64, head_elems=1024, num_warps=1))
    monkeypatch.setattr(prefill_plan, "_PLANS", {})


def small_channels_last_tiles(monkeypatch, rows_per_step):
    """Make the channels-last body (then the heads pass) apply to any size: 1-warp programs of 256 channels,
    chunks of 8 tokens (the window carried across chunks and steps), the step loop pipelined as by default
    (``stages``)."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_last", dict(
        num_warps=1, rows_per_step=rows_per_step, max_chunk=8, min_programs=1, min_elems=0, max_width=MAX_WIDTH,
        stages=_launch.TUNING["prefill_body_channels_last"]["stages"]))
    monkeypatch.setitem(_launch.TUNING, "prefill_heads", dict(block_d=16, elems=64, head_elems=1024, num_warps=1))
    monkeypatch.setattr(prefill_plan, "_PLANS", {})


@pytest.mark.parametrize("case", range(2))
# width 7 is the slowest of the grid in the interpreter and sits between 6 and 8, which stay in the default run
@pytest.mark.parametrize("width", [pytest.param(w, marks=pytest.mark.slow) if w == 7 else w
                                   for w in range(MIN_WIDTH, MAX_WIDTH + 1)])
def test_channels_first_body_matches_reference(width, case, small_channels_first_tiles, kernel_device):
    rng = random.Random(SEED + 100 + 10 * width + case)
    gen = torch.Generator().manual_seed(SEED + 100 + 10 * width + case)
    # The interpreter runs one 16-element program per tile: a draw of dim 130 with long sequences was 30 000
    # elements (over 90 s, the run's slowest test, and the main source of CI's run-to-run spread). Sizes are not
    # the point here: the tiles still straddle channel rows and sequences at every dim below (37: odd, three heads
    # blocks of 16 with a partial one), and lengths stay odd and past the tile and the window (T up to 45: a row
    # over three tiles; 77 at dim 37 was still over 20 s).
    dim = rng.choice([1, 5, 16, 37])
    dtype = DTYPES[(width + case) % 3]
    if case == 0:  # one sequence (the card's form), odd T, with or without bias and initial state
        T = rng.choice([17, 31, 45])
        x = make_x(dim, T, "channels_first", dtype, kernel_device, gen)
        weight = torch.randn(dim, width, generator=gen).to(kernel_device, dtype)
        bias = torch.randn(dim, generator=gen).to(kernel_device, dtype) if width % 3 else None
        states = torch.randn(2, dim, width - 1, generator=gen).to(kernel_device, dtype)
        qsl = torch.tensor([0, T], dtype=torch.int32, device=kernel_device)
        args = (x, weight, bias, states, qsl, torch.tensor([1], dtype=torch.int32, device=kernel_device),
                torch.tensor([width % 2 == 0], device=kernel_device))
    else:  # varlen with pad sequences, empty and short ones, and a tail past the last sequence
        args = random_batch(gen, rng, dim, width, "channels_first", dtype, kernel_device, n_seq=rng.randint(2, 6),
                            max_len=30, tail=rng.choice([0, 5, 21]), long_share=0.6)
        if args[0].shape[1] < 16:  # fewer tokens than the body's minimum: a longer tail
            args = random_batch(gen, rng, dim, width, "channels_first", dtype, kernel_device, n_seq=3, max_len=30,
                                tail=16, long_share=0.6)
    y, st_k, ref, st_r = run_both(*args, activation=[None, "silu"][(width + case) % 2])
    assert _used_bodies() == {"_channels_first_body_kernel"}, "the channels-first body did not run"
    check(y, st_k, ref, st_r, dtype)


@pytest.mark.parametrize("rows_per_step", [1, 2, 4, 8])
@pytest.mark.parametrize("width", range(MIN_WIDTH, MAX_WIDTH + 1))
def test_channels_last_body_matches_reference(width, rows_per_step, monkeypatch, kernel_device):
    """Dims around and past the 256-channel tile; a strided (non-contiguous) x on every other case."""
    small_channels_last_tiles(monkeypatch, rows_per_step)
    rng = random.Random(SEED + 200 + width * 8 + rows_per_step)
    gen = torch.Generator().manual_seed(SEED + 200 + width * 8 + rows_per_step)
    case = width + rows_per_step
    dim = [5, 256, 300, 64][case % 4]
    dtype = DTYPES[case % 3]
    layout = ["channels_last", "strided"][case % 2]
    # sequences of up to 3 chunks of 8 tokens (the window carried across chunks and steps), tails of up to two;
    # longer ones (40 tokens, 21-token tails) only repeated the same chunk steps at several times the
    # interpreter's cost
    args = random_batch(gen, rng, dim, width, layout, dtype, kernel_device, n_seq=rng.randint(2, 6),
                        max_len=24, tail=rng.choice([0, 3, 13]), long_share=0.6)
    if args[0].shape[1] == 0:  # every sequence empty and no tail: nothing to plan, so a tail
        args = random_batch(gen, rng, dim, width, layout, dtype, kernel_device, n_seq=3, max_len=24, tail=3,
                            long_share=0.6)
    y, st_k, ref, st_r = run_both(*args, activation=[None, "silu"][case % 2])
    assert _used_bodies() == {"_channels_last_body_kernel"}, "the channels-last body did not run"
    check(y, st_k, ref, st_r, dtype)


# case 3 (dim 300) is the slowest in the interpreter; the heads pass by columns is the default, so every other
# prefill test runs it too
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == 3 else c for c in range(6)])
def test_heads_pass_by_columns_matches_reference(case, monkeypatch, kernel_device):
    """The heads pass with TUNING's columns on (the default; the other heads tests set tiles without it): index,
    flag, taps and bias with the bounds, the head column by column; after either body, varlen with pads, empty and
    short sequences, a tail."""
    from convserve.kernels import _launch
    layout = ["channels_first", "channels_last", "strided"][case % 3]
    if layout == "channels_first":
        monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_first", dict(
            groups=2, min_groups=2, groups_per_thread=1, num_warps=1, tiles_per_row=1, min_t=16, max_width=MAX_WIDTH))
        monkeypatch.setattr(prefill_plan, "_PLANS", {})
    else:
        small_channels_last_tiles(monkeypatch, 4)
    monkeypatch.setitem(_launch.TUNING, "prefill_heads", dict(block_d=16, elems=64, head_elems=1024, num_warps=1,
                                                              columns=True))
    rng = random.Random(SEED + 800 + case)
    gen = torch.Generator().manual_seed(SEED + 800 + case)
    width = [2, 4, 8, 3, 5, 4][case]
    dim = [5, 33, 16, 300, 7, 64][case]
    args = random_batch(gen, rng, dim, width, layout, DTYPES[case % 3], kernel_device, n_seq=1 + case, max_len=24,
                        tail=[0, 3, 21][case % 3] + 16, long_share=0.6)
    y, st_k, ref, st_r = run_both(*args, activation=[None, "silu"][case % 2])
    [(body, heads, *_)] = prefill_plan._PLANS.values()
    assert body and heads.constexprs["COLUMNS"]
    check(y, st_k, ref, st_r, DTYPES[case % 3])


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_more_sequences_than_one_search_step_match_reference(layout, monkeypatch, kernel_device):
    """Over 64 sequences: the piece kernel counts query_start_loc keys in several vector steps (SEARCH = 64: 80
    sequences are 81 keys, a full step then a masked one; the interpreter's cost grows with the batch, one program
    per sequence)."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_first",
                        dict(_launch.TUNING["prefill_body_channels_first"], min_t=1 << 30))
    monkeypatch.setattr(prefill_plan, "_PLANS", {})
    rng = random.Random(SEED + 300)
    gen = torch.Generator().manual_seed(SEED + 300)
    args = random_batch(gen, rng, 8, 4, layout, torch.float32, kernel_device, n_seq=80, max_len=12,
                        long_share=0.5)
    y, st_k, ref, st_r = run_both(*args)
    assert not _used_bodies(), "expected the piece kernel"
    check(y, st_k, ref, st_r, torch.float32)


@pytest.mark.parametrize("width", [2, 3, 4, 6])
def test_fp32_state_with_bf16_x(width, kernel_device):
    rng, gen = random.Random(SEED), torch.Generator().manual_seed(SEED)
    args = random_batch(gen, rng, 48, width, "channels_last", torch.bfloat16, kernel_device, n_seq=6, max_len=40,
                        state_dtype=torch.float32)
    y, st_k, ref, st_r = run_both(*args)
    assert st_k.dtype == torch.float32
    assert_close(y, ref, torch.bfloat16)
    assert torch.equal(st_k.cpu(), st_r.float())


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("has_init", [True, False])
def test_sequence_shorter_than_window_shifts_old_state_in(T, has_init, kernel_device):
    width, dim = 4, 16
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(dim, T, generator=gen).to(kernel_device)
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    states = torch.randn(2, dim, width - 1, generator=gen).to(kernel_device)
    old = states[0].clone()
    qsl = torch.tensor([0, T], dtype=torch.int32, device=kernel_device)
    causal_conv1d_fn(x, w, None, states, qsl, torch.tensor([0], device=kernel_device),
                     torch.tensor([has_init], device=kernel_device))
    kept = old[:, T:] if has_init else torch.zeros_like(old[:, T:])
    assert torch.equal(states[0], torch.cat([kept, x], dim=1))


def test_tokens_past_last_sequence_and_pad_sequences_are_zero(kernel_device):
    rng, gen = random.Random(SEED), torch.Generator().manual_seed(SEED)
    x, w, b, states, qsl, idx, init = random_batch(gen, rng, 40, 4, "channels_first", torch.float32, kernel_device,
                                                   n_seq=5, max_len=50)
    x = torch.cat([x, torch.randn(40, 37, generator=gen).to(kernel_device)], dim=1)  # a padded bucket tail
    idx[1] = PAD_SLOT_ID
    y, st_k, ref, st_r = run_both(x, w, b, states, qsl, idx, init)
    check(y, st_k, ref, st_r, torch.float32)
    end = int(qsl[-1])
    assert torch.all(y[:, end:] == 0)
    assert torch.all(y[:, int(qsl[1]):int(qsl[2])] == 0)


def test_one_token_sequences_among_long_ones_match_reference(kernel_device):
    """A frontend's mixed step as the engine launches it (x channels-last): mostly one-token sequences, from a
    stored state or from zeros, a few long ones, padded to a multiple of 16 sequences (empty pad ones) and of 16
    tokens."""
    layout = "channels_last"
    rng, gen = random.Random(SEED + 5), torch.Generator().manual_seed(SEED + 5)
    dim, width = 24, 4
    lens = [1] * 21 + [rng.randint(2, 40) for _ in range(3)]
    rng.shuffle(lens)
    pad = -len(lens) % 16
    total = sum(lens)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist() + [total] * pad, dtype=torch.int32,
                       device=kernel_device)
    lines = 2 * len(lens)
    idx = torch.tensor(rng.sample(range(lines), len(lens)) + [PAD_SLOT_ID] * pad, dtype=torch.int32,
                       device=kernel_device)
    init = torch.tensor([rng.random() < 0.6 for _ in lens] + [False] * pad, device=kernel_device)
    x = make_x(dim, total - total % 16 + 16, layout, torch.float32, kernel_device, gen)
    weight = torch.randn(dim, width, generator=gen).to(kernel_device)
    bias = torch.randn(dim, generator=gen).to(kernel_device)
    states = torch.randn(lines, dim, width - 1, generator=gen).to(kernel_device)
    y, st_k, ref, st_r = run_both(x, weight, bias, states, qsl, idx, init)
    check(y, st_k, ref, st_r, torch.float32)
    assert torch.all(y[:, total:] == 0)


def test_wider_state_rows_keep_columns_past_the_window(kernel_device):
    rng, gen = random.Random(SEED), torch.Generator().manual_seed(SEED)
    x, w, b, _, qsl, idx, init = random_batch(gen, rng, 24, 3, "channels_last", torch.float32, kernel_device,
                                              n_seq=4, max_len=20)
    states = torch.randn(int(idx.max()) + 2, 24, 6, generator=gen).to(kernel_device)
    y, st_k, ref, st_r = run_both(x, w, b, states, qsl, idx, init)
    check(y, st_k, ref, st_r, torch.float32)
    assert torch.equal(st_k[:, :, 2:], states[:, :, 2:])


@pytest.mark.parametrize("activation", [None, "silu", "swish", True, False])
def test_without_state_and_without_indices(activation, kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(20, 30, generator=gen).to(kernel_device)
    w = torch.randn(20, 4, generator=gen).to(kernel_device)
    qsl = torch.tensor([0, 7, 7, 30], dtype=torch.int32, device=kernel_device)
    y, _, ref, _ = run_both(x, w, None, None, qsl, None, None, activation)
    assert_close(y, ref, torch.float32)


def test_states_indexed_by_sequence_when_no_indices(kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(16, 30, generator=gen).to(kernel_device, torch.bfloat16)
    w = torch.randn(16, 3, generator=gen).to(kernel_device, torch.bfloat16)
    states = torch.randn(4, 16, 2, generator=gen).to(kernel_device, torch.bfloat16)
    qsl = torch.tensor([0, 1, 11, 30], dtype=torch.int64, device=kernel_device)
    init = torch.tensor([True, False, True], device=kernel_device)
    check(*run_both(x, w, None, states, qsl, None, init), torch.bfloat16)


def test_strided_bias_is_read_by_channel(kernel_device):
    """A bias that is a strided view (every other element of a packed parameter) gives the same as a copy."""
    gen = torch.Generator().manual_seed(SEED + 5)
    x = torch.randn(16, 30, generator=gen).to(kernel_device)
    w = torch.randn(16, 4, generator=gen).to(kernel_device)
    b = torch.randn(32, generator=gen).to(kernel_device)[::2]
    states = torch.randn(3, 16, 3, generator=gen).to(kernel_device)
    qsl = torch.tensor([0, 9, 30], dtype=torch.int32, device=kernel_device)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=kernel_device)
    init = torch.tensor([True, False], device=kernel_device)
    check(*run_both(x, w, b, states, qsl, idx, init), torch.float32)


def _column(t):
    """``t`` as a column of a two-column table (stride 2), as a framework's metadata slice may be."""
    table = torch.zeros(t.shape[0], 2, dtype=t.dtype, device=t.device)
    table[:, 0] = t
    return table[:, 0]


@pytest.mark.parametrize("strided", ["query_start_loc", "cache_indices", "has_initial_state", "all"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_strided_metadata_is_read_by_sequence_on_the_first_and_the_planned_call(strided, layout, kernel_device,
                                                                                 monkeypatch):
    """query_start_loc, cache_indices and has_initial_state as strided views give the reference's outputs and
    state rows, on the call that builds the plan and on the next one with other values in the same layout (the
    cached plan's path: the slow path runs once)."""
    gen, rng = torch.Generator().manual_seed(SEED + 7), random.Random(SEED + 7)
    slow = []
    real = prefill_plan._prefill_slow
    monkeypatch.setattr(prefill_plan, "_PLANS", type(prefill_plan._PLANS)())   # empty, with its guards
    monkeypatch.setattr(prefill_plan, "_prefill_slow", lambda *a: slow.append(1) or real(*a))
    x, w, b, states, qsl, idx, init = random_batch(gen, rng, 33, 4, layout, torch.float32, kernel_device,
                                                   n_seq=5, max_len=20, tail=3, long_share=0.8)
    names = ["query_start_loc", "cache_indices", "has_initial_state"] if strided == "all" else [strided]
    for call in range(2):
        if call:                            # other rows and flags, the same shapes: the planned path
            idx = idx[torch.randperm(idx.numel(), generator=gen).to(idx.device)]
            init = ~init
        meta = {"query_start_loc": qsl, "cache_indices": idx, "has_initial_state": init}
        meta.update({k: _column(meta[k]) for k in names})
        assert all(meta[k].stride(0) == 2 for k in names)
        check(*run_both(x, w, b, states, meta["query_start_loc"], meta["cache_indices"],
                        meta["has_initial_state"]), torch.float32)
    assert len(slow) == 1, "the second call did not take the cached plan"


def test_default_output_is_allocated_like_x(kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(50, 16, generator=gen).to(kernel_device).t()
    w = torch.randn(16, 4, generator=gen).to(kernel_device)
    qsl = torch.tensor([0, 50], dtype=torch.int32, device=kernel_device)
    y = causal_conv1d_fn(x, w, None, None, qsl)
    assert y.shape == x.shape and y.stride() == x.stride()
    assert_close(y, causal_conv1d_ref(x.cpu(), w.cpu(), None, None, qsl.cpu(), compute_dtype=torch.float64))


def _bad_prefill_calls(dev):
    x = torch.zeros(8, 10, device=dev)
    w = torch.zeros(8, 4, device=dev)
    st = torch.zeros(3, 8, 3, device=dev)
    q = torch.tensor([0, 10], dtype=torch.int32, device=dev)
    return {
        "x": (dict(x=torch.zeros(8, 10, 2, device=dev)), "x"),
        "x dtype": (dict(x=torch.zeros(8, 10, dtype=torch.int32, device=dev)), "x"),
        "weight dim": (dict(weight=torch.zeros(9, 4, device=dev)), "weight"),
        "width": (dict(weight=torch.zeros(8, 9, device=dev)), "weight"),
        "bias": (dict(bias=torch.zeros(7, device=dev)), "bias"),
        "state dim": (dict(conv_states=torch.zeros(3, 7, 3, device=dev)), "conv_states"),
        "state len": (dict(conv_states=torch.zeros(3, 8, 2, device=dev)), "conv_states"),
        "qsl dtype": (dict(query_start_loc=torch.tensor([0.0, 10.0], device=dev)), "query_start_loc"),
        "qsl len": (dict(query_start_loc=torch.tensor([0], dtype=torch.int32, device=dev)), "query_start_loc"),
        # shorter than the batch (longer is padding: tests/test_kernels_padded_metadata.py)
        "indices": (dict(cache_indices=torch.tensor([], dtype=torch.int32, device=dev)), "cache_indices"),
        "state rows": (dict(query_start_loc=torch.tensor([0, 2, 4, 6, 10], dtype=torch.int32, device=dev)),
                       "conv_states"),
        "init": (dict(has_initial_state=torch.tensor([], dtype=torch.bool, device=dev)), "has_initial_state"),
        "activation": (dict(activation="gelu"), "activation"),
        "out": (dict(out=torch.zeros(8, 11, device=dev)), "out"),
        "base": (dict(x=x, weight=w, bias=None, conv_states=st, query_start_loc=q), None),
    }


@pytest.mark.parametrize("case", [k for k in _bad_prefill_calls("cpu") if k != "base"])
def test_bad_arguments_raise_value_error_naming_the_argument(case, kernel_device):
    calls = _bad_prefill_calls(kernel_device)
    kwargs = dict(calls["base"][0])
    change, name = calls[case]
    kwargs.update(change)
    with pytest.raises(ValueError, match=name):
        causal_conv1d_fn(**kwargs)
    with pytest.raises(ValueError, match=name):
        causal_conv1d_ref(**kwargs)


def test_validate_data_reports_bad_index_values(kernel_device):
    x = torch.zeros(8, 10, device=kernel_device)
    w = torch.zeros(8, 4, device=kernel_device)
    st = torch.zeros(3, 8, 3, device=kernel_device)
    q = torch.tensor([0, 4, 10], dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="cache_indices"):
        causal_conv1d_fn(x, w, None, st, q, torch.tensor([0, 3], device=kernel_device), validate_data=True)
    with pytest.raises(ValueError, match="query_start_loc"):
        causal_conv1d_fn(x, w, None, st, torch.tensor([0, 11, 10], device=kernel_device), validate_data=True)


def test_reference_on_large_dim_matches_float64():
    """The fp32 reference itself, on a wide model (dim 4096 + 32) and a long varlen batch."""
    rng, gen = random.Random(SEED), torch.Generator().manual_seed(SEED)
    x, w, b, states, qsl, idx, init = random_batch(gen, rng, 4096 + 32, 4, "channels_last", torch.float32, "cpu",
                                                   n_seq=6, max_len=1200)
    st32, st64 = states.clone(), states.clone()
    y32 = causal_conv1d_ref(x, w, b, st32, qsl, idx, init)
    y64 = causal_conv1d_ref(x, w, b, st64, qsl, idx, init, compute_dtype=torch.float64)
    assert_close(y32, y64, torch.float32)
    assert torch.equal(st32, st64)


# ---------------------------------------------------------------- GPU only: the card's shapes and big offsets
CARD = [(1, 4096), (128, 4096), (256, 4096), (514, 4096), (1024, 4096), (1, 8192), (4195, 8192), (11027, 8192),
        (14807, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("T,dim", CARD)
def test_card_shapes_match_reference_on_gpu(T, dim, layout):
    gen = torch.Generator().manual_seed(SEED + T)
    x = make_x(dim, T, layout, torch.bfloat16, "cuda", gen) * 0.02
    w = (torch.randn(dim, 4, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    b = (torch.randn(dim, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    states = (torch.randn(1, dim, 3, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    init = torch.tensor([True], device="cuda")
    check(*run_both(x, w, b, states, qsl, None, init), torch.bfloat16)


@pytest.mark.gpu
def test_offsets_past_two_to_the_31_on_gpu():
    """T * dim > 2**31 elements: the last tokens must land where the reference puts them."""
    dim, T = 8192, (2**31) // 8192 + 300
    x = torch.randn(dim, T, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16)
    states = torch.randn(2, dim, 3, device="cuda", dtype=torch.bfloat16)
    st_k = states.clone()
    qsl = torch.tensor([0, T - 100, T], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, True], device="cuda")
    y = torch.full_like(x, float("nan"))
    causal_conv1d_fn(x, w, None, st_k, qsl, None, init, out=y)
    tail = slice(T - 400, T)
    sub_x = x[:, tail].contiguous()
    st_r = states.clone().cpu()
    ref = causal_conv1d_ref(sub_x.cpu(), w.cpu(), None, st_r, torch.tensor([0, 300, 400], dtype=torch.int32),
                            None, torch.tensor([False, True]), compute_dtype=torch.float64)
    # the first sequence's last 300 - 3 tokens need no state; compare those and the whole second sequence
    assert_close(y[:, tail][:, 3:], ref[:, 3:], torch.bfloat16)
    assert torch.equal(st_k[1].cpu(), st_r[1].to(torch.bfloat16))
    assert not torch.isnan(y).any()


@pytest.mark.parametrize("path", ["piece", "body"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_empty_bucket_of_pad_sequences_writes_zeros_and_touches_no_state(layout, path, monkeypatch, kernel_device):
    """A captured bucket before its first use: every sequence empty and padded, every token in the tail (the
    piece kernel, or the layout's body then the heads pass)."""
    monkeypatch.setattr(prefill_plan, "_PLANS", {})
    if path == "body" and layout == "channels_first":
        from convserve.kernels import _launch
        monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_first", dict(
            groups=2, min_groups=2, groups_per_thread=1, num_warps=1, tiles_per_row=1, min_t=16, max_width=MAX_WIDTH))
        monkeypatch.setattr(prefill_plan, "_PLANS", {})
    elif path == "body":
        small_channels_last_tiles(monkeypatch, 4)
    gen = torch.Generator().manual_seed(SEED)
    # 24 tokens: past the channels-first body's 16-token minimum and over several tiles of either body (70 tokens
    # took the interpreter over 20 s to write the same zeros)
    x = make_x(40, 24, layout, torch.float32, kernel_device, gen)
    w = torch.randn(40, 4, generator=gen).to(kernel_device)
    states = torch.randn(3, 40, 3, generator=gen).to(kernel_device)
    before = states.clone()
    qsl = torch.zeros(5, dtype=torch.int32, device=kernel_device)
    idx = torch.full((4,), PAD_SLOT_ID, dtype=torch.int32, device=kernel_device)
    out = torch.full_like(x, float("nan"))
    causal_conv1d_fn(x, w, None, states, qsl, idx, torch.ones(4, dtype=torch.bool, device=kernel_device), out=out)
    assert bool(_used_bodies()) == (path == "body")
    assert torch.all(out == 0)
    assert torch.equal(states, before)
