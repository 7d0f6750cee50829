"""docs/client.md's *A frontend's step loop* runs as it stands against a real server, in both layouts: one
WebSocket, the layers of a step one after another's answer, a sealed arena, a verify step's accept pipelined."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.live import LiveServer

DOC = Path(__file__).resolve().parents[1] / "docs" / "client.md"

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="a sealed arena needs Linux")


def _block() -> str:
    text = DOC.read_text()
    section = text[text.index("## A frontend's step loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("layout", [["--workers", "0"], ["--workers", "1"]], ids=["in-process", "engine-process"])
def test_the_docs_frontend_loop_runs_and_leaves_the_positions_it_says(layout):
    srv = LiveServer(["--layers", "0,2,5", "--dim", "64", "--dtype", "bfloat16", "--client-shm", *layout])
    try:
        code = _block()
        assert 'URL = "http://127.0.0.1:8000"' in code
        ns: dict = {}
        exec(compile(code.replace("http://127.0.0.1:8000", srv.url), str(DOC), "exec"), ns)
        kept = dict(zip(ns["sessions"], [2, 4, 0, 1]))
        assert ns["final"] == {s: [16 + 3 + k + 1] * 3 for s, k in kept.items()}
    finally:
        srv.kill()
