#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no package index), for Python 3.12 on x86-64, into .whl/ (git-ignored
# through .git/info/exclude; pass carry [".whl"] to the device run). Pure-Python or manylinux wheels only.
# The device has torch, transformers, accelerate, safetensors, numpy 2, pillow, scikit-image, matplotlib, grpcio,
# prometheus-client, nvidia-ml-py and onnx already.
#
#   bash tools/device/wheels.sh --dry-run   # no download: each wheel's version checked against the project's pins
#                                           # (requirements*.txt, or $REQUIREMENTS), the commands printed
set -euo pipefail
cd "$(dirname "$0")/../.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
REQUIREMENTS=${REQUIREMENTS:-requirements.txt requirements-serve.txt}
pinned() {  # NAME -> the version the project pins it at (nothing when it does not pin it)
  local want
  want=$(echo "$1" | tr 'A-Z_' 'a-z-')
  # shellcheck disable=SC2086
  cat $REQUIREMENTS | sed 's/#.*//' | tr 'A-Z_' 'a-z-' | sed -n "s/^$want\(\[[^]]*\]\)\?==\([^ ;]*\).*/\2/p" | head -1
}
dl() {
  local cmd=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
             --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@")
  if [ $DRY = 0 ]; then "${cmd[@]}"; return; fi
  for spec in "$@"; do
    name=${spec%%==*} version=${spec##*==}
    pin=$(pinned "$name")
    if [ -n "$pin" ] && [ "$pin" != "$version" ]; then
      echo "$name: the device would get $version, the project pins $pin ($REQUIREMENTS)"; exit 1
    fi
  done
  echo "would run: ${cmd[*]}"
}
[ $DRY = 1 ] || mkdir -p .whl
dl diffusers==0.42.1 importlib_metadata==8.7.0 zipp==3.23.0          # the model code
dl pytest==8.3.5 pluggy==1.5.0 iniconfig==2.1.0 pytest-timeout==2.3.1  # the tests
dl tritonclient==2.50.0 python-rapidjson==1.21 tqdm==4.67.1           # the client (tests import it)
# The cache's checksums: the image's own xxhash is of unknown version, and the loader's verify threads need one-shot
# hashing that releases the GIL (xxhash >= 3.0); carry the project's pin so the GPU measures what CPU CI tests.
dl xxhash==4.1.0
if [ $DRY = 0 ]; then du -sh .whl; ls .whl; fi
