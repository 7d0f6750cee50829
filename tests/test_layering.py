"""The package layering: one ``convserve`` namespace, kernels <- state_pool <- service, and a client side that
imports nothing of the server (the contracts are ``[tool.importlinter]`` in pyproject.toml)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL_IMPORT = re.compile(r"^\s*(from|import)\s+(kernels|state_pool|service|clients)(\.|\s|$)", re.M)


def test_import_linter_contracts_are_kept():
    r = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_no_module_imports_a_folder_by_its_top_level_name():
    offenders = []
    for folder in ("kernels", "state_pool", "service", "clients", "tests", "bench"):
        for py in (ROOT / folder).rglob("*.py"):
            for m in TOP_LEVEL_IMPORT.finditer(py.read_text()):
                offenders.append(f"{py.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not offenders, "import through convserve.<package> instead:\n" + "\n".join(offenders)
