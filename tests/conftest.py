"""Test set-up shared by every test module.

Without CUDA the Triton kernels run in Triton's interpreter on CPU tensors; that must be switched on before any
kernel is defined, so it happens here, before test modules import ``kernels``.
"""

import collections
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Where the kernel grid runs: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


#: The largest kernel grids, which run in Triton's interpreter without CUDA: there every other case of each is
#: marked ``slow`` (CI's time; ``pytest -m slow`` runs the rest), and on CUDA every case runs.
HALVED_WITHOUT_CUDA = frozenset({
    "test_single_sequence_with_initial_state_matches_reference", "test_channels_last_body_matches_reference",
    "test_update_matches_reference", "test_prefill_reads_and_writes_only_its_tensors",
    "test_pairs_kernel_matches_reference", "test_varlen_batch_with_pads_and_mixed_initial_state_matches_reference",
    "test_few_token_update_matches_reference_on_both_paths", "test_one_sequence_matches_reference",
    "test_state_contiguous_along_the_window_matches_reference",
})


@pytest.hookimpl(tryfirst=True)         # before the `-m` selection reads the marks
def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    cases = collections.Counter()
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        name = getattr(item, "originalname", item.name)
        if name in HALVED_WITHOUT_CUDA:
            key = (item.nodeid.split("::")[0], name)
            if cases[key] % 2:
                item.add_marker(pytest.mark.slow)
            cases[key] += 1


@pytest.fixture
def kernel_device() -> str:
    return KERNEL_DEVICE


@pytest.fixture
def engine():
    """A started CPU engine (``tests.engine_support.make_engine``), stopped after the test."""
    from tests.engine_support import make_engine

    e = make_engine()
    yield e
    e.stop(drain=False)


#: the process layouts every test of the shared server runs against: two engine processes (sessions spread over
#: both, batches split) behind one worker, and the engine inside the HTTP process
SERVER_MODES = {"two-engines": ["--workers", "1", "--devices", "cpu,cpu"], "in-process": ["--workers", "0"]}


@pytest.fixture
def spec_engine():
    """A started CPU engine (``tests.engine_support.make_engine``) that takes verifies of up to 4 tokens, stopped
    after the test."""
    from tests.engine_support import make_engine

    e = make_engine(max_spec_tokens=4)
    yield e
    e.stop(drain=False)


@pytest.fixture(scope="session", params=list(SERVER_MODES))
def server(request):
    """The conv server the test_http_* modules share (``tests.http_api.SERVER_ARGS``), one per layout and test
    worker. A module that needs another configuration defines its own ``server``."""
    from tests.http_api import SERVER_ARGS
    from tests.live import LiveServer

    srv = LiveServer([*SERVER_ARGS, *SERVER_MODES[request.param]])
    yield srv
    srv.terminate()


@pytest.fixture(scope="session")
def api(server):
    from tests.http_api import Api

    return Api(server.url)


@pytest.fixture
def disk(monkeypatch):
    """The rewind journal's writes fail (a full disk) while ``disk.full``; ``disk.tried`` counts the refused ones;
    the engine tries a failed note again every 0.05 s."""
    import errno
    from types import SimpleNamespace

    from convserve.service.engine import snapshot as engine_snapshot
    from convserve.service.rewind_journal import RewindJournal

    monkeypatch.setattr(engine_snapshot, "NOTE_RETRY_S", 0.05)
    real = RewindJournal.note
    state = SimpleNamespace(full=False, tried=0)

    def note(self, ids, fail_fast=True):
        if state.full:
            state.tried += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, ids, fail_fast)

    monkeypatch.setattr(RewindJournal, "note", note)
    return state
