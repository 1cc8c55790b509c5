"""Per-request denoising state and the model runner that advances a set of requests by one step.

A ``DenoiseJob`` owns everything that differs between requests (latents, conditioning, text embeddings,
its own scheduler and step index), so requests at different steps can share a running batch.
``ModelRunner.step`` is the only place that calls the transformer. Requests of one resolution share a plain
Diffusers call; requests of different resolutions share one *packed* call (rows padded to the longest, every
row computed through the gathered path of ``maskedit.cache.flux`` with its own token count and rotary tables),
so a running batch never splits into one transformer call per resolution.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.pipelines.flux.pipeline_flux_fill import FluxFillPipeline

from .cache.flux import FULL, FluxCacheHooks, RowView, StepContext
from .components import FLUX, load_scheduler_config, load_transformer, model_family, torch_dtype, vae_scale_factor
from .errors import InvalidInput
from .schedule import make_scheduler
from .settings import Settings

_ids = itertools.count()


@dataclass
class DenoiseInputs:
    """The tensors preprocess produced for one request (numpy, as received)."""

    latents: np.ndarray  # (tokens, C)
    cond: np.ndarray  # (tokens, C_cond)
    prompt_embeds: np.ndarray  # (txt, D)
    pooled_embeds: np.ndarray  # (D_pooled,)
    token_mask: np.ndarray  # (tokens,) bool
    model_w: int
    model_h: int
    steps: int
    guidance: float
    cache_key: str | None = None  # activation-cache key (None: caching off for this request)
    register: bool = False  # a template run: record even if an entry exists
    deadline: float | None = None  # absolute time.time() by which the request must finish, if any


@dataclass
class JobTensors:
    """A request's conditioning on the device, made once when it is admitted."""

    cond: torch.Tensor  # (1, tokens, C_cond): masked-image latents and mask
    prompt_embeds: torch.Tensor  # (1, txt, D)
    pooled: torch.Tensor  # (1, D_pooled)
    img_ids: torch.Tensor  # (tokens, 3) token grid ids
    txt_ids: torch.Tensor  # (txt, 3)
    guidance: torch.Tensor | None  # (1,) when the model embeds guidance
    rope: tuple | None = None  # its own rotary tables, made the first time it joins a packed call


@dataclass(eq=False)  # identity semantics: jobs are tracked in lists, and fields hold arrays
class DenoiseJob:
    inputs: DenoiseInputs
    on_done: Callable[["DenoiseJob"], None] = lambda job: None
    on_error: Callable[["DenoiseJob", BaseException], None] = lambda job, e: None
    on_step: Callable[["DenoiseJob"], None] | None = None
    is_cancelled: Callable[[], bool] = lambda: False
    id: int = field(default_factory=lambda: next(_ids))
    # Image tokens this request computes per step: estimated at submit (early deadline check), exact once the
    # cache decision is made (before admission; the scheduler's token budget counts it).
    tokens: int | None = None
    idle_steps: int = 0  # loop steps since this request last advanced (or arrived): the scheduler's aging
    # Filled in by the runner.
    step_index: int = 0
    latents: torch.Tensor | None = None
    scheduler: Any = None
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None
    decision: Any = None  # the activation cache's ``CacheDecision``, made once before admission
    cache: Any = None  # its ``JobCache`` once admitted (None: no cache runtime)
    tensors: JobTensors | None = None
    restarts: int = 0  # times it started again from its first step (its cached rows failed verification)

    @property
    def steps(self) -> int:
        return self.inputs.steps

    @property
    def deadline(self) -> float | None:
        return self.inputs.deadline

    @property
    def done(self) -> bool:
        return self.step_index >= self.inputs.steps

    def result(self) -> np.ndarray:
        return self.latents[0].detach().to("cpu", torch.float32).numpy()


