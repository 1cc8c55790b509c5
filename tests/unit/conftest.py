import pytest

from maskedit.denoise import ModelRunner
from maskedit.local import denoise_inputs
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from tests.conftest import png


@pytest.fixture(scope="session")
def runner(settings):
    """One model runner (no cache) shared by the engine and scheduler tests."""
    return ModelRunner(settings)


@pytest.fixture(scope="session")
def make_inputs(settings, template_img, box_mask):
    """Denoise inputs for the shared template and box mask, with the given number of steps."""
    pre = Preprocessor(settings)
    return lambda steps: denoise_inputs(pre(png(template_img), png(box_mask), parse_params(settings, "a hat",
                                                                                           steps=steps)))
