"""``convserve-loadtest`` (also ``python -m clients.loadtest``): the load-testing client. See :mod:`.cli`."""

from clients.loadtest.cli import main

__all__ = ["main"]
