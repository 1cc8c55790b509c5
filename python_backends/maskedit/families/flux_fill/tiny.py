"""Flux Fill presets: model directories with seeded random weights and local tokenizers (``maskedit.presets``),
loaded like real weights (``MASKEDIT_MODEL_DIR=/path/to/FLUX.1-Fill-dev``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...presets import denoiser, flux1_parts, generate, visible_init, write_model

@dataclass(frozen=True)
class Preset:
    """Sizes of one generated Flux Fill model."""

    resolution: int  # default square model resolution in pixels
    steps: int  # default denoising steps served for this model
    vae_channels: tuple[int, ...]
    latent_channels: int
    dim_head: int
    heads: int
    num_layers: int  # dual-stream blocks
    num_single_layers: int
    rope_axes: tuple[int, int, int]
    text_dim: int  # T5 d_model == joint_attention_dim
    clip_dim: int  # CLIP hidden == pooled_projection_dim
    max_sequence_length: int  # T5 tokens
    # Transformer weights are generated (seeded) on the serving device at load time instead of written to disk:
    # a FLUX.1-size transformer is 24 GB in bf16, and its random weights carry no information worth the bytes.
    generated_transformer: bool = False
    text_ff: int = 0  # T5 feed-forward width (0: twice d_model); small for wide presets (encoders run once)


PRESETS = {
    # The demo / test default: 256x256 pixels -> 256 image tokens, runs in well under a second a step.
    "tiny": Preset(
        resolution=256, steps=8, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=16, heads=2,
        num_layers=2, num_single_layers=2, rope_axes=(4, 6, 6), text_dim=32, clip_dim=32,
        max_sequence_length=64,
    ),
    # Benchmark size: ~20M transformer parameters, 512x512 pixels -> 1024 image tokens.
    "bench": Preset(
        resolution=512, steps=8, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=64, heads=4,
        num_layers=4, num_single_layers=8, rope_axes=(8, 28, 28), text_dim=64, clip_dim=64,
        max_sequence_length=64,
    ),
    # FLUX.1-Fill-dev's transformer exactly (19 dual + 38 single blocks, 24 x 128 heads = 3072 hidden, in 384 /
    # out 64, T5 width 4096, pooled 768, guidance embeds; 11.9 B parameters) at 1024 x 1024 = 4096 image + 512 text
    # tokens. Text encoders and VAE are small stand-ins with the real interface widths: they run once per request,
    # outside the denoise loop that this preset measures.
    "flux-dev": Preset(
        resolution=1024, steps=28, vae_channels=(8, 16, 16, 16), latent_channels=16, dim_head=128, heads=24,
        num_layers=19, num_single_layers=38, rope_axes=(16, 56, 56), text_dim=4096, clip_dim=768,
        max_sequence_length=512, generated_transformer=True, text_ff=256,
    ),
    # FLUX.1-Fill-dev's widths with 4 dual + 8 single blocks: the same shape of work per block, a step a fifth as
    # long, so serving benchmarks on a GPU fit the device's time limits (a block-count ratio scales to full depth).
    "flux-width": Preset(
        resolution=1024, steps=8, vae_channels=(8, 16, 16, 16), latent_channels=16, dim_head=128, heads=24,
        num_layers=4, num_single_layers=8, rope_axes=(16, 56, 56), text_dim=4096, clip_dim=768,
        max_sequence_length=512, generated_transformer=True, text_ff=256,
    ),
}


def transformer_config(preset: str) -> dict:
    """The ``FluxTransformer2DModel`` config of ``preset``."""
    p = PRESETS[preset]
    scale = 2 ** (len(p.vae_channels) - 1)
    packed = p.latent_channels * 4
    return dict(
        patch_size=1, in_channels=2 * packed + scale * scale * 4, out_channels=packed, num_layers=p.num_layers,
        num_single_layers=p.num_single_layers, attention_head_dim=p.dim_head, num_attention_heads=p.heads,
        joint_attention_dim=p.text_dim, pooled_projection_dim=p.clip_dim, guidance_embeds=True,
        axes_dims_rope=p.rope_axes,
    )


def build(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Generate a Flux Fill model directory loadable by ``FluxFillPipeline.from_pretrained``."""
    from diffusers import FluxFillPipeline, FluxTransformer2DModel

    p = PRESETS[preset]
    parts = flux1_parts(p, seed)  # encoders, VAE, scheduler (seeded first: the transformer's weights follow)
    transformer = denoiser(FluxTransformer2DModel, transformer_config(preset), p.generated_transformer)
    pipe = FluxFillPipeline(**parts, transformer=transformer)
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": 30.0,
               "max_sequence_length": p.max_sequence_length, "preset": preset, "seed": seed}
    return write_model(out_dir, pipe, serving, "transformer" if p.generated_transformer else None)


def generate_transformer(model_dir: Path, seed: int, device, dtype):
    """The transformer of a generated preset, built straight on ``device`` in ``dtype`` from its saved config with
    seeded random weights (seconds for FLUX.1 size on a GPU: no file is read)."""
    from diffusers import FluxTransformer2DModel

    return generate(FluxTransformer2DModel, model_dir, "transformer", seed, device, dtype, visible_init)
