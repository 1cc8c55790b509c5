"""Model presets: the FLUX.1-Fill-dev-size preset has the real transformer's exact configuration and generates its
weights on the serving device instead of writing 24 GB of random numbers."""

import json

import pytest
import torch

from maskedit.components import load_pipeline, load_transformer
from maskedit.settings import load_settings
from maskedit.build_model import build


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    return build(tmp_path_factory.mktemp("presets") / "flux-dev-flux-fill", "flux-dev")


def test_flux_dev_preset_is_flux_1_fill_dev_sized(flux_dev):
    cfg = json.loads((flux_dev / "transformer" / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                                "in_channels", "out_channels", "joint_attention_dim", "pooled_projection_dim",
                                "guidance_embeds")} == {
        "num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24, "attention_head_dim": 128,
        "in_channels": 384, "out_channels": 64, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
        "guidance_embeds": True}
    assert not list((flux_dev / "transformer").glob("*.safetensors"))  # nothing generated is written


def test_its_transformer_is_generated_on_the_device_in_the_serving_dtype(flux_dev):
    s = load_settings({"MASKEDIT_MODEL_DIR": str(flux_dev), "MASKEDIT_DEVICE": "meta", "MASKEDIT_DTYPE": "bfloat16"})
    assert (s.resolution, s.max_sequence_length) == (1024, 512)
    model = load_transformer(s)
    params = sum(p.numel() for p in model.parameters())
    assert 11.8e9 < params < 12.0e9
    assert all(p.dtype == torch.bfloat16 and p.device.type == "meta" for p in model.parameters())


def test_its_encoders_and_vae_load_with_stock_diffusers(flux_dev):
    pipe = load_pipeline(load_settings({"MASKEDIT_MODEL_DIR": str(flux_dev), "MASKEDIT_DEVICE": "cpu"}))
    assert pipe.transformer is None and pipe.text_encoder_2.config.d_model == 4096
    assert pipe.text_encoder.config.hidden_size == 768 and pipe.vae.config.latent_channels == 16
