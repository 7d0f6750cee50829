"""EngineConfig: validation, building it from the HTTP settings, and its defaults as the only ones (the scheduler's
config and the settings' engine fields take theirs from it)."""

import copy
import dataclasses
import os

import pytest
import torch

from convserve.service.config import Settings
from convserve.service.engine import DEFAULTS, EngineConfig
from convserve.service.scheduler import SchedulerConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CONVSERVE_"):
            monkeypatch.delenv(k)


def _same(a, b) -> bool:
    return (tuple(a) == tuple(b)) if isinstance(a, (list, tuple)) else a == b


def test_the_settings_engine_defaults_are_the_engine_configs():
    engine = EngineConfig()
    shared = [f.name for f in dataclasses.fields(EngineConfig) if f.name in Settings.model_fields]
    assert len(shared) >= 15                       # every engine knob the service exposes
    drift = {name: (Settings.model_fields[name].default, getattr(engine, name)) for name in shared
             if not _same(Settings.model_fields[name].default, getattr(engine, name))}
    assert not drift, f"Settings defaults differ from EngineConfig's: {drift}"
    assert EngineConfig.from_settings(Settings()) == engine


def test_defaults_read_off_the_class_are_an_engine_configs():
    engine = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert _same(getattr(DEFAULTS, f.name), getattr(engine, f.name)), f.name


def test_the_scheduler_config_is_derived_from_the_engine_config_and_has_no_defaults():
    for f in dataclasses.fields(SchedulerConfig):
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name
    engine = EngineConfig(max_batch_tokens=512, max_batch_size=8, max_queue_delay_us=7, decode_buckets=(4, 1, 2),
                          request_timeout_s=2.5, max_prefill_tokens_per_step=48)
    sched = engine.scheduler_config()
    for f in dataclasses.fields(SchedulerConfig):
        assert _same(getattr(sched, f.name), getattr(engine, f.name)), f.name


@pytest.mark.parametrize("kw", [dict(slots=0), dict(slots="many"), dict(state_dtype="float64"),
                                dict(max_spec_tokens=0), dict(max_spec_tokens=100, max_batch_tokens=64),
                                dict(decode_buckets=()), dict(session_ttl_s=0), dict(max_queue=0),
                                dict(gpu_timing_interval=0)])
def test_bad_engine_config_is_rejected(kw):
    with pytest.raises(ValueError):
        EngineConfig(**kw)


def test_engine_config_from_settings_like_object():
    class S:
        slots = 32
        max_batch_tokens = 1024
        decode_buckets = [4, 1, 2]
        state_dtype = "float32"
        session_ttl_s = 10.0
        unrelated = "x"

    cfg = EngineConfig.from_settings(S())
    assert cfg.slots == 32 and cfg.decode_buckets == (1, 2, 4) and cfg.state_dtype == torch.float32
    assert cfg.max_batch_tokens == 1024 and cfg.session_ttl_s == 10.0
    assert copy.copy(cfg) == cfg


@pytest.mark.parametrize("max_spec_tokens", [1, 8, 16])
def test_slots_auto_on_the_cpu_is_1024_whatever_the_verify_length(max_spec_tokens):
    """On the CPU there is no free-memory reading to share with the verify buffers: auto is the fixed count."""
    from tests.engine_support import make_engine

    e = make_engine(slots="auto", max_spec_tokens=max_spec_tokens)
    try:
        assert e.stats()["slots_total"] == 1024
    finally:
        e.stop(drain=False)
