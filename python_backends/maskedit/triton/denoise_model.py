"""Triton ``masked_denoise`` (decoupled): hands requests to the denoise engine's loop and returns at once.

Responses are sent from the engine thread when a request finishes; every request ends in exactly one
final response, a result or an error.
"""

from __future__ import annotations

import json
import logging
import os
import socket

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import logs
from ..denoise import DenoiseInputs, DenoiseJob, ModelRunner, reference_fields
from ..admission import QueueBoard, board_path
from ..cancel import CancelBoard
from ..controlnets.job import from_wire
from ..engine import DenoiseEngine
from ..fair_share import FairShare
from ..scheduler import BatchScheduler
from ..settings import load_settings
from . import controlnet_bls, io
from .adapter_metrics import AdapterMetrics
from .cache_setup import CacheMetrics, cache_runtime, keep_recovering
from .controlnet_metrics import ControlNetMetrics
from .temporal_metrics import TemporalMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("maskedit.triton.denoise")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = s = load_settings()
        self.log = logs.setup("masked_denoise", s.service.log_level)
        io.limit_threads(args, s.service, default=max(1, os.cpu_count() or 1))
        runner = ModelRunner(s)
        runner.cache = cache_runtime(runner.transformer, s, self.log)
        if s.controlnet_placement == "triton":  # residuals from the controlnet model, by BLS
            runner.control_transport = controlnet_bls.transport(timeout_s=s.controlnet_timeout_s)
        b = s.batching
        self.board = QueueBoard(board_path(s.service.admission_dir))  # pre-processing refuses early while it is full
        self.engine = DenoiseEngine(runner, max_queue=b.max_queue, scheduler=BatchScheduler(
            b.policy, max_batch=b.max_batch, max_tokens=b.max_tokens_per_step, reject_late=b.reject_late,
            max_wait_steps=b.max_wait_steps, decode_s=self.board.decode_s), on_queue=self.board.publish,
            fair=FairShare(b.fair_share), on_backlog=self.board.publish_backlog)
        self.cancels = CancelBoard(s.service.cancel_dir)
        self._sweeper = self.cancels.sweep_every(s.service.cancel_sweep_s)
        self.instance = f"{socket.gethostname()}:{os.getpid()}"  # which server denoised: behind a router, per request
        store = runner.cache.store if runner.cache else None
        self.metrics = CacheMetrics(store, adapter_stats=runner.adapters.stats)
        self._probe = keep_recovering(store, s.cache)  # a budget shrunk by a full filesystem grows back, and so on
        self.control_metrics = ControlNetMetrics(runner)
        self.temporal_metrics = TemporalMetrics()
        self._metrics_sync = self.metrics.sync_every(s.service.metrics_sync_s)
        rt = runner.adapters  # the adapter cache's device tier (host tier behind it) and its metrics
        self.adapter_metrics = AdapterMetrics(rt.stats, rt.host, rt)
        self._adapter_sync = self.adapter_metrics.sync_every(s.service.metrics_sync_s)
        logs.event(self.log, "ready", max_batch=self.engine.max_batch, max_queue=self.engine.max_queue,
                   cache=runner.cache.policy if runner.cache else "off")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as e:  # refused at admission (queue full, bound, deadline, bad tensors): answered at once
                self.log.warning("rejected request: %s", e)
                self.metrics.outcome(getattr(e, "code", "INTERNAL"))
                sender.send(io.error_response(e, request.request_id()), flags=FINAL)
            finally:
                # counted once it is in the published queue (or answered): pre-processing, which counts it as on
                # its way until then, may count it twice for a moment but never misses it
                self.board.arrived()
        return None

    def _submit(self, request, sender):
        info = json.loads(io.blob(request, "REQUEST_INFO"))
        relay = {f"{k}_OUT": io.array(request, k) for k in ("TEMPLATE_RGB", "ALPHA")}
        size = io.array(request, "MODEL_SIZE").astype(np.int32)
        if info.get("skip_model"):
            info.update(denoise_s=0.0, cache_hit=False, cache="skipped")
            sender.send(self._result(np.zeros((0, 0), np.float32), size, relay, info), flags=FINAL)
            return
        inputs = DenoiseInputs(
            latents=io.array(request, "LATENTS"), cond=io.array(request, "COND"),
            prompt_embeds=io.array(request, "PROMPT_EMBEDS"), pooled_embeds=io.array(request, "POOLED_EMBEDS"),
            token_mask=io.array(request, "TOKEN_MASK").astype(bool), model_w=int(size[0]), model_h=int(size[1]),
            steps=int(io.scalar(request, "STEPS_RESOLVED")), guidance=float(io.scalar(request, "GUIDANCE_RESOLVED")),
            cache_key=info.get("cache_key") or None, register=bool(info.get("register")),
            deadline=info.get("deadline_ts"), answer_by=info.get("answer_by_ts"),
            bound_s=float(info.get("bound_s") or 0.0), bound_source=info.get("bound_source") or "",
            loras=tuple(info.get("loras") or ()),
            base_cache_key=info.get("base_cache_key") or None,
            controls=from_wire(io.array(request, "CONTROL_COND"), info.get("controls")),
            temporal=info.get("temporal"),
            first_step=int(info.get("first_step") or 0), guidance_rescale=float(info.get("guidance_rescale") or 0.0),
            true_cfg_scale=float(info.get("true_cfg_scale") or 1.0),
            **reference_fields(io.array(request, "REFERENCE"), io.array(request, "REFERENCE_GRIDS")),
        )

        def done(job: DenoiseJob):
            info.update(denoise_s=round(job.finished_at - job.started_at, 6),
                        queue_s=round(job.started_at - job.submitted_at, 6), cache_hit=False, cache="off",
                        steps_wall_s=round(job.steps_wall_s, 6), steps_cpu_s=round(job.steps_cpu_s, 6),
                        instance=self.instance)
            if job.controls:  # the ControlNet calls' wall time (on a GPU: launch time, the calls are not synchronised)
                placement = self.settings.controlnet_placement
                cached = [c.status for c in job.control_cache]  # where they are cached beside the denoiser
                info.update(control_s=round(job.control_s, 6), control_placement=placement,
                            control_cache=cached or None)
                if placement == "triton":  # of which BLS round trips to the controlnet model
                    info.update(control_bls_s=round(job.control_bls_s, 6),
                                control_model_s=round(job.control_model_s, 6))
                _quietly(self.control_metrics.sync)
                _quietly(self.control_metrics.observe_cache, cached or ["off"] * len(job.controls))
            jc = job.cache
            if jc is not None:
                info.update(jc.info(), cache_load_s=round(jc.load_s, 6))
            if job.temporal is not None:  # which steps reused their middle blocks (``maskedit.temporal``)
                info.update(job.temporal.info())
            if job.adapters_from_step:  # early start: the step its adapters applied from
                info.update(adapters_from_step=job.adapters_from_step)
            _quietly(self.metrics.observe, info)  # a metrics failure must never keep the answer from its caller
            _quietly(self.temporal_metrics.observe, info)
            _quietly(self.adapter_metrics.sync)
            _quietly(self.metrics.outcome, "OK")
            self.cancels.clear(rid)  # a marker that came too late to matter
            sender.send(self._result(job.result(), size, relay, info), flags=FINAL)

        def failed(job: DenoiseJob, e: BaseException):
            _quietly(self.metrics.outcome, getattr(e, "code", "INTERNAL"))
            _quietly(self.metrics.sync)
            _quietly(self.adapter_metrics.sync)
            _quietly(self.control_metrics.sync)
            self.cancels.clear(rid)  # its marker (if it was cancelled) has done its work
            sender.send(io.error_response(e, rid), flags=FINAL)

        def progress(job: DenoiseJob):  # small non-final responses; vae_decode passes them through undecoded
            sender.send(self._result(np.zeros((0, 0), np.float32), size, empty_relay,
                                     {"progress": [job.run_index, job.run_steps], "skip_model": True}))

        empty_relay = {"TEMPLATE_RGB_OUT": np.zeros((0, 0, 3), np.uint8), "ALPHA_OUT": np.zeros((0, 0), np.uint8)}
        rid = request.request_id()

        def cancelled() -> bool:  # the stream's own cancel, or a cancel sent through the `cancel` model
            return sender.is_cancelled() or self.cancels.is_cancelled(rid)

        job = DenoiseJob(inputs, on_done=done, on_error=failed, is_cancelled=cancelled,
                         on_step=progress if info.get("progress_requested") else None,
                         tenant=info.get("tenant", ""), weight=float(info.get("tenant_weight", 1.0)))
        self.engine.runner.load_controls(job)  # here, off the denoise loop; a bad ControlNet is refused at once
        self.engine.submit(job)  # its adapters load in the background meanwhile; a bad one fails it alone

    @staticmethod
    def _result(latents, size, relay, info):
        return io.response({"DENOISED": latents, "MODEL_SIZE_OUT": size, **relay, "REQUEST_INFO_OUT": info})

    def finalize(self):
        self._sweeper.set()
        self._metrics_sync.set()
        if self._probe is not None:
            self._probe.set()
        self._adapter_sync.set()
        self.engine.shutdown(timeout=self.settings.service.shutdown_grace_s)
        provider = self.engine.runner._control_provider
        if provider is not None and hasattr(provider, "close"):
            provider.close()
        if self.engine.runner.cache is not None:
            self.engine.runner.cache.close()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("metrics update failed")
