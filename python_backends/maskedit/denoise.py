"""Per-request denoising state and the model runner that advances a set of requests by one step.

A ``DenoiseJob`` owns everything that differs between requests (latents, conditioning, text embeddings,
its own scheduler and step index), so requests at different steps can share a running batch.
``ModelRunner.step`` is the only place that calls the denoiser: it groups the jobs that can share a call and hands
each group to the model family (``ModelFamily.step``), through the activation cache's step context.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .components import family, load_scheduler_config
from .device import torch_dtype
from .errors import InvalidInput
from .settings import Settings
from . import temporal

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
    # its bound (``maskedit.completion``): answered or refused by this time.time() (None: no bound), ``bound_s``
    # after its arrival, the bound being ``bound_source``'s (MASKEDIT_LATENCY_BOUND_S or DEADLINE_MS)
    answer_by: float | None = None
    bound_s: float = 0.0
    bound_source: str = ""
    loras: tuple = ()  # its adapters: ``ResolvedRef``s (name, scale, file digest) or dicts of them
    base_cache_key: str | None = None  # with adapters: its key without them (``CacheSettings.lora_base_reuse``)
    controls: tuple = ()  # its ControlNets: ``maskedit.controlnets.job.ControlInput`` (spec + prepared image)
    # STRENGTH < 1: the schedule's step it starts at (the stock ``get_timesteps``' ``t_start``); it runs
    # ``steps - first_step`` steps, the stock schedule's last ones
    first_step: int = 0
    guidance_rescale: float = 0.0  # SDXL's ``guidance_rescale``
    true_cfg_scale: float = 1.0  # FluxInpaintPipeline's true classifier-free guidance (with a negative text row)
    temporal: Any = None  # its temporal reuse: a ``maskedit_common.temporal.TemporalSpec`` or its dict (None: off)
    # In-context edit models: reference image tokens beyond the template, (R, C) in the family's layout, and each
    # image's token grid (rows, cols) (``ModelFamily.prepare_references``); None / () without any.
    reference: np.ndarray | None = None
    reference_grids: tuple = ()


def reference_fields(reference, grids) -> dict:
    """``DenoiseInputs``' reference fields from the stage tensors REFERENCE (R, C) and REFERENCE_GRIDS (k, 2)."""
    if reference is None or not reference.size:
        return {}
    return {"reference": reference, "reference_grids": tuple(tuple(int(v) for v in g) for g in grids)}


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
    # Over the steps it was in: their wall time, and the denoise loop thread's CPU time in them. A gap between
    # the two is time the thread waited for a core; both grown is slower compute (caches, memory bandwidth).
    steps_wall_s: float = 0.0
    steps_cpu_s: float = 0.0
    decision: Any = None  # the activation cache's ``CacheDecision``, made once before admission
    cache: Any = None  # its ``JobCache`` once admitted (None: no cache runtime)
    tensors: Any = None  # its conditioning on the device, in its family's own dataclass
    restarts: int = 0  # times it started again from its first step (its cached rows failed verification)
    adapters: tuple = ()  # ((LoadedAdapter, weight), ...) once resolved (``ModelRunner.load_adapters``)
    adapters_loaded: bool = False
    adapter_load: Any = None  # the Future of its adapters' background load (``maskedit.adapters.jobs``), if one
    adapters_from_step: int | None = None  # the step its adapters applied from (> 0 only under early start)
    tenant: str = ""  # who sent it (the router's ``maskedit_tenant`` parameter) and its weight: ``fair_share``
    weight: float = 1.0
    fair_tag: float = 0.0  # its virtual finish tag in the denoise queue (0: fair share off)
    controls: tuple = ()  # ``controlnets.job.ActiveControl`` per control once loaded (``ModelRunner.load_controls``)
    controls_loaded: bool = False
    control_s: float = 0.0  # seconds its ControlNets took, over all its steps (EDIT_INFO ``control_s``)
    control_bls_s: float = 0.0  # of which BLS round trips to the ``controlnet`` model (placement ``triton``)
    control_model_s: float = 0.0  # of which the ``controlnet`` model's own work (the rest is BLS overhead)
    control_cache: tuple = ()  # its controls' ``JobCache`` each, where cached beside it (``cache.controlnet``)
    temporal: Any = None  # its ``maskedit.temporal.TemporalState`` once admitted (None: no temporal reuse)

    def __post_init__(self):
        self.step_index = self.first_step  # a strength < 1 edit starts into the schedule

    @property
    def steps(self) -> int:
        return self.inputs.steps

    @property
    def first_step(self) -> int:
        return getattr(self.inputs, "first_step", 0)

    @property
    def run_steps(self) -> int:
        """Steps this request runs (the stock pipeline's ``len(timesteps)`` after ``strength``)."""
        return self.inputs.steps - self.first_step

    @property
    def run_index(self) -> int:
        """Its place in the steps it runs (the stock loop's ``i``: ControlNet windows and progress count these)."""
        return self.step_index - self.first_step

    @property
    def deadline(self) -> float | None:
        return self.inputs.deadline

    @property
    def done(self) -> bool:
        return self.step_index >= self.inputs.steps

    def result(self) -> np.ndarray:
        return self.latents[0].detach().to("cpu", torch.float32).numpy()


