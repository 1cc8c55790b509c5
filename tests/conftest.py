import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from maskedit import samples
from maskedit.denoise import ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.local import run_job
from maskedit.scratch import SCRATCH_VARS, make_scratch
from maskedit.settings import load_settings
from maskedit.build_model import build
from maskedit_client import encode_image

# Where the suite's stores, cancel markers and admission files go unless a test names its own: a directory of
# this run's (``maskedit.scratch``), removed at its end, so tests never write into (or read from) the host's serving
# defaults under /dev/shm/maskedit-$UID and ~/.cache/maskedit. Servers the tests start inherit it through the
# environment.
def pytest_configure(config):
    if getattr(config, "_maskedit_scratch", None) is not None:
        return
    config._maskedit_scratch = make_scratch("maskedit-tests-", SCRATCH_VARS, override=True)


def pytest_unconfigure(config):
    scratch = getattr(config, "_maskedit_scratch", None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="session")
def settings():
    s = load_settings()
    if not (s.model_dir / "model_index.json").exists():
        build(s.model_dir, "tiny")
    return s


REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout under test

png = encode_image  # PNG bytes of a PIL image or uint8 array


def plain(runner, inputs):
    """``inputs`` denoised without the activation cache, on ``runner``'s model: what every hit is compared with."""
    eng = DenoiseEngine(ModelRunner(runner.settings, transformer=runner.transformer))
    try:
        return run_job(eng, replace(inputs, cache_key=None))
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def template_img():
    return samples.template(256, 256, seed=1)


@pytest.fixture(scope="session")
def box_mask():
    m = np.zeros((256, 256), np.uint8)
    m[64:128, 96:192] = 255
    return m


# Comparing two computations of the same latents that group tokens differently (a hit's gathered rows against the
# full forward, a batch against one request, ours against stock Diffusers). float32 on the CPU agrees to each test's
# own tight atol. Reduced precision, and GPU kernels (TF32 convolutions, GEMM tiling that depends on the row count),
# round differently: these are the stated tolerances there (latents are ~N(0, 1)).
REDUCED_ATOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}


def atol(settings, exact: float) -> float:
    """``exact`` for float32 on the CPU, else the dtype's stated tolerance (never tighter than ``exact``)."""
    if settings.torch_device == "cpu" and settings.dtype == "float32":
        return exact
    return max(exact, REDUCED_ATOL[settings.dtype])


def exact_here(settings) -> bool:
    """Bit-exact comparisons with stock Diffusers hold for float32 on the CPU."""
    return settings.torch_device == "cpu" and settings.dtype == "float32"


@pytest.fixture(scope="session")
def adapters(settings):
    """The model's LoRA adapter library (what the servers read by default): written as ``make model`` writes it
    when the model directory has none."""
    from maskedit_common.loras import library_names

    if not library_names(settings.adapters):
        from maskedit.build_model import build_adapters

        build_adapters(settings.model_dir)
    return settings.adapters
