"""Test set-up shared by every test module.

Without CUDA the Triton kernels run in Triton's interpreter on CPU tensors; that must be switched on before any
kernel is defined, so it happens here, before test modules import ``kernels``.
"""

import os

import pytest
import torch
from _pytest.mark.structures import ParameterSet

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Where the kernel grid runs: the GPU when there is one, else the interpreter on CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


#: The largest kernel grids, which run in Triton's interpreter without CUDA: there every other case of each
#: (:func:`_odd_case`) is marked ``slow`` (CI's time; ``pytest -m slow`` runs the rest), and on CUDA every case runs.
HALVED_WITHOUT_CUDA = frozenset({
    "test_single_sequence_with_initial_state_matches_reference", "test_channels_last_body_matches_reference",
    "test_update_matches_reference", "test_prefill_reads_and_writes_only_its_tensors",
    "test_pairs_kernel_matches_reference", "test_varlen_batch_with_pads_and_mixed_initial_state_matches_reference",
    "test_few_token_update_matches_reference_on_both_paths", "test_one_sequence_matches_reference",
    "test_state_contiguous_along_the_window_matches_reference",
    "test_tokens_before_a_nonzero_first_query_start_loc_are_zeros_and_nothing_is_read_outside",
})


#: Large grids of live-server cases (each drives a real server, most wait out a timeout or a restart): every other
#: case of each runs by default (:func:`_odd_case`), the rest with ``pytest -m slow`` (CI's time).
HALVED_LIVE = frozenset({
    "test_the_load_tester_runs_through_the_unix_socket",
    "test_a_create_whose_answer_is_lost_is_retried_and_returns_the_one_session_it_made",
    "test_a_ws_stream_of_large_frames_with_a_wide_window_gets_every_answer",
    "test_health_and_metadata_answer_as_tritonclient_reads_them",
    "test_stream_frames_with_x_in_the_arena_go_by_reference_and_answer_in_the_same_block",
    "test_an_async_iterable_that_ends_itself_on_a_timeout_ends_the_stream_normally",
    "test_a_bad_request_is_one_4xx_naming_the_problem_and_changes_no_state",
    "test_a_websockets_connection_lines_are_written_only_with_the_access_log",
    "test_an_async_stream_closed_while_its_iterable_ignores_the_cancel_returns_and_sends_nothing_more",
    "test_a_ws_stream_whose_requests_pause_past_the_timeout_with_nothing_owed_goes_on",
    "test_a_websocket_stream_with_an_arena_of_window_blocks_never_hands_a_yielded_ys_block_out_again",
    "test_a_replicated_stream_that_fails_yields_the_answers_of_what_it_sent_then_raises",
})


@pytest.hookimpl(tryfirst=True)         # before the `-m` selection reads the marks
def pytest_collection_modifyitems(config, items):
    halved = HALVED_LIVE if HAS_CUDA else HALVED_LIVE | HALVED_WITHOUT_CUDA
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        if getattr(item, "originalname", item.name) in halved and _odd_case(item):
            item.add_marker(pytest.mark.slow)


def _odd_case(item) -> bool:
    """Whether the sum of a case's places on its grid's axes is odd. Each argname of a ``parametrize`` is an axis
    (its value's place among the distinct values of its column: a list of tuples built as a product is halved as
    the product would be), and so is each parametrized fixture. The even half keeps every value of every axis and,
    with three axes or more, every pair of values of two axes."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    params, seen, total = callspec.params, set(), 0
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if not names or any(n not in params for n in names) or mark.kwargs.get("indirect"):
            continue
        rows = [list(v.values) if isinstance(v, ParameterSet) else list(v) if len(names) > 1 else [v]
                for v in mark.args[1]]
        for k, name in enumerate(names):
            column = list(dict.fromkeys(_key(row[k]) for row in rows))
            total += column.index(_key(params[name])) if _key(params[name]) in column else 0
        seen.update(names)
    for name in params.keys() - seen:                      # a parametrized fixture's value, by its place
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        values = list(defs[-1].params or ()) if defs else []
        total += values.index(params[name]) if params[name] in values else 0
    return total % 2 == 1


def _key(value):
    """A parameter value as a dict key: itself when hashable (with its type: True is not 1), else its identity."""
    try:
        hash(value)
    except TypeError:
        return id(value)
    return type(value), value


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