class ModelRunner:
    """Holds the denoiser; turns jobs into denoiser calls and scheduler steps (the family's)."""

    def __init__(self, settings: Settings, transformer=None, cache=None):
        """``cache``: a ``maskedit.cache.runtime.CacheRuntime`` (hooks on this denoiser), or None."""
        self.settings = settings
        self.device = torch.device(settings.torch_device)
        self.dtype = torch_dtype(settings)
        self.family = family(settings)
        self.transformer = transformer if transformer is not None else self.family.load_denoiser(settings)
        self.scheduler_config = load_scheduler_config(settings)
        self.family.check_scheduler(self.scheduler_config)
        self.geometry = self.family.geometry(settings)
        self.pixels_per_token = self.geometry.patch
        self.cache = cache
        self._adapter_jobs = None  # maskedit.adapters.jobs.AdapterJobs, made on first use
        self._controlnets = None  # maskedit.controlnets.library.ControlNetLibrary, made on first use
        self._control_provider = None  # maskedit.controlnets.provider: where residuals come from, made on first use
        self.control_transport = None  # the BLS call to the controlnet model (set by the Triton shim)

    @property
    def adapters(self):
        return self.adapter_jobs.runtime

    @property
    def adapter_jobs(self):
        """Requests' adapters on their way to the batch (``maskedit.adapters.jobs``): the device tier of this
        denoiser, the host tier shared by the host's processes, the background loader; made on first use."""
        if self._adapter_jobs is None:
            from .adapters import host_cache, skeleton
            from .adapters.jobs import AdapterJobs
            from .adapters.library import AdapterLibrary
            from .adapters.runtime import AdapterRuntime

            s = self.settings
            runtime = AdapterRuntime(self.family, self.transformer, AdapterLibrary(s.adapters),
                                     budget_bytes=s.lora_device_bytes, host=host_cache.from_settings(s),
                                     fingerprint=skeleton.fingerprint(s, self.family))
            self._adapter_jobs = AdapterJobs(runtime, early_start=s.lora_early_start, threads=s.lora_load_threads)
        return self._adapter_jobs

    def start_adapters(self, job: DenoiseJob, wake=None) -> None:
        """At submit: the job's adapters from the device tier, or their load started in the background (``wake()``
        when it ends). Never raises for a bad adapter: the load's error fails the job when the loop collects it."""
        if job.inputs.loras:
            self.adapter_jobs.start(job, wake)
        else:
            job.adapters_loaded = True

    def adapters_pending(self, job: DenoiseJob) -> bool:
        """The job waits for its adapters: the scheduler does not see it yet."""
        return job.adapter_load is not None and self.adapter_jobs.pending(job)

    def adapter_failure(self, job: DenoiseJob) -> BaseException | None:
        """The error of the job's background adapter load, once it failed."""
        return self.adapter_jobs.failure(job) if job.adapter_load is not None else None

    def patch_adapters(self, jobs: list[DenoiseJob]) -> list[tuple[DenoiseJob, BaseException]]:
        """Early start: admitted jobs whose adapters arrived carry them from this step on; returns the jobs whose
        load failed, with the error."""
        if self._adapter_jobs is None or not self._adapter_jobs.early_start:
            return []
        return self._adapter_jobs.patch(jobs)

    def load_adapters(self, job: DenoiseJob) -> None:
        """At admission (the loop thread): the job's adapters, loaded here if nobody started their load, their
        hooks on the denoiser. A bad adapter fails this request only (``InvalidInput`` naming LORAS)."""
        if job.inputs.loras:
            self.adapter_jobs.admit(job)
        else:
            job.adapters_loaded = True

    @property
    def controlnets(self):
        if self._controlnets is None:
            from .controlnets.library import ControlNetLibrary

            self._controlnets = ControlNetLibrary(self.settings.controlnets, self.family, self.settings)
        return self._controlnets

    @property
    def control_provider(self):
        """Where the family's step gets ControlNet residuals (``MASKEDIT_CONTROLNET_PLACEMENT``)."""
        if self._control_provider is None:
            from .controlnets.provider import make_provider

            self._control_provider = make_provider(self, self.control_transport)
        return self._control_provider

    def load_controls(self, job: DenoiseJob) -> None:
        """Load (or find loaded) the job's ControlNets and put its control images on the device; called off the
        loop where the caller can, else at admission. A bad one fails this request only (naming CONTROLS)."""
        if job.controls_loaded:
            return
        from .controlnets.job import ActiveControl

        # Placed in the ``controlnet`` model, a ControlNet is checked here from its config and loaded there.
        load = self.controlnets.check_remote if self.settings.controlnet_placement == "triton" else \
            self.controlnets.load
        job.controls = tuple(
            ActiveControl(c.spec, load(c.spec, i, self.transformer),
                          torch.from_numpy(np.ascontiguousarray(c.image)).to(self.device, self.dtype))
            for i, c in enumerate(job.inputs.controls))
        job.controls_loaded = True

    def decide(self, job: DenoiseJob) -> None:
        """Make the job's cache decision (once, before admission) and count the tokens it will compute."""
        n = int(job.inputs.latents.shape[0])
        if self.cache is None:
            job.tokens = n
        elif job.decision is None and ((job.inputs.loras and (not self.family.adapters_in_masked_path
                                                              or self.settings.lora_early_start))
                                       or (job.inputs.controls and not self._controls_cached())
                                       or not self.family.runs_cached(job.inputs)
                                       or getattr(job.inputs, "true_cfg_scale", 1.0) > 1):
            # This family's cached (masked) block paths do not add adapter deltas or ControlNet residuals (or its
            # ControlNets run in the ``controlnet`` model, out of the cache's reach), or cannot serve this request
            # at all (``ModelFamily.runs_cached``): such a request runs in full.
            # Under early start its first steps may run without its adapters: never recorded under (or served from)
            # its adapter set's key. TRUE_CFG_SCALE's negative row would need entries of its own text: in full.
            from .cache.decision import CacheDecision

            job.decision = CacheDecision("off", job.inputs.cache_key)
            job.tokens = n
        elif job.decision is None:
            job.decision = self.cache.decide(job.inputs)
            job.tokens = job.decision.tokens(n)

    def _controls_cached(self) -> bool:
        """Requests with controls are cached where the family's masked path takes ControlNets and they run here."""
        return self.family.controls_in_masked_path and self.settings.controlnet_placement != "triton"

    def prepare(self, job: DenoiseJob) -> None:
        """Admit a job: its tensors to the device, its own scheduler, its cache decision carried out."""
        _check_shapes(job.inputs, self.pixels_per_token)
        self.load_adapters(job)
        self.load_controls(job)
        self.family.prepare_job(self, job)
        if job.inputs.first_step and hasattr(job.scheduler, "set_begin_index"):
            job.scheduler.set_begin_index(job.inputs.first_step)  # as the stock get_timesteps sets it
        self._admit_cache(job)
        temporal.admit(self, job)  # after the cache decision: a template run computes every block

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
        job.step_index, job.latents, job.cache, job.tensors = job.first_step, None, None, None
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
                and self.family.runs_cached(x) \
                and (self.cache.recording(x.cache_key) or self.cache.store.locate(x.cache_key)):
            return max(1, int(np.count_nonzero(x.token_mask)))
        return n

    def release(self, job: DenoiseJob, ok: bool) -> None:
        """The job left the batch (finished, failed or cancelled)."""
        if self.cache is not None:
            self.cache.finish(job, ok)

    def groups(self, jobs: list[DenoiseJob]) -> list[list[DenoiseJob]]:
        """Jobs that share one denoiser call (the family says which: e.g. equal text length, since text tokens
        attend and cannot be padded). Adapter sets do not split a call where the family's masked paths add their
        deltas (``maskedit.adapters.delta``); ControlNet residuals do unless its masked path takes them
        (``_plain_split``)."""
        groups = group_by(jobs, self.family.group_key)
        return [g for group in groups for g in _plain_split(group, self.family.adapters_in_masked_path,
                                                             self.family.controls_in_masked_path)]

    @torch.no_grad()
    def step(self, jobs: list[DenoiseJob]) -> None:
        """Advance every job by one denoising step: one denoiser call per group of ``groups``; the group's adapters
        (``maskedit.adapters.delta``; merged into the weights when every request carries one set and the cost
        model says it pays, ``maskedit.adapters.merge``) active for the call."""
        from .adapters import delta, merge

        for group in self.groups(jobs):
            hooks = lambda: self.family.temporal_hooks(self.transformer)  # noqa: E731
            reusing = any(j.temporal is not None for j in group)  # temporal reuse: rows a hit will not read
            ctx = None if self.cache is None else self.cache.context(group, temporal.loads(group, hooks()) if reusing
                                                                        else None)
            ctx = temporal.attach(ctx, group, hooks)
            plan = merge.merger_for(self.transformer, self.settings).plan([j.adapters for j in group], max(
                j.steps - j.step_index for j in group)) if any(j.adapters for j in group) else None
            with delta.active(plan):
                self.family.step(self, group, ctx)
            temporal.commit(ctx, group)
            if self.cache is not None:
                self.cache.after_step(group)


