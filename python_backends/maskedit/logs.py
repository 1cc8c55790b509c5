"""Structured (JSON lines) logging for the services: one object per line on stderr."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "pid": os.getpid(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(service: str, level: str | None = None) -> logging.Logger:
    """Send the ``maskedit`` loggers to stderr as JSON; quiet the libraries' progress bars."""
    root = logging.getLogger("maskedit")
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level or os.environ.get("MASKEDIT_LOG_LEVEL", "INFO"))
    try:
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
    return root


def event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields) -> None:
    """Log ``msg`` with extra structured fields."""
    logger.log(level, msg, extra={"fields": fields})
