"""Tile choices for the launchers.

The shapes are picked from the memory order of ``x``: the tile's long side runs along x's contiguous axis, so
each warp loads long runs of consecutive bytes. ``TUNING`` holds the numbers (the sweeps behind them are in
bench/NOTES.md); the benchmark overrides them to compare variants in one process. A plan reads ``TUNING`` when it
is built and keeps what it read, so a change applies to layouts seen before only once the op's plan cache is
emptied (``kernels.prefill.plan._PLANS.clear()``, ``kernels.decode.plan._PLANS.clear()``), as the benchmarks do.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ._replay import AVAILABLE as REPLAYS_AVAILABLE
from ._replay import Replays
from ._validate import byte_span, check_apart


@dataclass(frozen=True)
class Tile:
    block_t: int  # tokens per program
    block_d: int  # channels per program
    num_warps: int


TUNING = {
    # prefill, piece kernel, x channels-first (T contiguous, the benchmark card's (dim, T)): tokens per
    # program, elements per program, warps
    "prefill_piece_channels_first": dict(block_t=512, elems=2048, num_warps=4),
    # prefill, piece kernel, x channels-last (dim contiguous, x.stride(0) == 1: serving stacks)
    "prefill_piece_channels_last": dict(block_d=256, elems=4096, num_warps=4),
    # prefill, piece kernel, batch == 1: query_start_loc, the index, the flag, the weights and the bias read in
    # one round of independent loads instead of the sequence search (on=False: the search, for comparisons);
    # channels_first: also for a channels-first x of T >= 2 (off by default: bench/NOTES.md has the timings);
    # thread_per_channel: at T == 1, as many threads as channels per program (up to 8 warps)
    "prefill_piece_one_seq": dict(on=True, channels_first=False, thread_per_channel=True),
    # Both bodies apply up to width max_width (the piece kernel takes wider ones).
    # prefill, channels-first body (x and out a contiguous (dim, T) with T >= min_t), then the heads pass: up to
    # `groups` aligned groups of 8 elements per program: about T / (8 * tiles_per_row), but not below min_groups
    # (nor above T / 8), groups_per_thread per thread
    "prefill_body_channels_first": dict(groups=512, min_groups=128, groups_per_thread=4, num_warps=4,
                                        tiles_per_row=2, min_t=512, max_width=8),
    # prefill, channels-last body (x and out with stride(0) == 1, dim * T >= min_elems), then the heads pass:
    # 8 * 32 * num_warps channels per program, rows_per_step rows per loop step, chunks of at most max_chunk
    # tokens (halved until there are min_programs programs), one program per chunk; stages > 0: the step loop
    # software-pipelined by Triton (tl.range num_stages: cp.async into shared memory, stages - 1 tiles in
    # flight), at widths up to stages_max_width; stages == 0 or wider windows: each step's tile loaded one step
    # before its use
    "prefill_body_channels_last": dict(num_warps=2, rows_per_step=4, max_chunk=128, min_programs=132 * 16,
                                       min_elems=1 << 24, max_width=8, stages=4, stages_max_width=4),
    # the heads pass after either body: channels per program (at most head_elems / HEAD, so a [HEAD, BLOCK_D]
    # head tile stays in registers at widths 6-8), elements per zeroing step of a pad; columns: the index, flag,
    # taps and bias in the bounds' round of loads and the head column by column, one channel per thread (off:
    # loaded after the bounds, the head as [HEAD, BLOCK_D] tiles)
    "prefill_heads": dict(block_d=256, elems=2048, head_elems=1024, num_warps=4, columns=True),
    # decode, one token per row (the dense kernel, and the chunked one at seqlen 1): channels per program
    "decode": dict(block_d=512, num_warps=8),
    # several tokens per row with x dense per row (speculative verify): the dense kernel while
    # width - 1 + tokens <= max_positions (0: never)
    "decode_short": dict(max_positions=8, block_d=128, num_warps=4),
    # a state strided along dim ((lines, dim, width - 1) contiguous along the window: Dao's and the seed's
    # pools), x dense per row: the dense kernel while width - 1 + tokens <= max_positions, with the dim strides
    # of x, out and bias unspecialized when scalar (one register layout for every load; dense.py)
    "decode_strided_state": dict(max_positions=8, block_d=128, num_warps=4, scalar=True),
    # one token per row on a 16-bit state exactly width - 1 wide and contiguous along the window (pairs.py):
    # channel pairs per program, warps
    "decode_pairs": dict(on=True, block_p=128, num_warps=4),
    # several tokens per row otherwise (chunked kernel: strided x, long chunks): narrower tiles keep the token
    # chunk and its windows in registers
    "decode_multi": dict(block_d=128, num_warps=2),
    # every plan on CUDA: the `after`-th launch with the same tensor addresses captures a one-node CUDA graph that
    # later launches with those addresses replay (less host time per call; _replay.py); at most `keep` graphs per
    # plan. after=0: never
    "replay": dict(after=2, keep=16),
    # host_copy.PinnedCopies: 8-byte words per program, warps, the largest copy into and out of the device made by
    # the SMs (larger ones go to the copy engines: the SMs' writes into host lines the CPU has read slow down past
    # about 4 MiB, their reads do not); on: the engine copies x in and y out with it (off: the copy engines)
    "pinned_copy": dict(on=True, block=4096, num_warps=4, max_bytes_in=1 << 30, max_bytes_out=2 << 20),
}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1); plain int arithmetic, cheaper per call than triton.next_power_of_2."""
    return 1 << max(0, int(n) - 1).bit_length()



