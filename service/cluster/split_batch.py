"""A batch whose sessions live on several engines: its parts, the check of their positions, and the join.

:meth:`.remote.RemoteEngine.submit_batch_async` sends each engine its part (the sessions it holds, in batch order,
with their slices of x) after every part was checked; these functions are the pieces of that which need no link.
"""

from __future__ import annotations

import copy
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import torch

from convserve.clients.protocol.errors import (BadRequest, EngineTimeout, LateRequest, PositionMismatch, ServiceError,
                                               StateLost, UnknownSession)

from ..engine.positions import PART_POSITIONS, mismatch_message
from ..engine.positions import check_positions as check_position_list
from ..engine.validate import (check_batch_plan, check_batch_rows, check_batch_sessions, check_one_token_rows,
                               check_padded_verify, check_x)
from ..model import layer_position
from ..sessions import with_gone


def batch_limits(settings) -> SimpleNamespace:
    """The engines' batch limits (every engine runs with the same settings) that :func:`check_whole` applies."""
    return SimpleNamespace(max_batch_size=settings.max_batch_size, max_spec_tokens=settings.max_spec_tokens,
                           max_batch_tokens=settings.max_batch_tokens, max_bucket=max(settings.decode_buckets),
                           check_finite=settings.check_finite)


def whole_model(info: dict) -> SimpleNamespace:
    """What :func:`check_whole` needs of the model, from an engine's ``model_info()``."""
    layers = list(info["layers"])
    return SimpleNamespace(dim=int(info["dim"]), dtype=getattr(torch, info["dtype"]), layers=layers,
                           positions={layer: p for p, layer in enumerate(layers)})


def check_whole(sids: list, x, tokens, speculative, position, layer, limits, model) -> torch.Tensor:
    """The checks of a batch that need no session state, run on the whole batch before it is split, in the
    engine's order and with its messages (each engine would run them on its part only, and a part refused there
    would leave the others applied): distinct sessions, ``position`` (one per session, or None), the layer, the
    ``tokens`` / ``speculative`` plan within ``max_spec_tokens``, x's dtype and shape, NaN/Inf after the cast to
    the model dtype (with ``check_finite``), x's rows against the tokens, ``max_batch_tokens`` and, with verify
    rows, the one-token rows against the largest decode bucket. ``limits``: ``max_batch_size``, ``max_spec_tokens``,
    ``max_batch_tokens``, ``max_bucket``, ``check_finite``; ``model``: :func:`whole_model`.
    Returns x as the model dtype's contiguous CPU tensor, checked."""
    n = check_batch_sessions(sids, limits.max_batch_size)
    if position is not None:
        check_position_list(position, n)
    layer_position(layer, model.positions, model.layers)
    plan = check_batch_plan(n, tokens, speculative, limits.max_spec_tokens)
    xm, _ = check_x(model, limits, x, False, rows="rows")
    total = n if plan is None else int(plan[0].sum())
    check_batch_rows(xm.shape[0], total, plan is not None, model.dim, limits.max_batch_tokens)
    if plan is not None and plan[1].any():        # the verify rows of one engine's launch are padded as a whole
        check_padded_verify(plan[0][plan[1]], total, limits.max_batch_tokens)
    # only a batch with verify rows runs its one-token rows in a decode launch (others: in the prefill launch)
    verifies = plan is not None and plan[1].any()
    check_one_token_rows(int(np.count_nonzero(~plan[1] & (plan[0] == 1))) if verifies else 0, limits.max_bucket)
    return xm


def whole_key(sids: list, tokens, speculative) -> str:
    """What identifies a split batch with positions for its parts' repeats, the same in every worker: a digest of
    its sessions in order, tokens and flags. Each part's kept answer carries it, so a part repeats an applied part
    only within the same whole batch (a batch sent again in another order is not a repeat, as on one engine)."""
    n = len(sids)
    toks = [1] * n if tokens is None else [int(k) for k in tokens]
    spec = [bool(speculative)] * n if not isinstance(speculative, list) else [bool(f) for f in speculative]
    return hashlib.blake2b(json.dumps([list(sids), toks, spec]).encode(), digest_size=16).hexdigest()


def parts_of(groups: dict, speculative) -> list:
    """``(engine, positions in the batch, that part's speculative)`` per engine of ``groups`` (``placement.split``)."""
    return [(e, pos, speculative if not isinstance(speculative, list) else [speculative[i] for i in pos])
            for e, pos in groups.items()]


def sub(v, pos):
    """The entries of a per-session list (or None) at ``pos``."""
    return None if v is None else [v[i] for i in pos]


