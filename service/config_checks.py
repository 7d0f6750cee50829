"""The checks of :class:`.config.Settings` across settings, run once every setting has its own value: a limit
given above the one that bounds it, two settings that contradict each other, and the defaults that follow another
setting (each left unset takes the value the other allows)."""

from __future__ import annotations

from convserve.clients.protocol.wire import BATCH_FIXED_OBJECTS, BATCH_SESSION_OBJECTS

from .unix_listener import check_path


#: the settings of the random model only (with ``weights`` the file says what they are)
RANDOM_MODEL = ("layers", "dim", "width", "seed")


def check_across(s):
    """Check (and, for those left at their defaults, fit) the settings of ``s`` against each other; raise
    ValueError naming the settings and the fix."""
    if s.engine_reply_timeout_s is not None and s.engine_reply_timeout_s <= s.request_timeout_s:
        raise ValueError(f"engine_reply_timeout_s ({s.engine_reply_timeout_s}) must exceed request_timeout_s "
                         f"({s.request_timeout_s}): a request may wait that long in the engine's queue before "
                         "it starts, and would then be answered as possibly applied")
    if s.snapshot_interval_s is not None and s.state_dir is None:
        raise ValueError("snapshot_interval_s is set but state_dir is not: snapshots are written only into "
                         "state_dir; set --state-dir (or drop --snapshot-interval-s)")
    if s.uds is not None:
        check_path(s.uds)
    given = s.model_fields_set
    random_only = [k for k in RANDOM_MODEL if k in given]
    if s.weights is not None and random_only:
        flags = ", ".join(f"--{k}" for k in random_only)
        them = ("it", "describes") if len(random_only) == 1 else ("them", "describe")
        raise ValueError(f"{flags} {them[1]} the random model, and weights is set: the model's layers, dim and "
                         f"width come from the file; drop {them[0]} (--dtype casts the file's weights)")
    if s.max_batch_tokens < s.max_tokens_per_request and "max_tokens_per_request" not in given:
        s.max_tokens_per_request = s.max_batch_tokens      # its default: at most what a step takes
    if s.max_batch_tokens < s.max_tokens_per_request:
        raise ValueError(f"max_tokens_per_request ({s.max_tokens_per_request}) exceeds max_batch_tokens "
                         f"({s.max_batch_tokens}): such a request could never be scheduled; raise "
                         "max_batch_tokens or lower max_tokens_per_request")
    need = BATCH_FIXED_OBJECTS + BATCH_SESSION_OBJECTS * s.max_batch_size
    if s.max_body_objects < need:
        raise ValueError(f"max_body_objects ({s.max_body_objects}) cannot hold a batch of max_batch_size "
                         f"({s.max_batch_size}) sessions ({BATCH_SESSION_OBJECTS} objects a session in its "
                         f"sessions, tokens, speculative and position lists, and up to {BATCH_FIXED_OBJECTS} "
                         f"more): raise max_body_objects to {need} or more, or lower max_batch_size")
    if s.max_spec_tokens > s.max_tokens_per_request and "max_spec_tokens" not in given:
        s.max_spec_tokens = s.max_tokens_per_request      # its default: at most what a request may carry
    # a limit given above the one that bounds it would read as taking effect and never could
    if "max_spec_tokens" in given and s.max_spec_tokens > s.max_tokens_per_request:
        raise ValueError(f"max_spec_tokens ({s.max_spec_tokens}) exceeds max_tokens_per_request "
                         f"({s.max_tokens_per_request}): no verify that long can be sent; lower it")
    if "max_json_body_bytes" in given and s.max_json_body_bytes > s.max_body_bytes:
        raise ValueError(f"max_json_body_bytes ({s.max_json_body_bytes}) exceeds max_body_bytes "
                         f"({s.max_body_bytes}), which bounds every body: lower it, or raise max_body_bytes")
    b = s.max_prefill_tokens_per_step
    if "max_prefill_tokens_per_step" in given and isinstance(b, int) and b > s.max_batch_tokens:
        raise ValueError(f"max_prefill_tokens_per_step ({b}) exceeds max_batch_tokens ({s.max_batch_tokens}), "
                         "the tokens of one step: lower it, or raise max_batch_tokens")
    c = s.caller_step_max_tokens       # (unset: 512 on CUDA, which a smaller step bounds as it is)
    if "caller_step_max_tokens" in given and c is not None and c > s.max_batch_tokens:
        raise ValueError(f"caller_step_max_tokens ({c}) exceeds max_batch_tokens ({s.max_batch_tokens}), the "
                         "tokens of one step, so no step that large comes to a caller's thread: lower it, or raise "
                         "max_batch_tokens")
    _fit_decode_buckets(s, "decode_buckets" in given)
    return s


def _fit_decode_buckets(s, given: bool) -> None:
    """No step holds more than ``max_batch_size`` rows, so a decode bucket above it is never used, yet costs its
    CUDA graphs (one per layer and bucket, per batch and verify slot) and buffers sized to the largest bucket.
    Buckets given so are refused. The default buckets above it are dropped and ``max_batch_size`` becomes the
    largest bucket: a step of that many decodes of one layer still runs in one decode launch, padded to no more
    than it holds (the largest bucket bounds a layer's decode rows and a batch's one-token rows)."""
    most = s.max_batch_size
    if s.decode_buckets[-1] <= most:
        return
    fit = [b for b in s.decode_buckets if b < most] + [most]
    if given:
        over = [b for b in s.decode_buckets if b > most]
        raise ValueError(f"decode_buckets {', '.join(map(str, over))} exceed max_batch_size ({most}), the rows of "
                         "one step: no decode batch fills them, and their CUDA graphs would be captured for "
                         f"nothing; drop them (decode_buckets {','.join(map(str, fit))}), or raise "
                         f"max_batch_size to {over[-1]}")
    s.decode_buckets = fit
