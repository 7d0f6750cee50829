"""``convserve-loadtest`` (also ``python -m convserve.clients.loadtest``): the load-testing client. See :mod:`.cli`."""

from convserve.clients.loadtest.cli import main

__all__ = ["main"]
