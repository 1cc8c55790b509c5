"""Build a FLUX.2 [klein] inpainting model directory locally: seeded random weights, a locally trained tokenizer.

The real architecture scaled down: ``Flux2Transformer2DModel`` (double- and single-stream blocks, shared
modulation, no guidance embedding), ``AutoencoderKLFlux2`` (its latent batch-norm statistics randomised so they
matter), a ``Qwen3ForCausalLM`` text encoder with the 28+ layers the pipeline reads hidden states from
(layers 9, 18, 27 stacked: ``joint_attention_dim = 3 * hidden``) at a tiny width, a byte-level BPE
``Qwen2TokenizerFast`` with a Qwen-style chat template, and the flow-matching scheduler with dynamic shifting.
Written with ``Flux2KleinInpaintPipeline(...).save_pretrained`` and loadable with ``from_pretrained``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...presets import CORPUS, generate, visible_init, write_model

# Qwen3's chat template reduced to what Flux2Klein's ``apply_chat_template(..., add_generation_prompt=True,
# enable_thinking=False)`` renders: the user turn, the assistant header and an empty think block.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TEXT_LAYERS = (9, 18, 27)  # the pipeline's default ``text_encoder_out_layers``


@dataclass(frozen=True)
class Preset:
    resolution: int  # default square model resolution in pixels
    steps: int  # default denoising steps served
    vae_channels: tuple[int, ...]
    latent_channels: int  # VAE latent channels (the transformer sees 4x: 2x2 patchified)
    dim_head: int
    heads: int
    num_layers: int  # double-stream blocks
    num_single_layers: int
    rope_axes: tuple[int, int, int, int]  # (T, H, W, L) axes, summing to dim_head
    text_hidden: int  # Qwen3 hidden width (joint_attention_dim = 3 * text_hidden)
    text_layers: int = 28  # enough for hidden states 9, 18, 27
    text_ff: int = 0  # Qwen3 MLP width (0: twice hidden)
    text_heads: int = 2
    text_head_dim: int = 16
    max_sequence_length: int = 64
    timestep_channels: int = 256
    generated_transformer: bool = False  # weights generated at load time (real-size preset), config only on disk
    distilled: bool = True  # klein 4B is step-distilled: no classifier-free guidance


PRESETS = {
    # Tests and the demo: 256 px -> 256 noisy + 256 reference image tokens.
    "klein-tiny": Preset(resolution=256, steps=4, vae_channels=(8, 16, 16, 16), latent_channels=4, dim_head=16, heads=2,
                   num_layers=2, num_single_layers=2, rope_axes=(4, 4, 4, 4), text_hidden=32, timestep_channels=32),
    # CPU engine benchmarks: FLUX.2 klein 4B's block structure (5 double + 20 single blocks) at 256 wide,
    # 512 px -> 1024 noisy + 1024 reference tokens.
    "klein-bench": Preset(resolution=512, steps=4, vae_channels=(8, 16, 16, 16), latent_channels=8, dim_head=64, heads=4,
                    num_layers=5, num_single_layers=20, rope_axes=(16, 16, 16, 16), text_hidden=64),
    # FLUX.2 [klein] 4B's transformer (5 double + 20 single blocks, 24 x 128 heads = 3072 wide, in 128 = 32 latent
    # channels x 2x2, Qwen3-4B width 2560 -> joint 7680, rope axes 32 x 4, theta 2000, no guidance embedding,
    # mlp ratio 3) at 1024 x 1024 = 4096 noisy + 4096 reference tokens, 512 text tokens; its weights generated on
    # the serving device. Text encoder and VAE are small stand-ins with the real interface widths.
    "klein-4b": Preset(resolution=1024, steps=4, vae_channels=(8, 16, 16, 16), latent_channels=32, dim_head=128,
                       heads=24, num_layers=5, num_single_layers=20, rope_axes=(32, 32, 32, 32), text_hidden=2560,
                       text_ff=64, text_heads=1, text_head_dim=32, max_sequence_length=512,
                       generated_transformer=True),
}


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE (Qwen's kind) on the fixed corpus, as a ``Qwen2TokenizerFast`` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    lines = [line.strip() for line in CORPUS.strip().splitlines()] * 4
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2TokenizerFast(vocab=model["vocab"], merges=merges, model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def transformer_config(p: Preset) -> dict:
    return dict(patch_size=1, in_channels=4 * p.latent_channels, out_channels=None, num_layers=p.num_layers,
                num_single_layers=p.num_single_layers, attention_head_dim=p.dim_head, num_attention_heads=p.heads,
                joint_attention_dim=3 * p.text_hidden, timestep_guidance_channels=p.timestep_channels,
                mlp_ratio=3.0, axes_dims_rope=p.rope_axes, rope_theta=2000, eps=1e-6, guidance_embeds=False)


def build(out_dir: str | Path, preset: str = "klein-tiny", seed: int = 0) -> Path:
    """Write a ``Flux2KleinInpaintPipeline`` model directory for ``preset`` (seeded)."""
    import torch
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinInpaintPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    p = PRESETS[preset]
    tok = train_tokenizer()

    torch.manual_seed(seed)
    text = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=p.text_hidden, intermediate_size=p.text_ff or 2 * p.text_hidden,
        num_hidden_layers=p.text_layers, num_attention_heads=p.text_heads, num_key_value_heads=1,
        head_dim=p.text_head_dim, max_position_embeddings=max(1024, p.max_sequence_length),
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None))
    n_down = len(p.vae_channels)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n_down,
        up_block_types=("UpDecoderBlock2D",) * n_down, block_out_channels=p.vae_channels, layers_per_block=1,
        latent_channels=p.latent_channels, norm_num_groups=4, sample_size=p.resolution, use_quant_conv=True,
        use_post_quant_conv=True)
    with torch.no_grad():  # latent statistics that matter (fresh BatchNorm stats are the identity)
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
    config = transformer_config(p)
    if p.generated_transformer:
        with torch.device("meta"):
            transformer = Flux2Transformer2DModel(**config)
    else:
        transformer = Flux2Transformer2DModel(**config)
        visible_init(transformer)
    # FLUX.2 klein's scheduler: flow matching with dynamic shifting (the pipeline passes ``mu`` from
    # ``compute_empirical_mu`` and its own sigmas).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
    pipe = Flux2KleinInpaintPipeline(scheduler=scheduler, vae=vae, text_encoder=text, tokenizer=tok,
                                     transformer=transformer, is_distilled=p.distilled)
    serving = {"resolution": p.resolution, "steps": p.steps, "guidance": 1.0,
               "max_sequence_length": p.max_sequence_length, "preset": preset, "seed": seed}
    return write_model(out_dir, pipe, serving, "transformer" if p.generated_transformer else None)


def generate_transformer(model_dir: Path, seed: int, device, dtype):
    """The transformer of a generated preset, made on ``device`` in ``dtype`` from its saved config (seeded)."""
    from diffusers import Flux2Transformer2DModel

    return generate(Flux2Transformer2DModel, Path(model_dir), "transformer", seed, device, dtype, visible_init)
