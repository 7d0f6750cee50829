"""The seed's calling conventions on every op (Triton, vectorized PyTorch, reference): its extra keyword
arguments (``metadata``, ``seq_lens_cpu``) are taken and not needed, ``metadata`` and ``validate_data`` by position
too (the seed's parameters 10-11 / 12-13), any other unknown keyword is a TypeError (a
misspelled ``conv_state_indices`` must not update the wrong rows), and ``pad_slot_id=None`` (the seed's "no pad
marker") works as the default marker: rows outside the pool are skipped either way."""

import pytest
import torch

from convserve.kernels import (PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_fn_torch, causal_conv1d_ref,
                               causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_update_torch)
from tests.tolerance import assert_close

PREFILL_OPS = {"triton": causal_conv1d_fn, "torch": causal_conv1d_fn_torch, "reference": causal_conv1d_ref}
UPDATE_OPS = {"triton": causal_conv1d_update, "torch": causal_conv1d_update_torch,
              "reference": causal_conv1d_update_ref}
DIM, W = 16, 4


def _prefill_args(device):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(DIM, 9, generator=g).to(device), torch.randn(DIM, W, generator=g).to(device)
    st = torch.randn(4, DIM, W - 1, generator=g).to(device)
    qsl = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    ci = torch.tensor([2, PAD_SLOT_ID], dtype=torch.int32, device=device)
    hs = torch.tensor([True, False], device=device)
    return x, w, st, qsl, ci, hs


def _update_args(device):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, DIM, generator=g).to(device), torch.randn(DIM, W, generator=g).to(device)
    st = torch.randn(4, DIM, W - 1, generator=g).to(device)
    idx = torch.tensor([0, PAD_SLOT_ID, 2], dtype=torch.int32, device=device)
    return x, w, st, idx


@pytest.mark.parametrize("op", list(PREFILL_OPS))
def test_prefill_takes_the_seeds_extras_and_none_as_pad_slot_id_and_refuses_other_keywords(op, kernel_device):
    fn = PREFILL_OPS[op]
    x, w, st, qsl, ci, hs = _prefill_args(kernel_device)
    s0, s1, s2 = st.clone(), st.clone(), st.clone()
    y0 = fn(x, w, None, s0, qsl, ci, hs, "silu", PAD_SLOT_ID)
    y1 = fn(x, w, None, s1, qsl, ci, hs, "silu", None, metadata=object(), seq_lens_cpu=[4, 5])
    assert_close(y1, y0, torch.float32)
    assert_close(s1, s0, torch.float32)
    with pytest.raises(TypeError, match="'has_initial_states'"):
        fn(x, w, None, s2, qsl, ci, has_initial_states=hs)
    assert torch.equal(s2, st)                             # refused before anything ran


@pytest.mark.parametrize("op", list(UPDATE_OPS))
def test_update_takes_the_seeds_extras_and_none_as_pad_slot_id_and_refuses_other_keywords(op, kernel_device):
    fn = UPDATE_OPS[op]
    x, w, st, idx = _update_args(kernel_device)
    s0, s1, s2 = st.clone(), st.clone(), st.clone()
    y0 = fn(x, s0, w, None, "silu", conv_state_indices=idx, pad_slot_id=PAD_SLOT_ID)
    y1 = fn(x, s1, w, None, "silu", conv_state_indices=idx, pad_slot_id=None, metadata=None)
    assert_close(y1, y0, torch.float32)
    assert_close(s1, s0, torch.float32)
    assert torch.equal(s1[1], st[1]) and torch.equal(s1[3], st[3])   # the pad row and the unused line untouched
    with pytest.raises(TypeError, match="'conv_state_indice'"):
        fn(x, s2, w, conv_state_indice=idx)
    assert torch.equal(s2, st)


@pytest.mark.parametrize("op", list(PREFILL_OPS))
def test_a_token_major_prefill_x_is_named_with_the_fix(op, kernel_device):
    x, w, st, qsl, ci, hs = _prefill_args(kernel_device)
    with pytest.raises(ValueError, match=r"^x: expected shape \(dim, total_tokens\) with dim = weight.shape\[0\] = 16; "
                                         r"a token-major x is x.t\(\)"):
        PREFILL_OPS[op](x.t().contiguous(), w, None, st, qsl, ci, hs)


@pytest.mark.parametrize("op", list(UPDATE_OPS))
def test_a_sequence_major_update_x_and_a_conv1d_weight_are_named_with_the_fix(op, kernel_device):
    x, w, st, idx = _update_args(kernel_device)
    with pytest.raises(ValueError, match=r"^x: .*dim = weight.shape\[-2\] = 16; a \(batch, seqlen, dim\) x is "
                                         r"x.transpose\(1, 2\)"):
        UPDATE_OPS[op](torch.randn(3, 2, DIM, device=kernel_device), st, w)
    with pytest.raises(ValueError, match=r"^weight: .*nn.Conv1d's \(dim, 1, width\) is weight.squeeze\(1\)"):
        UPDATE_OPS[op](x, st, w[:, None, :])


@pytest.mark.parametrize("op", list(PREFILL_OPS))
def test_prefill_takes_metadata_and_validate_data_by_position_as_the_seed_orders_them(op, kernel_device):
    fn = PREFILL_OPS[op]
    x, w, st, qsl, ci, hs = _prefill_args(kernel_device)
    s0, s1 = st.clone(), st.clone()
    y0 = fn(x, w, None, s0, qsl, ci, hs, "silu", PAD_SLOT_ID)
    y1 = fn(x, w, None, s1, qsl, ci, hs, "silu", PAD_SLOT_ID, object(), True)
    assert_close(y1, y0, torch.float32)
    assert_close(s1, s0, torch.float32)
    bad = torch.tensor([2, 2], dtype=torch.int32, device=kernel_device)    # one row for two sequences
    with pytest.raises(ValueError):                    # validate_data=True by position: the values are checked
        fn(x, w, None, st.clone(), qsl, bad, hs, "silu", PAD_SLOT_ID, None, True)


@pytest.mark.parametrize("op", list(UPDATE_OPS))
def test_update_takes_metadata_and_validate_data_by_position_as_the_seed_orders_them(op, kernel_device):
    fn = UPDATE_OPS[op]
    x, w, st, idx = _update_args(kernel_device)
    s0, s1 = st.clone(), st.clone()
    y0 = fn(x, s0, w, None, "silu", None, idx)
    y1 = fn(x, s1, w, None, "silu", None, idx, None, None, None, PAD_SLOT_ID, object(), True)
    assert_close(y1, y0, torch.float32)
    assert_close(s1, s0, torch.float32)
    bad = torch.tensor([0, 0, 2], dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError):
        fn(x, st.clone(), w, None, "silu", None, bad, None, None, None, PAD_SLOT_ID, None, True)
