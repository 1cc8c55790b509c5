"""A request's controls between the stages: as pre-processing produced them (``ControlInput``, numpy, carried as
``CONTROL_COND`` rows plus their specs and shapes in ``REQUEST_INFO``) and once admitted (``ActiveControl``: the
loaded ControlNet and the image on the device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from maskedit_common.controls import ControlSpec


@dataclass(frozen=True)
class ControlInput:
    spec: ControlSpec
    image: np.ndarray  # the family's prepared control image (``ModelFamily.prepare_control_image``), its own shape


@dataclass(frozen=True)
class ActiveControl:
    spec: ControlSpec
    model: Any  # the loaded ControlNet (``ControlNetLibrary.load``; shared by every request naming it)
    image: Any  # torch.Tensor: ``ControlInput.image`` on the denoiser's device and dtype

    def scale_at(self, step: int, steps: int) -> float:
        return self.spec.scale_at(step, steps)

    def scale_for(self, job) -> float:
        """Its conditioning scale at ``job``'s current step (0 outside its window)."""
        return self.spec.scale_at(*run_position(job))


def run_position(job, step: int | None = None) -> tuple[int, int]:
    """(index, count) of ``job``'s step (default: its current one) among the steps it runs: a STRENGTH < 1 edit runs
    the schedule's last steps, and the stock pipelines count ControlNet windows over those (``len(timesteps)``)."""
    first = getattr(job.inputs, "first_step", 0)
    return (job.step_index if step is None else step) - first, job.steps - first


def to_wire(controls) -> tuple[np.ndarray, list[dict]]:
    """``ControlInput``s as the ``CONTROL_COND`` rows (one per control, float32; (0, 0) for none) and the
    ``REQUEST_INFO`` "controls" list (each spec with its image's shape)."""
    if not controls:
        return np.zeros((0, 0), np.float32), []
    flat = [np.ascontiguousarray(c.image, np.float32).reshape(-1) for c in controls]
    rows = np.zeros((len(flat), max(f.size for f in flat)), np.float32)  # shapes may differ: rows are padded
    for row, f in zip(rows, flat):
        row[:f.size] = f
    return rows, [{**c.spec.as_dict(), "shape": list(c.image.shape)} for c in controls]


def from_wire(rows: np.ndarray | None, info: list[dict] | None) -> tuple[ControlInput, ...]:
    """The inverse of ``to_wire``."""
    if not info:
        return ()
    out = []
    for row, d in zip(rows, info):
        d = dict(d)
        shape = tuple(d.pop("shape"))
        out.append(ControlInput(ControlSpec(**d), np.asarray(row[:int(np.prod(shape))]).reshape(shape)))
    return tuple(out)