def _check_shapes(x: DenoiseInputs, pixels_per_token: int) -> None:
    """Inconsistent tensors would fail the whole batch's step; reject them before they join."""
    tokens = (x.model_h // pixels_per_token) * (x.model_w // pixels_per_token)
    got = {"LATENTS": x.latents.shape[0], "COND": x.cond.shape[0], "TOKEN_MASK": x.token_mask.shape[0]}
    for name, n in got.items():
        if n != tokens:
            raise InvalidInput(f"has {n} tokens but MODEL_SIZE {x.model_w}x{x.model_h} implies {tokens}", name)
    if x.prompt_embeds.ndim != 2 or x.pooled_embeds.ndim != 1:
        raise InvalidInput("PROMPT_EMBEDS must be (tokens, dim) and POOLED_EMBEDS (dim,)", "PROMPT_EMBEDS")
    if x.reference is not None:
        grids = sum(int(h) * int(w) for h, w in x.reference_grids)
        if x.reference.ndim != 2 or x.reference.shape[0] != grids or x.reference.shape[1] != x.latents.shape[1]:
            raise InvalidInput(f"has shape {tuple(x.reference.shape)}; its grids {list(x.reference_grids)} and "
                               f"LATENTS' width {x.latents.shape[1]} need ({grids}, {x.latents.shape[1]})",
                               "REFERENCE")
    if not 0 <= x.first_step < x.steps:
        raise InvalidInput(f"leaves no step to run: it starts at step {x.first_step} of {x.steps}", "STRENGTH")


def _plain_split(group: list[DenoiseJob], adapters_masked: bool, controls_masked: bool = False
                 ) -> list[list[DenoiseJob]]:
    """A call carrying adapters or ControlNet residuals (unless the family's masked path takes them) runs every row
    through the denoiser's own forward (where the delta hooks are, and which takes the residuals), so it holds only
    requests that compute every token (no cache hit, no recording) at one resolution (no packed rows); requests
    with and without adapters or controls share it. The others form their own call."""
    if not any((j.adapters and not adapters_masked) or (j.controls and not controls_masked) for j in group):
        return [group]
    plain = lambda j: j.cache is None or j.cache.status in ("off", "full")  # noqa: E731
    return group_by(group, lambda j: ("plain", j.inputs.model_w, j.inputs.model_h) if plain(j) else ("cached",))


def group_by(jobs: list[DenoiseJob], key) -> list[list[DenoiseJob]]:
    groups: dict = {}
    for j in jobs:
        groups.setdefault(key(j), []).append(j)
    return list(groups.values())
