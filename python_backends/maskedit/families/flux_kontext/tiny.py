"""FLUX.1 Kontext inpainting presets: ``FluxKontextInpaintPipeline`` model directories with seeded random weights and
local tokenizers (``maskedit.presets``), loaded with ``from_pretrained`` as real weights load
(``MASKEDIT_MODEL_DIR=/path/to/FLUX.1-Kontext-dev``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...presets import denoiser, flux1_parts, generate, visible_init, write_model


@dataclass(frozen=True)
class Preset:
    resolution: int  # default square model resolution in pixels
    steps: int  # default denoising steps served
    vae_channels: tuple[int, ...]
    latent_channels: int  # the transformer sees 4x: 2x2 packed
    dim_head: int
    heads: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    rope_axes: tuple[int, int, int]
    text_dim: int  # T5 d_model == joint_attention_dim
    clip_dim: int  # CLIP hidden == pooled_projection_dim
    max_sequence_length: int
    generated_transformer: bool = False  # weights generated at load time (real-size preset), config only on disk
    text_ff: int = 0


PRESETS = {
    # Tests and the demo: FLUX.1 Kontext's structure (packed latents only, in = 4 x latent channels, guidance
    # embedded) at 256 px -> 256 noisy + 256 reference tokens.
    "kontext-tiny": Preset(resolution=256, steps=4, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=16,
                           heads=2, num_layers=2, num_single_layers=2, rope_axes=(4, 6, 6), text_dim=32, clip_dim=32,
                           max_sequence_length=64),
    # CPU engine benchmarks: the Flux ``bench`` preset's blocks (4 double + 8 single at 256 wide) at 512 px ->
    # 1024 noisy + 1024 reference tokens.
    "kontext-bench": Preset(resolution=512, steps=8, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=64,
                            heads=4, num_layers=4, num_single_layers=8, rope_axes=(8, 28, 28), text_dim=64,
                            clip_dim=64, max_sequence_length=64),
    # FLUX.1-Kontext-dev's transformer (19 double + 38 single blocks, 24 x 128 heads = 3072 wide, in 64 = 16 latent
    # channels x 2x2, T5 4096, CLIP pooled 768, guidance embedded; 11.9 B parameters) at 1024 x 1024 = 4096 noisy +
    # 4096 reference tokens, 512 text tokens; its weights generated on the serving device. Text encoders and VAE
    # are small stand-ins with the real interface widths.
    "kontext-dev": Preset(resolution=1024, steps=28, vae_channels=(8, 16, 16, 16), latent_channels=16, dim_head=128,
                          heads=24, num_layers=19, num_single_layers=38, rope_axes=(16, 56, 56), text_dim=4096,
                          clip_dim=768, max_sequence_length=512, generated_transformer=True, text_ff=256),
}


def transformer_config(p: Preset) -> dict:
    return dict(patch_size=1, in_channels=4 * p.latent_channels, out_channels=None, num_layers=p.num_layers,
                num_single_layers=p.num_single_layers, attention_head_dim=p.dim_head, num_attention_heads=p.heads,
                joint_attention_dim=p.text_dim, pooled_projection_dim=p.clip_dim, guidance_embeds=True,
                axes_dims_rope=p.rope_axes)


def build(out_dir: str | Path, preset: str = "kontext-tiny", seed: int = 0) -> Path:
    """Write a ``FluxKontextInpaintPipeline`` model directory for ``preset`` (seeded)."""
    from diffusers import FluxKontextInpaintPipeline, FluxTransformer2DModel

    p = PRESETS[preset]
    parts = flux1_parts(p, seed)
    transformer = denoiser(FluxTransformer2DModel, transformer_config(p), p.generated_transformer)
    pipe = FluxKontextInpaintPipeline(**parts, transformer=transformer)
    # FLUX.1 Kontext's recommended guidance (embedded, no negative row).
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": 2.5,
               "max_sequence_length": p.max_sequence_length, "preset": preset, "seed": seed}
    return write_model(out_dir, pipe, serving, "transformer" if p.generated_transformer else None)


def generate_transformer(model_dir: Path, seed: int, device, dtype):
    from diffusers import FluxTransformer2DModel

    return generate(FluxTransformer2DModel, Path(model_dir), "transformer", seed, device, dtype, visible_init)
