"""The workers' shared-memory arenas: blocks are reused, and never while anything still reads them."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.cluster.shm import MIN_BLOCK, Arena, ArenaMap


@pytest.fixture
def arena(tmp_path):
    a = Arena(str(tmp_path / "arena-w0-g1"), 1 << 20)
    yield a
    a.close()


@pytest.mark.parametrize("nbytes", [1, 100, MIN_BLOCK, MIN_BLOCK + 1, 65536, 300_000])
def test_a_released_block_is_handed_out_again(arena, nbytes):
    off, lease = arena.lease(nbytes)
    assert lease.nbytes == nbytes and arena.in_use == 1
    del lease
    gc.collect()
    assert arena.in_use == 0
    off2, lease2 = arena.lease(nbytes)
    assert off2 == off and arena.reused == 1


@pytest.mark.parametrize("holder", ["tensor", "view", "memoryview", "wire"])
def test_a_block_is_not_reused_while_a_response_still_reads_it(arena, holder):
    off, lease = arena.lease(4 * 64)
    y = torch.from_numpy(lease).view(torch.float32).view(4, 16)
    y.copy_(torch.arange(64, dtype=torch.float32).view(4, 16))
    keep = {"tensor": lambda: y, "view": lambda: y[1:3].t(), "memoryview": lambda: memoryview(y.numpy()),
            "wire": lambda: wire.encode_tensor(y)["data"]}[holder]()
    del lease, y
    gc.collect()
    assert arena.in_use == 1
    others = [arena.lease(4 * 64) for _ in range(8)]       # the same size class, all while `keep` lives
    assert off not in [o for o, _ in others]
    first = float(keep.reshape(-1)[0]) if isinstance(keep, torch.Tensor) else np.frombuffer(keep, np.float32)[0]
    assert first == (16 if holder == "view" else 0)        # still what the engine wrote
    del keep, others
    gc.collect()
    assert arena.in_use == 0


def test_a_full_arena_hands_out_nothing_and_counts_the_miss(tmp_path):
    a = Arena(str(tmp_path / "arena-w0-g1"), 4 * MIN_BLOCK)
    held = [a.lease(MIN_BLOCK) for _ in range(4)]
    assert a.lease(1) is None and a.inline == 1
    assert a.lease(8 * MIN_BLOCK) is None and a.inline == 2
    held.pop()
    gc.collect()
    assert a.lease(MIN_BLOCK) is not None
    a.close()


def test_an_engine_sees_what_the_worker_wrote_and_the_worker_sees_its_answer(arena, tmp_path):
    off, lease = arena.lease(256)
    lease[:] = np.arange(256, dtype=np.uint8)
    base = ArenaMap(str(tmp_path)).get("arena-w0-g1")
    assert bytes(base[off:off + 256]) == bytes(range(256))
    base[off:off + 256] = 7
    assert (lease == 7).all()


def test_an_engine_drops_the_arena_of_a_restarted_worker(tmp_path):
    a1, a2 = Arena(str(tmp_path / "arena-w3-g1"), 1 << 16), Arena(str(tmp_path / "arena-w3-g2"), 1 << 16)
    maps = ArenaMap(str(tmp_path))
    maps.get("arena-w3-g1")
    maps.get("arena-w3-g2")
    assert list(maps._maps) == ["arena-w3-g2"]
    with pytest.raises(ValueError):
        maps.get("../status")
    a1.close()
    a2.close()


def test_a_late_message_of_a_replaced_worker_generation_leaves_the_current_arena_mapped(tmp_path):
    from convserve.clients.protocol.errors import NotReady

    arenas = [Arena(str(tmp_path / f"arena-w3-g{g}"), 1 << 16) for g in (1, 2, 10)]
    maps = ArenaMap(str(tmp_path))
    current = maps.get("arena-w3-g2")
    with pytest.raises(NotReady, match="restarted"):
        maps.get("arena-w3-g1")
    assert maps.get("arena-w3-g2") is current and list(maps._maps) == ["arena-w3-g2"]
    maps.get("arena-w3-g10")                  # generations compare as numbers
    with pytest.raises(NotReady):
        maps.get("arena-w3-g2")
    assert list(maps._maps) == ["arena-w3-g10"]
    for a in arenas:
        a.close()


def test_a_block_the_filesystem_cannot_back_goes_inline_instead_of_being_carved(arena, monkeypatch):
    import errno
    import os

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert arena.lease(65536) is None and arena.inline == 1 and arena.in_use == 0
    monkeypatch.undo()
    off, lease = arena.lease(65536)          # room again: the same space is carved, nothing was lost
    assert off == 0 and arena.in_use == 1


_SMALL_TMPFS = r"""
import os, subprocess, sys
d = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], check=True)
from convserve.service.cluster.shm import Arena
a = Arena(os.path.join(d, "arena-w0-g1"), 4 << 20)       # a 4 MiB arena on a 1 MiB tmpfs (sparse: it fits)
got, held = [], []
for _ in range(6):                                      # each block written in full and held, as requests' x are
    r = a.lease(256 << 10)
    if r is not None:
        r[1][:] = 7
        held.append(r)
    got.append(r is not None)
