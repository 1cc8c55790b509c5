"""Triton ``controlnet``: a step's ControlNet residuals for one request per Triton request (``controlnets.wire``),
computed by ``controlnets.service``. Called through BLS by ``masked_denoise`` when
``MASKEDIT_CONTROLNET_PLACEMENT=triton``; its instance group is its own (docs/controlnet.md). Each request is
answered alone: one bad or failing request never fails the others Triton hands over with it."""

from __future__ import annotations


from .. import logs
from ..controlnets.wire import INPUTS
from ..settings import load_settings
from . import io


class TritonPythonModel:
    def initialize(self, args):
        self.settings = load_settings()
        self.log = logs.setup("controlnet", self.settings.service.log_level)
        io.limit_threads(args, self.settings.service, default=1)  # see docs/controlnet.md
        self._service = None  # loaded on first use: a server whose family runs no ControlNets pays nothing

    @property
    def service(self):
        if self._service is None:
            from ..controlnets.service import ControlNetService

            self._service = ControlNetService(self.settings)
        return self._service

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            arrays = {k: io.array(request, k) for k in INPUTS}
            out = self.service.run({k: v for k, v in arrays.items() if v is not None})
            return io.response(out)
        except Exception as e:
            self.log.exception("controlnet call failed")
            return io.error_response(e, request.request_id())
