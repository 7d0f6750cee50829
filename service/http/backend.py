"""The narrow interface through which the HTTP layer reaches the engine.

The HTTP modules call nothing on the engine beyond :class:`EngineAPI`, so an engine living in another process
can be served by any object with these methods (a client of that process), with no change to the routes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from typing import Any, Optional, Protocol, Sequence, Union


class EngineAPI(Protocol):
    @property
    def ready(self) -> bool: ...                       # started and warm: requests are accepted

    # --- description and monitoring
    def model_info(self) -> dict: ...                  # layers, dim, width, dtype, state_dtype, slots, weights_sha256
    def model_weights(self) -> bytes: ...              # the canonical safetensors file weights_sha256 digests
    def stats(self) -> dict: ...                       # read at scrape time by /metrics

    # --- conv requests (position: where the client believes the session is on the layer, one per session for a
    # batch; None checks nothing; see service/engine/positions.py. borrowed: true when x is a view of memory its
    # client may write meanwhile, so the backend copies it before it checks or reads it; the block's {key, offset}
    # when that memory is a sealed client segment, which an engine process reads in place: client_blocks.py)
    def submit(self, session_id: str, layer: int, x, speculative: bool = False,
               position: Optional[int] = None, borrowed: Union[bool, dict, None] = False) -> cf.Future: ...
    def submit_async(self, session_id: str, layer: int, x, speculative: bool = False,
                     position: Optional[int] = None, borrowed: Union[bool, dict, None] = False) -> asyncio.Future: ...
    def submit_batch(self, session_ids: Sequence[str], layer: int, x, tokens: Optional[Sequence[int]] = None,
                     speculative=None, position: Optional[Sequence[int]] = None,
                     borrowed: Union[bool, dict, None] = False) -> cf.Future: ...
    def submit_batch_async(self, session_ids: Sequence[str], layer: int, x, tokens: Optional[Sequence[int]] = None,
                           speculative=None, position: Optional[Sequence[int]] = None,
                           borrowed: Union[bool, dict, None] = False) -> asyncio.Future: ...
    def cancel(self, future) -> bool: ...                  # withdraw a request that has not started
    # an accept_batch queued now, ordered before every request on its sessions submitted after this call (a
    # stream's accept frame); its future's result is None (a cf.Future in-process, an asyncio one otherwise)
    def submit_accept_batch(self, session_ids: Sequence[str], tokens: Sequence[int],
                            request_id: Optional[str] = None) -> Union[cf.Future, asyncio.Future]: ...
    def submit_accept(self, session_id: str, n_tokens: int,
                      request_id: Optional[str] = None) -> Union[cf.Future, asyncio.Future]: ...

    # --- session operations (blocking: the routes run them in a thread)
    # (request_id: PREFIX:N, ordering the operation among its client's calls on the session; see docs/client.md,
    # Late copies)
    def create_session(self, session_id: Optional[str] = None, request_id: Optional[str] = None) -> str: ...
    def delete_session(self, session_id: str, request_id: Optional[str] = None) -> None: ...
    def fork_session(self, src_id: str, new_id: Optional[str] = None, request_id: Optional[str] = None) -> str: ...
    def export_state(self, session_id: str) -> Any: ...
    def import_state(self, session_id: str, state, request_id: Optional[str] = None) -> None: ...
    def accept(self, session_id: str, n_tokens: int, request_id: Optional[str] = None) -> None: ...
    def accept_batch(self, session_ids: Sequence[str], tokens: Sequence[int],
                     request_id: Optional[str] = None) -> None: ...
    def session_info(self, session_id: str) -> dict: ...   # positions, pending verify, idle time
    def list_sessions(self, cursor: Optional[str] = None, limit: int = 100) -> dict: ...   # {"sessions", "next"}

    # --- life cycle (the app's lifespan)
    def start(self) -> None: ...
    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None: ...
