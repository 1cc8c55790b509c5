#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no package index), for Python 3.12 on x86-64, into .whl/ (git-ignored
# through .git/info/exclude; pass carry [".whl"] to the device run). Pure-Python or manylinux wheels only.
# The device has torch, transformers, accelerate, safetensors, numpy 2, pillow, scikit-image, matplotlib, grpcio,
# prometheus-client, nvidia-ml-py and onnx already.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"; }
dl diffusers==0.42.1 importlib_metadata==8.7.0 zipp==3.23.0          # the model code
dl pytest==8.3.5 pluggy==1.5.0 iniconfig==2.1.0 pytest-timeout==2.3.1  # the tests
dl tritonclient==2.50.0 python-rapidjson==1.21 tqdm==4.67.1           # the client (tests import it)
du -sh .whl; ls .whl
