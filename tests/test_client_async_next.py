"""``_next_unless``, how the async client's streams take the caller's next request: an item the iterable has at
hand is taken in the same pass with no task; one it has to wait for is raced against the stop, which leaves it
untaken; the iterable's own errors and a cancellation of the caller go through as they would with ``anext``."""

from __future__ import annotations

import asyncio

import pytest

from convserve.clients.async_client import _STOPPED, _next_unless


class _Counted:
    """A task factory that counts the tasks the loop makes."""

    def __init__(self):
        self.n = 0

    def __call__(self, loop, coro, **kw):
        self.n += 1
        return asyncio.Task(coro, loop=loop, **kw)


async def _gen(items, waits):
    """Yields ``items``; before item i it waits as ``waits[i]`` says: None (at hand), 0 (one pass of the loop),
    a float (a sleep) or an asyncio.Event (until it is set)."""
    for item, wait in zip(items, waits):
        if isinstance(wait, asyncio.Event):
            await wait.wait()
        elif wait is not None:
            await asyncio.sleep(wait)
        yield item


class _FutureIterator:
    """An async iterator that is not a generator: ``__anext__`` returns a future the loop completes later."""

    def __init__(self, n):
        self.i, self.n = 0, n

    def __aiter__(self):
        return self

    def __anext__(self):
        fut = asyncio.get_running_loop().create_future()
        if self.i == self.n:
            fut.set_exception(StopAsyncIteration())
        else:
            asyncio.get_running_loop().call_soon(fut.set_result, self.i)
        self.i += 1
        return fut


def _run(main):
    return asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("waits", [[None] * 5, [0] * 5, [0.001] * 5, [None, 0, 0.002, None, 0],
                                   [0.002, None, None, None, 0]])
def test_items_come_in_order_whether_at_hand_or_waited_for_and_the_end_is_stopped(waits):
    async def main():
        stopped = asyncio.get_running_loop().create_future()
        it = _gen(range(5), waits).__aiter__()
        got = []
        while (r := await _next_unless(it, stopped)) is not _STOPPED:
            got.append(r)
        assert got == list(range(5))
    _run(main)


@pytest.mark.parametrize("n", [1, 3, 17])
def test_items_at_hand_are_taken_without_a_task(n):
    async def main():
        counted = _Counted()
        asyncio.get_running_loop().set_task_factory(counted)
        stopped = asyncio.get_running_loop().create_future()
        it = _gen(range(n), [None] * n).__aiter__()
        got = [await _next_unless(it, stopped) for _ in range(n)]
        assert got == list(range(n))
        assert counted.n == 0
        assert await _next_unless(it, stopped) is _STOPPED
    _run(main)


def test_an_iterator_whose_anext_is_a_future_is_taken_through_the_race():
    async def main():
        stopped = asyncio.get_running_loop().create_future()
        it = _FutureIterator(4)
        got = []
        while (r := await _next_unless(it, stopped)) is not _STOPPED:
            got.append(r)
        assert got == [0, 1, 2, 3]
    _run(main)


@pytest.mark.parametrize("stop_before", [True, False])
def test_the_stop_leaves_an_item_the_iterable_waits_for_untaken(stop_before):
    async def main():
        stopped = asyncio.get_running_loop().create_future()
        never = asyncio.Event()
        produced = []

        async def requests():
            yield "first"
            await never.wait()
            produced.append("second")
            yield "second"

        it = requests().__aiter__()
        assert await _next_unless(it, stopped) == "first"
        if stop_before:
            stopped.set_result(None)
        else:
            asyncio.get_running_loop().call_later(0.01, stopped.set_result, None)
        assert await _next_unless(it, stopped) is _STOPPED
        never.set()
        await asyncio.sleep(0.01)
        assert produced == []
    _run(main)


@pytest.mark.parametrize("wait", [None, 0, 0.001])
def test_the_iterables_error_is_raised_to_the_caller(wait):
    async def main():
        stopped = asyncio.get_running_loop().create_future()

        async def requests():
            yield 1
            if wait is not None:
                await asyncio.sleep(wait)
            raise KeyError("the caller's own")

        it = requests().__aiter__()
        assert await _next_unless(it, stopped) == 1
        with pytest.raises(KeyError, match="the caller's own"):
            await _next_unless(it, stopped)
    _run(main)


def test_a_cancelled_caller_cancels_the_await_the_iterable_was_in():
    async def main():
        stopped = asyncio.get_running_loop().create_future()
        seen = []

        async def requests():
            try:
                await asyncio.Event().wait()
                yield 1
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        it = requests().__aiter__()
        caller = asyncio.ensure_future(_next_unless(it, stopped))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)
        assert seen == ["cancelled"]
    _run(main)


def test_a_value_sent_back_into_the_iterables_await_reaches_it():
    """The loop resumes the iterable's await with what it was waiting for: an item that awaits a future's result
    gets that result."""
    async def main():
        stopped = asyncio.get_running_loop().create_future()
        fut = asyncio.get_running_loop().create_future()

        async def requests():
            yield await fut

        asyncio.get_running_loop().call_later(0.005, fut.set_result, "from the future")
        assert await _next_unless(requests().__aiter__(), stopped) == "from the future"
    _run(main)
