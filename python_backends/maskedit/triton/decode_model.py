"""Triton ``vae_decode``: final latents to the response PNG (see ``maskedit.decode``)."""

from __future__ import annotations

import json
import time

from .. import logs
from ..admission import QueueBoard, board_path
from ..completion import Ema
from ..decode import Decoder
from ..settings import load_settings
from . import io


class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings()
        self.log = logs.setup("vae_decode", settings.service.log_level)
        io.limit_threads(args, settings.service, default=1)
        self.decoder = Decoder(settings)
        self.board = QueueBoard(board_path(settings.service.admission_dir))  # its decoding time, for admission
        self.decode_s = Ema()

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        t0 = time.perf_counter()
        try:
            info = json.loads(io.blob(request, "REQUEST_INFO_OUT"))
            if "progress" in info:  # a progress response: pass it on, nothing to decode
                return io.response({"IMAGE": b"", "EDIT_INFO": info})
            size = io.array(request, "MODEL_SIZE_OUT")
            generated = None
            if not info.get("skip_model"):
                generated = self.decoder.decode_latents(io.array(request, "DENOISED"), int(size[0]), int(size[1]))
            image = self.decoder.finish(generated, io.array(request, "TEMPLATE_RGB_OUT"),
                                        io.array(request, "ALPHA_OUT"), info["raw_output"], info["base64"],
                                        crop=info.get("crop"), fmt=info.get("output_format", "png"),
                                        quality=info.get("output_quality", 95))
            info["decode_s"] = round(time.perf_counter() - t0, 6)
            if info.get("arrival_ts"):  # from its earliest arrival: what the front predicted, what it took
                info["answered_s"] = round(time.time() - info["arrival_ts"], 3)
                if info.get("predicted_ts"):
                    info["predicted_s"] = round(info["predicted_ts"] - info["arrival_ts"], 3)
            if generated is not None:
                self.decode_s.observe(info["decode_s"])
                self.board.decoded(self.decode_s.get())
            logs.event(self.log, "edit done", **{k: info.get(k) for k in
                       ("template_hash", "mask_ratio", "steps", "preprocess_s", "queue_s", "denoise_s", "decode_s",
                        "answered_s", "predicted_s")})
            return io.response({"IMAGE": image, "EDIT_INFO": info})
        except Exception as e:
            self.log.exception("decode failed")
            return io.error_response(e, request.request_id())
