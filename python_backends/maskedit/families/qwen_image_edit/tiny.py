"""Build a Qwen-Image-Edit inpainting model directory locally: seeded random weights, a locally trained tokenizer and
a local vision-language processor — no model hub.

The real architecture scaled down: ``QwenImageTransformer2DModel`` (an MMDiT of dual-stream blocks with 3-axis
rotary positions), ``AutoencoderKLQwenImage`` (the causal 3-D VAE, its latent mean / std randomised so they matter),
a ``Qwen2_5_VLForConditionalGeneration`` built from a ``transformers`` config (a Qwen2.5 language model and a
window-attention vision tower; the pipeline reads its last hidden state over the chat-templated prompt *and the
template's image tokens*), a byte-level BPE ``Qwen2Tokenizer`` with Qwen's special tokens, and a ``Qwen2VLProcessor``
(its image processor bounded to a few image tokens). Written with ``save_pretrained``, loaded with
``from_pretrained`` like real weights.

The pipeline always works at about 1024 x 1024 pixels (``calculate_dimensions(1024 * 1024, ratio)``: its ``height``
and ``width`` arguments are ignored), so the stock comparison needs 1 MP images. The tiny preset keeps them cheap
with a VAE of five 2x downsamplings (32 pixels per latent pixel, 64 per token: 16 x 16 noisy tokens at 1024 x 1024)
and no residual blocks on the encoder's levels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...presets import CORPUS, generate, generated_key, save, visible_init, write_serving_defaults, writing

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
# The pipeline's prompt template (``prompt_template_encode``) is part of every encoded prompt: the tokenizer learns
# its words too.
TEMPLATE_TEXT = ("Describe the key features of the input image (color, shape, size, texture, objects, background), "
                 "then explain how the user's text instruction should alter or modify the image. Generate a new "
                 "image that meets the user's requirements while maintaining consistency with the original input "
                 "where appropriate.")
PROCESSOR = "processor"  # the pipeline's processor component (subfolder)


@dataclass(frozen=True)
class Preset:
    resolution: int  # served area is resolution**2 pixels (the stock pipeline's is always 1024**2)
    steps: int  # default denoising steps served
    guidance: float  # default ``true_cfg_scale`` (classifier-free guidance when a negative prompt is given)
    z_dim: int  # VAE latent channels (the transformer sees 4x: 2x2 patches)
    vae_base: int
    vae_mult: tuple[int, ...]  # one level per entry; 2 ** (levels - 1) pixels per latent pixel
    vae_res_blocks: int
    heads: int
    dim_head: int
    num_layers: int  # dual-stream blocks
    rope_axes: tuple[int, int, int]  # (frame, height, width) axes, summing to dim_head
    text_hidden: int  # Qwen2.5-VL hidden width (the transformer's joint_attention_dim)
    text_layers: int = 2
    text_ff: int = 64
    text_heads: int = 2
    vision_hidden: int = 32
    vision_depth: int = 2
    vl_max_pixels: int = 112 * 112  # the processor's image budget: (112 / 28) ** 2 = 16 image tokens
    max_sequence_length: int = 1024  # the pipeline's cap (its prompts are not truncated)
    generated_transformer: bool = False  # weights generated at load time (real-size preset), config only on disk


PRESETS = {
    # Tests and the demo: 1024 x 1024 (the pipeline's fixed area) -> 16 x 16 noisy + 256 reference tokens.
    "qwen-edit-tiny": Preset(resolution=1024, steps=4, guidance=4.0, z_dim=4, vae_base=4, vae_mult=(1,) * 6,
                             vae_res_blocks=0, heads=2, dim_head=16, num_layers=2, rope_axes=(4, 6, 6),
                             text_hidden=32),
    # CPU engine benchmarks: Qwen-Image's 60 dual-stream blocks at 256 wide, its VAE's 16 latent channels and 8
    # pixels per latent pixel, 512 x 512 -> 1024 noisy + 1024 reference tokens.
    "qwen-edit-bench": Preset(resolution=512, steps=4, guidance=4.0, z_dim=16, vae_base=4, vae_mult=(1,) * 4,
                              vae_res_blocks=0, heads=4, dim_head=64, num_layers=60, rope_axes=(16, 24, 24),
                              text_hidden=64),
    # Qwen-Image-Edit's transformer (60 blocks, 24 x 128 heads = 3072 wide, in 64 = 16 latent channels x 2x2, text
    # 3584 wide, rope axes 16 / 56 / 56) at 1024 x 1024 = 4096 noisy + 4096 reference tokens, its weights generated
    # on the serving device; the VL encoder and the VAE are small stand-ins with the real interface widths.
    "qwen-image-edit": Preset(resolution=1024, steps=50, guidance=4.0, z_dim=16, vae_base=8, vae_mult=(1,) * 4,
                              vae_res_blocks=0, heads=24, dim_head=128, num_layers=60, rope_axes=(16, 56, 56),
                              text_hidden=3584, text_layers=1, text_ff=64, text_heads=28, vision_hidden=32,
                              vision_depth=1, generated_transformer=True),
}


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE (Qwen's kind) on the fixed corpus and the prompt template, as a ``Qwen2Tokenizer`` with
    Qwen's special tokens (the vision ones the processor and the encoder look for among them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    lines = [line.strip() for line in (CORPUS + TEMPLATE_TEXT).strip().splitlines()] * 4
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    return tok


def image_processor(p: Preset):
    """Qwen2-VL's image processor (14-pixel patches merged 2x2) with a small pixel budget."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=p.vl_max_pixels, patch_size=14,
                                    temporal_patch_size=2, merge_size=2)