def row_indices(parts: list, tokens, n: int) -> list:
    """Per part, the rows of x its sessions' slices hold (an int64 tensor), with ``tokens`` rows per session
    (None: one each) among ``n`` sessions."""
    lengths = np.ones(n, np.int64) if tokens is None else np.asarray(tokens, np.int64)
    starts = np.cumsum(lengths) - lengths
    return [torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in pos]))
            for _e, pos, _spec in parts]


def refusal(parts: list, checks: list, sids: list, position, layer: int):
    """The error a split batch is refused with (None: every part may go on), as the in-process engine would
    choose it for the whole batch (``checks``: each part's answer or error). Its checks come in this order, so
    the first kind any part raised wins: an unknown or lost session, a late ``request_id``, the positions, then
    a session's own state (a pending verify, a queued import). The positions' ``409`` lists every session's,
    gathered from the parts' answers and errors (each part checks its positions before its sessions' state).
    When every part is new or a repeat, the batch goes on, each part run (new) or answered from its kept answer
    (a repeat). A mix of new and repeated parts is this batch sent again after an attempt of which only some
    parts ran (its worker died between the sends, say): a part repeats only the applied part of the same whole
    batch (its ``whole_key``) and request id, so the other parts complete it, exactly once. A part of
    speculative slices is either: a verify leaves the positions alone, so its repeat is to run it again (the
    same answer, the same pending verify)."""
    errors = [c for c in checks if isinstance(c, BaseException)]
    if not errors:
        return None
    first = min(errors, key=_check_rank)         # (the earliest part among equals)
    if not isinstance(first, PositionMismatch):
        return check_refusal(checks, sids)
    server: list = [None] * len(sids)
    for (_e, pos, _spec), c in zip(parts, checks):
        got = (c.position if isinstance(c, PositionMismatch) else
               c.extra.get(PART_POSITIONS) if isinstance(c, ServiceError) else
               None if isinstance(c, BaseException) else c["positions"])
        for i, q in zip(pos, got or ()):
            server[i] = q
    refused = [c for c in errors if isinstance(c, PositionMismatch)]
    applied = _common_applied_id(refused)
    differ = [sid for sid, want, q in zip(sids, position, server) if q is not None and want != q]
    # one request applied at every part's positions: the parts' own account (which names it), as the engine's
    what = (first.message.split(";")[0] if applied or not differ else
            f"layer {layer}: the batch's positions differ from the sessions' for {differ[:8]!r:.300}")
    return PositionMismatch(mismatch_message(what, server), position=server, **applied)


def check_refusal(checks: list, sids: list):
    """The error an accept split across engines is refused with, from its parts' checks (each None or an error;
    None: every part may go on): as :func:`refusal` picks it, without positions."""
    errors = [c for c in checks if isinstance(c, BaseException)]
    if not errors:
        return None
    first = min(errors, key=_check_rank)         # (the earliest part among equals)
    return _gone(errors, sids) if isinstance(first, (StateLost, UnknownSession)) else _own(first)


def _gone(errors: list, sids: list) -> ServiceError:
    """A copy of the parts' 410 or 404 that the whole request would have raised in one engine (the error of its
    first session, in its order, that is not live), naming every session of it that its parts found lost or
    unknown, in its order (:func:`with_gone`)."""
    at = {sid: i for i, sid in enumerate(sids)}
    gone = [e for e in errors if isinstance(e, (StateLost, UnknownSession))]
    first = min(gone, key=lambda e: min((at.get(s, len(sids)) for k in ("lost", "unknown")
                                         for s in e.extra.get(k, ())), default=len(sids)))
    out = copy.copy(_own(first))
    found = {k: sorted({s for e in errors if isinstance(e, ServiceError) for s in e.extra.get(k, ())}, key=at.get)
             for k in ("lost", "unknown")}
    return with_gone(out, found["lost"], found["unknown"])


def _check_rank(err: BaseException) -> int:
    """Where the engine's batch check raises ``err``: 0 an unknown or lost session (or an engine that does not
    answer), 1 a late ``request_id``, 2 the positions, 3 a session's own state (past the positions)."""
    if isinstance(err, BadRequest) or (isinstance(err, ServiceError) and PART_POSITIONS in err.extra):
        return 3
    return 2 if isinstance(err, PositionMismatch) else 1 if isinstance(err, LateRequest) else 0


