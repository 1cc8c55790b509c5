"""Triton ``cancel``: mark request ids as cancelled for the denoise loop (see ``maskedit.cancel``)."""

from __future__ import annotations

import numpy as np

from .. import logs
from ..cancel import CancelBoard
from . import io


class TritonPythonModel:
    def initialize(self, args):
        self.log = logs.setup("cancel")
        self.board = CancelBoard()

    def execute(self, requests):
        out = []
        for request in requests:
            ids = io.array(request, "REQUEST_IDS")
            n = sum(self.board.cancel(i.decode() if isinstance(i, bytes) else str(i)) for i in ids.reshape(-1))
            self.board.sweep()
            out.append(io.response({"CANCELLED": np.array([n], np.int32)}))
        return out
