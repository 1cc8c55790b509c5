"""The LoRA adapter path at FLUX.1's widths, without a full model: the ``flux-width`` preset's dual-stream and
single-stream transformer blocks (3072 wide, 24 x 128 heads, MLP 12288), one of each, on 1024 image + 512 text
tokens, with seeded random weights. Adapters are written in Diffusers format for these blocks
(``maskedit.adapters.build``) and served through ``AdapterRuntime`` (the same conversion, hooks and plans as a
denoiser), so a timed call is what one dual + one single block of a FLUX.1 step does under them."""

from __future__ import annotations

import torch

from maskedit.adapters import delta
from maskedit.adapters.build import write_library
from maskedit.adapters.library import AdapterLibrary
from maskedit.adapters.runtime import AdapterRuntime
from maskedit.families import family_class
from maskedit.families.flux_fill import tiny

IMAGE_TOKENS, TEXT_TOKENS = 1024, 512


class TwoBlocks(torch.nn.Module):
    """One dual-stream and one single-stream block under the names a ``FluxTransformer2DModel`` gives them, so
    adapter keys and targets are the model's."""

    def __init__(self, preset: str = "flux-width"):
        from diffusers.models.transformers.transformer_flux import (FluxPosEmbed, FluxSingleTransformerBlock,
                                                                    FluxTransformerBlock)

        super().__init__()
        p = tiny.PRESETS[preset]
        self.dim = p.heads * p.dim_head
        self.transformer_blocks = torch.nn.ModuleList([FluxTransformerBlock(self.dim, p.heads, p.dim_head)])
        self.single_transformer_blocks = torch.nn.ModuleList([FluxSingleTransformerBlock(self.dim, p.heads,
                                                                                         p.dim_head)])
        self.pos_embed = FluxPosEmbed(theta=10000, axes_dim=list(p.rope_axes))

    def inputs(self, seed: int = 0, device="cpu", dtype=torch.float32) -> dict:
        g = torch.Generator("cpu").manual_seed(seed)
        side = int(IMAGE_TOKENS ** 0.5)
        ids = torch.zeros(TEXT_TOKENS + IMAGE_TOKENS, 3)
        ids[TEXT_TOKENS:, 1] = torch.arange(IMAGE_TOKENS) // side
        ids[TEXT_TOKENS:, 2] = torch.arange(IMAGE_TOKENS) % side
        rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
        rot = tuple(t.to(device) for t in self.pos_embed(ids))
        return {"img": rnd(1, IMAGE_TOKENS, self.dim), "txt": rnd(1, TEXT_TOKENS, self.dim),
                "temb": rnd(1, self.dim), "rot": rot}

    @torch.no_grad()
    def forward(self, img, txt, temb, rot):
        txt, img = self.transformer_blocks[0](img, txt, temb, image_rotary_emb=rot)
        txt, img = self.single_transformer_blocks[0](img, txt, temb, image_rotary_emb=rot)
        return img


def build(work_dir, names=("fw-a", "fw-b"), rank: int = 16, device="cpu", dtype=torch.float32, seed: int = 0):
    """The blocks (seeded), their adapter library under ``work_dir`` and a runtime holding ``names`` loaded (hooks
    on); returns (blocks, runtime, adapters as ``((LoadedAdapter, 1.0), ...)``)."""
    torch.manual_seed(seed)
    blocks = TwoBlocks().to(device, dtype).eval()
    family = family_class("flux_fill")(work_dir, "FluxFillPipeline")  # its loaders only
    specs = tuple((n, rank, "attn+mlp", False) for n in names)
    write_library(work_dir, family, blocks, out=work_dir, seed=seed + 1, specs=specs)
    lib = AdapterLibrary(work_dir)
    runtime = AdapterRuntime(family, blocks, lib)
    adapters = runtime.resolve(lib.resolve(tuple(_ref(n) for n in names)))
    for a, _ in adapters:  # hooks go on at admission in serving (``AdapterJobs.admit``), here by hand
        delta.attach(blocks, a)
    return blocks, runtime, adapters


def _ref(name: str, scale: float = 1.0):
    from maskedit_common.loras import LoraRef

    return LoraRef(name, scale)
