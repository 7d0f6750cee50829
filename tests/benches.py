"""The benchmark scripts of ``bench/`` as modules, for the tests that run them on CPU."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """``bench/<name>.py`` imported as module ``name``: registered in ``sys.modules`` (the scripts' spawned
    processes find their functions by name) with ``bench/`` on the path (the scripts import their siblings)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
