"""Seeded random Flux ControlNets (Diffusers' ``FluxControlNetModel``, InstantX layout: the control image goes through
the VAE and is packed like the latents) for a Flux transformer: the ControlNet libraries ``make model`` writes beside
the tiny ``flux_controlnet`` and ``flux_fill`` models (``<model>/controlnets/<name>/``, ``save_pretrained``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The transformer config keys a ControlNet of it shares (its widths, rotary axes, guidance embedding).
SHARED = ("patch_size", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
          "guidance_embeds", "axes_dims_rope")


@dataclass(frozen=True)
class Net:
    """One generated ControlNet's depth (and a union ControlNet's number of control modes)."""

    num_layers: int  # double-stream blocks
    num_single_layers: int
    num_mode: int | None = None  # a union ControlNet's control modes (InstantX's Union has 7)


# The tiny models' library: two plain ControlNets of different depths and a union one.
TINY_NETS = {
    "canny": Net(num_layers=1, num_single_layers=2),
    "depth": Net(num_layers=2, num_single_layers=1),
    "union": Net(num_layers=1, num_single_layers=1, num_mode=7),
}


def controlnet(transformer_config: dict, latent_channels: int, net: Net, seed: int):
    """A seeded ``FluxControlNetModel`` fitting a transformer of ``transformer_config`` that denoises
    ``latent_channels`` packed latent channels. ControlNets start with zeroed output projections; random ones (a
    stronger init for the residual projections) make every ControlNet change the result, as trained ones do."""
    import torch
    from diffusers import FluxControlNetModel

    from ..presets import visible_init

    torch.manual_seed(seed)
    cfg = {k: transformer_config[k] for k in SHARED if k in transformer_config}
    model = FluxControlNetModel(**cfg, in_channels=latent_channels, num_layers=net.num_layers,
                                num_single_layers=net.num_single_layers, num_mode=net.num_mode)
    visible_init(model)
    with torch.no_grad():
        for proj in [*model.controlnet_blocks, *model.controlnet_single_blocks]:
            proj.weight.normal_(0.0, 0.1)
    return model


def write_library(lib: Path, transformer_config: dict, latent_channels: int, nets: dict, seed: int = 0) -> list[Path]:
    """``lib/<name>/`` for each of ``nets`` (name -> ``Net``), seeded in name order; those already there are kept."""
    out = []
    for i, (name, net) in enumerate(sorted(nets.items())):
        if not (Path(lib) / name / "config.json").is_file():
            controlnet(transformer_config, latent_channels, net, seed + 1 + i).save_pretrained(Path(lib) / name)
        out.append(Path(lib) / name)
    return out
