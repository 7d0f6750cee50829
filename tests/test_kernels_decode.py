"""causal_conv1d_update (Triton) against causal_conv1d_update_ref in float64, and against the prefill kernel.

Outputs are poisoned with NaN before each run. State pools carry rows no call should touch; they must come
back bit-identical.
"""

import random

import pytest
import torch

from convserve.kernels import (MAX_WIDTH, PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_update,
                     causal_conv1d_update_ref)
from tests.tolerance import assert_close

SEED = random.randrange(2**31)
print(f"test_kernels_decode seed={SEED}")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def pool_layout(lines, dim, state_len, dtype, device, gen):
    """A pool in the service's memory order (lines, state_len, dim), seen as (lines, dim, state_len)."""
    return torch.randn(lines, state_len, dim, generator=gen).to(device, dtype).transpose(1, 2)


def make_x(batch, dim, seqlen, layout, dtype, device, gen):
    if layout == "2d":
        return torch.randn(batch, dim, generator=gen).to(device, dtype)
    if layout == "3d":
        return torch.randn(batch, dim, seqlen, generator=gen).to(device, dtype)
    if layout == "token_last_major":  # (batch, seqlen, dim) memory seen as (batch, dim, seqlen)
        return torch.randn(batch, seqlen, dim, generator=gen).to(device, dtype).transpose(1, 2)
    if layout == "strided":
        return torch.randn(batch, 2 * dim, seqlen + 1, generator=gen).to(device, dtype)[:, ::2, 1:]
    raise ValueError(layout)


