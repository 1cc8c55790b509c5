"""Triton ``cancel``: mark request ids as cancelled for the denoise loop (see ``maskedit.cancel``)."""

from __future__ import annotations

import numpy as np

from .. import logs
from ..cancel import CancelBoard
from ..settings import load_settings
from . import io


class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings()
        self.log = logs.setup("cancel", settings.service.log_level)
        self.board = CancelBoard(settings.service.cancel_dir)

    def execute(self, requests):
        out = []
        for request in requests:
            ids = io.array(request, "REQUEST_IDS")
            n = sum(self.board.cancel(i.decode() if isinstance(i, bytes) else str(i)) for i in ids.reshape(-1))
            self.board.sweep()
            out.append(io.response({"CANCELLED": np.array([n], np.int32)}))
        return out
