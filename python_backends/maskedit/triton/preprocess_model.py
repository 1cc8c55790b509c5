"""Triton ``preprocess``: decode/validate, text + VAE encoding, token mask (see ``maskedit.preprocess``)."""

from __future__ import annotations

import math
import time

import numpy as np
from maskedit_common.request_fields import PARAMS

from .. import logs
from ..adapters import prefetch as adapter_prefetch
from ..admission import FrontCheck, QueueBoard, board_path
from ..arrival import sent_stamp
from ..cancel import CancelBoard
from ..controlnets.job import to_wire
from ..errors import Cancelled
from ..fair_share import tenant_of
from ..intake import floor_of
from ..params import parse_params
from ..preprocess import Preprocessor
from ..schedule import first_step
from ..settings import load_settings
from . import io
from .adapter_metrics import AdapterMetrics
from .cache_setup import StoreMetrics, cache_store, keep_recovering
from .prompt_cache_metrics import PromptCacheMetrics


class TritonPythonModel:
    def initialize(self, args):
        self.settings = load_settings()
        self.log = logs.setup("preprocess", self.settings.service.log_level)
        io.limit_threads(args, self.settings.service, default=1)
        store = cache_store(self.settings.cache, self.log)
        self.pre = Preprocessor(self.settings, store=store)
        self._probe = keep_recovering(store, self.settings.cache)  # its own view of the tiers' health recovers too
        self.board = QueueBoard(board_path(self.settings.service.admission_dir))
        b, res = self.settings.batching, self.settings.resolution
        self.front = FrontCheck(self.board, b.latency_bound_s, b.max_batch, b.max_tokens_per_step,
                                full_tokens=(res // self.pre.patch) ** 2, skew_s=b.clock_skew_s)
        self.board.preprocess_idle(time.time())  # a restart after a crash mid-execution: intake's count may heal
        self._stamp_noted = -math.inf  # when a stamp set aside was last logged (at most one a minute)
        self.cancels = CancelBoard(self.settings.service.cancel_dir)
        # Adapters a request names are converted into the host tier of the adapter cache in the background.
        self.prefetch = adapter_prefetch.from_settings(self.settings, self.pre.adapters)
        self.adapter_metrics = None
        if self.prefetch is not None:
            self.adapter_metrics = AdapterMetrics(self.prefetch.stats, self.prefetch.host,
                                                 prefix="maskedit_lora_prefetch", tiers=("host",))
            self._adapter_sync = self.adapter_metrics.sync_every(self.settings.service.metrics_sync_s)
        prompts = self.pre.family.prompt_cache(self.settings)  # encoded prompts kept by the family, if any
        self.prompt_metrics = PromptCacheMetrics(prompts) if prompts is not None else None
        # what it finds (a corrupt disk entry at promotion, a corrupt adapter entry) counted in the same metrics
        self.store_metrics = StoreMetrics(store, "preprocess", self.prefetch.stats if self.prefetch else None)
        self._store_sync = self.store_metrics.sync_every(self.settings.service.metrics_sync_s)
        logs.event(self.log, "ready", model_dir=str(self.settings.model_dir), resolution=self.settings.resolution)

    def execute(self, requests):
        responses = [self._one(r) for r in requests]
        if self.prompt_metrics is not None:
            self.prompt_metrics.sync()
        return responses

    def finalize(self):
        if self.adapter_metrics is not None:
            self._adapter_sync.set()
        self._store_sync.set()
        if self._probe is not None:
            self._probe.set()

    def _one(self, request):
        start, response = time.time(), None
        try:
            info = io.array(request, "INTAKE_INFO")  # None: a direct call, not through the ensemble's intake
            self.board.preprocess_started(from_intake=info is not None)  # no longer waiting in front of it
            floor = None if info is None else floor_of(info)
            if info is not None and floor is None:
                self.log.warning("request %s: INTAKE_INFO holds no arrival floor: inferred here", request.request_id())
            response = self._prepare(request, start, floor)
            return response
        finally:  # every execution, refused ones too: what bounds the next request's wait in the queue
            end = time.time()
            self.front.ran(start, end, prepared=response is not None and not response.has_error())
            self.board.preprocess_idle(end)

    def _note(self, arrival, request_id: str) -> None:
        """A sender's stamp set aside (its clock runs ahead of this one's): said at most once a minute."""
        if arrival.note and time.monotonic() - self._stamp_noted > 60:
            self._stamp_noted = time.monotonic()
            self.log.warning("request %s: %s (MASKEDIT_CLOCK_SKEW_S)", request_id, arrival.note)

    def _prepare(self, request, start: float, floor: float | None):
        t0 = time.perf_counter()
        try:
            if self.cancels.is_cancelled(request.request_id()):  # given up (e.g. refused by the router meanwhile)
                self.cancels.clear(request.request_id())
                raise Cancelled("cancelled before pre-processing")
            parameters = request.parameters()
            tenant, weight = tenant_of(parameters)  # set by the router after it checked the caller's key
            self.board.check(tenant, weight)  # the denoise queue is full: refused before any work, at once
            params = parse_params(self.settings, **{f.attr: io.scalar(request, f.name) for f in PARAMS})
            steps = params.steps - first_step(self.pre.family.pipeline_class(), params.steps, params.strength)
            # when it would be answered, behind the work ahead: refused before any work when past its bound, counted
            # from when its sender stamped it (the client, the router), else from its inferred arrival
            admitted = self.front.admit(start, steps, params.deadline_ms, sent_stamp(parameters), floor)
            self._note(admitted.arrival, request.request_id())
            images, refs = io.array(request, "CONTROL_IMAGES"), io.array(request, "REFERENCE_IMAGES")
            p = self.pre(io.blob(request, "TEMPLATE"), io.blob(request, "MASK"), params,
                         () if images is None else list(images.reshape(-1)),
                         () if refs is None else list(refs.reshape(-1)))
        except Exception as e:
            self.log.warning("rejected request: %s", e)
            return io.error_response(e, request.request_id())
        if p.loras and self.prefetch is not None:
            try:
                self.prefetch.start(p.loras)  # returns at once: the conversion runs on its own thread
            except Exception:  # the denoise process loads its adapters itself
                self.log.exception("adapter prefetch could not start")
        control_rows, controls = to_wire(p.controls)
        info = {
            "mask_ratio": round(p.mask_ratio, 6), "masked_tokens": int(p.token_mask.sum()),
            "tokens": int(p.token_mask.size), "empty_mask": p.empty_mask, "skip_model": p.skip_model,
            "template_hash": p.template_hash, "cache_key": p.cache_key, "base_cache_key": p.base_cache_key,
            "template_seed": params.template_seed,
            "register": params.register, "progress_requested": params.progress,
            **_timing(admitted, params.deadline_ms),
            "model_size": [p.model_w, p.model_h], "seed": params.seed, "steps": params.steps,
            "guidance": params.guidance, "loras": [r.as_dict() for r in p.loras], "controls": controls,
            "temporal": params.temporal.as_dict(),
            "reference_images": int(p.reference_grids.shape[0]),
            "raw_output": params.raw_output, "base64": p.was_base64,
            "preprocess_s": round(time.perf_counter() - t0, 6), "request_id": request.request_id(),
            "tenant": tenant, "tenant_weight": weight,
            # the stock pipelines' options (docs/api.md): what the denoiser and the decoder do with them
            "strength": params.strength, "first_step": p.first_step, "crop": list(p.crop) if p.crop else None,
            "guidance_rescale": params.guidance_rescale, "true_cfg_scale": p.true_cfg_scale,
            "output_format": params.output_format, "output_quality": params.output_quality,
        }
        self.front.sent(0 if p.skip_model else steps, int(p.token_mask.size), info["answer_by_ts"])
        self.board.passed()  # on its way to denoise: counts against the queue until it arrives
        return io.response({
            "LATENTS": p.latents, "COND": p.cond, "PROMPT_EMBEDS": p.prompt_embeds, "POOLED_EMBEDS": p.pooled_embeds,
            "TOKEN_MASK": p.token_mask.astype(bool), "MODEL_SIZE": np.array([p.model_w, p.model_h], np.int32),
            "STEPS_RESOLVED": np.array([params.steps], np.int32),
            "GUIDANCE_RESOLVED": np.array([params.guidance], np.float32), "CONTROL_COND": control_rows,
            "REFERENCE": p.reference, "REFERENCE_GRIDS": p.reference_grids,
            "TEMPLATE_RGB": p.template_rgb, "ALPHA": p.alpha, "REQUEST_INFO": info,
        })


def _timing(admitted, deadline_ms: int | None) -> dict:
    """REQUEST_INFO's times (``time.time()``), counted from the request's earliest arrival (and what says so): its
    DEADLINE_MS, its bound (``maskedit.completion``: answered or refused by ``answer_by_ts``) and the front's
    prediction."""
    a, bound = admitted.arrival.at, admitted.bound
    return {"deadline_ts": a + deadline_ms / 1000.0 if deadline_ms else None,
            "answer_by_ts": a + bound.seconds if bound else None, "bound_s": bound.seconds if bound else None,
            "bound_source": bound.source if bound else None, "arrival_ts": a,
            "arrival_source": admitted.arrival.source, "predicted_ts": admitted.predicted_at}