def _own(err: BaseException) -> BaseException:
    """``err`` as the client gets it: without the part's positions (a copy: one engine's error may be shared)."""
    if not isinstance(err, ServiceError) or PART_POSITIONS not in err.extra:
        return err
    out = copy.copy(err)
    out.extra = {k: v for k, v in err.extra.items() if k != PART_POSITIONS}
    return out


def _common_applied_id(errors: list) -> dict:
    """``{"applied_request_id": id}`` when every refused part (``errors``, its 409s) found the same request applied
    at its claimed positions, else ``{}``: a client books its lost answer only by an id all parts agree on."""
    applied = {repr(e.extra["applied_request_id"]) for e in errors if "applied_request_id" in e.extra}
    if len(applied) == 1 and all("applied_request_id" in e.extra for e in errors):
        return {"applied_request_id": errors[0].extra["applied_request_id"]}
    return {}


def failure(parts: list, results: list, sids: list, position=None, tokens=None) -> BaseException:
    """The error to raise for a split batch some of whose parts failed (``results``: each part's y or error).
    A part whose step failed after its launches lost its sessions' state: that (410) is what the client must
    learn, not another part's retryable error. When other parts ran, the error's ``applied`` field lists their
    sessions (in batch order) and the message says so: sending the batch again without positions would apply
    those slices twice. A part refused for its positions (``position``: the batch's, ``tokens`` its lengths)
    after others ran is a 409 whose ``position`` lists every session's (:func:`_mismatch_after_parts_ran`)."""
    failed = [r for r in results if isinstance(r, BaseException)]
    first = next((r for r in failed if isinstance(r, StateLost)), failed[0])
    done = sorted((i for p, r in zip(parts, results) if not isinstance(r, BaseException) for i in p[1]))
    if done and isinstance(first, PositionMismatch) and position is not None:
        first = _mismatch_after_parts_ran(first, parts, results, position, tokens)
    if done and isinstance(first, ServiceError):
        first = partly_applied(first, [sids[i] for i in done], "slices",
                               any(isinstance(r, EngineTimeout) for r in failed))
    return first


def _mismatch_after_parts_ran(err: PositionMismatch, parts: list, results: list, position: list, tokens):
    """``err``, a part's 409, for the whole batch: ``position`` per session in batch order, the refused parts'
    as they reported them, the parts that ran at their claimed positions moved by their plain slices' tokens, and
    null for a part that failed otherwise (nothing known of it here)."""
    server: list = [None] * len(position)
    for (_e, pos, spec), r in zip(parts, results):
        if isinstance(r, PositionMismatch) and isinstance(r.position, list):
            for i, q in zip(pos, r.position):
                server[i] = q
        elif not isinstance(r, BaseException):
            flags = spec if isinstance(spec, list) else [bool(spec)] * len(pos)
            for i, f in zip(pos, flags):
                server[i] = position[i] + (0 if f else 1 if tokens is None else tokens[i])
    refused = [r for r in results if isinstance(r, PositionMismatch)]
    extra = {**{k: v for k, v in err.extra.items() if k not in ("position", "applied_request_id")},
             **_common_applied_id(refused)}
    return PositionMismatch(f"{err.message.split(';')[0]}; the batch's parts on other engines ran. The server's "
                            f"positions are {server!r:.300} (in 'position'; null where not known)",
                            position=server, **extra)


def partly_applied(err: ServiceError, applied: list, what: str, unknown: bool = False) -> ServiceError:
    """A copy of ``err`` (an engine's error may be one object shared by every request that was waiting on that
    engine) that lists ``applied``, the sessions whose part of the request ran, in its ``applied`` field and its
    message. ``unknown``: a part's engine did not answer in time, so the others may have run too."""
    out = copy.copy(err)
    out.extra = {**err.extra, "applied": applied}
    others = ("the others may or may not have been (an engine did not answer in time): GET their sessions before "
              "sending them again" if unknown else
              "the others not; see 'applied'. Send only the others again, or the request with positions")
    out.message = (f"{err.message} (this request was split across engines and only some parts answered: the "
                   f"{what} of {applied!r:.300} were applied, {others})")
    out.args = (out.message,)
    return out


def sent_or_refused(loop, sends) -> list:
    """Each part's future: what its ``send()`` returned, or a future holding the error it raised at once (its
    engine went down after the checks), so that the parts already sent are still awaited and reported
    (:func:`failure`)."""
    out = []
    for send in sends:
        try:
            out.append(send())
        except Exception as exc:  # noqa: BLE001 - reported with the other parts' outcomes
            out.append(loop.create_future())
            out[-1].set_exception(exc)
    return out
