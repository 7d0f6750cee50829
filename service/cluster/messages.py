"""The messages between a worker and an engine process: msgpack maps over a ZeroMQ DEALER/ROUTER pair.

Tensors do not travel in messages: x and y live in the worker's arena (:mod:`.shm`), and a message names the
block (``a`` arena file, ``o`` offset). Only when no block was free does a tensor travel inline, as a second
frame. Every request carries the engine ``epoch`` the worker believes it talks to; an engine drops a request of
another epoch (it was queued for a process that died), so nothing sent to a dead engine runs on its successor.

Worker -> engine, first frame a map with ``k`` (kind), ``i`` (request id, per worker) and ``e`` (epoch), or a list
of such maps (the requests of one tick of the worker's loop, none with a data frame):

=====  =========================================================================================================
``c``  conv: ``s`` session, ``l`` layer, ``sp`` speculative, ``po`` position or None, ``d`` dtype, ``n`` rows;
       x in the arena (``a``, ``o``) or inline (second frame); ``ck`` true: x is in the model dtype and finite
       (the worker cast and checked it). Reply: ``ok``, y written over x's block (or inline)
``b``  batch: ``ss`` sessions, ``l``, ``t`` tokens or None, ``sp`` bool / list / None, ``po`` positions or None,
       ``d``, ``n``; as ``c``
``x``  cancel request ``i`` if it has not started (no reply of its own: the request itself answers)
``o``  a session operation ``f`` with arguments ``a`` (a state tensor, and a moved session's verify x, travel as
       a second frame: :func:`put_tensors`)
``q``  a check before a batch split across engines (``f``: ``batch`` with ``ss``, ``sp``, ``t``, ``l``, ``po``;
       or ``accept``): validates, queues nothing; with ``po`` the reply is ``{"positions", "repeat"}``
``s``  stats
=====  =========================================================================================================

Engine -> worker: ``{"i", "ok": result}`` or ``{"i", "err": code, "m": message, "ra": retry_after, "x": extra}``
(``x``, the error's extra fields such as a :class:`PositionMismatch`'s ``position``, only when it has some); an
answer with a data frame (an inline y, a state, the weights) comes alone, and the answers without one that are
ready together (a step's) come as one message whose first frame is a list of such maps.
"""

from __future__ import annotations

import math

from convserve.clients.protocol.errors import BY_CODE, Internal, ServiceError

CONV, BATCH, CANCEL, OP, CHECK, STATS = "c", "b", "x", "o", "q", "s"

#: the session operations an ``o`` message may name
OPS = ("create_session", "delete_session", "fork_session", "export_state", "import_state", "accept",
       "accept_batch", "export_for_fork", "create_with_state", "model_weights", "session_info", "list_sessions")


def error_reply(mid: int, exc: BaseException) -> dict:
    if not isinstance(exc, ServiceError):
        exc = Internal(f"the engine failed: {type(exc).__name__}: {exc}")
    reply = {"i": mid, "err": exc.code, "m": exc.message, "ra": exc.retry_after}
    if exc.extra:
        reply["x"] = exc.extra
    return reply


def error_of(reply: dict) -> ServiceError:
    cls = BY_CODE.get(reply.get("err"), Internal)
    return cls(reply.get("m") or "engine error", retry_after=reply.get("ra"), **(reply.get("x") or {}))


#: the head's keys that describe the tensors of a data frame (:func:`put_tensors`): dtype and shape of each
_TENSOR_KEYS = (("d", "sh"), ("sd", "ssh"))


def put_tensors(head: dict, *tensors):
    """A data frame holding ``tensors`` (a state, then optionally a moved session's verify x; None entries are
    left out) one after another, each described in ``head`` (``d`` / ``sh``, then ``sd`` / ``ssh``)."""
    import torch

    parts = []
    for t, (kd, ks) in zip(tensors, _TENSOR_KEYS):
        if t is not None:
            t = t.contiguous()
            head[kd], head[ks] = str(t.dtype).removeprefix("torch."), list(t.shape)
            parts.append(t.view(-1).view(torch.uint8))
    return memoryview((parts[0] if len(parts) == 1 else torch.cat(parts)).numpy())


def get_tensors(head: dict, frame) -> tuple:
    """The tensors of a data frame made by :func:`put_tensors`, each None that ``head`` does not describe."""
    import torch

    buf, at, out = bytearray(frame), 0, []
    for kd, ks in _TENSOR_KEYS:
        if kd not in head:
            out.append(None)
            continue
        dtype, shape = getattr(torch, head[kd]), head[ks]
        count = math.prod(shape)
        out.append(torch.frombuffer(buf, dtype=dtype, count=count, offset=at).view(*shape) if count else
                   torch.empty(shape, dtype=dtype))
        at += count * out[-1].element_size()
    return tuple(out)


def endpoint(run_dir: str, engine: int) -> str:
    return f"ipc://{run_dir}/engine-{engine}.sock"


def arena_name(worker: int, generation: int) -> str:
    return f"arena-w{worker}-g{generation}"
