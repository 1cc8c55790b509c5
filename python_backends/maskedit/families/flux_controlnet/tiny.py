"""Flux ControlNet inpainting presets: a FLUX.1-dev-shaped model directory (``FluxControlNetInpaintPipeline`` with its
``controlnet`` left empty: ControlNets are named per request) and a ControlNet library beside it, ``controlnets/``,
one ``FluxControlNetModel.save_pretrained`` directory per ControlNet. Seeded random weights, local tokenizers
(``maskedit.presets``), loaded with ``from_pretrained`` as real weights load (``MASKEDIT_MODEL_DIR=/path/to/FLUX.1-dev``
with e.g. InstantX's ControlNets in ``controlnets/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...controlnets import flux_build
from ...controlnets.flux_build import TINY_NETS, Net  # noqa: F401  (tests build their own Nets)
from ...presets import denoiser, flux1_parts, generate, visible_init, write_model

LIBRARY = "controlnets"  # the ControlNet library's folder beside the model (the default library directory)


@dataclass(frozen=True)
class Preset:
    resolution: int
    steps: int
    vae_channels: tuple[int, ...]
    latent_channels: int
    dim_head: int
    heads: int
    num_layers: int
    num_single_layers: int
    rope_axes: tuple[int, int, int]
    text_dim: int  # T5 d_model == joint_attention_dim
    clip_dim: int  # CLIP hidden == pooled_projection_dim
    max_sequence_length: int
    controlnets: dict = field(default_factory=dict)  # library name -> Net
    generated_transformer: bool = False
    text_ff: int = 0


PRESETS = {
    # Tests and the demo: FLUX.1-dev's structure (in 4 x latent channels, guidance embedded) at 256 px = 256 tokens.
    "flux-cn-tiny": Preset(
        resolution=256, steps=8, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=16, heads=2,
        num_layers=2, num_single_layers=2, rope_axes=(4, 6, 6), text_dim=32, clip_dim=32, max_sequence_length=64,
        controlnets=TINY_NETS),
    # CPU benchmarks: 4 double + 8 single blocks at 256 wide, 512 px = 1024 tokens; InstantX-like ControlNets
    # (Union: 5 double + 10 single of FLUX.1-dev's 19 + 38, here 2 + 4 of 4 + 8).
    "flux-cn-bench": Preset(
        resolution=512, steps=8, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=64, heads=4,
        num_layers=4, num_single_layers=8, rope_axes=(8, 28, 28), text_dim=64, clip_dim=64, max_sequence_length=64,
        controlnets={"canny": Net(2, 4), "depth": Net(2, 4), "union": Net(2, 4, num_mode=7)}),
}


def transformer_config(p: Preset) -> dict:
    """FLUX.1-dev's transformer scaled down: the packed latents only (in = out = 4 x latent channels), guidance
    embedded."""
    return dict(patch_size=1, in_channels=4 * p.latent_channels, out_channels=None, num_layers=p.num_layers,
                num_single_layers=p.num_single_layers, attention_head_dim=p.dim_head, num_attention_heads=p.heads,
                joint_attention_dim=p.text_dim, pooled_projection_dim=p.clip_dim, guidance_embeds=True,
                axes_dims_rope=p.rope_axes)


def controlnet(p: Preset, net: Net, seed: int):
    """A seeded ``FluxControlNetModel`` for ``p``'s transformer (``controlnets.flux_build``)."""
    return flux_build.controlnet(transformer_config(p), 4 * p.latent_channels, net, seed)


def build_library(lib: Path, p: Preset, seed: int = 0) -> list[Path]:
    """``lib/<name>/`` for each of the preset's ControlNets (``save_pretrained``); those already there are kept."""
    return flux_build.write_library(lib, transformer_config(p), 4 * p.latent_channels, p.controlnets, seed)


def build(out_dir: str | Path, preset: str = "flux-cn-tiny", seed: int = 0) -> Path:
    """A ``FluxControlNetInpaintPipeline`` model directory (no ControlNet in it) and its ControlNet library."""
    from diffusers import FluxControlNetInpaintPipeline, FluxTransformer2DModel

    p = PRESETS[preset]
    parts = flux1_parts(p, seed)  # encoders, VAE, scheduler (seeded first: the transformer's weights follow)
    transformer = denoiser(FluxTransformer2DModel, transformer_config(p), p.generated_transformer)
    pipe = FluxControlNetInpaintPipeline(**parts, transformer=transformer, controlnet=None)
    # FLUX.1-dev's usual guidance (embedded, no negative row) and the ControlNet pipelines' default.
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": 3.5,
               "max_sequence_length": p.max_sequence_length, "preset": preset, "seed": seed}
    out = write_model(out_dir, pipe, serving, "transformer" if p.generated_transformer else None)
    build_library(out / LIBRARY, p, seed)
    return out


def generate_transformer(model_dir: Path, seed: int, device, dtype):
    from diffusers import FluxTransformer2DModel

    return generate(FluxTransformer2DModel, model_dir, "transformer", seed, device, dtype, visible_init)
