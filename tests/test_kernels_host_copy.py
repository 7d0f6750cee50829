"""Copies by the SMs (kernels/host_copy.py): the copy kernel leaves ``dst`` bit-equal to ``src`` for every dtype,
odd sizes and offsets, and touches nothing past ``dst``; ``PinnedCopies`` copies by the SMs only between its device
and the pinned buffers it was given (both directions, in a CUDA graph too) and hands every other copy (pageable or
foreign host memory, odd sizes, strided or misaligned views, copies past ``max_bytes``, two host or two device
tensors) to ``Tensor.copy_``, with the same result. The kernel on the CPU through Triton's interpreter; the class
on CUDA."""

import pytest
import torch

from convserve.kernels._launch import TUNING
from convserve.kernels.host_copy import PinnedCopies, copy_words

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.float64]
# (elements, element offset into the buffer), for 8-byte elements: sizes around the kernel's block, offsets that
# keep 8-byte words
SIZES = [(1, 0), (3, 1), (64, 0), (1000, 3), (4097, 2), (10_001, 1)]
POISON = 0x5A


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _pair(n, off, dtype, src_device, dst_device, seed=0):
    """A random src of ``n`` 8-byte words' worth of ``dtype`` at word offset ``off`` into its buffer, and a poisoned
    dst buffer with 8 words more, whose words from ``off`` on are the copy's target: (src, dst, dst_buffer)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, ((n + off) * 8,), generator=g, dtype=torch.uint8)
    buf = torch.full(((n + off + 8) * 8,), POISON, dtype=torch.uint8)
    raw, buf = (t.pin_memory() if where == "pinned" else t.cuda() if where == "cuda" else t
                for t, where in ((raw, src_device), (buf, dst_device)))
    src, dst = raw[off * 8:(off + n) * 8].view(dtype), buf[off * 8:(off + n) * 8].view(dtype)
    return src, dst, buf


def _check(src, dst, buf, off):
    got = buf.cpu()
    assert torch.equal(_bits(dst.cpu()), _bits(src.cpu()))
    assert (got[:off * 8] == POISON).all() and (got[(off * 8 + src.numel() * src.element_size()):] == POISON).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,off", SIZES)
def test_the_kernel_copies_bit_exact_and_stays_inside_dst(dtype, n, off):
    src, dst, buf = _pair(n, off, dtype, "cpu", "cpu", seed=n + off)
    copy_words(dst, src)
    _check(src, dst, buf, off)


def test_an_empty_copy_launches_nothing():
    copy_words(torch.empty(0), torch.empty(0))


def _copies(*buffers):
    c = PinnedCopies(torch.device("cuda"))
    c.add(*buffers)
    return c


@gpu
@needs_cuda
@pytest.mark.parametrize("direction", [("pinned", "cuda"), ("cuda", "pinned")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,off", SIZES + [(1 << 18, 0), (3 * (1 << 17) + 5, 2)])
def test_a_copy_between_given_pinned_memory_and_the_device_is_made_by_the_sms_bit_exact(direction, dtype, n, off):
    src, dst, buf = _pair(n, off, dtype, *direction, seed=n + off)
    host = src if direction[0] == "pinned" else buf
    c = _copies(host)
    c.copy(dst, src)
    torch.cuda.synchronize()
    _check(src, dst, buf, off)
    small = src.numel() * src.element_size() <= TUNING["pinned_copy"]["max_bytes"]   # larger: the copy engines
    assert c.by_sm == (1 if (src.data_ptr() | dst.data_ptr()) % 16 == 0 and small else 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", ["pageable", "not given", "odd bytes", "strided", "misaligned", "two devices",
                                  "two hosts", "dtype", "large", "off"])
def test_any_other_copy_goes_to_tensor_copy_with_the_same_result(case):
    g = torch.Generator().manual_seed(3)
    pinned = torch.randn(64, 40, generator=g).to(torch.bfloat16).pin_memory()
    other = torch.randn(64, 40, generator=g).to(torch.bfloat16).pin_memory()
    dev = torch.zeros(64, 40, dtype=torch.bfloat16, device="cuda")
    c = _copies(pinned)
    dst, src = dev, pinned
    if case == "pageable":
        src = pinned.clone()
    elif case == "not given":
        src = other
    elif case == "odd bytes":
        dst, src = dev.view(-1)[:9], pinned.view(-1)[:9]          # 18 bytes: not whole words
    elif case == "strided":
        dst, src = dev[:, :8], pinned[:, :8]
    elif case == "misaligned":
        dst, src = dev.view(-1)[4:36], pinned.view(-1)[4:36]    # 8-byte aligned, not 16
    elif case == "two devices":
        src = dev.clone() + 1
    elif case == "two hosts":
        dst = torch.zeros(64, 40, dtype=torch.bfloat16)
    elif case == "dtype":
        dst = torch.zeros(64, 40, dtype=torch.float32, device="cuda")
    elif case == "large":
        big = torch.randn(TUNING["pinned_copy"]["max_bytes"] // 2 + 8, generator=g).to(torch.bfloat16).pin_memory()
        c.add(big)
        dst, src = torch.zeros_like(big, device="cuda"), big
    elif case == "off":
        TUNING["pinned_copy"]["on"] = False
    try:
        c.copy(dst, src)
    finally:
        TUNING["pinned_copy"]["on"] = True
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src.cpu().to(dst.dtype))
    assert c.by_sm == 0


@gpu
@needs_cuda
def test_only_pinned_host_memory_can_be_given():
    c = PinnedCopies(torch.device("cuda"))
    with pytest.raises(ValueError, match="not pinned"):
        c.add(torch.empty(8))
    with pytest.raises(ValueError, match="expected pinned host memory"):
        c.add(torch.empty(8, device="cuda"))
    b = torch.empty(100, dtype=torch.uint8).pin_memory()
    c.add(b[10:20])                                   # the whole storage is given
    assert c.covers(b.data_ptr(), 100) and not c.covers(b.data_ptr() + 1, 100)


@gpu
@needs_cuda
def test_a_copy_captured_in_a_graph_copies_what_the_buffer_holds_at_each_replay():
    h = torch.empty(256, 4096, dtype=torch.bfloat16, pin_memory=True)
    back = torch.empty(256, 4096, dtype=torch.bfloat16, pin_memory=True)
    d = torch.empty(256, 4096, dtype=torch.bfloat16, device="cuda")
    c = _copies(h, back)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):         # compiled and launched once outside the capture
        c.copy(d, h)
        c.copy(back, d)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c.copy(d, h)
        d.mul_(2)
        c.copy(back, d)
    for seed in range(3):
        want = torch.randn(256, 4096, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        h.copy_(want)                  # the CPU writes the pinned buffer, then the replay reads it
        back.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(back, want * 2)
    assert c.by_sm == 4
