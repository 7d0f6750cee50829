"""causal_conv1d_update on the state layout of Dao's and the seed's callers, ``(lines, dim, width - 1)`` contiguous
along the window: the pairs kernel (plain 16-bit decode) and both paths of the other decodes, against
causal_conv1d_update_ref in float64, states bit-exact."""

import random

import pytest
import torch

from convserve.kernels import MAX_WIDTH, PAD_SLOT_ID, causal_conv1d_update, causal_conv1d_update_ref
from tests.test_kernels_decode import DTYPES, SEED, assert_states_equal, check_state_mode
from tests.tolerance import assert_close


@pytest.fixture(params=["dense", "chunked"])
def strided_state_path(request, monkeypatch):
    """Run a test with a state strided along dim through the dense kernel's scalar variant, or with it switched off
    (the chunked kernel), on fresh plan caches, with tiles smaller than the test's dim (the pairs kernel off: it
    has its own tests)."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan
    on = request.param == "dense"
    monkeypatch.setitem(_launch.TUNING, "decode_strided_state",
                        dict(max_positions=8 if on else 0, block_d=32, num_warps=1, scalar=True))
    monkeypatch.setitem(_launch.TUNING, "decode_multi", dict(block_d=32, num_warps=1))
    monkeypatch.setitem(_launch.TUNING, "decode_pairs", dict(on=False, block_p=16, num_warps=1))
    monkeypatch.setattr(plan, "_PLANS", {})
    yield on
    used = {p.fn.__name__ for p in plan._PLANS.values()}
    assert ("_dense_kernel" in used) == on, f"kernels used: {used}"


@pytest.mark.parametrize("width", range(2, MAX_WIDTH + 1))
@pytest.mark.parametrize("variant", ["plain", "no-bias-no-silu", "grouped", "no-indices", "unaligned", "fp16", "x3d"])
def test_pairs_kernel_matches_reference(width, variant, monkeypatch, kernel_device):
    """The pairs kernel (plain 16-bit decode on a state contiguous along the window): outputs against float64,
    states bit-exact, a pad row, a dim past the tile (and not a multiple of it), stacked
    weights, no bias or activation, x and out (batch, dim, 1), and x / out / state 2 bytes off 4-byte alignment
    (the dense kernel then runs instead)."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan
    monkeypatch.setitem(_launch.TUNING, "decode_pairs", dict(on=True, block_p=16, num_warps=1))
    monkeypatch.setattr(plan, "_PLANS", {})
    gen = torch.Generator().manual_seed(SEED + 19 * width + len(variant))
    rng = random.Random(SEED + width + len(variant))
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    # dim 38: past the 32-channel tile (16 pairs) and not a multiple of it (70, three tiles, took twice as long)
    dim, batch, groups, per = 38, 6, (3 if variant == "grouped" else 1), 8
    lines = groups * per
    shift = 1 if variant == "unaligned" else 0
    x = torch.randn(batch, dim + 2 * shift, generator=gen).to(kernel_device, dtype)[:, shift:dim + shift]
    base = torch.randn(lines * dim * (width - 1) + shift, generator=gen).to(kernel_device, dtype)
    state = base[shift:].view(lines, dim, width - 1)
    if variant == "grouped":
        w = torch.randn(groups, dim, width, generator=gen).to(kernel_device, dtype)
        b = torch.randn(groups, dim, generator=gen).to(kernel_device, dtype)
    else:
        w = torch.randn(dim, width, generator=gen).to(kernel_device, dtype)
        b = None if variant == "no-bias-no-silu" else torch.randn(dim, generator=gen).to(kernel_device, dtype)
    act = None if variant == "no-bias-no-silu" else "silu"
    kw = {}
    if variant != "no-indices":
        rows = rng.sample(range(lines), batch)
        rows[1] = PAD_SLOT_ID  # a pad row: zeros, no state touched
        kw["conv_state_indices"] = torch.tensor(rows, dtype=torch.int32, device=kernel_device)
    st_k, st_r = state.clone(), state.clone().cpu()
    if shift:  # keep the kernel's copy off 4-byte alignment too
        st_k = torch.empty(state.numel() + shift, dtype=dtype, device=kernel_device)[shift:].view(state.shape)
        st_k.copy_(state)
    out = torch.full((batch, dim + 2 * shift), float("nan"), dtype=dtype, device=kernel_device)[:, shift:dim + shift]
    if variant == "x3d":  # (batch, dim, 1): a one-token chunk (DecodeGraph's buffers)
        x, out = x.unsqueeze(-1), out.unsqueeze(-1)
    y = causal_conv1d_update(x, st_k, w, b, act, out=out, **kw)
    ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), b.cpu() if b is not None else None, act,
                                   compute_dtype=torch.float64, **{k: v.cpu() for k, v in kw.items()})
    assert_close(y, ref, dtype, "output")
    assert_states_equal(st_k, st_r)
    used = {p.fn.__name__ for p in plan._PLANS.values()}
    assert used == {"_pairs_kernel"}, used


@pytest.mark.parametrize("width,seqlen", [(2, 1), (3, 1), (4, 1), (4, 3), (6, 1), (3, 4)])
@pytest.mark.parametrize("mode", ["live", "inter", "osi", "accepted"])
def test_state_contiguous_along_the_window_matches_reference(width, seqlen, mode, strided_state_path,
                                                             kernel_device):
    """Dao's and the seed's pool, ``(lines, dim, state_len)`` contiguous along the window, on both decode paths:
    outputs, windows, rows written through output_state_indices, the wide row read at num_accepted_tokens; a pad
    row; a dim that is not a multiple of the tile."""
    gen = torch.Generator().manual_seed(SEED + 37 * width + seqlen)
    rng = random.Random(SEED + 11 * width + seqlen)
    dim, batch, lines = 45, 4, 12
    dtype = DTYPES[(width + seqlen + len(mode)) % 3]
    x = torch.randn(batch, dim, seqlen, generator=gen).to(kernel_device, dtype)
    if seqlen == 1:
        x = x[:, :, 0].contiguous()
    w = torch.randn(dim, width, generator=gen).to(kernel_device, dtype)
    b = torch.randn(dim, generator=gen).to(kernel_device, dtype)
    state_len = width - 2 + seqlen + 1 if mode == "accepted" else width - 1
    if state_len == 1:
        state_len = 2  # a window of one column is the pool layout too: widen the row so dim stays strided
    state = torch.randn(lines, dim, state_len, generator=gen).to(kernel_device, dtype)
    rows = rng.sample(range(1, lines), batch)
    rows[rng.randrange(batch)] = PAD_SLOT_ID
    osi = None
    if mode == "osi":
        free = iter(rng.sample([r for r in range(1, lines) if r not in rows], lines - 1 - batch))
        osi = [[next(free, -1) if (i + t) % 2 else -1 for t in range(seqlen)] for i in range(batch)]
    check_state_mode(x, state, w, b, rows, mode, seqlen, rng, osi)
