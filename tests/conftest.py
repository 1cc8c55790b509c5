import numpy as np
import pytest

from maskedit import samples
from maskedit.settings import load_settings
from maskedit.tiny_model import build
from maskedit_client import encode_image


@pytest.fixture(scope="session")
def settings():
    s = load_settings()
    if not (s.model_dir / "model_index.json").exists():
        build(s.model_dir, "tiny")
    return s


png = encode_image  # PNG bytes of a PIL image or uint8 array


@pytest.fixture(scope="session")
def template_img():
    return samples.template(256, 256, seed=1)


@pytest.fixture(scope="session")
def box_mask():
    m = np.zeros((256, 256), np.uint8)
    m[64:128, 96:192] = 255
    return m
