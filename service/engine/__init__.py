"""The serving engine: one per device (:class:`Engine`, semantics in :mod:`.core`).

Two sides, which meet at the scheduler's queue and at the results of a step:

* accept and deliver (callers' threads): :mod:`.intake` validates (:mod:`.validate`), stages and queues conv
  requests; :mod:`.session_ops` queues session operations; :mod:`.outputs` holds the futures and hands a step's
  results to them.
* schedule and run (the worker thread): :mod:`.loop` picks each step from the scheduler and runs the ready
  session operations; :mod:`.runner` executes a step (pack, launch, copy out, unpack) in the memory of
  :mod:`.buffers` with the decode launchers of :mod:`.cuda_graphs`. The runner holds no futures and takes no
  engine lock.

:mod:`.config` holds :class:`EngineConfig`, the one source of the engine's defaults; :mod:`.records` the
engine's request records. ``from convserve.service.engine import EngineConfig`` imports neither torch nor the
kernels; the other names load :mod:`.core` on first use.
"""

from .config import DEFAULTS, EngineConfig

#: the names this package exports: module of each (loaded on first access)
_LAZY = {
    "Engine": ".core",
    "all_finite": ".validate",
    "BATCH_SLOTS": ".buffers",
    "OutputRing": ".buffers",
    "Buffers": ".buffers",
    "DecodeLaunchers": ".cuda_graphs",
    "Runner": ".runner",
    "ConvFuture": ".outputs",
    "AsyncConvFuture": ".outputs",
}

__all__ = ["DEFAULTS", "EngineConfig", *_LAZY]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
