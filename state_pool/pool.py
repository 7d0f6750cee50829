"""One tensor holding the conv state of every session for every conv layer of a model, on one device.

Memory order is ``(layers, slots + 1, width - 1, dim)``: the channels of one window column are contiguous, so a
decode kernel's loads and stores of a state row coalesce. The kernels address states as
``(num_cache_lines, dim, state_len)``; :meth:`ConvStatePool.layer` hands them that as a view (stride 1 along dim),
with no copy.

Line 0 is the null slot: never allocated, so a padded batch row may point at it (or at the pad id -1) without
touching any session's state. Every other line belongs to at most one session at a time. Freed lines are zeroed,
so a freshly allocated slot always holds the zero state a new session starts from.

This module is a lower layer than the service: it raises its own :class:`PoolError` family and knows nothing of
HTTP. The pool is not thread-safe; its owner (the engine's worker) serializes calls.
"""

from __future__ import annotations

from typing import Union

import torch

NULL_SLOT = 0

STATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PoolError(Exception):
    """Misuse of the pool. ``expected`` and ``actual`` say what was wanted and what was given."""

    def __init__(self, message: str, *, expected=None, actual=None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class PoolExhausted(PoolError):
    """Every slot is in use. ``capacity`` and ``in_use`` are the counts at the time of the call."""

    def __init__(self, capacity: int, in_use: int):
        super().__init__(f"state pool exhausted: all {capacity} slots are in use ({in_use} in use)",
                         expected=f"a free slot (capacity {capacity})", actual=f"{in_use} in use")
        self.capacity = capacity
        self.in_use = in_use


class PoolShapeError(PoolError):
    """An imported state has the wrong shape."""


class PoolDtypeError(PoolError):
    """An imported state has the wrong dtype."""


def pool_bytes(n_layers: int, slots: int, dim: int, width: int, dtype: torch.dtype) -> int:
    """Bytes a pool of ``slots`` allocatable slots takes: ``layers * (slots + 1) * (width - 1) * dim * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return n_layers * (slots + 1) * (width - 1) * dim * itemsize


def slots_for_bytes(budget: int, n_layers: int, dim: int, width: int, dtype: torch.dtype) -> int:
    """The most allocatable slots whose pool fits in ``budget`` bytes (0 when not even one fits)."""
    per_slot = pool_bytes(n_layers, 1, dim, width, dtype) // 2
    return max(0, budget // per_slot - 1)


class ConvStatePool:
    """Conv states of ``slots`` sessions (plus the null slot 0) for ``n_layers`` conv layers.

    Args:
        n_layers: conv layers of the model (positions 0..n_layers-1, in ascending model order).
        slots: allocatable slots; slot ids run 1..slots.
        dim, width: the conv's channels and kernel width; a state row holds the last ``width - 1`` inputs.
        dtype: state dtype (bf16, fp16 or fp32; it may differ from the activations').
        device: where the tensor lives.
    """

    def __init__(self, n_layers: int, slots: int, dim: int, width: int, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu"):
        for name, value, low in (("n_layers", n_layers, 1), ("slots", slots, 1), ("dim", dim, 1),
                                 ("width", width, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PoolError(f"{name}: expected an int >= {low}, got {value!r}", expected=f">= {low}",
                                actual=value)
        if dtype not in STATE_DTYPES:
            raise PoolDtypeError(f"state dtype: expected one of {STATE_DTYPES}, got {dtype}",
                                 expected=STATE_DTYPES, actual=dtype)
        self.n_layers, self.slots, self.dim, self.width, self.dtype = n_layers, slots, dim, width, dtype
        self.device = torch.device(device)
        #: (layers, slots + 1, width - 1, dim), zero-initialised.
        self.storage = torch.zeros((n_layers, slots + 1, width - 1, dim), dtype=dtype, device=self.device)
        # LIFO free list: the most recently freed (cache-warm) slot is reused first. Popping from the end of a
        # list built descending hands out 1, 2, 3, ... on a fresh pool.
        self._free = list(range(slots, 0, -1))
        self._in_use: set[int] = set()
        self.peak = 0

    # ---- counters

    @property
    def capacity(self) -> int:
        """Allocatable slots (the null slot not counted)."""
        return self.slots

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    # ---- views for the kernels

    def layer(self, layer: int) -> torch.Tensor:
        """``(slots + 1, dim, width - 1)`` view of one layer's states, stride 1 along dim (what kernels take)."""
        return self.storage[layer].transpose(1, 2)

    def lines(self) -> torch.Tensor:
        """``(layers * (slots + 1), dim, width - 1)`` view of every layer's states as one table of lines: line
        ``layer * (slots + 1) + slot``. With the layers' weights stacked, one decode launch serves rows of several
        layers (``causal_conv1d_update``'s ``(groups, dim, width)`` weight: line l uses group l // (slots + 1))."""
        n, s1, w1, d = self.storage.shape
        return self.storage.view(n * s1, w1, d).transpose(1, 2)

    def states(self) -> torch.Tensor:
        """``(layers, slots + 1, dim, width - 1)`` view of everything."""
        return self.storage.transpose(2, 3)

    # ---- slot life cycle

    def _check_allocated(self, slot, what: str) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise PoolError(f"{what}: expected an int slot id, got {slot!r}", expected="int", actual=slot)
        if slot not in self._in_use:
            if slot == NULL_SLOT:
                why = "slot 0 is the reserved null slot"
            elif 1 <= slot <= self.slots:
                why = f"slot {slot} is free (double free, or never allocated)"
            else:
                why = f"slot {slot} is outside 1..{self.slots}"
            raise PoolError(f"{what}: {why}", expected=f"an allocated slot in 1..{self.slots}", actual=slot)
        return slot

    def alloc(self) -> int:
        """Take a free slot (holding the zero state). Raises :class:`PoolExhausted` when none is free."""
        if not self._free:
            raise PoolExhausted(self.slots, len(self._in_use))
        slot = self._free.pop()
        self._in_use.add(slot)
        if len(self._in_use) > self.peak:
            self.peak = len(self._in_use)
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back, zeroing it. Raises :class:`PoolError` on a double free or an unknown slot."""
        self._check_allocated(slot, "free")
        self.storage[:, slot].zero_()
        self._in_use.remove(slot)
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero every layer's state of an allocated slot."""
        self._check_allocated(slot, "reset")
        self.storage[:, slot].zero_()

    def fork(self, src: int) -> int:
        """Allocate a new slot holding a copy of ``src``'s state for every layer."""
        self._check_allocated(src, "fork")
        dst = self.alloc()
        self.storage[:, dst].copy_(self.storage[:, src])
        return dst

    def export(self, slot: int) -> torch.Tensor:
        """``(layers, dim, width - 1)`` contiguous CPU copy of ``slot``'s state, in the state dtype."""
        self._check_allocated(slot, "export")
        return self.storage[:, slot].transpose(1, 2).to("cpu").contiguous()

    def check_import(self, state) -> None:
        """Raise :class:`PoolShapeError` / :class:`PoolDtypeError` unless ``state`` can be imported."""
        expected = (self.n_layers, self.dim, self.width - 1)
        if not isinstance(state, torch.Tensor):
            raise PoolError(f"import: expected a torch.Tensor, got {type(state).__name__}", expected="Tensor",
                            actual=type(state).__name__)
        if state.dtype != self.dtype:
            raise PoolDtypeError(f"import: expected state dtype {self.dtype}, got {state.dtype}",
                                 expected=self.dtype, actual=state.dtype)
        if tuple(state.shape) != expected:
            raise PoolShapeError(f"import: expected state shape (layers, dim, width - 1) = {expected}, got "
                                 f"{tuple(state.shape)}", expected=expected, actual=tuple(state.shape))

    def import_(self, slot: int, state: torch.Tensor) -> None:
        """Overwrite ``slot``'s state with ``state`` of shape ``(layers, dim, width - 1)`` in the state dtype."""
        self._check_allocated(slot, "import")
        self.check_import(state)
        self.storage[:, slot].copy_(state.transpose(1, 2))

    def __repr__(self) -> str:
        return (f"ConvStatePool(layers={self.n_layers}, slots={self.slots}, dim={self.dim}, width={self.width}, "
                f"dtype={self.dtype}, device={self.device}, in_use={self.in_use}, peak={self.peak})")


def auto_slots(n_layers: int, dim: int, width: int, dtype: torch.dtype, device: Union[str, torch.device],
               fraction: float = 0.5, reserve_bytes: int = 0, max_slots: int = 1 << 20,
               cpu_slots: int = 1024) -> int:
    """Slots for ``slots="auto"``: ``fraction`` of the device's free memory (minus ``reserve_bytes``).

    On CUDA it reads ``torch.cuda.mem_get_info``; on CPU it returns ``cpu_slots``. Raises :class:`PoolError`
    when not one slot fits.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_slots
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * fraction) - reserve_bytes
    n = min(max_slots, slots_for_bytes(max(budget, 0), n_layers, dim, width, dtype))
    if n < 1:
        raise PoolError(f"slots=auto: {free} bytes free on {device}, not enough for one slot",
                        expected=f">= {pool_bytes(n_layers, 1, dim, width, dtype)} bytes", actual=budget)
    return n

