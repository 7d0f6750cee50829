"""What one step of a load test measured: latencies per kind, tokens, bytes, errors and retries by code."""

from __future__ import annotations

import collections
import math
import time
from fractions import Fraction
from typing import Optional

#: Kinds of conv requests (each carries tokens; ``batch`` is one layer's call of the frontend scenario).
CONV_KINDS = ("prefill", "decode", "verify", "batch")
#: The frontend scenario's compound kinds: a step of every layer, and a session's time to its prefill's end.
FRONTEND_KINDS = ("step", "prefill_done")
CONTROL_KINDS = ("create", "delete", "accept")


def percentile(sorted_xs, q: float) -> float:
    """Nearest-rank percentile of an already sorted list (``q`` in [0, 1]): the smallest value with at least
    ``q`` of the values at or below it, i.e. index ``ceil(q * n) - 1``; NaN when empty. ``q`` is taken as the
    decimal it was written as (0.99 is 99/100, not the float just above it), so ``0.99 * 100`` is rank 99."""
    n = len(sorted_xs)
    if not n:
        return float("nan")
    rank = math.ceil(Fraction(repr(float(q))) * n)
    return sorted_xs[min(n - 1, max(0, rank - 1))]


class Recorder:
    """Collects one step. Only operations started at or after ``measure_from`` count (the warm-up does not): a
    request's latency, tokens, error, retries and verification all count by the time the request started, a
    completed session by the time it completed."""

    def __init__(self, measure_from: float, live_window_s: float = 2.0):
        self.measure_from = measure_from
        self.lat: dict = collections.defaultdict(list)
        self.tokens: dict = collections.Counter()
        self.errors: collections.Counter = collections.Counter()          # conv requests (and dropped arrivals)
        #: errors of control calls (create, delete, accept), by kind then code: not conv errors
        self.control_errors: dict = collections.defaultdict(collections.Counter)
        #: the first message the server (or the client library) gave for each error code
        self.error_messages: dict = {}
        self.retries: collections.Counter = collections.Counter()
        self.last_conv_done: Optional[float] = None
        self.sessions_done = 0
        self.accepted_tokens = 0
        self.verified = 0
        self.mismatches = 0
        self.prefill_steps = 0      # frontend steps carrying prefill rows, and their prefill tokens
        self.prefill_tokens = 0
        self.ok_total = 0           # conv requests answered, warm-up included (progress display)
        self.err_total = 0
        self._recent = collections.deque()   # (t_done, latency) of conv requests, for the live view
        self._window = live_window_s

    def ok(self, kind: str, t_start: float, t_done: float, tokens: int = 0) -> None:
        if kind in CONV_KINDS:
            self.ok_total += 1
            rec = self._recent
            rec.append((t_done, t_done - t_start))
            # keep only the live window (amortized O(1)); without a live view nothing else trims it, and a long
            # step would hold every request's entry
            horizon = t_done - self._window
            while rec[0][0] < horizon:
                rec.popleft()
        if t_start < self.measure_from:
            return
        self.lat[kind].append(t_done - t_start)
        self.tokens[kind] += tokens
        if kind not in CONTROL_KINDS and (self.last_conv_done is None or t_done > self.last_conv_done):
            self.last_conv_done = t_done

    def error(self, code: str, t_start: float, kind: str = "", message: Optional[str] = None) -> None:
        """A failed request: a conv error, or with ``kind`` one of :data:`CONTROL_KINDS` a control-call error."""
        self.err_total += 1
        if t_start < self.measure_from:
            return
        if kind in CONTROL_KINDS:
            self.control_errors[kind][code] += 1
        else:
            self.errors[code] += 1
        if message and code not in self.error_messages:
            self.error_messages[code] = message[:500]

    def retry(self, code: str, t_start: float) -> None:
        if t_start >= self.measure_from:
            self.retries[code] += 1

    def accepted(self, t_start: float, tokens: int) -> None:
        """A frontend step's tokens that advanced its sessions: prefill and decode tokens and the accepted part of
        each verify (its ``step`` tokens are every token sent, drafted verify tokens included)."""
        if t_start >= self.measure_from:
            self.accepted_tokens += tokens

    def checked(self, t_start: float, mismatch: bool) -> None:
        """One answer compared with the reference (``mismatch``: it differed; also an error of its request)."""
        if t_start >= self.measure_from:
            self.verified += 1
            self.mismatches += mismatch

    def prefill_step(self, t_start: float, tokens: int) -> None:
        """A frontend step begun at ``t_start`` carried ``tokens`` (> 0) prefill tokens."""
        if t_start >= self.measure_from:
            self.prefill_steps += 1
            self.prefill_tokens += tokens

    def session_done(self, t_done: float) -> None:
        if t_done >= self.measure_from:
            self.sessions_done += 1

    # --- live view

    def live(self, now: Optional[float] = None) -> dict:
        now = time.perf_counter() if now is None else now
        rec = self._recent
        while rec and rec[0][0] < now - self._window:
            rec.popleft()
        lats = sorted(lt for _, lt in rec)
        return {"req_per_s": len(lats) / self._window, "p50_ms": percentile(lats, 0.5) * 1e3,
                "p99_ms": percentile(lats, 0.99) * 1e3}

    # --- summary

    def summary(self, end: float, bytes_sent: int, bytes_received: int) -> dict:
        """Every figure of the step. Rates are over ``[measure_from, max(end, last conv answer)]``; the caller
        passes the deadline, the last conv answer (a ``--requests`` step) or the interrupt's time as ``end``, so
        the deletes and other control calls after the last conv answer do not stretch the window."""
        stop = max(end, self.last_conv_done or end)
        elapsed = max(1e-9, stop - self.measure_from)
        kinds = {}
        conv_lats = []
        n_conv = tok_conv = 0
        for kind in CONV_KINDS + FRONTEND_KINDS + CONTROL_KINDS:
            xs = self.lat.get(kind)
            if not xs:
                continue
            xs = sorted(xs)
            if kind in CONV_KINDS:
                conv_lats.extend(xs)
                n_conv += len(xs)
                tok_conv += self.tokens[kind]
            kinds[kind] = {"count": len(xs), "tokens": self.tokens[kind], "req_per_s": len(xs) / elapsed,
                           "tokens_per_s": self.tokens[kind] / elapsed, **_lat_fields(xs)}
            if kind == "step":
                kinds[kind].update(accepted_tokens=self.accepted_tokens,
                                   accepted_tokens_per_s=self.accepted_tokens / elapsed)
        conv_lats.sort()
        return {
            "elapsed_s": elapsed,
            "requests": n_conv,
            "tokens": tok_conv,
            "req_per_s": n_conv / elapsed,
            "tokens_per_s": tok_conv / elapsed,
            "mb_sent": bytes_sent / 1e6,
            "mb_received": bytes_received / 1e6,
            "mb_per_s": (bytes_sent + bytes_received) / 1e6 / elapsed,
            "latency": _lat_fields(conv_lats),
            "kinds": kinds,
            "errors": dict(sorted(self.errors.items())),
            "errors_total": sum(self.errors.values()),
            "control_errors": {k: dict(sorted(v.items())) for k, v in sorted(self.control_errors.items())},
            "control_errors_total": sum(sum(v.values()) for v in self.control_errors.values()),
            "error_messages": dict(sorted(self.error_messages.items())),
            "retries": dict(sorted(self.retries.items())),
            "retries_total": sum(self.retries.values()),
            "sessions_completed": self.sessions_done,
            "prefill_steps": self.prefill_steps,
            "prefill_tokens": self.prefill_tokens,
            "verify": {"checked": self.verified, "mismatches": self.mismatches},
        }


def _lat_fields(sorted_xs) -> dict:
    if not sorted_xs:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    return {"p50_ms": percentile(sorted_xs, 0.5) * 1e3, "p90_ms": percentile(sorted_xs, 0.9) * 1e3,
            "p99_ms": percentile(sorted_xs, 0.99) * 1e3, "max_ms": sorted_xs[-1] * 1e3,
            "mean_ms": sum(sorted_xs) / len(sorted_xs) * 1e3}
