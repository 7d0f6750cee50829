"""The engine's knobs and their defaults: :class:`EngineConfig` is the one place they are written. The
scheduler's config is derived from it (:meth:`EngineConfig.scheduler_config`) and the HTTP settings take their
engine defaults from :data:`DEFAULTS`.

Importing this module needs neither torch nor the kernels (the CLI reads the defaults for ``--help``): what
needs them is imported where it is used.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

    from ..scheduler import SchedulerConfig


def _dtype(v, what: str) -> "torch.dtype":
    import torch

    from ..model import DTYPE_NAMES, MODEL_DTYPES

    by_name = {name: dt for dt, name in DTYPE_NAMES.items()}
    if isinstance(v, torch.dtype) and v in MODEL_DTYPES:
        return v
    if isinstance(v, str) and v in by_name:
        return by_name[v]
    raise ValueError(f"{what}: expected one of {list(by_name)}, got {v!r}")


#: ``max_prefill_tokens_per_step="auto"``: prefill elements (tokens x dim) per step by device type, so that a
#: step, and every decode waiting behind it, stays short. On the CPU the prefill's own arithmetic bounds a step;
#: on a GPU the host's copies of x and y do (8 MiB of bf16 each way at 2^22). The costs behind both numbers are
#: in bench/NOTES.md, *Isolation under load*.
PREFILL_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 22}


@dataclass
class EngineConfig:
    """Engine knobs. The HTTP layer's settings fill these; the defaults serve a single GPU well."""

    slots: Union[int, str] = 256                 # session slots in the pool, or "auto" (pool_memory_fraction)
    state_dtype: Optional[Union["torch.dtype", str]] = None  # None: the model dtype. The state holds past
    #                                              inputs, which are cast to the model dtype, so that is lossless.
    max_batch_tokens: int = 8192                 # tokens per step (longer prefills run in chunks)
    max_batch_size: int = 256                    # rows per step
    max_queue_delay_us: int = 200                # how long a step waits to fill
    max_prefill_tokens_per_step: Union[int, str] = "auto"  # prefill tokens of one step (chunks of longer
    #                                              ones run in later steps), so that a step, and with it every
    #                                              decode queued behind it, stays short; "auto": see
    #                                              prefill_budget (by device and dim)
    decode_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # padded decode sizes (one CUDA graph
    #                                              per layer and bucket); the largest bounds decode rows per layer
    max_queue: int = 4096                        # queued requests before QueueFull
    session_ttl_s: float = 3600.0                # idle seconds before a session is evicted
    request_timeout_s: float = 30.0              # queue wait before RequestTimeout; also bounds session ops
    use_cuda_graphs: bool = True                 # replay decode buckets from CUDA graphs (CUDA only)
    multi_layer_decode: bool = True              # a step's decodes of several layers in one launch (stacked
    #                                              weights, one table of state lines), when they fit a bucket;
    #                                              off: one launch per layer (less graph memory at start-up)
    gpu_timing_interval: int = 16                # CUDA: time the GPU with events on every Nth step (event
    #                                              records cost host time on the step's path); the counters
    #                                              scale the sample (1: time every step)
    max_spec_tokens: int = 16                    # most tokens of one speculative verify
    verify_slots: bool = True                    # a verify-only batch with one length per row (one of
    #                                              verify_graph_tokens) launches from a verify slot (CUDA: one
    #                                              graph replay; see Buffers), else from the token arena with
    #                                              the layer's other verify rows
    verify_graph_tokens: Sequence[int] = (2, 3, 4, 5, 6, 7, 8)   # the verify lengths that have verify-slot
    #                                              launches (CUDA: warmed and captured as graphs at start, per
    #                                              slot, layer and bucket)
    prefill_slots: bool = True                   # a batch without verify rows launches from a prefill slot
    #                                              (its x staged into one half of the token arena; CUDA: one
    #                                              graph replay per slot, layer and token bucket; see Buffers),
    #                                              else with the layer's other prefill rows
    caller_step_max_tokens: Optional[int] = None  # the largest step a submitting thread runs itself when the
    #                                              worker is parked and the step would start at once (a batch,
    #                                              a steady lone caller): no hand-off to the worker and back;
    #                                              0: every step on the worker thread; None: 512 on CUDA, 0 on
    #                                              the CPU (whose steps are torch ops on the worker's threads)
    check_finite: bool = True                    # reject x with NaN/Inf (NonFinite) instead of poisoning state
    pool_memory_fraction: float = 0.5            # slots="auto": this share of free device memory
    max_evicted_ids: int = 65536                 # evicted ids remembered (StateLost rather than UnknownSession),
    #                                              and as many removed ids' request counters (LateRequest)
    request_clients_kept: int = 8                # per session, the clients (PREFIX of PREFIX:N request ids)
    #                                              whose highest N is kept: a late copy of a client dropped
    #                                              from them is not refused (LateRequest)
    verify_ids_kept: int = 16                    # per session and layer, the last verifies' other request ids
    #                                              kept to refuse their late copies
    answer_store_bytes: int = 64 << 20           # answers of position-carrying requests kept for their retries
    #                                              (oldest dropped first past this; see engine/positions.py)

    def __post_init__(self):
        if isinstance(self.slots, str):
            if self.slots != "auto":
                raise ValueError(f"slots: expected an int >= 1 or 'auto', got {self.slots!r}")
        elif isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots: expected an int >= 1 or 'auto', got {self.slots!r}")
        if self.state_dtype is not None:
            self.state_dtype = _dtype(self.state_dtype, "state_dtype")
        self.decode_buckets = tuple(sorted(set(int(b) for b in self.decode_buckets)))
        self.verify_graph_tokens = tuple(sorted(set(int(k) for k in self.verify_graph_tokens)))
        if self.verify_graph_tokens and self.verify_graph_tokens[0] < 1:
            raise ValueError(f"verify_graph_tokens: expected token counts >= 1, got {self.verify_graph_tokens}")
        if self.answer_store_bytes < 0:
            raise ValueError(f"answer_store_bytes: expected >= 0, got {self.answer_store_bytes}")
        if self.caller_step_max_tokens is not None and self.caller_step_max_tokens < 0:
            raise ValueError(f"caller_step_max_tokens: expected >= 0, got {self.caller_step_max_tokens}")
        for name in ("max_queue", "max_spec_tokens", "max_evicted_ids", "gpu_timing_interval", "request_clients_kept",
                     "verify_ids_kept"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_spec_tokens > self.max_batch_tokens:
            raise ValueError(f"max_spec_tokens ({self.max_spec_tokens}) exceeds max_batch_tokens "
                             f"({self.max_batch_tokens}): a verify runs in one step")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s: expected > 0, got {self.session_ttl_s}")
        if not 0 < self.pool_memory_fraction <= 1:
            raise ValueError(f"pool_memory_fraction: expected in (0, 1], got {self.pool_memory_fraction}")
        b = self.max_prefill_tokens_per_step
        if b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"max_prefill_tokens_per_step: expected an int >= 1 or 'auto', got {b!r}")
        self.scheduler_config()  # validates the batching knobs

    def prefill_budget(self, device_type: Optional[str] = None, dim: Optional[int] = None) -> int:
        """``max_prefill_tokens_per_step`` as a number of tokens, at most ``max_batch_tokens``. ``"auto"`` bounds
        the elements (tokens x dim) of a step's prefill rows by :data:`PREFILL_ELEMENTS` of the device type, so
        a step takes about the same time at any dim, in whole multiples of 16 tokens (a step's launches are
        padded to 16 tokens); without a known device type or dim it is ``max_batch_tokens`` (no bound)."""
        b = self.max_prefill_tokens_per_step
        if b == "auto":
            per = PREFILL_ELEMENTS.get(device_type or "")
            if per is None or not dim:
                return self.max_batch_tokens
            b = max(16, per // dim // 16 * 16)
        return min(b, self.max_batch_tokens)

    def scheduler_config(self, device_type: Optional[str] = None, dim: Optional[int] = None) -> "SchedulerConfig":
        """The scheduler's knobs: these fields of this config (the scheduler has no defaults of its own), the
        prefill budget resolved for ``device_type`` and ``dim`` (see :meth:`prefill_budget`)."""
        from ..scheduler import SchedulerConfig

        return SchedulerConfig(self.max_batch_tokens, self.max_batch_size, self.max_queue_delay_us,
                               self.decode_buckets, self.request_timeout_s, self.prefill_budget(device_type, dim))

    @classmethod
    def from_settings(cls, settings: Any, **overrides) -> "EngineConfig":
        """Take every field this config has from an object with the same attribute names (the HTTP settings)."""
        kw = {f.name: getattr(settings, f.name) for f in fields(cls) if getattr(settings, f.name, None) is not None}
        kw.update(overrides)
        return cls(**kw)


#: every field's default, by name (``DEFAULTS.max_batch_size``), read off the class: no EngineConfig is built,
#: so reading it imports nothing more
DEFAULTS = types.SimpleNamespace(**{f.name: f.default for f in fields(EngineConfig)})
