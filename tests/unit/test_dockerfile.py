"""The Dockerfile cannot be built here (no Docker engine); check what it relies on instead."""

import re

from maskedit import repository
from tests.conftest import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


# NGC Triton releases: tritonserver and the image's Python (their release notes)
NGC_TRITON = {"24.10": ("2.51.0", "3.10"), "24.12": ("2.53.0", "3.12")}
EMBEDDED_TRITON = "2.51.0"  # what the nvidia-pytriton pin ships (checked by the integration test)


def _base_release() -> str:
    got = re.search(r"^FROM nvcr.io/nvidia/tritonserver:(\d\d\.\d\d)-py3$", DOCKERFILE, re.M)
    assert got and got.group(1) in NGC_TRITON, "the image's base is not a Triton release this test knows"
    return got.group(1)


def test_base_image_is_a_triton_no_older_than_the_embedded_one():
    triton, _ = NGC_TRITON[_base_release()]
    assert tuple(map(int, triton.split("."))) >= tuple(map(int, EMBEDDED_TRITON.split(".")))


def test_the_images_python_is_one_every_serving_pin_installs_on():
    """diffusers 0.42 and transformers 5.23 need Python >= 3.11: on 24.10's 3.10 the image's pip install fails."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet

    _, python = NGC_TRITON[_base_release()]
    for name, version in _pins(REPO_ROOT / "requirements-serve.txt").items():
        assert md.version(name) == version, f"{name}: the metadata read is not the pinned release's"
        needs = md.metadata(name).get("Requires-Python")
        assert not needs or SpecifierSet(needs).contains(python + ".0"), \
            f"{name}=={version} needs Python {needs}; the image has {python}"


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


# -- what the image installs covers what the served code imports ---------------------------------------------------
# Served code: the Triton models and their packages, the router and the client (the router imports it). Modules the
# image gets otherwise: the Python backend's own utils module, and the launcher of the embedded default, which the
# image does not run (its CMD starts tritonserver).
SERVED = ("python_backends", "common", "router", "client", "model_repository")
PROVIDED = {"triton_python_backend_utils": "the Python backend", "pytriton": "the embedded default's launcher only"}


def _pins(path) -> dict[str, str]:
    """name (normalised, extras dropped) -> version of a requirements file's ``==`` pins."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[_norm(name.split("[")[0])] = version.strip()
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _image_torch() -> str:
    got = re.search(r"pip install [^\n]*torch==([0-9][^ ]*) ", DOCKERFILE)
    assert got, "the Dockerfile pins no CUDA torch"
    return got.group(1)


def _served_imports() -> dict[str, str]:
    """top-level third-party module -> one served file importing it."""
    import ast
    import sys

    found = {}
    for root in SERVED:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and not top.startswith("maskedit"):
                        found.setdefault(top, path.relative_to(REPO_ROOT).as_posix())
    return found


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` install, with what they require in turn (their installed metadata; extras only
    where pinned, as tritonclient[all])."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    extras = {_norm(n.split("[")[0]): set(re.findall(r"\[(.*)\]", n)[0].split(",")) if "[" in n else set()
              for n in names}
    seen, todo = set(), list(extras)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras.get(name, {""}) | {""}):
                todo.append(_norm(req.name))
    return seen


def test_the_image_installs_every_module_the_served_code_imports():
    """A module the models, router or client import that the image does not install fails there at import (as the
    activation cache's xxhash, the canny preprocessor's cv2 and the TaylorSeer state's cache-dit once did)."""
    import importlib.metadata as md

    serve = (REPO_ROOT / "requirements-serve.txt").read_text().splitlines()
    lines = [line.split("#")[0].strip() for line in serve]
    installed = _closure({line.split("==")[0] for line in lines if "==" in line} | {"torch"})
    dists = md.packages_distributions()
    missing = {module: where for module, where in _served_imports().items()
               if module not in PROVIDED and not {_norm(d) for d in dists.get(module, [module])} & installed}
    assert not missing, f"imported by served code, not installed by the image: {missing}"


def test_the_images_torch_satisfies_what_its_packages_require():
    """The image's CUDA torch is installed first; a serving pin that needs a newer one would make pip replace it with
    an unpinned build from the package index (cache-dit 1.5 needs torch >= 2.7.1)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    torch = _image_torch().split("+")[0]
    for name in _pins(REPO_ROOT / "requirements-serve.txt"):
        for text in md.requires(name) or []:
            req = Requirement(text)
            if _norm(req.name) == "torch" and (req.marker is None or any(  # its torch extra: what it checks at
                    req.marker.evaluate({"extra": e}) for e in ("", "torch"))):  # import (transformers: >= 2.6)
                assert req.specifier.contains(torch), f"{name} requires {req}; the image pins torch {torch}"
