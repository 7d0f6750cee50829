"""Packaging: the wheel holds one top-level package, the plain install is the client side, and that side runs
without torch, triton or a web server.

The wheel is built from a copy of the source tree (a stale ``build/`` in the checkout could otherwise add files
that no longer exist), installed into a fresh virtual environment with its dependencies, and that environment
drives a real server: ``python -m convserve.clients`` and ``convserve-loadtest --verify``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.live import LiveServer

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "docs", "src", "kernels", "state_pool", "service", "clients")
SERVER_ONLY = ("torch", "triton", "fastapi", "uvicorn", "pydantic_settings", "prometheus_client")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc",
                                                                                            "*.egg-info"))
        else:
            shutil.copy2(src, tree / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(tree)], check=True, capture_output=True, text=True, timeout=300)
    (whl,) = out.glob("convserve-*.whl")
    return whl


def _metadata(whl: Path) -> str:
    with zipfile.ZipFile(whl) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_the_wheel_puts_only_convserve_at_the_top_of_site_packages(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"convserve", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for pkg in ("kernels", "state_pool", "service", "clients", "clients/protocol", "clients/loadtest"):
        assert f"convserve/{pkg}/__init__.py" in names
    # every module of the checkout is in the wheel, under the namespace
    for folder in ("kernels", "state_pool", "service", "clients"):
        for py in (ROOT / folder).rglob("*.py"):
            assert f"convserve/{py.relative_to(ROOT).as_posix()}" in names, py


def test_the_plain_install_requires_nothing_of_the_server(wheel):
    plain = [line.split(":", 1)[1].strip() for line in _metadata(wheel).splitlines()
             if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert plain, "the plain install has no dependencies at all"
    for dep in plain:
        name = dep.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        assert name.replace("-", "_") not in SERVER_ONLY, dep
    server = [line for line in _metadata(wheel).splitlines() if 'extra == "server"' in line]
    for pkg in ("torch", "triton", "fastapi", "uvicorn"):
        assert any(f"Requires-Dist: {pkg}" in line for line in server), pkg


@pytest.fixture(scope="module")
def client_venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("client-venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return env_dir


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_the_client_side_installs_and_runs_without_torch(client_venv, tmp_path):
    py = client_venv / "bin" / "python"
    probe = ("import importlib.util as u, sys\n"
             f"missing = [m for m in {SERVER_ONLY!r} if u.find_spec(m) is not None]\n"
             "assert not missing, f'server packages installed: {missing}'\n"
             "import convserve, convserve.clients.client, convserve.clients.loadtest.cli, convserve.clients.protocol\n"
             "for top in ('kernels', 'service', 'clients', 'state_pool'):\n"
             "    assert u.find_spec(top) is None, top\n"
             "print(convserve.__version__)\n")
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0.1.0"

    weights = tmp_path / "w.safetensors"
    from convserve.service.model import ConvModel
    import torch

    ConvModel.random(layers=[1, 3], dim=64, width=4, dtype=torch.bfloat16, seed=3).save_safetensors(weights)
    srv = LiveServer(["--weights", str(weights), "--slots", "16"])
    try:
        env = {**os.environ, "CONVSERVE_URL": srv.url}
        r = subprocess.run([str(py), "-m", "convserve.clients", "conv", "--tokens", "5", "--dtype", "bfloat16"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["y"]["shape"] == [5, 64] and out["y"]["dtype"] == "bfloat16"

        report = tmp_path / "lt"
        r = subprocess.run([str(client_venv / "bin" / "convserve-loadtest"), "--url", srv.url, "--scenario", "spec",
                            "--concurrency", "4", "--requests", "120", "--prefill", "uniform:4:24", "--decode",
                            "const:6", "--warmup", "0", "--verify", str(weights), "--verify-sample", "1",
                            "--fail-on-errors", "--no-progress", "--out", str(report)],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        (step,) = json.loads((report / "loadtest.json").read_text())["steps"]
        assert step["verify"]["checked"] >= 90 and step["verify"]["mismatches"] == 0, step["verify"]
        # no matplotlib on the client side: the report page says how to get the plot instead of failing
        assert not (report / "loadtest.png").exists()
        assert "convserve[loadtest]" in (report / "loadtest.html").read_text()
    finally:
        srv.kill()
