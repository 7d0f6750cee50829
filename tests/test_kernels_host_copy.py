"""Copies by the SMs (kernels/host_copy.py): the copy kernel leaves ``dst`` bit-equal to ``src`` for every dtype,
odd sizes and offsets, and touches nothing past ``dst``; ``PinnedCopies`` copies by the SMs only between its device
and the pinned buffers it was given (both directions, in a CUDA graph too) and hands every other copy (pageable or
foreign host memory, odd sizes, strided or misaligned views, copies past the size limits, two host or two device
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


class _Fake:
    """What PinnedCopies reads of a tensor, at an address of our choosing (no memory behind it: nothing is copied)."""

    def __init__(self, ptr=1 << 20, nbytes=1024, cuda=False, dtype=torch.bfloat16, shape=None, contiguous=True,
                 index=0, pinned=True, storage=None):
        self.ptr, self.nbytes, self.is_cuda, self.dtype = ptr, nbytes, cuda, dtype
        self.shape = torch.Size(shape or (nbytes // torch.empty((), dtype=dtype).element_size(),))
        self.device = torch.device("cuda", index) if cuda else torch.device("cpu")
        self._contiguous, self._pinned, self._storage = contiguous, pinned, storage or (ptr, nbytes)

    def numel(self):
        return self.shape.numel()

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def data_ptr(self):
        return self.ptr

    def is_contiguous(self):
        return self._contiguous

    def is_pinned(self):
        return self._pinned

    def untyped_storage(self):
        lo, n = self._storage
        return type("S", (), {"data_ptr": lambda _s: lo, "nbytes": lambda _s: n})()


def _router(**limits):
    c = PinnedCopies(torch.device("cuda", 0), **limits)
    c.add(_Fake(ptr=1 << 20, nbytes=1 << 16, storage=(1 << 20, 1 << 16)))   # [1 MiB, 1 MiB + 64 KiB)
    return c


ROUTES = [  # (what, dst, src, by the SMs?)
    ("in", dict(cuda=True, ptr=1 << 30), dict(), True),
    ("out", dict(), dict(cuda=True, ptr=1 << 30), True),
    ("at the buffer's end", dict(cuda=True, ptr=1 << 30), dict(ptr=(1 << 20) + (1 << 16) - 1024), True),
    ("past the buffer's end", dict(cuda=True, ptr=1 << 30), dict(ptr=(1 << 20) + (1 << 16) - 1008), False),
    ("before the buffer", dict(cuda=True, ptr=1 << 30), dict(ptr=(1 << 20) - 16), False),
    ("another host range", dict(cuda=True, ptr=1 << 30), dict(ptr=1 << 24), False),
    ("two hosts", dict(), dict(), False),
    ("two devices", dict(cuda=True, ptr=1 << 30), dict(cuda=True), False),
    ("another device", dict(cuda=True, ptr=1 << 30, index=1), dict(), False),
    ("dtype", dict(cuda=True, ptr=1 << 30, dtype=torch.float16), dict(), False),
    ("shape", dict(cuda=True, ptr=1 << 30, shape=(2, 256)), dict(shape=(256, 2)), False),
    ("odd bytes", dict(cuda=True, ptr=1 << 30, nbytes=1020), dict(nbytes=1020), False),
    ("empty", dict(cuda=True, ptr=1 << 30, nbytes=0), dict(nbytes=0), False),
    ("8-byte aligned", dict(cuda=True, ptr=(1 << 30) + 8), dict(ptr=(1 << 20) + 8), False),
    ("strided", dict(cuda=True, ptr=1 << 30, contiguous=False), dict(), False),
    ("out at max_bytes_out", dict(nbytes=2 << 20), dict(cuda=True, ptr=1 << 30, nbytes=2 << 20), True),
    ("out past max_bytes_out", dict(nbytes=(2 << 20) + 16), dict(cuda=True, ptr=1 << 30, nbytes=(2 << 20) + 16),
     False),
    ("in past max_bytes_out", dict(cuda=True, ptr=1 << 30, nbytes=3 << 20), dict(nbytes=3 << 20), True),
    ("in at max_bytes_in", dict(cuda=True, ptr=1 << 30, nbytes=4 << 20), dict(nbytes=4 << 20), True),
    ("in past max_bytes_in", dict(cuda=True, ptr=1 << 30, nbytes=(4 << 20) + 16), dict(nbytes=(4 << 20) + 16),
     False),
]


@pytest.mark.parametrize("what,dst,src,want", ROUTES, ids=[r[0] for r in ROUTES])
def test_only_whole_aligned_copies_inside_a_given_buffer_go_to_the_sms(what, dst, src, want):
    c = _router(max_bytes_in=4 << 20)       # in-copies of up to 4 MiB, out-copies of up to 2 MiB (the default)
    if "max_bytes" in what:
        c.add(_Fake(ptr=1 << 20, nbytes=8 << 20, storage=(1 << 20, 8 << 20)))
    assert c.by_sms(_Fake(**dst), _Fake(**src)) is want


def test_the_sms_are_not_used_when_turned_off():
    c = _router()
    TUNING["pinned_copy"]["on"] = False
    try:
        assert not c.by_sms(_Fake(cuda=True, ptr=1 << 30), _Fake())
    finally:
        TUNING["pinned_copy"]["on"] = True
    assert c.by_sms(_Fake(cuda=True, ptr=1 << 30), _Fake())


def test_only_pinned_host_memory_can_be_given_and_its_whole_storage_counts():
    c = PinnedCopies(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="not pinned"):
        c.add(_Fake(pinned=False))
    with pytest.raises(ValueError, match="expected pinned host memory"):
        c.add(_Fake(cuda=True))
    c.add(_Fake(ptr=1010, nbytes=10, storage=(1000, 100)))               # a view: its storage is given
    assert c.covers(1000, 100) and c.covers(1050, 50)
    assert not c.covers(999, 2) and not c.covers(1001, 100)


@pytest.mark.parametrize("seed", range(40))
def test_a_range_is_covered_exactly_when_every_byte_of_it_lies_in_a_given_buffer(seed):
    import random

    rng = random.Random(seed)
    c = PinnedCopies(torch.device("cuda", 0))
    pinned = set()
    for _ in range(rng.randint(1, 12)):             # buffers apart, adjacent, overlapping, nested, repeated, empty
        lo, n = rng.randrange(0, 400), rng.choice([0, 1, 3, 8, 20, 60])
        c.add(_Fake(ptr=lo, nbytes=n, storage=(lo, n)))
        pinned.update(range(lo, lo + n))
    for _ in range(300):
        ptr, n = rng.randrange(0, 480), rng.randint(1, 80)
        assert c.covers(ptr, n) is all(b in pinned for b in range(ptr, ptr + n)), (ptr, n)


def _copies(*buffers):
    c = PinnedCopies(torch.device("cuda"))
    c.add(*buffers)
    return c


@gpu
@needs_cuda
@pytest.mark.parametrize("direction", [("pinned", "cuda"), ("cuda", "pinned")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,off", SIZES + [(1 << 18, 0), (3 * (1 << 17) + 5, 2), (3 << 19, 0)])
def test_a_copy_between_given_pinned_memory_and_the_device_is_made_by_the_sms_bit_exact(direction, dtype, n, off):
    src, dst, buf = _pair(n, off, dtype, *direction, seed=n + off)
    host = src if direction[0] == "pinned" else buf
    warm_h = torch.zeros(96, dtype=torch.uint8).pin_memory()
    c = _copies(host, warm_h)
    c.copy(torch.empty(96, dtype=torch.uint8, device="cuda"), warm_h)   # compiled on 12 words: the copy below
    c.copy(dst, src)                                                     # takes the direct launcher, any size
    torch.cuda.synchronize()
    _check(src, dst, buf, off)
    most = TUNING["pinned_copy"]["max_bytes_in" if direction[1] == "cuda" else "max_bytes_out"]
    small = src.numel() * src.element_size() <= most                                 # larger: the copy engines
    assert c.by_sm == 1 + ((src.data_ptr() | dst.data_ptr()) % 16 == 0 and small)


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
        big = torch.randn(TUNING["pinned_copy"]["max_bytes_out"] // 2 + 8, generator=g).to(torch.bfloat16)
        big = big.pin_memory()
        c.add(big)
        dst, src = big, torch.zeros_like(big, device="cuda")      # out of the device: past max_bytes_out
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
def test_a_launcher_that_refuses_its_arguments_leaves_every_copy_to_tensor_copy():
    h = torch.randn(64, 64).pin_memory()
    d = torch.zeros(64, 64, device="cuda")
    c = _copies(h)
    c.copy(d, h)                                         # compiles
    raw, run, *rest = c._launch

    def refuses(*args):
        raise TypeError("launch() takes other arguments")
    c._launch = (raw, refuses, *rest)
    d.zero_()
    with pytest.warns(UserWarning, match="cannot be launched directly"):
        c.copy(d, h)
    c.copy(d[:32], h[:32])
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), h) and c.by_sm == 1 and not c.by_sms(d, h)


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
