"""Structured logs: one JSON object per line on stderr, for our loggers and uvicorn's alike.

Fields: ``ts`` (ISO 8601 UTC), ``level``, ``logger``, ``msg``, with engine processes ``proc`` (which process
wrote the line: ``supervisor``, ``worker-N``, ``engine-N``), plus whatever the call passed in ``extra``
(``log.info("listening", extra={"port": 8000})``) and ``exc`` with the traceback when there is one.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# Attributes every LogRecord has; anything else on a record came from ``extra`` and is emitted as a field.
_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "color_message",
                                                                    "taskName"}


class RedactSecrets(logging.Filter):
    """Blank what must never reach a log at any level: the API key's value and any ``authorization`` header value
    (uvicorn and websockets log request headers at debug level)."""

    _AUTH = re.compile(r"(?i)(authorization['\"]?\s*[:,=]\s*\(?\s*b?['\"]?)(bearer\s+)?[^'\"\s,)]+")
    secrets: tuple = ()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = self._AUTH.sub(lambda m: m.group(1) + (m.group(2) or "") + "***", msg)
        for s in self.secrets:
            clean = clean.replace(s, "***")
        if clean != msg:
            record.msg, record.args = clean, None
        return True


class JsonFormatter(logging.Formatter):
    #: this process's name in a multi-process server (set_process), on every line; "" for none
    process = ""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.process:
            out["proc"] = self.process
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class ConnectionLines(logging.Filter):
    """Drops the lines uvicorn and websockets write per WebSocket connection at info level (the handshake's
    outcome, "connection open", "connection closed"): access-log lines, kept only with ``access_log``."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not (record.levelno == logging.INFO and (msg.startswith('%s - "WebSocket %s"')
                                                        or msg in ("connection open", "connection closed")))


def log_config(level: str = "info", access: bool = False) -> dict:
    """A ``logging.config.dictConfig`` dict (also handed to uvicorn) sending everything as JSON to stderr;
    ``access``: the ``access_log`` setting (the WebSocket connections' lines too)."""
    lvl = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "filters": {"secrets": {"()": RedactSecrets}, "connections": {"()": ConnectionLines}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr",
                                "filters": ["secrets"]}},
        "loggers": {
            "convserve": {"handlers": ["stderr"], "level": lvl, "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": lvl, "propagate": False},
            "uvicorn.error": {"level": lvl, "filters": [] if access else ["connections"]},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }


def configure(level: str = "info", secrets=(), access: bool = False) -> None:
    """Send every log as JSON to stderr; ``secrets`` (the API key) are blanked wherever they would appear."""
    import logging.config

    RedactSecrets.secrets = tuple(s for s in secrets if s)
    logging.config.dictConfig(log_config(level, access))
    logging.captureWarnings(True)
    sys.stderr.reconfigure(line_buffering=True)


def set_process(name: str) -> None:
    """Name this process (``worker-0``) in the ``proc`` field of every line it writes from now on."""
    JsonFormatter.process = name
