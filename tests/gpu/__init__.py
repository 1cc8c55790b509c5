"""The engine on a CUDA GPU (skipped without one). ``DEVICE=cpu`` runs the same tests on the CPU in one dtype, the
checks only a GPU can make left out: the dry run that keeps them from rotting (``tools/device/gpu_check.sh --dry-run
tests``, run by tests/unit/test_device_scripts.py in make test)."""

import os

DEVICE = os.environ.get("DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise ValueError(f"DEVICE must be cuda or cpu (the dry run), got {DEVICE!r}")
# GPU_DTYPES narrows a short GPU lease to some dtypes (e.g. "bfloat16"); the dry run has the CPU's float32 only.
DTYPES = (tuple(os.environ.get("GPU_DTYPES", "float32 bfloat16 float16").split()) if DEVICE == "cuda"
          else ("float32",))
if not DTYPES or not set(DTYPES) <= {"float32", "bfloat16", "float16"}:  # else a lease's tests collect nothing
    raise ValueError(f"GPU_DTYPES must name some of float32, bfloat16, float16, got {' '.join(DTYPES) or 'none'}")