class ModelRunner:
    """Holds the transformer; turns jobs into transformer calls and scheduler steps."""

    def __init__(self, settings: Settings, transformer=None, cache=None):
        """``cache``: a ``maskedit.cache.runtime.CacheRuntime`` (hooks on this transformer), or None."""
        self.settings = settings
        self.device = torch.device(settings.torch_device)
        self.dtype = torch_dtype(settings)
        self.transformer = transformer if transformer is not None else load_transformer(settings)
        self.scheduler_config = load_scheduler_config(settings)
        # SD 2 / SDXL inpainting: ``transformer`` is the UNet and one token is one latent pixel (``unet_runner``).
        self.unet = model_family(settings.model_dir) != FLUX
        if self.unet:
            from .unet_prepare import check_unet_scheduler

            check_unet_scheduler(self.scheduler_config)
        self.guidance_embeds = not self.unet and bool(self.transformer.config.guidance_embeds)
        self.pixels_per_token = (1 if self.unet else 2) * vae_scale_factor(settings)  # Flux packs 2x2 latents
        self.cache = cache

    def decide(self, job: DenoiseJob) -> None:
        """Make the job's cache decision (once, before admission) and count the tokens it will compute."""
        n = int(job.inputs.latents.shape[0])
        if self.cache is None:
            job.tokens = n
        elif job.decision is None:
            job.decision = self.cache.decide(job.inputs)
            job.tokens = job.decision.tokens(n)

    def prepare(self, job: DenoiseJob) -> None:
        """Admit a job: its tensors to the device, its own scheduler, its cache decision carried out."""
        x = job.inputs
        _check_shapes(x, self.pixels_per_token)
        if self.unet:
            from .unet_runner import prepare_job

            prepare_job(self, job)
            self._admit_cache(job)
            return
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, self.dtype).unsqueeze(0)
        job.latents = t(x.latents)
        # Token grid ids, as FluxFillPipeline._prepare_latent_image_ids builds them.
        grid_h, grid_w = x.model_h // self.pixels_per_token, x.model_w // self.pixels_per_token
        job.tensors = JobTensors(
            cond=t(x.cond), prompt_embeds=t(x.prompt_embeds), pooled=t(x.pooled_embeds),
            img_ids=FluxFillPipeline._prepare_latent_image_ids(1, grid_h, grid_w, self.device, self.dtype),
            txt_ids=torch.zeros(x.prompt_embeds.shape[0], 3, device=self.device, dtype=self.dtype),
            guidance=torch.full([1], x.guidance, device=self.device, dtype=torch.float32)
            if self.guidance_embeds else None)
        job.scheduler = make_scheduler(self.scheduler_config, x.steps, x.latents.shape[0], self.device)
        self._admit_cache(job)

    def _admit_cache(self, job: DenoiseJob) -> None:
        self.decide(job)
        if self.cache is not None:
            jc = self.cache.admit(job, job.decision)
            job.tokens = max(1, int(jc.idx_c.numel())) if jc.status == "hit" else int(job.inputs.latents.shape[0])
        job.started_at = time.perf_counter()

    def recompute(self, job: DenoiseJob, error: BaseException) -> None:
        """A hit's entry failed verification mid-run. The rows it used so far were verified, but the rest cannot
        be trusted: the entry is discarded and the request starts again from its first step without it (same
        inputs and seed: the result a miss gives). A second corrupt entry for the same request turns caching off."""
        key = job.inputs.cache_key
        if self.cache is not None:
            self.cache.corrupt(job, error)
        job.restarts += 1
        job.step_index, job.latents, job.cache, job.tensors = 0, None, None, None
        job.decision = None
        if job.restarts > 1 and self.cache is not None:
            from .cache.decision import CacheDecision

            job.decision = CacheDecision("off", key)
        self.prepare(job)
        if job.cache is not None:
            job.cache.recovered = str(error)

    def estimate_tokens(self, job: DenoiseJob) -> int:
        """A cheap guess of the tokens per step at submit (for the early deadline check only): the masked tokens
        if an entry or a template run of the key exists here, else all. The decision proper comes later."""
        x = job.inputs
        n = int(x.latents.shape[0])
        if self.cache is not None and x.cache_key and not x.register and self.cache.store is not None \
                and (self.cache.recording(x.cache_key) or self.cache.store.locate(x.cache_key)):
            return max(1, int(np.count_nonzero(x.token_mask)))
        return n

    def release(self, job: DenoiseJob, ok: bool) -> None:
        """The job left the batch (finished, failed or cancelled)."""
        if self.cache is not None:
            self.cache.finish(job, ok)

    def groups(self, jobs: list[DenoiseJob]) -> list[list[DenoiseJob]]:
        """Jobs that share one transformer call: equal text length (text tokens attend, so they cannot be padded);
        different resolutions pack into one call (UNet: one resolution per call)."""
        if self.unet:
            return group_by(jobs, lambda j: (tuple(j.tensors.prompt_embeds.shape), j.inputs.model_h, j.inputs.model_w))
        return group_by(jobs, lambda j: tuple(j.tensors.prompt_embeds.shape))

    @torch.no_grad()
    def step(self, jobs: list[DenoiseJob]) -> None:
        """Advance every job by one denoising step: one transformer call per group of ``groups``."""
        for group in self.groups(jobs):
            if self.unet:
                from .unet_runner import step_group

                ctx = self.cache.context(group) if self.cache is not None else None
                step_group(self, group, ctx)
                if self.cache is not None:
                    self.cache.after_step(group)
                continue
            timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
            tokens = [j.latents.shape[1] for j in group]
            packed = len({(j.inputs.model_h, j.inputs.model_w) for j in group}) > 1
            longest = group[tokens.index(max(tokens))]
            pad = (lambda x: F.pad(x, (0, 0, 0, max(tokens) - x.shape[1]))) if packed else (lambda x: x)
            cat = lambda key: torch.cat([getattr(j.tensors, key) for j in group], dim=0)  # noqa: E731
            latents = torch.cat([pad(j.latents) for j in group], dim=0)
            cond = torch.cat([pad(j.tensors.cond) for j in group], dim=0)
            timestep = torch.stack([t.to(self.device) for t in timesteps]).to(latents.dtype)
            guidance = cat("guidance") if self.guidance_embeds else None
            forward = lambda: self.transformer(  # noqa: E731
                hidden_states=torch.cat((latents, cond), dim=2),
                timestep=timestep / 1000,
                guidance=guidance,
                pooled_projections=cat("pooled"),
                encoder_hidden_states=cat("prompt_embeds"),
                txt_ids=group[0].tensors.txt_ids,
                img_ids=longest.tensors.img_ids,
                joint_attention_kwargs=None,
                return_dict=False,
            )[0]
            ctx = self.cache.context(group) if self.cache is not None else None
            if packed:
                ctx = self._packed_context(group, ctx)
            if ctx is not None:
                noise_pred = FluxCacheHooks.of(self.transformer).run(ctx, forward)
            else:
                noise_pred = forward()
            if self.cache is not None:
                self.cache.after_step(group)
            for i, (job, t, n) in enumerate(zip(group, timesteps, tokens)):
                job.latents = job.scheduler.step(noise_pred[i : i + 1, :n], t, job.latents, return_dict=False)[0]
                job.step_index += 1

    def _packed_context(self, group: list[DenoiseJob], ctx: StepContext | None) -> StepContext:
        """Every row through the gathered path, with its own token count and rotary tables."""
        n_blocks = len(FluxCacheHooks.of(self.transformer).blocks)
        rows = ctx.rows if ctx is not None else [None] * len(group)
        views = []
        for job, view in zip(group, rows):
            view = view if view is not None else RowView(modes=[FULL] * n_blocks)
            view.tokens = job.latents.shape[1]
            jt = job.tensors
            if jt.rope is None:  # the request's own grid: the same tables a call at its size builds
                jt.rope = self.transformer.pos_embed(torch.cat((jt.txt_ids, jt.img_ids), dim=0))
            view.rope = jt.rope
            views.append(view)
        return StepContext(views, packed=True, on_block=ctx.on_block if ctx is not None else None)


def _check_shapes(x: DenoiseInputs, pixels_per_token: int) -> None:
    """Inconsistent tensors would fail the whole batch's step; reject them before they join."""
    tokens = (x.model_h // pixels_per_token) * (x.model_w // pixels_per_token)
    got = {"LATENTS": x.latents.shape[0], "COND": x.cond.shape[0], "TOKEN_MASK": x.token_mask.shape[0]}
    for name, n in got.items():
        if n != tokens:
            raise InvalidInput(f"has {n} tokens but MODEL_SIZE {x.model_w}x{x.model_h} implies {tokens}", name)
    if x.prompt_embeds.ndim != 2 or x.pooled_embeds.ndim != 1:
        raise InvalidInput("PROMPT_EMBEDS must be (tokens, dim) and POOLED_EMBEDS (dim,)", "PROMPT_EMBEDS")


def group_by(jobs: list[DenoiseJob], key) -> list[list[DenoiseJob]]:
    groups: dict = {}
    for j in jobs:
        groups.setdefault(key(j), []).append(j)
    return list(groups.values())
