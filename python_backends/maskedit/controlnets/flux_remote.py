"""Flux ControlNets placed in the ``controlnet`` Triton model (``MASKEDIT_CONTROLNET_PLACEMENT=triton``), for both
Flux families (``flux_controlnet``; ``flux_fill``'s ControlNet extension).

Both Flux steps get their transformer calls' residual lists from ``step_lists``, in-process or placed. Placed, the
denoiser side: per step, one BLS call per request with a control acting at that step (``start``: the provider's
calls are in flight together on return), carrying that request's rows and its acting controls' packed latents.
The transformer is handed its residual lists before they exist (``LateSamples``): ``FluxTransformer2DModel.forward``
embeds the latents, the text, the timestep and guidance, builds the rotary tables and runs its first double block
before it first touches ``controlnet_block_samples`` (``len`` and indexing come after that block), so that work
overlaps the calls; the first touch collects them (``collect``). Which rows of a step share a transformer call is
decided before the answers arrive: by each request's merged list lengths (``controlnets.flux.structure``, from the
ControlNets' configs: the denoiser loads no ControlNet weights) and whether any control acts this step.

Service side (``remote_residuals``, the ``controlnet`` model): each acting control's ControlNet call for the
request's rows, scaled, merged in control order as ``FluxMultiControlNetModel`` merges them (``flux.merge``, cut
to the request's structure): the in-process path's numbers for that request (it batches rows of several requests
per ControlNet; a batch of one may round differently in the last bits).

A call that fails or times out raises ``ControlNetFailed`` at the first touch, naming every request whose call
failed; the engine retires those and runs the step again for the others (as for the UNet families).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from . import flux as R


def config_of(runner, active, index: int):
    """A control's ControlNet config: the loaded model's, or (placed in the ``controlnet`` model, where the denoiser
    loads no weights) its ``config.json`` from the library."""
    if active.model is not None:
        return active.model.config
    return runner.controlnets.config(active.spec.name, index)


def placed(runner) -> bool:
    """Are this runner's ControlNets in the ``controlnet`` model? (Test runners without settings: in-process.)"""
    return getattr(getattr(runner, "settings", None), "controlnet_placement", "inprocess") == "triton"


def step_lists(runner, group: list, controls_of, latents, timestep, guidance, pooled, text, txt_ids, img_ids,
               run=None):
    """A step's transformer calls and their residual lists, from either placement: (calls, ``lists(idx)`` giving a
    call's (double, single) lists). In-process the ControlNets run now (``flux.step_residuals``; ``run``: the
    activation cache's wrapper of each ControlNet call); placed in the ``controlnet`` model the calls go out now and
    the lists are collected at the transformer's first touch (``LateRows``)."""
    if placed(runner) and any(controls_of(j) for j in group):
        provider, t0 = runner.control_provider, time.perf_counter()
        pending = start(provider, group, controls_of, latents, timestep, guidance, pooled, text, txt_ids, img_ids)
        late = LateRows(provider, group, pending, t0, latents, runner.transformer.inner_dim)
        return late.calls(), late.lists
    t0 = time.perf_counter()
    rows, shapes = R.step_residuals(group, controls_of, latents, timestep, guidance, pooled, text, txt_ids, img_ids,
                                    run)
    charge(group, rows, time.perf_counter() - t0)
    return R.calls(rows, shapes), lambda idx: R.stacked(rows, idx, latents)


def charge(group: list, rows: list, seconds: float) -> None:
    """In-process: the step's batched ControlNet calls took ``seconds``; each request that had residuals is charged
    all of it (EDIT_INFO ``control_s``; one request alone: its own ControlNet time)."""
    for job, r in zip(group, rows):
        if r is not None:
            job.control_s = getattr(job, "control_s", 0.0) + seconds  # (test jobs may lack the field)


def start(provider, group: list, controls_of, latents, timestep, guidance, pooled, text, txt_ids, img_ids) -> list:
    """One ``Pending`` (or None: no control acts) per request of ``group``. ``controls_of(job)``: its
    ((ActiveControl, mode index or None, (1, N, C) control latents), ...) in control order; the other arguments
    the step's batched ControlNet inputs (row i is request i)."""
    pending = []
    for i, job in enumerate(group):
        active = []
        for control, _, cond in controls_of(job):
            s = control.scale_for(job)
            if s != 0:  # outside its window the pipeline adds its zeros
                active.append((dataclasses.replace(control, image=cond[0]), s))
        if not active:
            pending.append(None)
            continue
        row = slice(i, i + 1)
        inputs = dict(hidden_states=latents[row], timestep=timestep[row], pooled_projections=pooled[row],
                      guidance=None if guidance is None else guidance[row], encoder_hidden_states=text[row],
                      txt_ids=txt_ids, img_ids=img_ids, structure=job.tensors.structure)
        pending.append(provider.start(job, active, inputs))
    return pending