def run_both(x, state, weight, bias, activation="silu", **kw):
    """Kernel (poisoned out) and float64 reference on copies of the state and of any output buffers."""
    st_k, st_r = state.clone(), state.clone().cpu()
    kw_k = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    kw_r = {k: (v.clone().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = torch.full_like(x, float("nan"))
    y = causal_conv1d_update(x, st_k, weight, bias, activation, out=out, **kw_k)
    assert y is out
    ref = causal_conv1d_update_ref(x.cpu(), st_r, weight.cpu(), bias.cpu() if bias is not None else None,
                                   activation, compute_dtype=torch.float64, **kw_r)
    return y, st_k, ref, st_r, kw_k, kw_r


def assert_states_equal(st_k, st_r):
    diff = (st_k.cpu() != st_r.cpu().to(st_k.dtype)).flatten(1).any(1).nonzero().flatten().tolist()
    assert not diff, f"state rows {diff} differ from the reference"


def check_state_mode(x, state, w, b, rows, mode, seqlen, rng, osi=None):
    """One verify-sized call on both sides with the state rows ``rows`` (a pad row among them) in ``mode``: "live"
    (indices only), "inter" (intermediate windows, poisoned first), "osi" (``osi``: output_state_indices) or
    "accepted" (num_accepted_tokens drawn from ``rng``); outputs against float64, states bit-exact, the live rows'
    windows."""
    dev, dtype, batch = x.device, x.dtype, x.shape[0]
    dim, width = w.shape[-2], w.shape[-1]
    kw = dict(conv_state_indices=torch.tensor(rows, dtype=torch.int32, device=dev))
    if mode == "inter":
        kw["intermediate_conv_window"] = torch.full((batch, seqlen, dim, width - 1), float("nan"), device=dev,
                                                    dtype=dtype)
    if mode == "osi":
        kw["output_state_indices"] = torch.tensor(osi, dtype=torch.int32, device=dev)
    if mode == "accepted":
        kw["num_accepted_tokens"] = torch.tensor([rng.randint(1, seqlen) for _ in range(batch)], dtype=torch.int32,
                                                 device=dev)
    y, st_k, ref, st_r, kw_k, kw_r = run_both(x, state, w, b, **kw)
    assert_close(y, ref, dtype, "output")
    assert_states_equal(st_k, st_r)
    if mode == "inter":
        got, want = kw_k["intermediate_conv_window"], kw_r["intermediate_conv_window"]
        live = [i for i in range(batch) if rows[i] != PAD_SLOT_ID]  # pad rows' windows are not written
        assert_close(got[live], want[live], dtype, "intermediate windows")



GRID = [(d, w, L) for d in (1, 7, 64, 257) for w in (2, 3, 4) for L in (1, 2, 3, 5)]
GRID += [(40, w, L) for w in range(5, MAX_WIDTH + 1) for L in (1, 4)]
GRID += [(33, 4, 40)]  # a long chunked decode: several token chunks
GRID += [(4096 + 32, 4, 1), (4096 + 32, 3, 2)]  # a dim past every tile size
# every GRID point with and without indices, except the dim past every tile at 2 tokens without indices (the
# grid's slowest point in the interpreter, about 15 s): pairwise coverage is kept -- that dim runs without indices
# at 1 token and with them at 2, and 2-token calls run without indices at every other dim
CASES = [(d, w, L, i) for d, w, L in GRID for i in (True, False) if not (d > 4096 and L == 2 and not i)]


@pytest.mark.parametrize("dim,width,seqlen,indices", CASES)
def test_update_matches_reference(dim, width, seqlen, indices, kernel_device):
    gen = torch.Generator().manual_seed(SEED + dim * 100 + width * 10 + seqlen)
    rng = random.Random(SEED + dim + seqlen)
    dtype = DTYPES[(dim + width + seqlen) % 3]
    layout = "2d" if seqlen == 1 and dim % 2 else rng.choice(["3d", "token_last_major", "strided"])
    batch, lines = 5, 9
    x = make_x(batch, dim, seqlen, layout, dtype, kernel_device, gen)
    w = torch.randn(dim, width, generator=gen).to(kernel_device, dtype)
    b = torch.randn(dim, generator=gen).to(kernel_device, dtype)
    state = pool_layout(lines, dim, width - 1, dtype, kernel_device, gen)
    kw = {}
    if indices:
        rows = rng.sample(range(lines), batch)
        rows[rng.randrange(batch)] = PAD_SLOT_ID
        kw["conv_state_indices"] = torch.tensor(rows, dtype=torch.int32, device=kernel_device)
    y, st_k, ref, st_r, _, _ = run_both(x, state, w, b, **kw)
    assert_close(y, ref, dtype, "output")
    assert_states_equal(st_k, st_r)


def test_pad_rows_give_zeros_and_keep_state(kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(4, 32, 2, generator=gen).to(kernel_device)
    w = torch.randn(32, 4, generator=gen).to(kernel_device)
    state = pool_layout(6, 32, 3, torch.float32, kernel_device, gen)
    before = state.clone()
    idx = torch.tensor([PAD_SLOT_ID, 2, PAD_SLOT_ID, 4], dtype=torch.int32, device=kernel_device)
    y = causal_conv1d_update(x, state, w, None, "silu", conv_state_indices=idx)
    assert torch.all(y[0] == 0) and torch.all(y[2] == 0)
    untouched = [0, 1, 3, 5]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("width", [2, 3, 4, 7])
@pytest.mark.parametrize("chunks", [[1, 1, 1, 1], [3, 1, 2], [2, 5], [1, 8, 1]])
def test_chunked_decode_on_exact_width_row_continues_like_one_prefill(width, chunks, kernel_device):
    """Prefill a prompt, then feed the rest in chunks through update: outputs and final state equal one prefill."""
    gen = torch.Generator().manual_seed(SEED + width)
    dim, prompt = 24, 6
    total = prompt + sum(chunks)
    x = torch.randn(dim, total, generator=gen).to(kernel_device)
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    b = torch.randn(dim, generator=gen).to(kernel_device)
    pool = pool_layout(3, dim, width - 1, torch.float32, kernel_device, gen)
    one = pool.clone()
    y_one = causal_conv1d_fn(x, w, b, one, torch.tensor([0, total], device=kernel_device),
                             torch.tensor([2], device=kernel_device), torch.tensor([False], device=kernel_device))
    ys = [causal_conv1d_fn(x[:, :prompt], w, b, pool, torch.tensor([0, prompt], device=kernel_device),
                           torch.tensor([2], device=kernel_device), torch.tensor([False], device=kernel_device))]
    pos = prompt
    for n in chunks:
        step = x[:, pos:pos + n].unsqueeze(0)  # (1, dim, n)
        ys.append(causal_conv1d_update(step, pool, w, b, "silu",
                                       conv_state_indices=torch.tensor([2], device=kernel_device))[0])
        pos += n
    assert_close(torch.cat(ys, dim=1), y_one, torch.float32)
    assert_close(pool[2], one[2], torch.float32)


@pytest.mark.parametrize("width", [2, 3, 4, 6])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_speculative_verify_then_accept_matches_plain_decode_of_accepted_tokens(width, k, kernel_device):
    """Verify k + 1 tokens with intermediate windows, commit the window after n of them, continue decoding."""
    gen = torch.Generator().manual_seed(SEED + 7 * width + k)
    rng = random.Random(SEED + k)
    dim, batch, lines = 40, 4, 8
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    b = torch.randn(dim, generator=gen).to(kernel_device)
    pool = pool_layout(lines, dim, width - 1, torch.float32, kernel_device, gen)
    rows = torch.tensor(rng.sample(range(lines), batch), dtype=torch.int32, device=kernel_device)
    draft = torch.randn(batch, dim, k + 1, generator=gen).to(kernel_device)
    nxt = torch.randn(batch, dim, generator=gen).to(kernel_device)
    accepted = [rng.randint(1, k + 1) for _ in range(batch)]

    plain = pool.clone()  # decode only the accepted tokens, one at a time
    y_plain = []
    for i in range(batch):
        for t in range(accepted[i]):
            y_plain.append(causal_conv1d_update(draft[i:i + 1, :, t], plain, w, b, "silu",
                                                conv_state_indices=rows[i:i + 1]))
    before = pool.clone()
    inter = torch.full((batch, k + 1, dim, width - 1), float("nan"), device=kernel_device)
    y_spec = causal_conv1d_update(draft, pool, w, b, "silu", conv_state_indices=rows,
                                  intermediate_conv_window=inter)
    assert torch.equal(pool, before), "a verify must leave the live state alone"
    ref_inter = torch.zeros_like(inter).cpu()
    causal_conv1d_update_ref(draft.cpu(), before.cpu(), w.cpu(), b.cpu(), "silu",
                             conv_state_indices=rows.cpu(), intermediate_conv_window=ref_inter)
    assert_close(inter, ref_inter, torch.float32, "intermediate windows")
    for i in range(batch):  # accept: commit the window after accepted[i] tokens
        pool[rows[i]] = inter[i, accepted[i] - 1]
    got = [y_spec[i:i + 1, :, t] for i in range(batch) for t in range(accepted[i])]
    assert_close(torch.cat(got), torch.cat(y_plain), torch.float32, "verified outputs")
    assert_close(pool, plain, torch.float32, "state after accept")
    y1 = causal_conv1d_update(nxt, pool, w, b, "silu", conv_state_indices=rows)
    y2 = causal_conv1d_update(nxt, plain, w, b, "silu", conv_state_indices=rows)
    assert_close(y1, y2, torch.float32, "decode after accept")


@pytest.mark.parametrize("width", [2, 4, 5])
def test_output_state_indices_write_each_window_and_leave_live_rows(width, kernel_device):
    gen = torch.Generator().manual_seed(SEED + width)
    dim, batch, L, lines = 20, 3, 4, 16
    x = torch.randn(batch, dim, L, generator=gen).to(kernel_device, torch.bfloat16)
    w = torch.randn(dim, width, generator=gen).to(kernel_device, torch.bfloat16)
    state = pool_layout(lines, dim, width - 1, torch.float32, kernel_device, gen)
    rows = torch.tensor([1, 2, 3], dtype=torch.int32, device=kernel_device)
    osi = torch.tensor([[4, 5, -1, 6], [-1, -1, -1, 7], [8, 9, 10, 3]], dtype=torch.int32, device=kernel_device)
    y, st_k, ref, st_r, _, _ = run_both(x, state, w, None, conv_state_indices=rows, output_state_indices=osi)
    assert_close(y, ref, torch.bfloat16)
    assert_states_equal(st_k, st_r)  # row 3 is both read (batch 2's live row) and written (its last window)
    assert torch.equal(st_k[1:3], state[1:3])


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("L", [2, 3, 4])
def test_wide_row_layout_with_num_accepted_tokens(width, L, kernel_device):
    """The seed's speculative layout: after L tokens on a row >= width - 2 + L wide, reading at offset a - 1
    continues as if only a tokens had been decoded."""
    gen = torch.Generator().manual_seed(SEED + L)
    dim, batch, lines = 24, 3, 5
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    state = pool_layout(lines, dim, width - 2 + L + 1, torch.float32, kernel_device, gen)
    state[:, :, width - 1:] = float("nan")  # only the window is meaningful at first
    x = torch.randn(batch, dim, L, generator=gen).to(kernel_device)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=kernel_device)
    y, st_k, ref, st_r, _, _ = run_both(x, state.nan_to_num(), w, None, conv_state_indices=rows)
    assert_close(y, ref, torch.float32)
    assert_states_equal(st_k, st_r)
    acc = torch.tensor([1, L, max(1, L - 1)], dtype=torch.int32, device=kernel_device)
    x2 = torch.randn(batch, dim, generator=gen).to(kernel_device)
    y2, st2, ref2, st2r, _, _ = run_both(x2, st_k, w, None, conv_state_indices=rows, num_accepted_tokens=acc)
    assert_close(y2, ref2, torch.float32)
    assert_states_equal(st2, st2r)
    for i in range(batch):  # same as decoding only the accepted tokens from the original window
        a = int(acc[i])
        seq = torch.cat([state[rows[i], :, :width - 1], x[i, :, :a], x2[i, :, None]], dim=1)
        expect = causal_conv1d_ref(seq[:, width - 1:].cpu(), w.cpu(), None,
                                   state[rows[i]:rows[i] + 1, :, :width - 1].cpu(), torch.tensor([0, a + 1]), None,
                                   torch.tensor([True]), compute_dtype=torch.float64)[:, -1]
        assert_close(y2[i], expect, torch.float32)


def test_fp32_state_with_bf16_x_and_default_output(kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(6, 64, generator=gen).to(kernel_device, torch.bfloat16)
    w = torch.randn(64, 4, generator=gen).to(kernel_device, torch.bfloat16)
    state = pool_layout(8, 64, 3, torch.float32, kernel_device, gen)
    st_r = state.clone().cpu()
    idx = torch.tensor([7, 1, 0, 3, PAD_SLOT_ID, 5], device=kernel_device)
    y = causal_conv1d_update(x, state, w, None, True, conv_state_indices=idx)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), None, True, conv_state_indices=idx.cpu(),
                                   compute_dtype=torch.float64)
    assert_close(y, ref, torch.bfloat16)
    assert_states_equal(state, st_r)


def _bad_update_calls(dev):
    base = dict(x=torch.zeros(2, 8, device=dev), conv_state=torch.zeros(4, 8, 3, device=dev),
                weight=torch.zeros(8, 4, device=dev))
    return base, {
        "cache_seqlens": (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device=dev)), "cache_seqlens"),
        "x ndim": (dict(x=torch.zeros(2, device=dev)), "x"),
        "x seqlen 0": (dict(x=torch.zeros(2, 8, 0, device=dev)), "x"),
        "state dim": (dict(conv_state=torch.zeros(4, 9, 3, device=dev)), "conv_state"),
        "state short": (dict(conv_state=torch.zeros(4, 8, 2, device=dev)), "conv_state"),
        "state rows": (dict(conv_state=torch.zeros(1, 8, 3, device=dev)), "conv_state"),
        "indices": (dict(conv_state_indices=torch.zeros(3, dtype=torch.int32, device=dev)), "conv_state_indices"),
        "accepted": (dict(num_accepted_tokens=torch.ones(1, dtype=torch.int32, device=dev)), "num_accepted_tokens"),
        "inter": (dict(intermediate_conv_window=torch.zeros(2, 1, 8, 2, device=dev)), "intermediate_conv_window"),
        "osi": (dict(output_state_indices=torch.zeros(2, dtype=torch.int32, device=dev)), "output_state_indices"),
        "width": (dict(weight=torch.zeros(8, 1, device=dev)), "weight"),
        "device": (dict(weight=torch.zeros(8, 4, device="meta")), "weight"),
        "activation": (dict(activation="relu"), "activation"),
    }