print(got, a.inline)
"""


def test_an_arena_larger_than_its_tmpfs_never_kills_the_worker_with_sigbus(tmp_path):
    import shutil
    import subprocess
    import sys

    if os_geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs in a private mount namespace")
    d = tmp_path / "small"
    d.mkdir()
    script = tmp_path / "small_tmpfs.py"
    script.write_text(_SMALL_TMPFS)
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(script), str(d)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "mount" in r.stderr and "Traceback" in r.stderr and "CalledProcessError" in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr[-200:]}")
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])      # -7 was SIGBUS at the first write past 1 MiB
    got, inline = r.stdout.strip().rsplit(" ", 1)
    assert got.startswith("[True, True, True") and "False" in got and int(inline) >= 1


def os_geteuid() -> int:
    import os

    return os.geteuid()


def test_a_conv_naming_an_arena_whose_run_directory_is_gone_is_not_ready_not_an_engine_failure(tmp_path):
    # the supervisor killed with -9: its children remove the run directory while a request is still on its way
    import types

    from convserve.clients.protocol.errors import NotReady
    from convserve.service.cluster.engine_proc import EngineProcess

    fake = types.SimpleNamespace(dtypes={"float32": torch.float32}, arenas=ArenaMap(str(tmp_path / "gone")),
                                 index=0, engine=types.SimpleNamespace(model_cpu=types.SimpleNamespace(dim=8)))
    head = {"k": 1, "i": 7, "d": "float32", "n": 1, "a": "arena-w0-g1", "o": 0}
    with pytest.raises(NotReady, match="supervisor is gone"):
        EngineProcess._conv(fake, b"w0", head, None)


@pytest.mark.parametrize("seed", range(4))
def test_carved_blocks_never_straddle_a_page_locked_chunk(tmp_path, monkeypatch, seed):
    """Blocks of mixed sizes, some released and reused: a block of at most a chunk lies in one chunk (with CHUNK
    made small, to cross many), and no two held blocks overlap."""
    import random

    from convserve.service.cluster import shm

    monkeypatch.setattr(shm, "CHUNK", 1 << 16)
    rng = random.Random(seed)
    a = Arena(str(tmp_path / "arena-w0-g1"), 1 << 26)
    held = []
    try:
        for _ in range(300):
            got = a.lease(rng.choice([1, 5000, 9000, 40_000, 70_000, 200_000]))
            if got is None:
                break
            off, lease = got
            if shm._size_class(lease.nbytes) <= shm.CHUNK:
                assert off // shm.CHUNK == (off + lease.nbytes - 1) // shm.CHUNK
            held.append(lease)
            offs = sorted((x.ctypes.data - a.base.ctypes.data, x.nbytes) for x in held)
            assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(offs, offs[1:])), "blocks overlap"
            if rng.random() < 0.6:
                held.pop(rng.randrange(len(held)))      # (returned at once: a lease is in no cycle)
        assert a.leases > 100 and a.reused > 0
    finally:
        held.clear()
        a.close()


@pytest.mark.parametrize("large", [60_000, 100_000, 200_000])   # classes up to a quarter chunk (a decode batch)
def test_blocks_kept_off_chunk_boundaries_cost_at_most_a_quarter_of_the_arena(tmp_path, monkeypatch, large):
    """Small and large leases in turn, all held, 16 chunks: a packed carve would fit ``size // (4 KiB + class)``
    pairs; moving the large blocks off the chunk boundaries (the gaps to the free lists) keeps 3/4 of that."""
    from convserve.service.cluster import shm

    monkeypatch.setattr(shm, "CHUNK", 1 << 20)
    size = 16 << 20
    a = Arena(str(tmp_path / "arena-w0-g1"), size)
    held, pairs = [], 0
    try:
        while True:
            small, big = a.lease(3000), a.lease(large)
            if small is None or big is None:
                break
            held += [small[1], big[1]]
            pairs += 1
        assert pairs >= 0.75 * (size // (4096 + shm._size_class(large)))
    finally:
        held.clear()
        a.close()


def test_a_gap_block_the_filesystem_cannot_back_goes_inline_and_is_kept_for_later(tmp_path, monkeypatch):
    import errno
    import os

    from convserve.service.cluster import shm

    monkeypatch.setattr(shm, "CHUNK", 1 << 20)
    a = Arena(str(tmp_path / "arena-w0-g1"), 4 << 20)
    try:
        first = a.lease(3000)
        big = a.lease(1 << 20)                       # aligned at 1 MiB: [4 KiB, 1 MiB) goes to the free lists
        assert big[0] == 1 << 20 and 4096 in a._unbacked

        def full(fd, off, n):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
        assert a.lease(3000) is None and a.inline == 1
        monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: None)
        off, blk = a.lease(3000)
        assert off == 4096 and 4096 not in a._unbacked and a.reused == 0
        del first, big, blk
    finally:
        a.close()


def test_without_pinning_blocks_go_direct_only_on_a_cpu_engine(tmp_path):
    """``shm_pin`` off on a GPU: no block goes direct (every request through the engine's own pinned memory)."""
    Arena(str(tmp_path / "arena-w0-g1"), 1 << 16).close(unlink=False)
    for host_direct in (True, False):
        maps = ArenaMap(str(tmp_path), host_direct=host_direct)
        maps.get("arena-w0-g1")
        assert maps.direct("arena-w0-g1", 0, 4096) is host_direct
    with pytest.raises(ValueError, match="not an arena name"):
        ArenaMap(str(tmp_path)).get("arena-w0")