def collect(provider, group: list, pending: list, t0: float) -> list:
    """Each request's merged (double, single) residuals or None, from ``start``'s calls. Requests whose call failed
    raise one ``ControlNetFailed`` naming them all."""
    from .provider import ControlNetFailed

    rows, failed = [], []
    for job, p in zip(group, pending):
        try:
            res = None if p is None else p.result()
        except ControlNetFailed as e:
            failed.append(e)
            res = None
        if p is not None:
            job.control_s += p.seconds
            job.control_bls_s += p.bls_s
            job.control_model_s += p.model_s
        rows.append(None if res is None else split(res))
    if any(p is not None for p in pending):
        provider.stats.add(steps=1, step_s=time.perf_counter() - t0)
    if failed:
        raise ControlNetFailed(str(failed[0]).removeprefix("CONTROLS: "), [f for e in failed for f in e.failures])
    return rows


def split(res) -> tuple:
    """A call's flat residuals (``wire.Residuals``) as (double samples or None, single samples or None), each
    sample (N, D) (the request's one row)."""
    double, single = res.groups
    flat = [r[0] for r in res]
    d = max(double, 0)
    return (flat[:d] if double >= 0 else None), (flat[d:d + single] if single >= 0 else None)


class LateSamples:
    """One kind (0 double, 1 single) of one transformer call's residual lists, resolved on first use: ``len`` is
    the call's structure (known before the answers), indexing collects the step's calls (once, shared by the
    step's transformer calls) and stacks the call's rows (zeros for rows without)."""

    def __init__(self, late: "LateRows", idx: list[int], kind: int, length: int):
        self.late, self.idx, self.kind, self.length = late, idx, kind, length
        self._samples = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if self._samples is None:
            self._samples = self.late.samples(self.idx, self.kind, self.length)
        return self._samples[i]


class LateRows:
    """The step's residuals on their way: ``calls`` splits the group as ``flux.calls`` does, ``lists`` gives a
    call's (double, single) ``LateSamples`` (None for a kind no row of the call has)."""

    def __init__(self, provider, group: list, pending: list, t0: float, like: torch.Tensor, inner: int):
        self.provider, self.group, self.pending, self.t0 = provider, group, pending, t0
        self.like, self.inner = like, inner
        self.shapes = [j.tensors.structure for j in group]
        self._rows = None

    def calls(self) -> list[list[int]]:
        return R.calls([None if p is None else True for p in self.pending], self.shapes)

    def lists(self, idx: list[int]) -> tuple:
        shape = next((self.shapes[i] for i in idx if self.pending[i] is not None), (None, None))
        return tuple(None if n is None else LateSamples(self, idx, kind, n) for kind, n in enumerate(shape))

    def rows(self) -> list:
        if self._rows is None:
            self._rows = collect(self.provider, self.group, self.pending, self.t0)
        return self._rows

    def samples(self, idx: list[int], kind: int, length: int) -> list:
        got = R.stacked(self.rows(), idx, self.like)[kind]
        if got is None:  # no acting control of these rows has this kind this step: the zeros the others add
            zero = torch.zeros(len(idx), self.like.shape[1], self.inner, device=self.like.device, dtype=self.like.dtype)
            got = [zero] * length
        return got


def remote_residuals(family, actives: list, inputs: dict) -> tuple[list, list[int]]:
    """The ``controlnet`` model's work for one Flux request at one step: ``actives`` (ActiveControl with its packed
    control latents as ``image``, scale at this step) in control order. Returns the merged residuals flat (double
    samples then single, each (R, N, D)) and their groups (double count, single count; -1 for none)."""
    parts = []
    for control, scale in actives:
        cfg = control.model.config
        mode = family.control_mode_index(control.spec.mode, cfg) if R.is_union(cfg) else None
        use = R.Use(0, 0, control.image.unsqueeze(0), scale, mode)
        parts.append(R.per_net(control.model, [use], inputs["hidden_states"], inputs["timestep"], inputs["guidance"],
                               inputs["pooled_projections"], inputs["encoder_hidden_states"], inputs["txt_ids"],
                               inputs["img_ids"]))
    double, single = R.merge(parts, inputs["structure"])
    return [*(double or []), *(single or [])], [-1 if double is None else len(double),
                                                -1 if single is None else len(single)]