@pytest.mark.parametrize("case", list(_bad_update_calls("cpu")[1]))
def test_bad_update_arguments_raise_value_error_naming_the_argument(case, kernel_device):
    base, cases = _bad_update_calls(kernel_device)
    change, name = cases[case]
    kwargs = {**base, **change}
    with pytest.raises(ValueError, match=name):
        causal_conv1d_update(**kwargs)
    with pytest.raises(ValueError, match=name):
        causal_conv1d_update_ref(**kwargs)


def test_validate_data_reports_bad_index_values(kernel_device):
    x = torch.zeros(2, 8, device=kernel_device)
    st = torch.zeros(4, 8, 3, device=kernel_device)
    w = torch.zeros(8, 4, device=kernel_device)
    with pytest.raises(ValueError, match="conv_state_indices"):
        causal_conv1d_update(x, st, w, conv_state_indices=torch.tensor([0, 4], device=kernel_device),
                             validate_data=True)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        causal_conv1d_update(x, st, w, num_accepted_tokens=torch.tensor([1, 2], device=kernel_device),
                             validate_data=True)


@pytest.mark.parametrize("idx,osi,ok", [
    ([0, 1], [[1], [-1]], False),       # entry 0 saves to the row entry 1 reads: a race
    ([0, 1], [[-1], [0]], False),
    ([0, 0], [[0], [-1]], False),       # the row is entry 0's own, but entry 1 reads it too
    ([0, 1], [[0], [1]], True),         # each entry saves to the row it reads
    ([0, 1], [[2], [3]], True),
    ([0, 3], [[3], [-1]], True),        # entry 1 is a pad (3 is the pad id here): it reads nothing
    (None, [[1], [-1]], False),         # without indices entry i reads row i
])
def test_validate_data_refuses_a_saved_row_that_another_entry_reads(kernel_device, idx, osi, ok):
    x = torch.zeros(2, 8, device=kernel_device)
    st = torch.zeros(4, 8, 3, device=kernel_device)
    w = torch.zeros(8, 4, device=kernel_device)
    kw = dict(output_state_indices=torch.tensor(osi, device=kernel_device), pad_slot_id=3, validate_data=True)
    if idx is not None:
        kw["conv_state_indices"] = torch.tensor(idx, dtype=torch.int32, device=kernel_device)
    if ok:
        causal_conv1d_update(x, st, w, **kw)
    else:
        with pytest.raises(ValueError, match="read by another batch entry"):
            causal_conv1d_update(x, st, w, **kw)


