"""The scheduler's output: what the engine runs in one step (:class:`SchedulerOutput`), one plain dataclass per
launch, a comment per field. :mod:`convserve.service.scheduler` decides it; the engine's runner executes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(slots=True)
class PrefillBatch:
    """One prefill launch: packed sequences of one layer (``causal_conv1d_fn``)."""

    layer: int                    # conv layer position: pool layer and index into the stacked weights
    requests: list                # the request of each row, in packing order
    starts: list                  # first token of each row's chunk within its request's x
    query_start_loc: list         # (rows + 1,) cumulative token offsets of the rows within this batch, from 0
    cache_indices: list           # pool slot of each row
    has_initial_state: list       # per row: continue from the stored state (False: start from zeros)
    token_offset: int             # where this batch's tokens start in the step's packed token buffer


@dataclass(slots=True)
class DecodeBatch:
    """One decode launch of one layer (``causal_conv1d_update``, one token per row), padded to a bucket. A step
    has at most one per layer (the launch's buffers are the layer's)."""

    layer: int                    # conv layer position
    requests: list                # the request of each real row (rows past len(requests) are padding); for a
    #                               batch request, that one request
    cache_indices: Optional[list]  # (bucket,) pool slot per row, PAD_SLOT_ID for the padding rows; None for a
    #                               batch request (the engine's record of it holds its rows' slots)
    bucket: int                   # padded batch size: the smallest configured bucket >= rows
    rows: int = 0                 # real rows: len(requests), or the batch request's rows


@dataclass(slots=True)
class VerifyBatch:
    """One speculative-verify launch of one layer: ``n_tokens`` tokens per row (each row's real tokens, then pad
    tokens up to ``n_tokens``), the state left unwritten."""

    layer: int                    # conv layer position
    n_tokens: int                 # tokens of every row in the launch: the longest row's
    requests: list                # the request of each row (a batch request once per row of it)
    cache_indices: list           # pool slot per row
    token_offset: int             # where this batch's rows start in the packed token buffer (row-major)
    starts: list = field(default_factory=list)    # first token of each row within its request's x
    lengths: list = field(default_factory=list)   # real tokens of each row (<= n_tokens)
    sessions: list = field(default_factory=list)  # the Session of each row


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the engine runs in one step."""

    step: int                                            # step number, from 0
    prefills: list = field(default_factory=list)         # PrefillBatch per layer with prefill rows
    decodes: list = field(default_factory=list)          # DecodeBatch per layer with decode rows
    verifies: list = field(default_factory=list)         # VerifyBatch per layer with verify rows
    verify_slots: list = field(default_factory=list)     # batch requests whose verify rows launch from their
    #                                                      verify slot (``RowBatch.vbuf``), one launch each
    prefill_slots: list = field(default_factory=list)    # batch requests without verify rows that launch from
    #                                                      their prefill slot (``RowBatch.pbuf``), one launch each
    batches: list = field(default_factory=list)          # the batch requests of this step (also in finished)
    finished: list = field(default_factory=list)         # requests whose last token runs now, in arrival order
    expired: list = field(default_factory=list)          # never-started requests past request_timeout_s: fail
    num_rows: int = 0                                    # real rows of all launches (chunks count once)
    num_tokens: int = 0                                  # real tokens of all launches
    packed_tokens: int = 0                               # tokens in the packed buffer (prefill + verify,
    #                                                      verify pad tokens included)
    num_padded_rows: int = 0                             # decode padding rows added to reach the buckets

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes or self.verifies or self.verify_slots or self.prefill_slots)
