"""`python -m maskedit_lab.engine.qwen_encoder_cost`: what Qwen-Image-Edit's prompt encoder costs against one denoise
step (a FLOP estimate from the models' configurations; nothing is run).

The pipeline encodes every prompt with Qwen2.5-VL-7B over a chat template holding the template image: the vision
tower reads the image at the processor's resolution (a 1 MP image: 74 x 74 = 5476 patches of 14 px), the language
model reads the system prompt, the image's 5476 / 4 = 1369 merged tokens and the prompt, and, as
``Qwen2_5_VLForConditionalGeneration`` is called, computes logits for every token (unused). One denoise step is one
transformer call on [text; 4096 noisy; 4096 reference] tokens at 1024 x 1024 (two with classifier-free guidance).
Counts are multiply-adds x 2 of the matrix products (projections, MLPs, attention scores and values); norms, rotary
and element-wise work are left out. Writes ``perf_profiles/results/qwen_encoder_cost.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from maskedit.families import family_class

from .. import REPO_ROOT

# Qwen2.5-VL-7B-Instruct (the text_encoder of Qwen/Qwen-Image-Edit): its published config.json.
QWEN25_VL_7B = {
    "text": {"hidden": 3584, "ff": 18944, "layers": 28, "heads": 28, "kv_heads": 4, "vocab": 152064},
    "vision": {"hidden": 1280, "ff": 3420, "depth": 32, "patch": 14, "merge": 2, "temporal_patch": 2,
               "window": 112, "full_attention_blocks": 4, "out_hidden": 3584},
}
SYSTEM_TOKENS = 64  # the pipeline's prompt_template_encode_start_idx: the system prompt, dropped after encoding
TEMPLATE_TOKENS = 13  # the rest of the chat template around the image and the prompt (Qwen's tokenizer)


def vision_patches(width: int, height: int, patch: int = 14, merge: int = 2) -> int:
    """Patches of a ``width`` x ``height`` image after Qwen2-VL's ``smart_resize`` (sides rounded to 28 px; 1 MP is
    within its default pixel bounds)."""
    f = patch * merge
    return (round(height / f) * f // patch) * (round(width / f) * f // patch)


def vl_encoder_flops(width: int, height: int, prompt_tokens: int, cfg=QWEN25_VL_7B) -> dict:
    t, v = cfg["text"], cfg["vision"]
    patches = vision_patches(width, height, v["patch"], v["merge"])
    merged = patches // v["merge"] ** 2
    d, h = v["hidden"], v["hidden"]
    # Vision tower: qkv + out projections, a gated MLP (gate, up, down) per block; window attention in most blocks
    # (window of (112 / 14)**2 = 64 patches), full attention in a few; patch embedding; the 2x2 merger MLP.
    per_patch = 2 * (4 * d * d + 3 * d * v["ff"]) * v["depth"]
    window = (v["window"] // v["patch"]) ** 2
    attn = 4 * patches * d * (window * (v["depth"] - v["full_attention_blocks"]) + patches * v["full_attention_blocks"])
    embed = 2 * patches * 3 * v["temporal_patch"] * v["patch"] ** 2 * h
    m = d * v["merge"] ** 2
    merger = 2 * merged * (m * m + m * v["out_hidden"])
    vision = per_patch * patches + attn + embed + merger
    # Language model over the whole chat sequence: GQA projections, a gated MLP, attention, the logits head.
    seq = SYSTEM_TOKENS + TEMPLATE_TOKENS + merged + prompt_tokens
    D, kv = t["hidden"], t["hidden"] // t["heads"] * t["kv_heads"]
    per_token = 2 * (2 * D * D + 2 * D * kv + 3 * D * t["ff"]) * t["layers"]
    lm = per_token * seq + 4 * seq * seq * D * t["layers"] + 2 * seq * D * t["vocab"]
    return {"vision_patches": patches, "image_tokens": merged, "sequence": seq, "text_rows": seq - SYSTEM_TOKENS,
            "vision_tflop": vision / 1e12, "language_tflop": lm / 1e12, "tflop": (vision + lm) / 1e12}


def transformer_call_flops(config: dict, noisy: int, text: int) -> float:
    """One ``QwenImageTransformer2DModel`` call: per token and block 24 D^2 (image or text stream: q, k, v, out and
    a 4x MLP), joint attention over every token, the input / output projections."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    s_img = 2 * noisy  # noisy + reference tokens
    s = s_img + text
    blocks = config["num_layers"] * (24 * d * d * s + 4 * s * s * d)
    edges = 2 * s_img * d * config["in_channels"] + 2 * text * d * config["joint_attention_dim"] + \
        2 * s_img * d * config["patch_size"] ** 2 * config["out_channels"]
    return blocks + edges


def estimate(width: int = 1024, height: int = 1024, prompt_tokens: int = 20, steps: int = 50) -> dict:
    fam = family_class("qwen_image_edit")
    preset = fam.presets["qwen-image-edit"]
    cfg = dict(patch_size=2, in_channels=4 * preset.z_dim, out_channels=preset.z_dim, num_layers=preset.num_layers,
               attention_head_dim=preset.dim_head, num_attention_heads=preset.heads,
               joint_attention_dim=preset.text_hidden)
    enc = vl_encoder_flops(width, height, prompt_tokens)
    noisy = (height // 16) * (width // 16)
    call = transformer_call_flops(cfg, noisy, enc["text_rows"]) / 1e12
    return {
        "image": [width, height], "prompt_tokens": prompt_tokens, "encoder": enc,
        "transformer_call_tflop": call, "noisy_tokens": noisy,
        "encoder_per_call": enc["tflop"] / call,
        # A request: one encoding per prompt (two with guidance) against the steps' calls.
        "share_of_request": {
            f"{steps} steps, guidance (2 encodings, 2 calls a step)": 2 * enc["tflop"] / (2 * enc["tflop"] +
                                                                                       2 * steps * call),
            "8 steps, no guidance (a distilled / Lightning model)": enc["tflop"] / (enc["tflop"] + 8 * call),
            "8 steps, no guidance, 20% of the tokens computed": enc["tflop"] / (enc["tflop"] + 8 * 0.2 * call),
        },
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "perf_profiles" / "results" / "qwen_encoder_cost.json")
    args = ap.parse_args(argv)
    e = estimate()
    enc = e["encoder"]
    print(f"prompt encoder (Qwen2.5-VL-7B, 1 MP template, {e['prompt_tokens']}-token prompt): "
          f"{enc['tflop']:.1f} TFLOP (vision {enc['vision_tflop']:.1f}, language {enc['language_tflop']:.1f}; "
          f"{enc['sequence']} tokens, {enc['image_tokens']} of them the image's)")
    print(f"one transformer call (60 blocks x 3072, {e['noisy_tokens']} noisy + {e['noisy_tokens']} reference + "
          f"{enc['text_rows']} text tokens): {e['transformer_call_tflop']:.1f} TFLOP")
    print(f"encoder / call: {e['encoder_per_call']:.1%}")
    for k, v in e["share_of_request"].items():
        print(f"  encoder's share of a request, {k}: {v:.1%}")
    args.out.write_text(json.dumps(e, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
