"""Python clients of convserve: :class:`ConvClient` (sync) and :class:`AsyncConvClient` (asyncio), on httpx.

Tensors go in and come out as torch tensors or numpy arrays: ``conv`` answers in the kind it was given
(numpy needs the ``ml_dtypes`` package for bfloat16). torch is imported only when the caller passes torch
tensors or asks for them, so a numpy-only frontend needs no torch at all; a call that takes no tensor
(``export_state``) answers in torch where torch is installed unless given ``backend="numpy"``.

:class:`AsyncConvClient` sends its request-response calls (``conv``, sessions, state) over its own keep-alive
HTTP/1.1 pool (:class:`convserve.clients.h1._H1Pool`), whose cost per request does not grow with the number of
connections the way httpx's pool does; streams, https, proxies and custom transports use httpx.

Every error answer raises the :mod:`convserve.clients.protocol.errors` class of its code (``UnknownSession``,
``QueueFull``...), all subclasses of :class:`ConvServeError`, carrying ``.status``, ``.code``, ``.message`` and
``.retry_after``.
Network failures raise httpx's (or websockets') own exceptions.

``stream`` pipelines many conv requests over one call and yields results as they arrive:

* ``transport="http"``: one ``POST /v1/conv/stream``. :class:`AsyncConvClient` over plain ``http://`` sends and
  reads at once (requests may be produced from earlier results); this sync client, and the async one over https,
  a proxy or a custom transport, go through httpx, which sends the whole request body before it reads the
  response, so every request must be known up front; results still arrive as each completes.
* ``transport="ws"``: the WebSocket ``/v1/conv/ws``, full duplex. At most ``window`` requests are in flight;
  requests may be produced lazily (even from earlier results).
"""

from convserve.clients.async_client import AsyncConvClient
from convserve.clients.common import (DEFAULT_URL, MAX_MESSAGE_BYTES, AcceptRequest, BatchRequest, ConvRequest,
                                      ConvResult, SessionState, error_from)
from convserve.clients.protocol.errors import (ConvServeError, OutcomeUnknown, ReplicaUnavailable, ServiceError,
                                              Unreachable)
from convserve.clients.sync_client import ConvClient

__all__ = ["ConvClient", "AsyncConvClient", "ConvRequest", "BatchRequest", "AcceptRequest", "ConvResult",
           "SessionState", "ConvServeError", "ServiceError", "ReplicaUnavailable", "OutcomeUnknown", "Unreachable",
           "error_from", "DEFAULT_URL", "MAX_MESSAGE_BYTES"]
