#!/usr/bin/env bash
# tritonserver 2.51 for the GPU machine, from the nvidia-pytriton wheel of this venv, repacked small enough to carry
# (the wheel is 55 MB; this is ~35 MB): the server, the Python backend, the Python 3.12 stub and the wheel's
# libraries, with a bare `pytriton` package (the launcher only needs its location). gpu_check.sh unpacks it.
#
#   bash tools/device/triton_pack.sh --dry-run   # the same copies from the same wheel, archived to a pipe (no .whl/)
set -euo pipefail
cd "$(dirname "$0")/../.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
site=$("${PYTHON:-.venv/bin/python}" -c "import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parents[1])")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/pytriton/tritonserver/python_backend_stubs"
echo '"""tritonserver from the nvidia-pytriton wheel, repacked for the GPU machine (tools/device/triton_pack.sh)."""' \
  > "$tmp/pytriton/__init__.py"
cp -r "$site/pytriton/tritonserver/bin" "$site/pytriton/tritonserver/backends" "$site/pytriton/tritonserver/caches" \
  "$tmp/pytriton/tritonserver/"
cp -r "$site/pytriton/tritonserver/python_backend_stubs/3.12" "$tmp/pytriton/tritonserver/python_backend_stubs/"
cp -r "$site/nvidia_pytriton.libs" "$tmp/"
test -x "$tmp/pytriton/tritonserver/bin/tritonserver"
if [ $DRY = 1 ]; then
  echo "would write .whl/tritonserver.tar.xz from $(du -sh "$tmp" | cut -f1) of files"
  exit 0
fi
mkdir -p .whl
tar -C "$tmp" -cJf .whl/tritonserver.tar.xz pytriton nvidia_pytriton.libs
du -sh .whl/tritonserver.tar.xz .whl
