"""Seeded random LoRA adapters for a (tiny) model directory, written in the formats users bring: Diffusers / PEFT
(the stock pipeline's ``save_lora_weights``) and, where Diffusers' kohya loader handles the model's widths (SDXL /
SD 2; its Flux converter is written for FLUX.1's real widths), kohya (Diffusers' ``convert_state_dict_to_kohya``).
Ranks 4-64; some touch attention only, some attention and MLP."""

from __future__ import annotations

import re
from pathlib import Path

import torch

# name, rank, targets (attention / attention + MLP), kohya twin
SPECS = (("attn-r4", 4, "attn", True), ("attn-mlp-r16", 16, "attn+mlp", True), ("attn-r64", 64, "attn", False),
         ("attn-mlp-r8", 8, "attn+mlp", False))
_ATTN = re.compile(r"(^|\.)(attn\d?)\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$")
_MLP = re.compile(r"(^|\.)(ff|ff_context|img_mlp|txt_mlp)\.net\.(0\.proj|2)$|(^|\.)proj_mlp$")


def targets(denoiser, kind: str) -> list[str]:
    """Linear layers of the denoiser's attention (and MLP) by their Diffusers names."""
    out = []
    for name, m in denoiser.named_modules():
        if isinstance(m, torch.nn.Linear) and (_ATTN.search(name) or (kind == "attn+mlp" and _MLP.search(name))):
            out.append(name)
    return out


def random_lora(denoiser, rank: int, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-format factors (``<module>.lora_A.weight`` (r, in), ``.lora_B.weight`` (out, r)); the deltas are a
    visible fraction of each layer's output."""
    g = torch.Generator("cpu").manual_seed(seed)
    sd = {}
    for name in targets(denoiser, kind):
        m = denoiser.get_submodule(name)
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * (0.3 / rank ** 0.5)
    return sd


def write_library(model_dir: str | Path, family, denoiser, out: str | Path | None = None, seed: int = 0,
                  specs=SPECS) -> list[Path]:
    """Write ``specs`` for ``denoiser`` into ``out`` (default ``<model_dir>/loras``)."""
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    out = Path(out) if out is not None else Path(model_dir) / "loras"
    out.mkdir(parents=True, exist_ok=True)
    pipe_cls = family.pipeline_class()
    prefix = family.lora_prefix()
    kohya_ok = family.lora_prefix() == "unet"
    written = []
    for i, (name, rank, kind, kohya) in enumerate(specs):
        sd = {k: v.contiguous() for k, v in random_lora(denoiser, rank, kind, seed * 1000 + i).items()}
        pipe_cls.save_lora_weights(out / name, **{f"{prefix}_lora_layers": sd})
        written.append(out / name)
        if kohya and kohya_ok:
            from safetensors.torch import save_file

            ksd = convert_state_dict_to_kohya({f"{prefix}.{k}": v for k, v in sd.items()})
            save_file({k: v.contiguous() for k, v in ksd.items()}, str(out / f"{name}-kohya.safetensors"))
            written.append(out / f"{name}-kohya.safetensors")
    return written
