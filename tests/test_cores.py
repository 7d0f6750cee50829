"""service.cores: the CPUs a process may use, the affinity mask capped by the cgroup's CPU limit."""

from __future__ import annotations

import os

import pytest

from convserve.service import cores as cores_mod
from convserve.service.config import load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CONVSERVE_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("files,cores,want", [
    ({"v2": "200000 100000"}, 16, 2),                  # docker --cpus 2
    ({"v2": "150000 100000"}, 16, 2),                  # 1.5 CPUs: rounded up
    ({"v2": "max 100000"}, 16, 16),                    # no limit
    ({"v2": "800000 100000"}, 4, 4),                   # a limit above the affinity mask: the mask
    ({"q1": "300000", "p1": "100000"}, 16, 3),         # cgroup v1
    ({"q1": "-1", "p1": "100000"}, 16, 16),
    ({}, 16, 16),                                      # nothing readable
    ({"v2": "garbage"}, 16, 16),
])
def test_usable_cores_is_the_affinity_mask_capped_by_the_cgroup_cpu_limit(tmp_path, monkeypatch, files, cores, want):
    paths = {k: tmp_path / k for k in ("v2", "q1", "p1")}
    for k, v in files.items():
        paths[k].write_text(v + "\n")
    monkeypatch.setattr(cores_mod, "CGROUP_CPU_FILES", (str(paths["v2"]), (str(paths["q1"]), str(paths["p1"]))))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert cores_mod.usable_cores() == want
    assert load_settings({"workers": "auto"}).resolved_workers(1) == max(1, min(8, want - 1))
