"""The sigma/timestep schedule of one request, computed the way ``FluxFillPipeline.__call__`` does it.

Each request gets its own scheduler instance: the scheduler keeps a step index, and requests at different
steps share a running batch.
"""

from __future__ import annotations

import numpy as np
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux_fill import calculate_shift, retrieve_timesteps


def make_scheduler(config: dict, steps: int, image_seq_len: int, device="cpu") -> FlowMatchEulerDiscreteScheduler:
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
    scheduler.set_begin_index(0)  # strength 1.0: start at the first timestep (FluxFillPipeline.get_timesteps)
    return scheduler
