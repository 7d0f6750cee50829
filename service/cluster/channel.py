"""A ZeroMQ socket driven by an asyncio loop: every message received is handed to a callback on the loop thread.

ZeroMQ's file descriptor is edge-triggered: it signals that the socket's state may have changed, and reading the
socket's events (which ``recv`` and ``send`` do) consumes that signal. So the reader drains the socket until it
reports no input, and a send, which can consume a signal meant for input, re-checks for input and drains if
there is some. (Waiting on the descriptor without these rules leaves messages unseen until the next one comes.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq

log = logging.getLogger("convserve.channel")

# plain ints: pyzmq's constants are enum flags, and ``getsockopt(zmq.EVENTS) & zmq.POLLIN`` then goes through
# enum.Flag.__and__ and a new flag member each time, several times per request and answer
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class Channel:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None], loop: asyncio.AbstractEventLoop):
        self.sock = sock
        self.on_message = on_message
        self.loop = loop
        self._draining = False
        self._fd = sock.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self.drain)
        loop.call_soon(self.drain)            # what arrived before the reader was registered

    def drain(self) -> None:
        if self._draining:                    # a send from inside a callback: the loop below picks it up
            return
        self._draining = True
        sock, handle = self.sock, self.on_message
        try:
            while sock.getsockopt(_EVENTS) & _POLLIN:
                try:
                    frames = sock.recv_multipart(_NOBLOCK, copy=True)
                except zmq.Again:
                    break
                try:
                    handle(frames)
                except Exception:  # noqa: BLE001 - one bad message must not stop the channel
                    log.exception("cannot handle a message")
        finally:
            self._draining = False

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)
        if not self._draining and self.sock.getsockopt(_EVENTS) & _POLLIN:
            self.loop.call_soon(self.drain)

    def close(self) -> None:
        try:
            self.loop.remove_reader(self._fd)
        except (ValueError, OSError):
            pass
        self.sock.close(0)
