"""A batch split across engines, one part of which failed: the error its client gets (no engine processes: the
parts' answers are stood in for)."""

import asyncio

import pytest
import torch

from convserve.clients.protocol.errors import OutOfMemory, RequestTimeout, StateLost
from convserve.service.cluster.remote import RemoteEngine


def _split(results: dict):
    """``_split_batch`` of two sessions, one on each of engines 0 and 1, whose parts answer ``results[e]``."""
    r = RemoteEngine.__new__(RemoteEngine)
    r.dim = 4

    async def call(e, head, data=None):
        return {"ok": None}, None

    async def main():
        loop = asyncio.get_running_loop()

        def conv(e, head, x, rows=None):
            f = loop.create_future()
            got = results[e]
            if isinstance(got, BaseException):
                f.set_exception(got)
            else:
                f.set_result(torch.zeros(len(rows), 4))
            return f

        r._call, r._conv = call, conv
        return await r._split_batch({0: [0], 1: [1]}, ["a", "b"], 1, torch.zeros(2, 4), None, None)

    return asyncio.run(main())


@pytest.mark.parametrize("other", [OutOfMemory("oom", retry_after=1), RequestTimeout("late")])
def test_a_split_batch_with_a_part_whose_step_lost_its_state_answers_410_whatever_the_other_part_got(other):
    with pytest.raises(StateLost, match="lost"):
        _split({0: other, 1: StateLost("the state of 'b' was lost")})


def test_a_split_batch_with_a_lost_part_and_an_applied_part_says_which_was_applied():
    with pytest.raises(StateLost, match=r"slices of \['a'\] were applied"):
        _split({0: None, 1: StateLost("the state of 'b' was lost")})
