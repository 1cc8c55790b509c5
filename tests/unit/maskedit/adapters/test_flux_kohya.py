"""The kohya and PEFT files of one Flux adapter give the same low-rank deltas, at FLUX.1's widths.

Diffusers' kohya converter for Flux is written for FLUX.1's real widths (3072 / 12288: it asserts them), so the two
formats are compared at the weight level on the ``flux-width`` preset's module shapes (a meta-device skeleton of its
transformer: no weights, no full model), one dual-stream and one single-stream block. The PEFT file is written by
the stock pipeline's ``save_lora_weights`` (alpha in its PEFT metadata); the kohya file has sd-scripts' layout
(BFL module names, fused ``qkv`` / ``linear1`` projections, a per-module ``alpha``) in the three forms users bring:
one ``lora_down`` shared by the fused projections, and block-diagonal factors (what converting a Diffusers-trained
adapter gives) for three and four splits. Both are read by ``maskedit.adapters.convert`` (Diffusers' loaders and
converters); each projection's ``scaling·B@A`` must agree."""

import pytest
import torch
from safetensors.torch import save_file

from maskedit.adapters import convert
from maskedit.adapters.library import AdapterLibrary
from maskedit.families import family_class
from maskedit.families.flux_fill import tiny

R, ALPHA = 16, 8.0  # PEFT scaling alpha / r = 0.5
DUAL, SINGLE = 1, 2  # block indices (not 0: the index mapping is checked too)


@pytest.fixture(scope="module")
def skeleton():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel(**tiny.transformer_config("flux-width"))


def _factors(skeleton, names, seed):
    g = torch.Generator("cpu").manual_seed(seed)
    out = {}
    for n in names:
        m = skeleton.get_submodule(n)
        out[n] = (torch.randn(R, m.in_features, generator=g) / m.in_features ** 0.5,
                  torch.randn(m.out_features, R, generator=g) / R ** 0.5)
    return out


def _block_diag(parts):
    """Fused factors of independent projections: ``down`` stacked, ``up`` block-diagonal (rank R per split)."""
    return torch.cat([a for a, _ in parts]), torch.block_diag(*[b for _, b in parts])


def _adapter(skeleton):
    """PEFT factors per projection and the kohya state dict of the same adapter."""
    d, s = f"transformer_blocks.{DUAL}", f"single_transformer_blocks.{SINGLE}"
    img_qkv = [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"]
    txt_qkv = [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"]
    linear1 = [f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v", f"{s}.proj_mlp"]
    plain = {f"{d}.attn.to_out.0": f"double_blocks_{DUAL}_img_attn_proj",
             f"{d}.attn.to_add_out": f"double_blocks_{DUAL}_txt_attn_proj",
             f"{d}.ff.net.0.proj": f"double_blocks_{DUAL}_img_mlp_0", f"{d}.ff.net.2": f"double_blocks_{DUAL}_img_mlp_2",
             f"{d}.ff_context.net.0.proj": f"double_blocks_{DUAL}_txt_mlp_0",
             f"{d}.ff_context.net.2": f"double_blocks_{DUAL}_txt_mlp_2", f"{s}.proj_out": f"single_blocks_{SINGLE}_linear2"}
    peft = _factors(skeleton, img_qkv + txt_qkv + linear1 + list(plain), seed=7)
    shared = peft[img_qkv[0]][0]  # sd-scripts trains a fused qkv with one lora_down
    for n in img_qkv:
        peft[n] = (shared, peft[n][1])
    kohya = {}

    def put(key, down, up, rank):
        kohya[f"lora_unet_{key}.lora_down.weight"] = down.contiguous()
        kohya[f"lora_unet_{key}.lora_up.weight"] = up.contiguous()
        kohya[f"lora_unet_{key}.alpha"] = torch.tensor(ALPHA * rank / R)  # the same alpha / rank as PEFT's

    put(f"double_blocks_{DUAL}_img_attn_qkv", shared, torch.cat([peft[n][1] for n in img_qkv]), R)
    put(f"double_blocks_{DUAL}_txt_attn_qkv", *_block_diag([peft[n] for n in txt_qkv]), 3 * R)
    put(f"single_blocks_{SINGLE}_linear1", *_block_diag([peft[n] for n in linear1]), 4 * R)
    for n, key in plain.items():
        put(key, *peft[n], R)
    return peft, kohya


def test_kohya_and_peft_files_give_the_same_deltas_at_flux_widths(skeleton, tmp_path):
    from peft import LoraConfig

    fam = family_class("flux_fill")(tmp_path, "FluxFillPipeline")  # its loaders only: no model directory read
    peft, kohya = _adapter(skeleton)
    assert skeleton.get_submodule(f"single_transformer_blocks.{SINGLE}.proj_mlp").out_features == 12288  # FLUX.1
    sd = {f"{n}.lora_{k}.weight": t.clone() for n, (a, b) in peft.items() for k, t in (("A", a), ("B", b))}
    meta = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=sorted(peft)).to_dict()
    meta["target_modules"] = sorted(peft)
    fam.pipeline_class().save_lora_weights(tmp_path / "ad", transformer_lora_layers=sd,
                                           transformer_lora_adapter_metadata=meta)
    save_file(kohya, str(tmp_path / "ad-kohya.safetensors"))
    lib = AdapterLibrary(tmp_path)
    got = {name: convert.load(lib.file(name), fam, skeleton, device="cpu", dtype=torch.float32)
           for name in ("ad", "ad-kohya")}
    assert got["ad"].format == "diffusers" and got["ad-kohya"].format == "kohya"
    assert set(got["ad"].modules) == set(got["ad-kohya"].modules) == set(peft)
    g = torch.Generator("cpu").manual_seed(1)
    for n, (a, b) in peft.items():
        # Deltas compared as linear maps on a random probe (equal maps agree on it; different ones, almost surely
        # not): the full out x in products at these widths would cost seconds for nothing more.
        probe = torch.randn(a.shape[1], 32, generator=g)
        want = b @ (a @ probe) * (ALPHA / R)
        deltas = {}
        for name, ad in got.items():
            m = ad.modules[n]
            assert m.A.shape[1] == a.shape[1] and m.B.shape[0] == b.shape[0], (name, n)
            deltas[name] = m.B @ (m.A @ probe) * m.scaling(1.0)
        # the two files agree to float rounding (alpha / rank = 0.5 folds in exactly), and equal the adapter
        torch.testing.assert_close(deltas["ad-kohya"], deltas["ad"], rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(deltas["ad"], want, rtol=1e-5, atol=1e-6, msg=n)
        assert want.abs().max() > 0.1
