"""The Dockerfile cannot be built here (no Docker engine); check what it relies on instead."""

import re

from maskedit import repository
from tests.conftest import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


def test_base_image_matches_embedded_triton():
    # 24.10 <-> tritonserver 2.51.0, the version the nvidia-pytriton pin ships (checked by the integration test).
    assert re.search(r"^FROM nvcr.io/nvidia/tritonserver:24.10-py3$", DOCKERFILE, re.M)


def test_serves_the_gpu_rendering_of_the_same_repository(tmp_path):
    assert "maskedit.repository --kind gpu --out /opt/maskedit/model_repository_gpu" in DOCKERFILE
    assert "--model-repository=/opt/maskedit/model_repository_gpu" in DOCKERFILE
    repository.write(tmp_path / "gpu", "gpu")
    rendered = {p.relative_to(tmp_path / "gpu").as_posix() for p in (tmp_path / "gpu").rglob("*") if p.is_file()}
    committed = {p.relative_to(repository.REPOSITORY).as_posix() for p in repository.REPOSITORY.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert rendered == committed


def test_serving_pins_agree_with_dev_pins():
    dev = dict(line.split("==") for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
               if "==" in line and not line.startswith("#"))
    for line in (REPO_ROOT / "requirements-serve.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            assert dev.get(name) == version, f"{name} pinned differently for serving"
    assert "MASKEDIT_PYTHONPATH=" in DOCKERFILE


def test_image_holds_the_shared_package_on_every_import_path():
    # The backend's stubs and the router both import maskedit_common: copied, installed, and on the shims' path.
    assert "COPY common ./common" in DOCKERFILE
    assert re.search(r"MASKEDIT_PYTHONPATH=\S*/opt/maskedit/common", DOCKERFILE)
