"""The serving engine: one per device. It owns the state pool, the weights, the batch buffers and a worker thread
that runs the scheduler's steps; callers in the same process submit conv requests and session operations.

Kernels: on CUDA the Triton ops of :mod:`kernels` (imported when the engine starts on CUDA), with each decode
bucket of each layer replayed from a CUDA graph captured at start-up; on CPU the vectorized PyTorch ops
(``kernels.torch_ops``).

Threading: every public method is thread-safe. The worker thread is the only one that touches device memory after
:meth:`Engine.start`: conv steps and the session operations that read or write state (delete, fork, export,
import, accept, TTL eviction) run on it, between steps, so a slot is never freed in the middle of a step. A
session operation runs after the requests of that session submitted before it (and holds back the ones
submitted after it), so ``submit(...); export_state(...)`` sees the submitted request's effect.

Conv semantics (``submit`` / ``conv``):

* ``x`` is ``(T, dim)``, ``T >= 1``, bf16 / fp16 / fp32 on any device; it is cast to the model dtype for compute
  and ``y`` comes back ``(T, dim)`` on the CPU in x's dtype. The first call of a session and layer starts from a
  zero state; later calls continue from the stored state (chunked prefill; ``T = 1`` is a decode). A prefill
  longer than what a step has room for runs in chunks over several steps, transparently.
* Speculative decoding: ``speculative=True`` sends ``k + 1`` tokens (at most ``max_spec_tokens``) that are
  computed from the committed state, which they leave unchanged. ``accept(session, n)`` then commits, for every
  layer with a pending verify at once, the state after the first ``n`` of its tokens (``0 <= n <= T``; ``n = 0``
  rejects them all). The engine keeps each layer's verify tokens, not the windows: the window after ``n`` tokens
  is the last ``width - 1`` columns of ``[committed state, x[:n]]``, bit-identical to the kernel's intermediate
  window. Rules while a verify is pending:

  - another speculative call on the same layer *replaces* that layer's pending verify (it again starts from the
    committed state: a retried verify is idempotent);
  - a non-speculative call on any layer of the session raises :class:`BadRequest` (accept, or ``accept(s, 0)``
    to discard, first): silently running it on either state would be wrong for some caller;
  - ``export_state`` returns the committed state; ``fork_session`` copies the pending verify too (each fork can
    accept its own ``n``); ``import_state`` replaces the state and discards the pending verify.

* Batch requests (``submit_batch`` / ``conv_batch``): a slice of tokens for each of several sessions on one
  layer as one request (a frontend's step: decodes, prefill chunks, speculative verifies), each slice exactly as
  its own ``submit`` would run; ``accept_batch`` commits several sessions' verifies as one operation. One
  scheduler entry and one result per batch; its rows join the step's launches of their kind on that layer. A
  plain decode batch (one token per session) is the hot path: one launch (a batch slot's CUDA graph: copy in,
  kernel, copy out); so is a verify-only batch of one length per row (a verify slot's graph: copy in, verify,
  x kept for accept, copy out). A batch runs after the requests and session operations of its sessions submitted before
  it, and before their later ones, in one step; it is validated, and fails, as a whole.
* Failure isolation: a request is validated before it is queued (:class:`UnknownSession`, :class:`StateLost`,
  :class:`UnknownLayer`, :class:`DtypeUnsupported`, :class:`ShapeMismatch`, :class:`NonFinite`,
  :class:`BadRequest`, :class:`QueueFull`); one that fails never enters a batch and changes no state.
* ``request_timeout_s``: a request that has not started by then fails with :class:`RequestTimeout`; once started
  it completes. Cancelling (``future.cancel()``, :meth:`Engine.cancel`, or cancelling the task awaiting
  :meth:`Engine.conv`) withdraws a request that has not started; one that has started still updates the state.
* Positions (:mod:`.positions`): each session counts the tokens committed per layer; ``position=`` on a
  submit is checked against it at enqueue (409 on a mismatch, nothing queued), and a repeat of the last applied
  request gets its kept answer instead of running twice. ``session_info`` and ``list_sessions`` report them.
* Sessions idle longer than ``session_ttl_s`` are evicted (slot freed); their ids then raise :class:`StateLost`
  (a bounded memory of evicted ids), while deleted and never-created ids raise :class:`UnknownSession`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from typing import Optional, Union

import torch

from convserve.clients.protocol.errors import NotReady
from convserve.state_pool import ConvStatePool, auto_slots, pool_bytes

from ..model import DTYPE_NAMES, ConvModel
from ..scheduler import Scheduler
from ..sessions import SessionTable
from .accepts import Accepts
from .config import EngineConfig
from .intake import Intake
from .loop import BATCH_HIST, STEP_FIELDS, Worker
from .outputs import deliver
from .positions import Positions
from .runner import Runner
from .session_ops import SessionOps, fail_op
from .snapshot import SnapshotTaking, check_content
from .turns import Turns

log = logging.getLogger("convserve.engine")


class _WakingCondition(threading.Condition):
    """The worker's condition; with a pump (:meth:`Engine.set_pump`) a notify from another thread also wakes
    the pump, where the worker waits instead of on this condition."""

    wake = None
    worker_ident = None

    def notify(self, n: int = 1) -> None:
        super().notify(n)
        if self.wake is not None and threading.get_ident() != self.worker_ident:
            self.wake()

    def notify_all(self) -> None:
        super().notify_all()
        if self.wake is not None and threading.get_ident() != self.worker_ident:
            self.wake()


class Engine(Intake, Turns, SessionOps, Accepts, Positions, SnapshotTaking, Worker):
    """See the module docstring. Typical use::

        engine = Engine(ConvModel.random(4, dim=1024), EngineConfig(slots=64), device="cuda")
        engine.start()
        sid = engine.create_session()
        y = engine.submit(sid, layer=0, x=x).result()          # or: y = await engine.conv(sid, 0, x)
        engine.stop()
    """

    def __init__(self, model: ConvModel, config: Optional[EngineConfig] = None,
                 device: Union[str, torch.device] = "cpu"):
        self.config = config or EngineConfig()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_cpu = model
        self.state_dtype = self.config.state_dtype or model.dtype
        self._lock = threading.Lock()
        self._cv = _WakingCondition(self._lock)
        self._pump = None           # see set_pump
        self._sessions = SessionTable(self.config.max_evicted_ids)
        self._sched = Scheduler(self.config.scheduler_config(self.device.type, model.dim))
        self._ops: collections.deque = collections.deque()
        self._seq = itertools.count()
        self._last_seq = -1
        self._state = "new"            # new -> running -> draining | stopping -> stopped
        self._ready = False
        self._thread: Optional[threading.Thread] = None
        # the worker is parked between steps and takes nothing up again before it holds the lock (Worker._wait)
        self._idle = False
        # a caller's thread is running a step on the runner (Worker._step_here_locked): the worker waits meanwhile
        self._caller_step = False
        cst = self.config.caller_step_max_tokens
        # the largest step a caller's thread may run (0: none); see Worker._step_here_locked
        self._caller_tokens = cst if cst is not None else (512 if self.device.type == "cuda" else 0)
        # may an op whose turn is there run on any caller's thread (SessionOps._runs_now_locked), or only on the
        # worker's own (an engine process's pump)? Any on CUDA, where an accept's commit is two asynchronous calls;
        # on the CPU the commit is the torch ops themselves, intra-op parallel, and they stay on the worker's thread
        # and its thread pool (another thread's pool competes with the worker's for the cores)
        self._ops_on_callers = self.device.type == "cuda"
        self.pool: Optional[ConvStatePool] = None
        self.model: Optional[ConvModel] = None
        self._runner: Optional[Runner] = None   # the buffers, kernels and launchers, from start()
        self._next_evict = 0.0
        self._init_positions()
        self._init_snapshots()
        #: extra numbers for stats() under "snapshot" (the snapshot writer's), or None
        self.snapshot_stats = None
        #: called with a list of session ids and ``wait`` before they are imported or deleted, and after they are
        #: evicted or dropped (the snapshot writer's rewind journal), or None; with ``wait`` it returns once the
        #: notes are durable
        self.on_rewind = None
        #: whether an import or delete waits, on the calling thread, for its note to be durable before it is queued
        #: (an engine process, whose calls arrive on the worker thread, answers them once it is instead)
        self.rewind_waits = True
        #: called with the id a :meth:`create_session` or :meth:`fork_session` is about to make (the snapshot
        #: writer's): returns the future of the note of the id's last removal while it is not durable (None when
        #: it is, or there was none), or raises :class:`StateUnwritable`; or None
        self.on_create = None
        # stats (guarded by _lock)
        self._st = collections.Counter()
        self._batch_hist = [0] * (len(BATCH_HIST) + 1)
        self._steps = collections.deque(maxlen=4096)   # tuples of STEP_FIELDS
        # what a client can check the served weights by: the digest once, the file itself when first asked for
        self._weights_sha256 = model.weights_sha256()
        self._weights_file: Optional[bytes] = None

    # ------------------------------------------------------------------ life cycle

    def start(self, snapshot=None) -> int:
        """Allocate the pool and buffers, load the weights, warm the kernels (CUDA: compile and capture the decode
        graphs), restore the sessions of ``snapshot`` (a checked :class:`~..snapshot_file.Snapshot`, see
        :mod:`.snapshot`), start the worker thread; the number of sessions restored. Raises ``RuntimeError`` when
        called twice, PoolError when no slot fits, ValueError when ``snapshot`` does not fit this model."""
        if self._state != "new":
            raise RuntimeError(f"Engine.start: expected a new engine, this one is {self._state}")
        cfg, m, dev = self.config, self.model_cpu, self.device
        if snapshot is not None:       # before anything is allocated: a refused snapshot leaves a new engine
            check_content(snapshot.meta, snapshot.tensors, m.n_layers, m.width, m.dim, self.state_dtype, m.dtype)
        self.model = m.to(dev)
        # the step's buffers, the decode launches' and the verify slots' device x and y (Buffers)
        buf_estimate = 4 * (cfg.max_batch_tokens + 2 * m.n_layers * cfg.decode_buckets[-1]) * m.dim * 4 + \
            2 * 4 * cfg.decode_buckets[-1] * m.dim * 4
        if cfg.slots == "auto":
            slots = auto_slots(m.n_layers, m.dim, m.width, self.state_dtype, dev, cfg.pool_memory_fraction,
                               reserve_bytes=buf_estimate)
            if dev.type == "cuda":     # the runner's per-slot verify x (Buffers.d_spec) shares the memory budget
                state = (m.width - 1) * torch.empty((), dtype=self.state_dtype).element_size()
                spec = cfg.max_spec_tokens * torch.empty((), dtype=m.dtype).element_size()
                slots = max(1, slots * state // (state + spec))
        else:
            slots = cfg.slots
        try:
            self.pool = ConvStatePool(m.n_layers, slots, m.dim, m.width, self.state_dtype, dev)
        except (RuntimeError, MemoryError) as e:      # out of host or device memory: say which setting to lower
            need = pool_bytes(m.n_layers, slots, m.dim, m.width, self.state_dtype)
            raise RuntimeError(f"slots: the state pool of {slots} slots ({need / 2**30:.1f} GiB on {dev}) could "
                               f"not be allocated ({type(e).__name__}: {str(e)[:160]}); lower --slots, or use "
                               "--slots auto (sized by pool_memory_fraction)") from e
        self._runner = Runner(self.model, self.pool, cfg, dev)
        restored = 0
        if snapshot is not None:
            restored = self._restore(snapshot.meta, snapshot.tensors)
        self._next_evict = time.monotonic() + self._evict_interval()
        with self._lock:
            self._state = "running"
        self._thread = threading.Thread(target=self._worker, name="convserve-engine", daemon=True)
        self._thread.start()
        self._ready = True
        ps = self._runner.prefill_slots
        log.info("engine started on %s: %s, %d slots (%.1f MiB pool), state %s, %d decode graphs, %d prefill slot "
                 "graphs", dev, m, slots, self.pool.nbytes / 2**20, self.state_dtype, self._runner.decode.n_graphs,
                 ps.n_graphs if ps is not None else 0)
        return restored

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop intake (new calls raise :class:`NotReady`); with ``drain`` finish every queued request and session
        op first, else fail them with :class:`NotReady`. Joins the worker; when ``timeout`` passes before the
        drain completes, the rest is failed. The step in flight always completes."""
        with self._lock:
            if self._state in ("new", "stopped"):
                self._state = "stopped"
                self._ready = False
                return
            self._ready = False
            self._state = "draining" if drain else "stopping"
            withdrawn = None if drain else self._withdraw_all_locked()
            self._cv.notify_all()
        if withdrawn:
            self._fail_withdrawn(withdrawn, "the engine stopped before this request ran")
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:
                self._state = "stopping"
                withdrawn = self._withdraw_all_locked()
                self._cv.notify_all()
            self._fail_withdrawn(withdrawn, "the engine stopped (drain timeout) before this request ran")
            self._thread.join()
        with self._lock:
            self._state = "stopped"

    def _withdraw_all_locked(self):
        failed = self._sched.drain()
        for r in failed:
            self._retire_locked(r, ok=False, withdrawn=True)
        ops = list(self._ops)
        self._ops.clear()
        for op in ops:
            op.cancelled = True
            self._op_done_locked(op)
        return failed, ops

    def _fail_withdrawn(self, withdrawn, why: str) -> None:
        failed, ops = withdrawn
        for op in ops:
            fail_op(op, NotReady(why))
        self._deliver_turns()
        deliver([(r, None, NotReady(why)) for r in failed])

    def set_pump(self, pump, wake) -> None:
        """Let the worker thread serve a message source between steps (an engine process's socket), so that one
        thread does both and no GIL is passed between them. ``pump(timeout)`` handles what has arrived, waiting
        up to ``timeout`` seconds for it; it is called without the engine lock, before every step and wherever the
        worker would wait. ``wake()`` (any thread) makes a waiting ``pump`` return: it is called when another
        thread queues work. Call before :meth:`start`."""
        self._pump = pump
        self._cv.wake = wake

    @property
    def ready(self) -> bool:
        """True once the pool is allocated and the kernels are warm, until stop()."""
        return self._ready and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict:
        """``{"layers", "dim", "width", "dtype", "state_dtype", "activation", "weights_sha256", "bias_layers",
        "seed", "slots": {"total", "free"}}``; ``slots.total`` counts allocatable slots (the null slot not
        included), ``weights_sha256`` digests :meth:`model_weights`, ``seed`` is None for weights from a file."""
        m = self.model_cpu
        with self._lock:
            total = self.pool.capacity if self.pool is not None else (
                self.config.slots if isinstance(self.config.slots, int) else 0)
            free = self.pool.free_count if self.pool is not None else total
        return {"layers": list(m.layers), "dim": m.dim, "width": m.width, "dtype": DTYPE_NAMES[m.dtype],
                "state_dtype": DTYPE_NAMES[self.state_dtype], "activation": m.activation,
                "weights_sha256": self._weights_sha256, "bias_layers": m.bias_layers, "seed": m.seed,
                "slots": {"total": total, "free": free}}

    def model_weights(self) -> bytes:
        """The served conv weights and biases as the canonical safetensors file (``protocol.weights``), whose
        sha256 is ``model_info()["weights_sha256"]``; built on the first call and kept (a race builds it twice,
        to the same bytes)."""
        if self._weights_file is None:
            self._weights_file = self.model_cpu.canonical_safetensors()
        return self._weights_file

    def stats(self) -> dict:
        """Counters for metrics and benchmarks. Times in seconds, sizes in bytes. ``batch_size`` is a histogram
        ``{"buckets": {le: cumulative count}, "sum", "count"}`` of rows per step."""
        with self._lock:
            st = dict(self._st)
            pool, runner = self.pool, self._runner
            cum, hist = 0, {}
            for le, c in zip(BATCH_HIST + (math.inf,), self._batch_hist):
                cum += c
                hist[le] = cum
            out = {
                "queue_depth": self._sched.depth,
                "queued_tokens": self._sched.queued_tokens,
                "prefill_budget_tokens": self._sched.config.max_prefill_tokens_per_step,   # resolved from "auto"
                "ops_queued": len(self._ops),
                "sessions": len(self._sessions),
                "slots_total": pool.capacity if pool else 0,
                "slots_in_use": pool.in_use if pool else 0,
                "slots_free": pool.free_count if pool else 0,
                "slots_peak": pool.peak if pool else 0,
                "steps": st.get("steps", 0),
                "requests": st.get("requests", 0),
                "tokens": st.get("tokens", 0),
                "requests_failed": st.get("failed", 0),
                "requests_cancelled": st.get("cancelled", 0),
                "requests_expired": st.get("expired", 0),
                "sessions_evicted": st.get("evicted", 0),
                "sessions_dropped": st.get("sessions_dropped", 0),
                "answers_kept": len(self._answers),
                "decode_rows": st.get("decode_rows", 0),
                "batch_requests": st.get("batches", 0),
                # batch requests launched from a batch slot (one graph replay); the rest went through the arena
                "batch_requests_in_slots": st.get("batches_in_slots", 0),
                # plain decode batches copied to the device from their caller's page-locked memory and y back
                # over it (an engine process's arena blocks): no host copy in the engine
                "batch_requests_direct": st.get("batches_direct", 0),
                # verify-only batches launched from a verify slot (one graph replay); the rest joined the layer's
                # verify launch
                "batch_requests_in_verify_slots": st.get("batches_in_verify_slots", 0),
                # batches without verify rows launched from a prefill slot (one graph replay); the rest joined
                # the layer's prefill launch
                "batch_requests_in_prefill_slots": st.get("batches_in_prefill_slots", 0),
                "decode_padded_rows": st.get("padded_rows", 0),
                # steps run by the thread that submitted their request (Worker._step_here_locked)
                "caller_steps": st.get("caller_steps", 0),
                "pad_ratio": st.get("padded_rows", 0) / max(1, st.get("padded_rows", 0) + st.get("decode_rows", 0)),
                "kernel_time_s": st.get("kernel_ns", 0) * 1e-9,
                "host_time_s": st.get("host_ns", 0) * 1e-9,
                "step_time_s": st.get("wall_ns", 0) * 1e-9,
                "batch_size": {"buckets": hist, "sum": st.get("rows", 0), "count": st.get("steps", 0)},
                "last_step": dict(zip(STEP_FIELDS, self._steps[-1])) if self._steps else {},
                "bytes": {
                    "pool": pool.nbytes if pool else 0,
                    "weights": self.model.nbytes() if self.model is not None else 0,
                    "buffers": runner.bufs.nbytes()["total"] if runner else 0,
                    "graphs": runner.graph_bytes if runner else 0,
                    "answers": self._answer_bytes,
                },
                "cuda_graphs": runner.n_graphs if runner else 0,
                "multi_layer_launches": runner.decode.multi_layer_runs if runner else 0,
                # steps whose result buffer was still held by callers, so a fresh one was allocated
                "outputs_fresh": runner.bufs.outputs.fresh if runner else 0,
            }
        if self.snapshot_stats is not None:
            out["snapshot"] = self.snapshot_stats()
        return out

    def recent_steps(self) -> list:
        """The last (up to 4096) steps as dicts (for benchmarks): ``rows``, ``tokens``; ``host_s`` = ``sched_s``
        (pick and pack the step) + ``launch_s`` (stage inputs, launch, start the copies back) + ``deliver_s``
        (cut results, wake callers); ``kernel_s`` (GPU time between the first and last launch, CUDA events, on
        every ``gpu_timing_interval``-th step, else None; on the CPU the torch ops' time); ``wall_s`` (all of
        it, including the wait for the GPU)."""
        with self._lock:
            return [dict(zip(STEP_FIELDS, s)) for s in self._steps]

    def _check_running_locked(self) -> None:
        if self._state != "running":
            raise NotReady("the engine is not running (starting or shutting down); retry shortly",
                           retry_after=1.0)
