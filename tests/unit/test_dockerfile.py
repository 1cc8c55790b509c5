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


# What the launcher passes that belongs to one process on a developer's host, not to the image: where its files and
# ports are, its shared-memory prefix (per start), its log level, metrics (the image serves GPU metrics), and its exit
# timeout (the pod's terminationGracePeriodSeconds bounds the image's).
LOCAL_FLAGS = ("--model-repository=", "--backend-directory=", "--http-port=", "--grpc-port=", "--metrics-port=",
               "--http-address=", "--grpc-address=", "--backend-config=python,shm-region-prefix-name=",
               "--log-verbose=", "--allow-metrics=", "--allow-gpu-metrics=", "--exit-timeout-secs=")


def test_the_image_starts_tritonserver_with_the_launchers_serving_flags():
    """A flag the launcher adds for how models load or requests are served (``--disable-auto-complete-config``, shm
    sizes, header forwarding, readiness) is in the image's CMD too, or the container serves differently from the
    tests."""
    from maskedit.launcher import TritonServer

    cmd = re.search(r'^CMD \[(.*?)\]$', DOCKERFILE, re.M | re.S).group(1)
    image = set(re.findall(r'"([^"]+)"', cmd))
    launcher = [a for a in TritonServer().command()[1:] if not a.startswith(LOCAL_FLAGS)]
    assert "--disable-auto-complete-config" in launcher
    missing = [a for a in launcher if a not in image]
    assert not missing, f"the Dockerfile's tritonserver lacks the launcher's {missing}"
