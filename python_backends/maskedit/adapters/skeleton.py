"""What converting an adapter needs of the served denoiser, without its weights: its module tree on the ``meta``
device (names, layer types and widths: what ``convert.load`` checks an adapter against) built from the model
directory's config, so the pre-processing process converts adapters for the host cache without loading the
denoiser; and the fingerprint of that architecture and dtype, part of every host-cache key (a converted adapter is
valid only for the denoiser and dtype it was converted for)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _denoiser_class(model_dir: Path, component: str):
    import diffusers

    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    _, cls_name = index[component]
    return getattr(diffusers, cls_name)


def denoiser_skeleton(settings, family):
    """The denoiser's modules on the ``meta`` device (no memory, no weights read)."""
    import torch

    cls = _denoiser_class(settings.model_dir, family.denoiser)
    config = cls.load_config(settings.model_dir, subfolder=family.denoiser)
    with torch.device("meta"):
        return cls.from_config(config)


def fingerprint(settings, family) -> str:
    """The denoiser's class, config file and compute dtype, hashed: the same in every process serving the model."""
    try:
        config = (Path(settings.model_dir) / family.denoiser / "config.json").read_bytes()
    except OSError:  # no config file to share: this model directory alone
        config = str(Path(settings.model_dir).resolve()).encode()
    h = hashlib.sha256(config)
    h.update(f"|{family.pipeline_class_name}|{family.denoiser}|{settings.dtype}".encode())
    return h.hexdigest()[:12]
