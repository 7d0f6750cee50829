"""The serving engine (moved to :mod:`.core`, to be split)."""

from .core import BATCH_SLOTS, DecodeLaunchers, Engine, EngineConfig, _OutputRing, all_finite  # noqa: F401
