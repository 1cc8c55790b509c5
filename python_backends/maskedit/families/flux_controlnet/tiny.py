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
from ...presets import generate, train_tokenizers, visible_init, write_model

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
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxControlNetInpaintPipeline, \
        FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    p = PRESETS[preset]
    vocab, merges, pieces = train_tokenizers(vocab_size=512)
    clip_tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    t5_tok = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=p.max_sequence_length)

    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=p.clip_dim, intermediate_size=2 * p.clip_dim, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=p.clip_dim,
        bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=p.text_dim, d_kv=min(64, p.text_dim // 2), d_ff=p.text_ff or 2 * p.text_dim,
        num_layers=2, num_heads=2, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    n_down = len(p.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=p.latent_channels, block_out_channels=p.vae_channels,
        down_block_types=("DownEncoderBlock2D",) * n_down, up_block_types=("UpDecoderBlock2D",) * n_down,
        layers_per_block=1, norm_num_groups=4, sample_size=p.resolution, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False)
    config = transformer_config(p)
    if p.generated_transformer:
        with torch.device("meta"):
            transformer = FluxTransformer2DModel(**config)
    else:
        transformer = FluxTransformer2DModel(**config)
        visible_init(transformer)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
        max_shift=1.15)
    pipe = FluxControlNetInpaintPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok,
        transformer=transformer, controlnet=None)
    # FLUX.1-dev's usual guidance (embedded, no negative row) and the ControlNet pipelines' default.
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": 3.5,
               "max_sequence_length": p.max_sequence_length, "preset": preset, "seed": seed}
    out = write_model(out_dir, pipe, serving, "transformer" if p.generated_transformer else None)
    build_library(out / LIBRARY, p, seed)
    return out


def generate_transformer(model_dir: Path, seed: int, device, dtype):
    from diffusers import FluxTransformer2DModel

    return generate(FluxTransformer2DModel, model_dir, "transformer", seed, device, dtype, visible_init)
