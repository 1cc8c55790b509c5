"""What every family's preset builder shares: locally trained tokenizers, saving a pipeline (with a component
whose weights are generated at load time), seeded generation of a denoiser on its device, and writing a model
directory atomically with its serving defaults.

There is no model hub here, so models are generated from configs and written with ``save_pretrained``; the server
then loads them with ``from_pretrained`` exactly as it loads real weights. Same preset and seed give the same files,
so tests and benchmarks are reproducible.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

from .settings import SERVING_DEFAULTS_FILE

# A small fixed corpus for training the tokenizers; what matters is that it is deterministic
# and covers the letters and words prompts use.
CORPUS = """
a photo of a red dress on a wooden table with soft light. replace the sky with a sunset.
remove the person from the background. a blue shirt, a white t-shirt, green jacket, black coat.
make the hair blonde and curly. add sunglasses to the face. change the color of the car to yellow.
a cat sitting on a sofa, a dog running in the park, flowers in a vase near the window.
high quality, detailed, realistic, studio lighting, portrait, product shot, fashion, try-on.
inpaint the masked region with a mountain lake and pine trees under a cloudy sky.
retouch the skin, smooth wrinkles, brighten the eyes, whiten the teeth, fix the shadows.
abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'"-()[]{}/&%$#@+=*
"""


def train_tokenizers(vocab_size: int):
    """Train a CLIP-style BPE and a T5-style Unigram vocabulary on the fixed corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    lines = [line.strip().lower() for line in CORPUS.strip().splitlines()] * 4

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>",
            show_progress=False,
        ),
    )
    bpe_model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe_model["merges"]]

    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    uni.train_from_iterator(
        lines,
        trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
        ),
    )
    pieces = [(p, float(s)) for p, s in json.loads(uni.to_str())["model"]["vocab"]]
    return bpe_model["vocab"], merges, pieces


def save(pipe, out: Path, generated: str | None = None) -> None:
    """``pipe.save_pretrained(out)``; with ``generated`` (a component's name), that component's config only: its
    weights are generated at load time (``generate``) and ``model_index.json`` still names its class."""
    if generated is None:
        pipe.save_pretrained(out)
        return
    model = getattr(pipe, generated)
    setattr(pipe, generated, None)
    pipe.register_to_config(**{generated: (None, None)})
    pipe.save_pretrained(out)
    model.save_config(out / generated)
    index = json.loads((out / "model_index.json").read_text())
    index[generated] = ["diffusers", type(model).__name__]
    (out / "model_index.json").write_text(json.dumps(index, indent=2))


def visible_init(model) -> None:
    """Random init leaves some output layers at zero (zero-initialised residual branches): small noise there makes
    every block matter, and the edit visible, as trained weights do."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.abs().sum() == 0:
                param.normal_(0.0, 0.02)


def generated_key(component: str) -> str:
    """The serving-defaults key recording that ``component``'s weights are generated: {"seed": ...}."""
    return f"generated_{component}"


def generated(model_dir: Path, component: str) -> dict | None:
    f = Path(model_dir) / SERVING_DEFAULTS_FILE
    return json.loads(f.read_text()).get(generated_key(component)) if f.exists() else None


def generate(model_cls, model_dir: Path, subfolder: str, seed: int, device, dtype, init):
    """``model_cls`` from ``model_dir/subfolder``'s config, its weights seeded and made on ``device`` in ``dtype``
    (then ``init(model)``: the presets' visible-edit tweak)."""
    import torch

    config = model_cls.load_config(model_dir, subfolder=subfolder)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    if torch.device(device).type != "meta":
        init(model)
    return model.eval()


@contextmanager
def writing(out_dir: str | Path):
    """A temporary directory beside ``out_dir`` to write into; it replaces ``out_dir`` when the block completes (the
    directory appears complete or not at all)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def write_serving_defaults(d: Path, serving: dict) -> None:
    (Path(d) / SERVING_DEFAULTS_FILE).write_text(json.dumps(serving, indent=2))


def write_model(out_dir: str | Path, pipe, serving: dict, generated: str | None = None) -> Path:
    """Write ``pipe`` and its serving defaults to ``out_dir`` atomically; ``generated``: the component whose weights
    are generated at load time from ``serving["seed"]`` (its config only is written)."""
    if generated is not None:
        serving = {**serving, generated_key(generated): {"seed": serving["seed"]}}
    with writing(out_dir) as tmp:
        save(pipe, tmp, generated)
        write_serving_defaults(tmp, serving)
    return Path(out_dir)



def denoiser(model_cls, config: dict, generated: bool):
    """``model_cls(**config)`` with seeded random weights made visible (``visible_init``), or, for a preset whose
    weights are generated at load time, on the meta device (its config is all that is written)."""
    import torch

    if generated:
        with torch.device("meta"):
            return model_cls(**config)
    model = model_cls(**config)
    visible_init(model)
    return model


def flux1_parts(p, seed: int) -> dict:
    """A FLUX.1 pipeline's components other than the transformer, scaled down: CLIP and T5 encoders with local
    tokenizers, the VAE (FLUX.1's scaling and shift) and the flow-matching scheduler with dynamic shifting, seeded.
    ``p``: a preset with ``vae_channels``, ``latent_channels``, ``text_dim`` (T5 width), ``clip_dim``,
    ``max_sequence_length``, ``resolution`` and ``text_ff`` (T5 feed-forward width, 0: twice the width)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

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
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
        max_shift=1.15)
    return dict(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                tokenizer_2=t5_tok)
