"""Triton ``intake``: the ensemble's first step, a count and a denoise-queue check on arrival (see
``maskedit.intake``)."""

from __future__ import annotations

import time

from .. import logs
from ..admission import QueueBoard, board_path
from ..fair_share import tenant_of
from ..intake import Intake
from ..settings import load_settings
from . import io


class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings()
        self.log = logs.setup("intake", settings.service.log_level)
        self.intake = Intake(QueueBoard(board_path(settings.service.admission_dir)))

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        start = time.time()
        try:
            tenant, weight = tenant_of(request.parameters())  # set by the router after it checked the caller's key
            return io.response({"INTAKE_INFO": self.intake.decide(start, tenant, weight)})
        except Exception as e:
            self.log.warning("refused request: %s", e)
            return io.error_response(e, request.request_id())
        finally:  # every execution: what bounds the next request's arrival
            self.intake.ran(start, time.time())
