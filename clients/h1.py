"""A lean keep-alive HTTP/1.1 pool over asyncio streams, for :class:`AsyncConvClient`'s request-response calls."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

import httpx


#: bytes a connection's reader buffers before it stops reading the socket: asyncio's default (64 KiB) makes a
#: multi-megabyte answer arrive in 128 KiB rounds of pause and resume
_READ_BUFFER = 1 << 24


class _Resp:
    """The parts of an ``httpx.Response`` that :func:`_raise_for` and :func:`_decode` read."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict, content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content


async def _within(coro, seconds: float):
    """``await coro`` within ``seconds``, else TimeoutError (``asyncio.timeout`` where there is one: no task)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)  # Python 3.10


class _H1Pool:
    """Keep-alive HTTP/1.1 connections over asyncio streams, for :class:`AsyncConvClient`'s request-response
    calls: a LIFO list of idle connections and a semaphore bounding them, so a request costs the same at any
    concurrency.

    Why not httpx's pool: httpcore's ``AsyncConnectionPool`` re-examines every connection on each request and on
    each response close (``has_expired`` / ``is_idle``: an anyio ``extra_attributes`` dict built with
    ``getpeername`` and a ``poll`` per idle socket), and imports ``sniffio`` per call (a failed, uncached import
    when sniffio is absent). With a load tester's pool of ``4 x concurrency`` connections its per-request cost
    grows with the concurrency: against a trivial echo server, 880 req/s at concurrency 1 fell to 160-210 req/s
    at 32 (2 vCPU). Behind a server that batches, the client then hands the requests over one at a time.

    Network failures raise httpx's exceptions (``ConnectError``, ``RemoteProtocolError``, ``ReadTimeout``), like
    the httpx path. A failed or cancelled exchange closes its connection; nothing is retried (a conv is not
    idempotent). An idle connection the server has closed (keep-alive timeout) is dropped before reuse.
    """

    def __init__(self, host: str, port: int, headers: dict, timeout: float, max_connections: int,
                 uds: Optional[str] = None):
        self.host, self.port, self.timeout, self.uds = host, port, timeout, uds
        self.max_connections = max(1, int(max_connections))
        name = f"[{host}]" if ":" in host else host
        hostport = name if port == 80 else f"{name}:{port}"
        lines = [f"host: {hostport}"] + [f"{k}: {v}" for k, v in headers.items()]
        self._fixed = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._idle: list = []
        self._loop = None
        self._slots: Optional[asyncio.Semaphore] = None

    def _bind(self):
        loop = asyncio.get_running_loop()
        if loop is not self._loop:   # first use, or a new loop: the old loop's connections are unusable
            self._drop_idle()
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._slots

    def _drop_idle(self) -> None:
        for _r, w in self._idle:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - its loop may be closed
                pass
        self._idle.clear()

    async def aclose(self) -> None:
        self._drop_idle()

    async def request(self, method: str, path: str, body: bytes = b"") -> _Resp:
        """One exchange. The wait for a free connection and the exchange (connect, send, answer) each get
        ``timeout`` seconds: a request is never sent with only what a long wait for a connection left of one
        budget. A timeout before the request was written raises what says nothing was sent (``PoolTimeout``
        waiting for a connection, ``ConnectTimeout`` connecting), after it ``ReadTimeout``."""
        slots = self._bind()
        if slots.locked():                    # none free: wait for one, within timeout (else it is taken at once)
            try:
                await _within(slots.acquire(), self.timeout)
            except (TimeoutError, asyncio.TimeoutError):
                raise httpx.PoolTimeout(f"no free connection (max_connections={self.max_connections}) for "
                                        f"{method} {path} within {self.timeout} s") from None
        else:
            await slots.acquire()
        phase = [""]
        try:
            return await _within(self._exchange(method, path, body, phase), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            if phase[0] == "connect":
                raise httpx.ConnectTimeout(f"no connection to the server for {method} {path} within "
                                           f"{self.timeout} s") from None
            raise httpx.ReadTimeout(f"no answer to {method} {path} within {self.timeout} s") from None
        finally:
            slots.release()

    async def _exchange(self, method: str, path: str, body: bytes, phase: list) -> _Resp:
        """``phase[0]``: "connect" while connecting, "sent" from the request's write on ("" before either)."""
        conn = None
        idle = self._idle
        while idle:
            r, w = idle.pop()
            if r.at_eof() or w.is_closing():   # closed by the server while idle
                w.close()
                continue
            conn = (r, w)
            break
        if conn is None:
            phase[0] = "connect"
            conn = await self._connect()
        phase[0] = "sent"
        r, w = conn
        keep = False
        try:
            head = b"%s %s HTTP/1.1\r\n%scontent-length: %d\r\n\r\n" % (
                method.encode(), path.encode("ascii"), self._fixed, len(body))
            if len(body) < 65536:
                w.write(head + body)
            else:               # one system call (and on uvloop, or asyncio from Python 3.12, the body not copied)
                w.writelines((head, body))
            resp, keep = await self._read(r)
            return resp
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
            raise httpx.RemoteProtocolError(f"{method} {path}: the connection failed before a complete answer "
                                            f"({type(e).__name__}: {e})") from e
        finally:
            if keep:
                idle.append(conn)
            else:
                w.close()

    async def _connect(self):
        try:
            if self.uds is not None:
                return await asyncio.open_unix_connection(self.uds, limit=_READ_BUFFER)
            return await asyncio.open_connection(self.host, self.port, limit=_READ_BUFFER)
        except OSError as e:
            where = self.uds if self.uds is not None else f"{self.host}:{self.port}"
            raise httpx.ConnectError(f"cannot connect to {where}: {e}") from e

    async def stream(self, path: str, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``POST path`` with a chunked body taken from ``body`` while the answer is read, on a connection of its
        own: yields the answer's body as it arrives (a status >= 400 raises, as :func:`_raise_for` does). The
        body is sent by a task, so a caller whose next frames depend on the answers (a model sending layer l + 1
        after layer l's answer) is not held up; httpx sends a whole body before it reads any of the answer.
        Each read waits at most ``timeout`` seconds; an error of ``body`` is raised here."""
        from convserve.clients.common import _raise_for

        r, w = await self._connect()
        failed: list = []

        async def send():
            frames = body.__aiter__()
            try:
                w.write(b"POST %s HTTP/1.1\r\n%stransfer-encoding: chunked\r\n\r\n" % (path.encode("ascii"),
                                                                                       self._fixed))
                while True:
                    try:
                        chunk = await frames.__anext__()
                    except StopAsyncIteration:
                        break
                    except asyncio.CancelledError:
                        raise
                    except BaseException as e:  # noqa: BLE001 - the caller's frames failed: raised as they are
                        failed.append(e)        # (by the reader, which the closed socket stops)
                        w.close()
                        return
                    if chunk:
                        w.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                        await w.drain()
                w.write(b"0\r\n\r\n")
                await w.drain()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the connection failed: an httpx error, as every call raises
                failed.append(httpx.WriteError(f"POST {path}: the connection failed while the stream was sent "
                                               f"({type(e).__name__}: {e})"))
                w.close()

        sender = asyncio.ensure_future(send())

        async def read(coro, parse=lambda b: b):
            try:
                return parse(await asyncio.wait_for(coro, self.timeout))
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"no answer on POST {path} within {self.timeout} s") from None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
                if failed:
                    raise failed[0] from None
                raise httpx.RemoteProtocolError(f"POST {path}: the connection failed before the end of the "
                                                f"answer ({type(e).__name__}: {e})") from e

        try:
            status, headers, _keep = await read(r.readuntil(b"\r\n\r\n"), _parse_head)
            if status >= 400:
                content = await read(_read_content(r, status, headers))
                _raise_for(_Resp(status, headers, content))
            if "chunked" in headers.get("transfer-encoding", "").lower():
                while True:
                    size = await read(r.readuntil(b"\r\n"), _chunk_size)
                    if size == 0:
                        break
                    yield await read(r.readexactly(size + 2), _chunk_data)
            else:
                left = int(headers.get("content-length", -1))
                while left:
                    piece = await read(r.read(_READ_BUFFER if left < 0 else min(left, _READ_BUFFER)))
                    if not piece:
                        break
                    left -= len(piece)
                    yield piece
            if failed:
                raise failed[0]
        finally:
            sender.cancel()
            w.close()

    @staticmethod
    async def _read(r: asyncio.StreamReader):
        status, headers, keep = _parse_head(await r.readuntil(b"\r\n\r\n"))
        content = await _read_content(r, status, headers)
        if "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower() and \
                not (status in (204, 304) or 100 <= status < 200):
            keep = False                           # delimited by the end of the connection
        return _Resp(status, headers, content), keep


def _parse_head(head: bytes) -> tuple:
    """``(status, headers with lower-case names, keep-alive?)`` of a response head."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    keep = headers.get("connection", "").lower() != "close" and parts[0] != b"HTTP/1.0"
    return status, headers, keep


_HEX = frozenset(b"0123456789abcdefABCDEF")


def _chunk_size(line: bytes) -> int:
    """The size of a chunk of a chunked body, from its size line (extensions after ``;`` ignored). Only hex digits
    make a size (``int`` would take ``-1``, ``0x10`` or ``1_0``): anything else raises ValueError."""
    digits = line.split(b";", 1)[0].strip(b" \t\r\n")
    if not digits or not _HEX.issuperset(digits):
        raise ValueError(f"bad chunk size line {line[:40]!r}")
    return int(digits, 16)


def _chunk_data(raw: bytes) -> bytes:
    """A chunk's data from its ``size + 2`` bytes read, which must end with CRLF (else the size lied)."""
    if raw[-2:] != b"\r\n":
        raise ValueError("a chunk is longer than its size line says")
    return raw[:-2]


async def _read_content(r: asyncio.StreamReader, status: int, headers: dict) -> bytes:
    """A whole response body: by its Content-Length, chunked, or up to the end of the connection."""
    n = headers.get("content-length")
    if n is not None:
        return await r.readexactly(int(n)) if int(n) else b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size = _chunk_size(await r.readuntil(b"\r\n"))
            if size == 0:
                while (await r.readuntil(b"\r\n")) != b"\r\n":   # trailers
                    pass
                return b"".join(chunks)
            chunks.append(_chunk_data(await r.readexactly(size + 2)))
    if status in (204, 304) or 100 <= status < 200:
        return b""
    return await r.read()


def _h1_target(url: str, uds: Optional[str] = None) -> Optional[tuple]:
    """``(host, port, path prefix)`` when :class:`_H1Pool` can serve ``url`` as httpx would: plain http and no
    proxy configured for it (httpx honours the proxy environment variables; none applies over the Unix socket
    ``uds``); else None."""
    import urllib.parse
    import urllib.request

    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.username or u.password:
        return None
    if uds is not None:
        return u.hostname, u.port or 80, u.path.rstrip("/")
    proxies = urllib.request.getproxies()
    if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(u.hostname):
        return None
    return u.hostname, u.port or 80, u.path.rstrip("/")


def unix_transport(transport, uds: str, limits: httpx.Limits, asynchronous: bool = False):
    """httpx's transport over the Unix socket ``uds`` (a client's ``uds=``), with the client's connection
    ``limits`` (httpx takes a given transport's own); a transport given too is an error."""
    if transport is not None:
        raise ValueError("give uds or transport, not both (a transport of your own can take uds= itself)")
    cls = httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport
    return cls(uds=uds, limits=limits)
