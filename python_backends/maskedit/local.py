"""The three stages wired together in one process: the reference for tests and benchmarks.

The Triton ensemble runs exactly these classes, one per model process.
"""

from __future__ import annotations

import json
import threading

from .controlnets.job import from_wire, to_wire
from .decode import Decoder
from .denoise import DenoiseInputs, DenoiseJob, ModelRunner, reference_fields
from .engine import DenoiseEngine
from .params import parse_params
from .preprocess import PreparedEdit, Preprocessor
from .settings import Settings, load_settings


def denoise_inputs(p: PreparedEdit) -> DenoiseInputs:
    return DenoiseInputs(
        latents=p.latents, cond=p.cond, prompt_embeds=p.prompt_embeds, pooled_embeds=p.pooled_embeds,
        token_mask=p.token_mask, model_w=p.model_w, model_h=p.model_h, steps=p.params.steps,
        guidance=p.params.guidance, cache_key=p.cache_key or None, register=p.params.register, loras=p.loras,
        base_cache_key=p.base_cache_key or None,
        controls=from_wire(*to_wire(p.controls)),  # through the wire format, as the stages pass them
        temporal=p.params.temporal.as_dict(),  # as the stages pass it
        first_step=p.first_step, guidance_rescale=p.params.guidance_rescale, true_cfg_scale=p.true_cfg_scale,
        **reference_fields(p.reference, p.reference_grids),
    )



def run_job(engine: DenoiseEngine, inputs: DenoiseInputs, timeout: float = 600.0) -> DenoiseJob:
    """Submit one job and block until it ends; re-raise its error."""
    done = threading.Event()
    errors: list[BaseException] = []
    job = DenoiseJob(inputs, on_done=lambda j: done.set(),
                     on_error=lambda j, e: (errors.append(e), done.set()))
    engine.submit(job)
    if not done.wait(timeout):
        raise TimeoutError(f"denoise did not finish in {timeout}s")
    if errors:
        raise errors[0]
    return job


class LocalEditor:
    def __init__(self, settings: Settings | None = None, max_batch: int = 1, cache=None, store=None):
        """``cache``: a callable (transformer -> CacheRuntime) to enable activation caching."""
        self.settings = settings or load_settings()
        self.pre = Preprocessor(self.settings, store=store)
        self.runner = ModelRunner(self.settings)
        if cache is not None:
            self.runner.cache = cache(self.runner.transformer)
        self.engine = DenoiseEngine(self.runner, max_batch=max_batch)
        self.dec = Decoder(self.settings)

    def edit(self, template: bytes, mask: bytes, prompt: str, seed=None, steps=None, guidance=None,
             raw_output=False, template_seed=None, register=False,
             use_cache=True, negative_prompt=None, loras=None, controls=None,
             control_images=(), temporal=None, reference_images=(),
             **options) -> tuple[bytes, PreparedEdit, DenoiseJob | None]:
        """``controls``: CONTROLS' JSON or a list of its objects; ``control_images``: one encoded image each;
        ``reference_images``: encoded reference images (in-context edit models); ``options``: the other request
        parameters by their schema names (``strength``, ``padding_mask_crop``, ...)."""
        if loras is not None and not isinstance(loras, (str, bytes)):  # [(name, scale)] or [{"name", "scale"}]
            loras = json.dumps([d if isinstance(d, dict) else {"name": d[0], "scale": d[1]} for d in loras])
        params = parse_params(self.settings, prompt, seed=seed, steps=steps, guidance=guidance, raw_output=raw_output,
                              template_seed=template_seed, register=register, use_cache=use_cache,
                              negative_prompt=negative_prompt, loras=loras,
                              controls=json.dumps(controls) if isinstance(controls, (list, dict)) else controls,
                              temporal=json.dumps(temporal) if isinstance(temporal, dict) else temporal,
                              **options)
        p = self.pre(template, mask, params, control_images, reference_images)
        finish = lambda img: self.dec.finish(img, p.template_rgb, p.alpha, raw_output, p.was_base64,  # noqa: E731
                                             crop=p.crop, fmt=params.output_format, quality=params.output_quality)
        if p.skip_model:
            return finish(None), p, None
        job = run_job(self.engine, denoise_inputs(p))
        return finish(self.dec.decode_latents(job.result(), p.model_w, p.model_h)), p, job

    def close(self) -> None:
        self.engine.shutdown()
        if self.runner.cache is not None:
            self.runner.cache.close()
