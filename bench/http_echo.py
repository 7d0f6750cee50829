"""The HTTP echo of ``bench_service.py``: what uvicorn alone costs a conv call, with no engine behind it.

A bare ASGI app under uvicorn, with the server's event loop (``loop="auto"``: uvloop when installed) and HTTP
protocol (:func:`convserve.service.http.conn.guarded_protocol`: httptools' with the service's guards), answers
``POST /v1/conv`` and ``POST /v1/conv/batch`` with ``{"y": x}``: it reads the body, decodes its msgpack and packs
an answer of the response's size, as the TCP echo (``tcp_echo.py``) does for raw frames. The legs drive it with the service's own client (``AsyncConvClient``), so
``step`` / ``step-http-echo`` is the engine's and the processes' share of a call and ``step-http-echo`` /
``step-echo`` is HTTP's. Run the server with ``python bench/http_echo.py PORT`` (0: any free port, printed as
``listening N``).
"""

from __future__ import annotations

import socket
import sys

from convserve.clients.protocol import wire

from tcp_echo import time_steps

_ROUTES = (b"/v1/conv", b"/v1/conv/batch")
_HEADERS = [(b"content-type", wire.MEDIA_TYPE.encode())]


async def app(scope, receive, send) -> None:
    """``{"y": x}`` for a POST to a conv route; 404 for anything else; the lifespan protocol acknowledged."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = bytearray()
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["method"] != "POST" or scope["raw_path"] not in _ROUTES:
        await send({"type": "http.response.start", "status": 404, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": wire.packb({"error": {"code": "not_found"}})})
        return
    out = wire.packb({"y": wire.unpackb(bytes(body), 1 << 30)["x"]})
    await send({"type": "http.response.start", "status": 200,
                "headers": _HEADERS + [(b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


def echo_server_main(port: int) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)       # connections made before uvicorn serves wait in the backlog
    print(f"listening {sock.getsockname()[1]}", flush=True)
    from convserve.service.config import load_settings
    from convserve.service.http.conn import guarded_protocol

    # the service's own HTTP protocol (uvicorn's, with its guards and the head sent with the body in one write)
    config = uvicorn.Config(app, loop="auto", http=guarded_protocol(load_settings({})), lifespan="on",
                            log_level="warning", access_log=False, server_header=False)
    uvicorn.Server(config).run(sockets=[sock])


async def leg_step_http_echo(args, port: int, info: dict, conc: int) -> dict:
    """The ``step`` leg's calls (same client, sessions list, x and y sizes) against the HTTP echo, one at a time."""
    import torch

    from convserve.clients.client import AsyncConvClient

    layers = list(info["layers"])
    x = torch.randn(conc, info["dim"]).to(getattr(torch, info["dtype"]))
    sessions = [f"{i:032x}" for i in range(conc)]       # ids of the server's length
    async with AsyncConvClient(f"http://127.0.0.1:{port}", max_connections=4) as client:
        return await time_steps(lambda i, layer: client.conv_batch(sessions, layer, x), layers, conc, args)


async def leg_http_echo(args, port: int, info: dict, conc: int, drive) -> dict:
    """The ``unary`` leg's requests (same client and transport, one session's layers at once) against the HTTP
    echo; ``drive`` is ``bench_service.drive``."""
    import torch

    from convserve.clients.client import AsyncConvClient
    from convserve.clients.loadtest.runner import make_transport

    layers = list(info["layers"])
    x = torch.randn(1, info["dim"]).to(getattr(torch, info["dtype"]))
    async with AsyncConvClient(f"http://127.0.0.1:{port}", max_connections=max(8, conc * len(layers))) as client:
        tr = make_transport(client, "unary", 0, args.inflight)
        try:
            return await drive(tr, [f"{i:032x}" for i in range(conc)], layers, x, args.warmup, args.duration)
        finally:
            await tr.close()


if __name__ == "__main__":
    echo_server_main(int(sys.argv[1]))
