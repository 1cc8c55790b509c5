"""Build Stable Diffusion 2 / SDXL inpainting model directories locally: seeded random weights, local tokenizers.

Like Flux Fill's presets (``maskedit.presets``): the directory is written with ``save_pretrained`` and served with
``from_pretrained``, exactly as real weights would be (``MASKEDIT_MODEL_DIR=/path/to/stable-diffusion-2-inpainting``
or ``…/stable-diffusion-xl-1.0-inpainting-0.1``). The UNet is the 9-channel inpainting UNet (latents, mask,
masked-image latents); ``sdxl`` has the real SDXL-inpainting UNet's dimensions (2.57 B parameters), generated on the
serving device at load time instead of written to disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...presets import generate, train_tokenizers, visible_init, write_model


@dataclass(frozen=True)
class UNetPreset:
    xl: bool  # SDXL (two text encoders, pooled + time-id conditioning) or SD 2
    resolution: int
    steps: int
    channels: tuple[int, ...]  # UNet block_out_channels
    down: tuple[str, ...]
    up: tuple[str, ...]
    layers: tuple[int, ...]  # transformer layers per block
    heads: tuple[int, ...]  # diffusers' ``attention_head_dim`` (the number of heads in SD/SDXL configs)
    cross_dim: int  # text width the UNet attends to
    text_dims: tuple[int, ...]  # hidden width of each text encoder (SDXL: the two concatenate to cross_dim)
    layers_per_block: int = 1
    groups: int = 8
    time_dim: int = 8  # SDXL addition_time_embed_dim
    vae_channels: tuple[int, ...] = (8, 16, 16, 16)
    generated_unet: bool = False


_SD_DOWN = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
_SD_UP = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
_XL_DOWN = ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
_XL_UP = ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")

UNET_PRESETS = {
    # Tests: 256x256 pixels -> 32x32 latents; attention at 32x32 and 16x16 (SD 2) / 16x16 and 8x8 (SDXL).
    "sd2-tiny": UNetPreset(xl=False, resolution=256, steps=6, channels=(32, 64, 64), down=_SD_DOWN, up=_SD_UP,
                           layers=(1, 1, 1), heads=(2, 4, 4), cross_dim=32, text_dims=(32,)),
    "sdxl-tiny": UNetPreset(xl=True, resolution=256, steps=6, channels=(32, 64, 64), down=_XL_DOWN, up=_XL_UP,
                            layers=(1, 1, 2), heads=(2, 4, 4), cross_dim=64, text_dims=(32, 32)),
    # CPU engine benchmarks: 512x512 -> 64x64 latents, SD 2's and SDXL's layouts at a sixteenth of the width.
    "sd2-bench": UNetPreset(xl=False, resolution=512, steps=8, channels=(64, 128, 128), down=_SD_DOWN, up=_SD_UP,
                            layers=(1, 1, 1), heads=(2, 4, 4), cross_dim=64, text_dims=(64,), layers_per_block=2,
                            groups=16),
    "sdxl-bench": UNetPreset(xl=True, resolution=512, steps=8, channels=(64, 128, 128), down=_XL_DOWN, up=_XL_UP,
                             layers=(1, 2, 4), heads=(2, 4, 4), cross_dim=64, text_dims=(32, 32), layers_per_block=2,
                             groups=16),
    # SDXL-inpainting's UNet exactly (320/640/1280 channels, 1/2/10 transformer layers, 64-wide heads, text width
    # 2048, pooled 1280 + 6 time ids x 256; 2.57 B parameters) at 1024x1024. Text encoders and VAE are small
    # stand-ins with the real interface widths (768 + 1280, 4 latent channels): they run once per request.
    "sdxl": UNetPreset(xl=True, resolution=1024, steps=30, channels=(320, 640, 1280), down=_XL_DOWN, up=_XL_UP,
                       layers=(1, 2, 10), heads=(5, 10, 20), cross_dim=2048, text_dims=(768, 1280),
                       layers_per_block=2, groups=32, time_dim=256, generated_unet=True),
}


def unet_config(p: UNetPreset) -> dict:
    cfg = dict(
        sample_size=p.resolution // 8, in_channels=9, out_channels=4, block_out_channels=p.channels,
        down_block_types=p.down, up_block_types=p.up, layers_per_block=p.layers_per_block,
        transformer_layers_per_block=p.layers, attention_head_dim=p.heads, cross_attention_dim=p.cross_dim,
        norm_num_groups=p.groups, use_linear_projection=True,
    )
    if p.xl:
        cfg.update(addition_embed_type="text_time", addition_time_embed_dim=p.time_dim,
                   projection_class_embeddings_input_dim=6 * p.time_dim + p.text_dims[-1])
    return cfg


def build_unet(out_dir: str | Path, preset: str, seed: int = 0) -> Path:
    import torch
    from diffusers import (AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, StableDiffusionInpaintPipeline,
                           StableDiffusionXLInpaintPipeline, UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    p = UNET_PRESETS[preset]
    vocab, merges, _ = train_tokenizers(vocab_size=512)
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    torch.manual_seed(seed)

    def clip(width: int, projection: bool):
        cfg = CLIPTextConfig(
            vocab_size=len(tok), hidden_size=width, intermediate_size=min(2 * width, 256), num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=width, hidden_act="gelu",
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)

    n_down = len(p.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=p.vae_channels,
        down_block_types=("DownEncoderBlock2D",) * n_down, up_block_types=("UpDecoderBlock2D",) * n_down,
        layers_per_block=1, norm_num_groups=4, sample_size=p.resolution,
        scaling_factor=0.13025 if p.xl else 0.18215,
    )
    if p.generated_unet:
        with torch.device("meta"):  # its config only
            unet = UNet2DConditionModel(**unet_config(p))
    else:
        unet = UNet2DConditionModel(**unet_config(p))
        visible_init(unet)
    sched_args = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                      steps_offset=1, timestep_spacing="leading")
    if p.xl:
        pipe = StableDiffusionXLInpaintPipeline(
            vae=vae, text_encoder=clip(p.text_dims[0], False), text_encoder_2=clip(p.text_dims[1], True),
            tokenizer=tok, tokenizer_2=tok, unet=unet, scheduler=EulerDiscreteScheduler(**sched_args),
            requires_aesthetics_score=False, force_zeros_for_empty_prompt=True)
    else:
        pipe = StableDiffusionInpaintPipeline(
            vae=vae, text_encoder=clip(p.text_dims[0], False), tokenizer=tok, unet=unet,
            scheduler=DDIMScheduler(**sched_args, clip_sample=False, set_alpha_to_one=False),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": 7.5, "max_sequence_length": 77,
               "preset": preset, "seed": seed}
    return write_model(out_dir, pipe, serving, "unet" if p.generated_unet else None)


def generate_unet(model_dir: Path, seed: int, device, dtype):
    """The UNet of a generated preset, built on ``device`` in ``dtype`` from its saved config (seeded weights)."""
    from diffusers import UNet2DConditionModel

    return generate(UNet2DConditionModel, model_dir, "unet", seed, device, dtype, visible_init)