def is_channels_first(x, total: int) -> bool:
    """x (dim, total) runs along tokens in memory (channels-first); else along channels (channels-last)."""
    return total > 1 and abs(x.stride(1)) < abs(x.stride(0))


def prefill_config(x, dim: int, total: int) -> Tile:
    """The piece kernel's tile for x (dim, total): its long side along x's contiguous axis."""
    if is_channels_first(x, total):
        t = TUNING["prefill_piece_channels_first"]
        block_t = min(t["block_t"], max(16, next_pow2(total)))
        block_d = min(next_pow2(dim), max(1, t["elems"] // block_t))
        return Tile(block_t, block_d, t["num_warps"])
    t = TUNING["prefill_piece_channels_last"]
    block_d = min(t["block_d"], max(16, next_pow2(dim)))
    block_t = min(next_pow2(total), max(1, t["elems"] // block_d))
    return Tile(block_t, block_d, t["num_warps"])


def decode_config(dim: int, seqlen: int, width: int) -> Tile:
    """The chunked decode kernel's tile: block_t tokens per chunk, block_d channels per program."""
    t = TUNING["decode" if seqlen == 1 else "decode_multi"]
    block_l = min(next_pow2(seqlen), 16)
    block_d = min(t["block_d"], max(16, next_pow2(dim)))
    return Tile(block_l, block_d, t["num_warps"])


def _raw_stream(index):
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811  (same value, a fraction of the cost)


class LaunchPlan:
    """One kernel launch with everything fixed except the tensors' addresses: grid, scalar arguments, constexprs.

    ``kernel[grid](...)`` re-derives the specialization of every argument through Triton's generic binder on each
    call, which costs far more host time than the launch itself. A plan is built once per argument layout (the
    public functions key their plan cache on shapes, strides, dtypes and devices); per call it only checks the one
    thing Triton still specializes on, each pointer's 16-byte alignment, and calls the compiled kernel's launcher
    directly with the addresses as plain integers (the launcher then skips its per-pointer
    ``cuPointerGetAttribute`` query: the plan key already pins every tensor to the plan's CUDA device). The first
    call of each alignment pattern goes through ``kernel[grid]`` (compiling if needed). Under the interpreter, or
    for CPU tensors, every call is plain ``kernel[grid](...)``.

    The public functions call ``plan.fast(...)``: ``__call__`` at first, then, once the all-aligned kernel is
    compiled, a launcher generated for the plan (``_make_fast``), which costs a few attribute reads less per call.
    """

    def __init__(self, fn, grid, scalars, constexprs: dict, num_warps: int, device: torch.device, fallback=None,
                 align: int = 1):
        self.fn, self.grid, self.scalars = fn, grid, tuple(scalars)
        self.constexprs, self.num_warps = constexprs, num_warps
        params = getattr(fn, "params", None)
        self.direct = device.type == "cuda" and params is not None
        self.const_values = tuple(constexprs[p.name] for p in params if p.is_constexpr) if self.direct else ()
        self.tail = self.scalars + self.const_values  # every argument after the tensors, in the kernel's order
        self.device_index = device.index if device.index is not None else 0
        self._compiled = {}  # alignment pattern -> Triton's compiled kernel
        self._entries = {}  # alignment pattern -> how to launch it (_entry)
        self._aligned = None  # the entry for all pointers 16-byte aligned (the usual case)
        self.copy_bias = False  # set by the public function: the caller's bias is strided and is copied per call
        # a kernel that needs every pointer `align`-byte aligned: calls with other pointers run `fallback` instead
        self.fallback, self.align_mask = fallback, align - 1
        # set by the public function (called_as): {slot: earlier slot} where the caller always passes the same
        # tensor in both (a stand-in for an absent optional tensor, which the kernel never reads), so the launch
        # reuses that address; (i, j): tensor j (out) must not share an element with tensor i (x) (check_apart
        # raises)
        self.same, self.alias = {}, None
        # the graphs of repeated launches (_replay.py), made with the generated launcher; None: never
        self.replays = None
        # what the public functions call: this generic __call__ until the aligned kernel is compiled, then a
        # launcher generated for this plan (_make_fast)
        self.fast = self.__call__

    def called_as(self, same: dict, alias) -> LaunchPlan:
        """Record how the public function calls this plan (``same``, ``alias``: see __init__), here and in its
        fallback; returns the plan."""
        for p in (self, self.fallback):
            if isinstance(p, LaunchPlan):
                p.same, p.alias = dict(same), alias
        return self

    def _slow(self, tensors):
        return self.fn[self.grid](*tensors, *self.scalars, num_warps=self.num_warps, **self.constexprs)

    def __call__(self, *tensors):
        if self.alias is not None:
            i, j = self.alias
            check_apart(tensors[j], tensors[i])
        if not self.direct:
            if self.align_mask and any(t.data_ptr() & self.align_mask for t in tensors):
                self.fallback(*tensors)
            else:
                self._slow(tensors)
            return
        ptrs = [t.data_ptr() for t in tensors]
        low = 0
        for p in ptrs:
            low |= p
        if low & 15:
            if low & self.align_mask:
                self.fallback(*tensors)
                return
            entry = self._entries.get(tuple([p & 15 == 0 for p in ptrs]))
        else:
            entry = self._aligned
        if entry is None:
            self._first(tensors, ptrs)
            return
        raw, run, function, meta, coop, pdl = entry
        try:
            if raw:  # the C launcher itself (see _entry)
                run(self.grid[0], self.grid[1], 1, _raw_stream(self.device_index), function, coop, pdl, None, None,
                    meta, None, None, None, *ptrs, *self.tail)
            else:
                run(self.grid[0], self.grid[1], 1, _raw_stream(self.device_index), function, meta, None, None, None,
                    *ptrs, *self.tail)
        except (TypeError, SystemError, AttributeError) as exc:  # a Triton whose launcher takes other arguments
            self._broken(exc, tensors)

    def _broken(self, exc, tensors):
        """The direct launch failed (a Triton whose launcher takes other arguments): from now on, and for this
        call, ``kernel[grid](...)``."""
        warnings.warn(f"convserve: direct Triton launch unavailable ({exc!r}); using kernel[grid](...)")
        self.direct = False
        self.fast = self.__call__
        self._slow(tensors)

    def _first(self, tensors, ptrs):
        """The first launch of an alignment pattern: through ``kernel[grid]``, keeping the compiled kernel."""
        compiled = self._slow(tensors)
        if hasattr(compiled, "result"):  # asynchronous compilation in some Triton versions
            compiled = compiled.result()
        sig = tuple([p & 15 == 0 for p in ptrs])
        self._compiled[sig] = compiled
        self._entries[sig] = entry = _entry(compiled)
        if all(sig):
            self._aligned = entry
            if entry[0]:
                r = TUNING["replay"]
                if r["after"] > 0 and REPLAYS_AVAILABLE:
                    self.replays = Replays(self.device_index, r["after"], r["keep"])
                self.fast = self._make_fast(entry, tensors)

    def _make_fast(self, entry, tensors):
        """A launcher for this plan alone, as Python source: one address read per distinct tensor (``same``),
        the alias check (do out's and x's byte ranges meet? their spans fixed by the plan's layout, taken from
        ``tensors``, the first call's) and the alignment check on plain ints, then the C launcher with the grid,
        the scalars and the constexprs written in as constants. Any other case (an unaligned pointer, an out that
        may overlap x) goes through the generic ``__call__``. With ``replays``, a launch whose addresses have a
        graph replays it instead, and a plain launch is noted (``Replays.note``)."""
        _, run, function, meta, coop, pdl = entry
        n = len(tensors)
        ts = [f"t{k}" for k in range(n)]
        ps = [f"p{self.same.get(k, k)}" for k in range(n)]
        distinct = sorted(set(ps), key=ps.index)
        consts = all(type(v) in (int, bool) for v in self.tail)
        tail = ", ".join(repr(v) for v in self.tail) if consts else "*tail"
        launch = (f"run({int(self.grid[0])}, {int(self.grid[1])}, 1, STREAM, "
                  f"function, coop, pdl, None, None, meta, None, None, None, {', '.join(ps)}"
                  f"{', ' + tail if self.tail else ''})")
        key = f"({', '.join(distinct)},)"
        lines = [f"def fast({', '.join(ts)}):"]
        lines += [f"    p{k} = t{k}.data_ptr()" for k in range(n) if k not in self.same]
        checks = []
        if self.alias is not None:
            i, j = self.alias
            checks.append(f"(p{j} < p{i} + {byte_span(tensors[i])} and p{i} < p{j} + {byte_span(tensors[j])})")
        checks.append(f"(({' | '.join(distinct)}) & 15)")
        lines.append(f"    if {' or '.join(checks)}:")
        lines.append(f"        return generic({', '.join(ts)})")
        on = f"stream({int(self.device_index)})"
        if self.replays is not None:  # the stream read once: the graph and the plain launch go to the same one
            lines.append(f"    s = {on}")
            lines.append(f"    key = {key}")
            lines.append("    graph = graphs.get(key)")
            lines.append("    if graph is not None and not (s and capturing(s)):")
            lines.append("        result = launch(graph.handle, s)")
            lines.append("        if not result:")
            lines.append("            return")
            lines.append("        failed(f'CUDA graph launch failed: CUDA driver error {result}')")
            on = "s"
        lines.append("    try:")
        lines.append(f"        {launch.replace('STREAM', on)}")
        lines.append("    except (TypeError, SystemError, AttributeError) as exc:")
        lines.append(f"        broken(exc, ({', '.join(ts)},))")
        if self.replays is not None:
            lines.append("        return")
            lines.append("    if graph is None:")
            lines.append("        note(key, s)")
            lines.append("def launch_on(key, s):")
            lines.append(f"    {', '.join(distinct)}, = key")
            lines.append(f"    {launch.replace('STREAM', 's')}")
        env = dict(run=run, stream=_raw_stream, function=function, coop=coop, pdl=pdl, meta=meta, tail=self.tail,
                   generic=self.__call__, broken=self._broken)
        r = self.replays
        if r is not None:
            env.update(graphs=r.graphs, capturing=r.capturing, launch=r.launch, note=r.note, failed=r.failed)
        name = f"<convserve launch {getattr(self.fn, '__name__', 'kernel')}>"
        exec(compile("\n".join(lines), name, "exec"), env)  # noqa: S102  (source built above from ints and names)
        if r is not None:
            r.launch_on = env["launch_on"]
        return env["fast"]


# Triton 3.6's CudaLauncher.__call__ does no more than this: allocate the global and profile scratch buffers (when
# the kernel has any), then call its C launcher with the cooperative-grid and PDL flags inserted. For a kernel with
# neither scratch buffer, _entry calls the C launcher directly (a microsecond of Python less per launch); any other
# launcher (another Triton version) is called through its __call__.
_TRITON_36_CALL = ("self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,"
                   "global_scratch,profile_scratch,*args)")
_RAW_OK = {}


def _entry(compiled):
    """(raw, run, function, packed_metadata, cooperative, pdl) for LaunchPlan.__call__."""
    run = compiled.run
    cls = type(run)
    if cls not in _RAW_OK:
        try:
            import inspect
            src = "".join(inspect.getsource(cls.__call__).split())
            params = tuple(inspect.signature(cls.__call__).parameters)
            _RAW_OK[cls] = (_TRITON_36_CALL in src and src.count("self.launch(") == 1
                            and params == ("self", "gridX", "gridY", "gridZ", "stream", "function", "args"))
        except (OSError, TypeError, ValueError):
            _RAW_OK[cls] = False
    raw = (_RAW_OK[cls] and getattr(run, "global_scratch_size", 1) == 0
           and getattr(run, "profile_scratch_size", 1) == 0 and hasattr(run, "launch"))
    if raw:
        return True, run.launch, compiled.function, compiled.packed_metadata, run.launch_cooperative_grid, \
            run.launch_pdl
    return False, run, compiled.function, compiled.packed_metadata, None, None


#: stand-ins for absent optional tensors in a layout guard's check, one per argument position (TensorGuards
#: refuses the same object twice): empty 7-dimensional bool tensors, which no valid argument matches
ABSENT = tuple(torch.empty((0,) * 7, dtype=torch.bool) for _ in range(8))
#: guards kept per fast-table key (the most recent ones): layouts seen under other thread-local dispatch states
#: (inference mode, say) add guards for the same plan
MAX_GUARDS = 8

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # a torch without them: every guard is a _KeyGuard
    _TensorGuards = None


class _KeyGuard:
    """layout_guard's fallback, in Python: shape, strides, dtype and device index of every tensor."""

    def __init__(self, tensors):
        self.keys = tuple(map(tensor_key, tensors))

    def check(self, *tensors) -> bool:
        return tuple(map(tensor_key, tensors)) == self.keys


def layout_guard(tensors):
    """An object whose ``check(*tensors)`` is true only for tensors with the same shapes, strides, dtypes and
    devices as these (TensorGuards, torch's C++ check behind torch.compile's guards, also compares dispatch keys and
    requires_grad: a stricter check only sends more calls the slow way). It checks a whole call's tensors in a
    fraction of a microsecond, where reading the same attributes from Python costs several."""
    if _TensorGuards is not None:
        try:
            guard = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
            if guard.check(*tensors):  # it refuses one object passed twice, for one
                return guard
        except Exception:  # noqa: BLE001 - another torch's signature: the Python check below
            pass
    return _KeyGuard(tensors)


class PlanCache(dict):
    """A public function's plan cache (its plan key -> plan), with the layout guards of its fast path:
    ``guards[fast key]`` holds ``(guard, plan)`` pairs (``add_guard``). Clearing the cache clears both; a plain
    dict in its place (as tests patch in) works, without the fast path."""

    def __init__(self):
        super().__init__()
        self.guards = {}

    def clear(self):
        super().clear()
        self.guards.clear()


def add_guard(cache, key, tensors, plan) -> None:
    """Remember in ``cache.guards[key]`` that calls whose tensors pass ``layout_guard(tensors)`` launch ``plan``
    (nothing for a cache without guards)."""
    table = getattr(cache, "guards", None)
    if table is None:
        return
    entries = table.get(key, ())
    for guard, p in entries:
        if p is plan and guard.check(*tensors):  # already there (a slow call for validate_data, say)
            return
    table[key] = (*entries[1 - MAX_GUARDS:], (layout_guard(tensors), plan))


def tensor_key(t):
    """What a plan depends on for one tensor argument (None stays None): shape, strides, dtype and device index
    (-1 on the CPU). Read on the slow path only: each attribute read costs a fraction of a microsecond, which is
    why a call with a known layout is matched by a layout guard instead (``layout_guard``)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())