def text_encoder(p: Preset, tok):
    """A Qwen2.5-VL of the preset's widths; its special token ids are the tokenizer's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    head_dim = p.text_hidden // p.text_heads
    quarter = head_dim // 8  # mrope sections (temporal, height, width) over head_dim / 2 frequencies, as 1:1:2
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=p.text_hidden, intermediate_size=p.text_ff,
                         num_hidden_layers=p.text_layers, num_attention_heads=p.text_heads, num_key_value_heads=1,
                         max_position_embeddings=4096, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [quarter, quarter, 2 * quarter]}),
        vision_config=dict(depth=p.vision_depth, hidden_size=p.vision_hidden, intermediate_size=p.vision_hidden,
                           num_heads=2, out_hidden_size=p.text_hidden, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[p.vision_depth - 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def transformer_config(p: Preset) -> dict:
    return dict(patch_size=2, in_channels=4 * p.z_dim, out_channels=p.z_dim, num_layers=p.num_layers,
                attention_head_dim=p.dim_head, num_attention_heads=p.heads, joint_attention_dim=p.text_hidden,
                guidance_embeds=False, axes_dims_rope=p.rope_axes)


def build(out_dir: str | Path, preset: str = "qwen-edit-tiny", seed: int = 0) -> Path:
    """Write a ``QwenImageEditInpaintPipeline`` model directory for ``preset`` (seeded)."""
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditInpaintPipeline,
                           QwenImageTransformer2DModel)

    from .processor import CLASS_NAME, ImageOnlyProcessor

    p = PRESETS[preset]
    tok = train_tokenizer()
    ip = image_processor(p)
    torch.manual_seed(seed)
    text = text_encoder(p, tok)
    levels = len(p.vae_mult)
    vae = AutoencoderKLQwenImage(
        base_dim=p.vae_base, z_dim=p.z_dim, dim_mult=list(p.vae_mult), num_res_blocks=p.vae_res_blocks,
        temperal_downsample=[False] * (levels - 1),
        latents_mean=torch.randn(p.z_dim).mul(0.3).tolist(), latents_std=torch.rand(p.z_dim).add(0.7).tolist())
    config = transformer_config(p)
    if p.generated_transformer:
        with torch.device("meta"):
            transformer = QwenImageTransformer2DModel(**config)
    else:
        transformer = QwenImageTransformer2DModel(**config)
        visible_init(transformer)
    # Qwen-Image's scheduler: flow matching with dynamic shifting (the pipeline passes ``mu`` from
    # ``calculate_shift`` and its own sigmas).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    processor = ImageOnlyProcessor(image_processor=ip, tokenizer=tok, video_processor=None)
    pipe = QwenImageEditInpaintPipeline(scheduler=scheduler, vae=vae, text_encoder=text, tokenizer=tok,
                                        processor=processor, transformer=transformer)
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": p.guidance,
               "max_sequence_length": p.max_sequence_length, "preset": preset, "seed": seed}
    generated = "transformer" if p.generated_transformer else None
    if generated:
        serving[generated_key(generated)] = {"seed": seed}
    with writing(out_dir) as tmp:
        save(pipe, tmp, generated)
        # Saved by the processor's own save_pretrained (``ImageOnlyProcessor``); the index names the class the
        # pipeline declares, as a processor saved on a torchvision host would be.
        index = json.loads((tmp / "model_index.json").read_text())
        index[PROCESSOR] = ["transformers", CLASS_NAME]
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
        write_serving_defaults(tmp, serving)
    return Path(out_dir)


def generate_transformer(model_dir: Path, seed: int, device, dtype):
    """The transformer of a generated preset, made on ``device`` in ``dtype`` from its saved config (seeded)."""
    from diffusers import QwenImageTransformer2DModel

    return generate(QwenImageTransformer2DModel, Path(model_dir), "transformer", seed, device, dtype, visible_init)
