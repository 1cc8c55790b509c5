"""The sigma/timestep schedule of one request, computed the way ``FluxFillPipeline.__call__`` does it.

Each request gets its own scheduler instance: the scheduler keeps a step index, and requests at different
steps share a running batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux_fill import calculate_shift, retrieve_timesteps


def first_step(pipeline_class, steps: int, strength: float) -> int:
    """The step of a ``steps``-step schedule a STRENGTH edit starts at: the stock pipeline's own ``get_timesteps``
    (its ``t_start``; the Flux pipelines and the UNet ones round ``steps * strength`` differently), for a one-order
    scheduler. Raises ``InvalidInput`` naming STRENGTH when no step is left (the pipelines' own ValueError)."""
    from .errors import InvalidInput

    schedule = SimpleNamespace(scheduler=SimpleNamespace(timesteps=list(range(steps)), order=1))
    _, run = pipeline_class.get_timesteps(schedule, steps, strength, "cpu")
    if run < 1:
        raise InvalidInput(f"{strength:g} leaves no step of {steps} to run ({pipeline_class.__name__} runs "
                           f"steps x strength of them); raise STRENGTH or STEPS", "STRENGTH")
    return steps - run


def make_scheduler(config: dict, steps: int, image_seq_len: int, device="cpu",
                   first: int = 0) -> FlowMatchEulerDiscreteScheduler:
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(first)  # FluxFillPipeline.get_timesteps: the strength's first step (0 at 1.0)
    return scheduler