# ---------------------------------------------------------------- GPU only: serving-size pools
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 1024])
@pytest.mark.parametrize("dim", [4096, 8192])
@pytest.mark.parametrize("layout", ["pool", "window-contiguous"])
def test_large_pool_decode_matches_reference_on_gpu(batch, dim, layout):
    gen = torch.Generator().manual_seed(SEED + batch)
    x = torch.randn(batch, dim, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(dim, 4, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(dim, generator=gen).to("cuda", torch.bfloat16)
    state = pool_layout(4096, dim, 3, torch.bfloat16, "cuda", gen)
    if layout == "window-contiguous":
        state = state.contiguous()
    idx = torch.randperm(4096, generator=gen)[:batch].to("cuda", torch.int32)
    y, st_k, ref, st_r, _, _ = run_both(x, state, w, b, conv_state_indices=idx)
    assert_close(y, ref, torch.bfloat16)
    assert_states_equal(st_k, st_r)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    dim, batch = 1024, 8
    w = torch.randn(dim, 4, device="cuda")
    state = torch.randn(16, 3, dim, device="cuda").transpose(1, 2)
    x = torch.randn(batch, dim, device="cuda")
    idx = torch.arange(batch, dtype=torch.int32, device="cuda") * 2
    out = torch.empty_like(x)
    causal_conv1d_update(x, state, w, None, "silu", conv_state_indices=idx, out=out)  # compile outside capture
    st_r = state.clone().cpu()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        causal_conv1d_update(x, state, w, None, "silu", conv_state_indices=idx, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), None, "silu", conv_state_indices=idx.cpu())
        assert_close(out, ref, torch.float32)
    assert_states_equal(state, st_r)


@pytest.mark.parametrize("width", [2, 4])
def test_intermediate_windows_and_output_state_indices_together(width, kernel_device):
    gen = torch.Generator().manual_seed(SEED + 31 * width)
    dim, batch, L, lines = 24, 3, 3, 12
    x = torch.randn(batch, dim, L, generator=gen).to(kernel_device)
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    state = pool_layout(lines, dim, width - 1, torch.float32, kernel_device, gen)
    rows = torch.tensor([1, 2, 3], dtype=torch.int32, device=kernel_device)
    osi = torch.tensor([[4, -1, 5], [6, 7, 8], [-1, 9, 2]], dtype=torch.int32, device=kernel_device)
    inter = torch.full((batch, L, dim, width - 1), float("nan"), device=kernel_device)
    y, st_k, ref, st_r, kw_k, kw_r = run_both(x, state, w, None, conv_state_indices=rows, output_state_indices=osi,
                                              intermediate_conv_window=inter)
    assert_close(y, ref, torch.float32)
    assert_states_equal(st_k, st_r)
    assert_close(kw_k["intermediate_conv_window"], kw_r["intermediate_conv_window"], torch.float32, "windows")


@pytest.fixture(params=["dense", "chunked"])
def short_path(request, monkeypatch):
    """Run a test through the dense kernel (x dense per row, width - 1 + seqlen <= 8) or with it switched off
    (the chunked kernel), on fresh plan caches, with tiles smaller than the test's dim."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan
    on = request.param == "dense"
    monkeypatch.setitem(_launch.TUNING, "decode_short", dict(max_positions=8 if on else 0, block_d=32, num_warps=1))
    monkeypatch.setitem(_launch.TUNING, "decode", dict(block_d=32, num_warps=1))
    monkeypatch.setattr(plan, "_PLANS", {})
    yield on
    used = {p.fn.__name__ for p in plan._PLANS.values()}
    assert ("_dense_kernel" in used) == on, f"kernels used: {used}"


SHORT_GRID = [(w, L) for w in (2, 3, 4) for L in range(1, 10 - w)]
SHORT_MODES = ["live", "inter", "osi", "accepted"]
# Pairwise over (width, seqlen) x mode x path rather than the full product (half the interpreter runs): every
# (width, seqlen) meets every mode, and the path alternates with the parity of the two indices, so every
# (width, seqlen) runs on both paths (two modes each) and every mode runs on both paths (half the grid each).
SHORT_CASES = [(w, L, mode, ["dense", "chunked"][(i + j) % 2])
               for i, (w, L) in enumerate(SHORT_GRID) for j, mode in enumerate(SHORT_MODES)]


@pytest.mark.parametrize("width,seqlen,mode,short_path", SHORT_CASES, indirect=["short_path"])
def test_few_token_update_matches_reference_on_both_paths(width, seqlen, mode, short_path, kernel_device):
    """Verify-sized calls (x contiguous (batch, dim, seqlen)): outputs, intermediate windows, windows written
    through output_state_indices, and the seed's wide-row layout read at num_accepted_tokens, with a pad row and a
    dim that is not a multiple of the tile."""
    gen = torch.Generator().manual_seed(SEED + 101 * width + seqlen)
    rng = random.Random(SEED + 13 * width + seqlen)
    dim, batch, lines = 45, 4, 12
    dtype = DTYPES[(width + seqlen) % 3]
    x = torch.randn(batch, dim, seqlen, generator=gen).to(kernel_device, dtype)
    w = torch.randn(dim, width, generator=gen).to(kernel_device, dtype)
    b = torch.randn(dim, generator=gen).to(kernel_device, dtype) if seqlen % 2 else None
    state_len = width - 2 + seqlen + 1 if mode == "accepted" else width - 1
    state = pool_layout(lines, dim, state_len, dtype, kernel_device, gen)
    rows = rng.sample(range(1, lines), batch)
    rows[rng.randrange(batch)] = PAD_SLOT_ID
    osi = None
    if mode == "osi":  # each window to a fresh row, some skipped; the last row's last window onto its own row
        free = iter(rng.sample([r for r in range(1, lines) if r not in rows], lines - 1 - batch + 1))
        osi = [[next(free, -1) if rng.random() < 0.5 else -1 for _ in range(seqlen)] for _ in range(batch)]
        osi[-1][-1] = rows[-1] if rows[-1] != PAD_SLOT_ID else -1
    check_state_mode(x, state, w, b, rows, mode, seqlen, rng, osi)


@pytest.mark.parametrize("seqlen", [1, 3])
@pytest.mark.parametrize("mode", ["live", "inter", "osi", "accepted"])
def test_stacked_weights_pick_each_rows_group_by_its_state_line(seqlen, mode, short_path, kernel_device):
    """weight (groups, dim, width): one launch for rows of several layers of one pool; line l uses group
    l // (lines / groups). Equals one call per row with that group's weight and bias, in every state mode."""
    gen = torch.Generator().manual_seed(SEED + 7 * seqlen)
    rng = random.Random(SEED + seqlen)
    groups, per, dim, width, batch = 3, 8, 37, 4, 7
    x = torch.randn(batch, dim, seqlen, generator=gen).to(kernel_device)
    if seqlen == 1:
        x = x[:, :, 0].contiguous()
    w = torch.randn(groups, dim, width, generator=gen).to(kernel_device)
    b = torch.randn(groups, dim, generator=gen).to(kernel_device)
    state_len = width - 2 + seqlen + 1 if mode == "accepted" else width - 1
    state = pool_layout(groups * per, dim, state_len, torch.float32, kernel_device, gen)
    rows = rng.sample(range(groups * per), batch)
    rows[rng.randrange(batch)] = PAD_SLOT_ID
    kw = dict(conv_state_indices=torch.tensor(rows, dtype=torch.int32, device=kernel_device))
    if mode == "inter":
        kw["intermediate_conv_window"] = torch.full((batch, seqlen, dim, width - 1), float("nan"),
                                                    device=kernel_device)
    if mode == "osi":  # windows to lines no row reads, in several groups; each line written once (two rows
        # writing one line is a race, as in the seed), every other position skipped with -1
        free = iter(rng.sample([r for r in range(groups * per) if r not in rows], groups * per - batch))
        kw["output_state_indices"] = torch.tensor([[next(free) if (i + t) % 2 else -1 for t in range(seqlen)]
                                                   for i in range(batch)], dtype=torch.int32, device=kernel_device)
    acc = [rng.randint(1, seqlen) for _ in range(batch)]
    if mode == "accepted":
        kw["num_accepted_tokens"] = torch.tensor(acc, dtype=torch.int32, device=kernel_device)
    y, st_k, ref, st_r, kw_k, kw_r = run_both(x, state, w, b, **kw)
    assert_close(y, ref, torch.float32)
    assert_states_equal(st_k, st_r)
    if mode == "inter":
        live = [i for i in range(batch) if rows[i] != PAD_SLOT_ID]
        assert_close(kw_k["intermediate_conv_window"][live], kw_r["intermediate_conv_window"][live],
                     torch.float32, "windows")
    for i, line in enumerate(rows):  # the same as a plain call with the row's own group
        if line == PAD_SLOT_ID:
            assert torch.all(y[i] == 0)
            continue
        g = line // per
        one = causal_conv1d_update_ref(x[i:i + 1].cpu(), state.clone().cpu(), w[g].cpu(), b[g].cpu(), "silu",
                                       conv_state_indices=torch.tensor([line]), compute_dtype=torch.float64,
                                       num_accepted_tokens=torch.tensor([acc[i]]) if mode == "accepted" else None)
        assert_close(y[i:i + 1], one, torch.float32, f"row {i} (group {g})")


def test_stacked_weights_need_lines_divisible_by_groups(kernel_device):
    x = torch.randn(2, 8, device=kernel_device)
    state = pool_layout(7, 8, 3, torch.float32, kernel_device, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="conv_state: expected a number of lines divisible"):
        causal_conv1d_update(x, state, torch.randn(2, 8, 4, device=kernel_device))
    with pytest.raises(ValueError, match="bias: expected shape"):
        causal_conv1d_update(x, state[:6], torch.randn(2, 8, 4, device=kernel_device),
                             torch.randn(3, 8, device=kernel_device))
    with pytest.raises(ValueError, match="weight: expected shape \\(groups >= 1"):
        causal_conv1d_update(x, state, torch.randn(0, 8, 4, device=kernel_device))
    with pytest.raises(ValueError, match="at least one per group"):
        causal_conv1d_update(x, state[:0], torch.randn(2, 8, 4, device=kernel_device))


def test_strided_bias_is_read_by_channel(short_path, kernel_device):
    """A bias that is a strided view (every other element of a packed parameter) gives the same as a copy."""
    gen = torch.Generator().manual_seed(SEED + 3)
    dim, width = 24, 3
    x = torch.randn(4, dim, generator=gen).to(kernel_device)
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    b = torch.randn(2 * dim, generator=gen).to(kernel_device)[::2]
    state = pool_layout(6, dim, width - 1, torch.float32, kernel_device, gen)
    y, st_k, ref, st_r, _, _ = run_both(x, state, w, b)
    assert_close(y, ref, torch.float32)


@pytest.mark.parametrize("mode", ["live", "inter", "osi"])
def test_state_strides_past_two_to_the_31_stay_64_bit(mode, short_path, tmp_path, kernel_device):
    """A pool whose state columns lie 2**30 elements apart: the column offsets pass 2**31 and must be computed in
    64 bits, on both decode paths. On CPU the pool is a sparse file mapped into memory, so only the touched pages
    exist; on CUDA it is a real 6 GiB tensor."""
    from convserve.kernels.decode import plan
    dim, width, lines, S = 24, 4, 3, 2**30
    n = (width - 1) * S + lines * dim
    if kernel_device == "cuda":
        base = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    else:
        if not hasattr(torch, "from_file"):
            pytest.skip("torch.from_file is needed")
        f = tmp_path / "pool.bin"
        with open(f, "wb") as fh:
            fh.truncate(n * 2)
        base = torch.from_file(str(f), shared=True, size=n, dtype=torch.bfloat16)
    state = base.as_strided((lines, dim, width - 1), (dim, 1, S))  # column k of line l at k * S + l * dim
    gen = torch.Generator().manual_seed(SEED + 17)
    for k in range(width - 1):
        state[:, :, k] = torch.randn(lines, dim, generator=gen).bfloat16().to(kernel_device)
    x = torch.randn(2, dim, generator=gen).bfloat16().to(kernel_device)
    w = torch.randn(dim, width, generator=gen).bfloat16().to(kernel_device)
    kw = dict(conv_state_indices=torch.tensor([2, 0], dtype=torch.int32, device=kernel_device))
    if mode == "inter":
        kw["intermediate_conv_window"] = torch.full((2, 1, dim, width - 1), float("nan"), dtype=torch.bfloat16,
                                                    device=kernel_device)
    if mode == "osi":
        kw["output_state_indices"] = torch.tensor([[1], [-1]], dtype=torch.int32, device=kernel_device)
    st_r = state.clone()  # dense: the reference's copy
    kw_r = {k: v.clone() for k, v in kw.items()}
    y = causal_conv1d_update(x, state, w, None, "silu", out=torch.full_like(x, float("nan")), **kw)
    assert any(p.constexprs.get("OFF64") for p in plan._PLANS.values()), "expected the 64-bit offsets"
    ref = causal_conv1d_update_ref(x, st_r, w, None, "silu", compute_dtype=torch.float64, **kw_r)
    assert_close(y, ref, torch.bfloat16)
    assert_states_equal(state, st_r)
    if mode == "inter":
        assert_close(kw["intermediate_conv_window"], kw_r["intermediate_conv_window"], torch.bfloat16, "windows")
