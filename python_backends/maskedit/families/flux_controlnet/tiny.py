"""Flux ControlNet inpainting presets: a FLUX.1-dev-shaped model directory (``FluxControlNetInpaintPipeline`` with its
``controlnet`` left empty: ControlNets are named per request) and a ControlNet library beside it, ``controlnets/``,
one ``FluxControlNetModel.save_pretrained`` directory per ControlNet. Seeded random weights, local tokenizers
(``maskedit.presets``), loaded with ``from_pretrained`` as real weights load (``MASKEDIT_MODEL_DIR=/path/to/FLUX.1-dev``
with e.g. InstantX's ControlNets in ``controlnets/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...presets import denoiser, flux1_parts, generate, visible_init, write_model

LIBRARY = "controlnets"  # the ControlNet library's folder beside the model (the default library directory)


@dataclass(frozen=True)
class Net:
    """One generated ``FluxControlNetModel`` (InstantX layout: no input hint block, the control image goes through
    the VAE and is packed like the latents)."""

    num_layers: int  # double-stream blocks
    num_single_layers: int
    num_mode: int | None = None  # a union ControlNet's control modes (InstantX's Union has 7)


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


TINY_NETS = {
    "canny": Net(num_layers=1, num_single_layers=2),
    "depth": Net(num_layers=2, num_single_layers=1),
    "union": Net(num_layers=1, num_single_layers=1, num_mode=7),
}

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
    """A seeded ``FluxControlNetModel`` for ``p``'s transformer. ControlNets start with zeroed output projections;
    random ones (a stronger init for the residual projections) make every ControlNet change the result, as
    trained ones do."""
    import torch
    from diffusers import FluxControlNetModel

    torch.manual_seed(seed)
    cfg = transformer_config(p)
    cfg.pop("out_channels")
    model = FluxControlNetModel(**{**cfg, "num_layers": net.num_layers, "num_single_layers": net.num_single_layers},
                                num_mode=net.num_mode)
    visible_init(model)
    with torch.no_grad():
        for proj in [*model.controlnet_blocks, *model.controlnet_single_blocks]:
            proj.weight.normal_(0.0, 0.1)
    return model


def build_library(lib: Path, p: Preset, seed: int = 0) -> list[Path]:
    """``lib/<name>/`` for each of the preset's ControlNets (``save_pretrained``); those already there are kept."""
    out = []
    for i, (name, net) in enumerate(sorted(p.controlnets.items())):
        if not (Path(lib) / name / "config.json").is_file():
            controlnet(p, net, seed + 1 + i).save_pretrained(Path(lib) / name)
        out.append(Path(lib) / name)
    return out


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
