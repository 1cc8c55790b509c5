"""The cost model on this machine: the shared ``CostModel`` (``maskedit_common.cost_model``, which the router
predicts with too) and the name of the hardware a profile is measured on, which needs torch."""

from __future__ import annotations

import re
from pathlib import Path

from maskedit_common.cost_model import CostModel, LinearFit, features, profile_name

__all__ = ["CostModel", "LinearFit", "device_slug", "features", "profile_path"]


def device_slug(device) -> str:
    """A short name for the hardware a profile was measured on: "cpu", or the GPU's model ("h100", "h200", ...)."""
    import torch

    if torch.device(device).type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()  # e.g. "nvidia h100 80gb hbm3"
    m = re.search(r"\b([a-z]+\d+[a-z]*)\b", name.replace("nvidia", ""))
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def profile_path(profiles_dir: Path, model_name: str, device) -> Path:
    """Where the cost profile of ``model_name`` measured on ``device`` lives in ``profiles_dir``."""
    return Path(profiles_dir) / profile_name(model_name, device_slug(device))
