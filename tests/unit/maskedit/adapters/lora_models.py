"""Shared by the LoRA unit tests (test_lora, test_lora_cache, test_merge): a tiny preset built in a temporary
directory with its seeded adapter library, settings that keep the adapter host tier in that directory, and the
stock Diffusers reference (``load_lora_weights`` + ``set_adapters``) served results are compared with."""

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from maskedit.adapters.build import write_library
from maskedit.build_model import build
from maskedit.families import family_for
from maskedit.settings import Settings, load_settings
from tests.conftest import png

STEPS = 3  # the stock comparisons' steps and image size
SIZE = 128


def model_with_library(root: Path, preset: str, library: bool = True, merge: str = "never") -> Settings:
    """Settings of ``preset`` built at ``root/model`` (the suite's dtype and device), its LoRA host tier at
    ``root/lora-host`` (never the host's shared default); ``library``: with the seeded adapters of ``make model``.
    ``merge``: the same-set calls' path (``MASKEDIT_LORA_MERGE``), pinned: ``auto`` chooses it from timings measured
    at run time, so on a busy host two runs of one request could take different paths and round differently;
    tests that compare numbers must know which path each side took (test_merge sets the merger's mode per case)."""
    base = load_settings()
    d = root / "model"
    build(d, preset)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DTYPE": base.dtype, "MASKEDIT_DEVICE": base.device,
                       "MASKEDIT_LORA_HOST_DIR": str(root / "lora-host"), "MASKEDIT_LORA_MERGE": merge})
    if library:
        fam = family_for(d)
        write_library(d, fam, fam.load_denoiser(s))
    return s


def stock_pipeline(s: Settings, adapters):
    """The stock Diffusers pipeline of ``s``'s model with ``adapters`` (``[(name, scale), ...]``) from its library."""
    from diffusers import DiffusionPipeline

    fam = family_for(s.model_dir)
    pipe = DiffusionPipeline.from_pretrained(s.model_dir, dtype=torch.float32 if s.dtype == "float32" else
                                             getattr(torch, s.dtype), **fam.pipeline_kwargs()).to(s.torch_device)
    pipe.set_progress_bar_config(disable=True)
    for name, _ in adapters:
        pipe.load_lora_weights(str(s.adapters / name), weight_name="pytorch_lora_weights.safetensors",
                               adapter_name=name)
    if adapters:
        pipe.set_adapters([n for n, _ in adapters], [w for _, w in adapters])
    return pipe


def stock_latents(preset, s, pipe, tpl, mask, p, seed) -> np.ndarray:
    """``pipe``'s latents for the edit ``served_edit`` makes (``p``: its parsed params), as served tokens."""
    kw = dict(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), height=p.model_h, width=p.model_w,
              num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")
    if preset == "tiny":
        out = pipe(guidance_scale=12.0, max_sequence_length=s.max_sequence_length, **kw).images[0]
        return out.float().cpu().numpy()
    out = pipe(guidance_scale=7.5, strength=1.0, **kw).images[0]
    return out.permute(1, 2, 0).reshape(-1, out.shape[0]).float().cpu().numpy()


def served_edit(preset, ed, tpl, mask, loras, seed=5):
    """One raw-output edit through ``ed`` (a ``LocalEditor``) with ``loras``."""
    g = 12.0 if preset == "tiny" else 7.5
    return ed.edit(png(tpl), png(mask), "a red hat", seed=seed, steps=STEPS, guidance=g, raw_output=True,
                   template_seed=5, loras=loras)
