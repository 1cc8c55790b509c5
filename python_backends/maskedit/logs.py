"""Structured logging for the model processes: the shared JSON-lines format (``maskedit_common.logs``) on stderr."""

from __future__ import annotations

import logging
import sys

from maskedit_common.logs import JsonFormatter, event

__all__ = ["JsonFormatter", "event", "setup"]


def setup(service: str, level: str = "INFO") -> logging.Logger:
    """Send the ``maskedit`` loggers to stderr as JSON at ``level`` (``Settings.service.log_level``); quiet the
    libraries' progress bars."""
    root = logging.getLogger("maskedit")
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)
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
