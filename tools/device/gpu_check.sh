#!/usr/bin/env bash
# One device call's worth of GPU checks for the engine (issue 15), run on the GPU machine from the repository
# root with the wheels of tools/device/wheels.sh carried in .whl/. Writes everything under $OUT (default out/device).
#
#   run(command="bash tools/device/gpu_check.sh tests", carry=[".whl"])       # gpu tests, every dtype (~5 min)
#   run(command="bash tools/device/gpu_check.sh calibrate", carry=[".whl"])   # FLUX.1-Fill-dev size, bf16
#   run(command="bash tools/device/gpu_check.sh bench", carry=[".whl"])       # engine benchmark, bf16, 8 steps
#   run(command="bash tools/device/gpu_check.sh unet", carry=[".whl"])        # SDXL-inpainting size, bf16 (issue 20)
#   run(command="bash tools/device/gpu_check.sh serving", carry=[".whl"])     # Triton on the GPU vs stock Diffusers
#                                                 (needs tools/device/triton_pack.sh's tritonserver in .whl/ too)
#
# Then copy $OUT's profile to perf_profiles/ and its engine_<gpu>.json/.png to perf_profiles/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
test -f .whl/tritonserver.tar.xz && tar -C /tmp/site -xJf .whl/tritonserver.tar.xz
export PYTHONPATH=/tmp/site:$PWD/common:$PWD/python_backends:$PWD/client:$PWD/router:$PWD/lab:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/gpu.txt"
df -h /dev/shm | tee -a "$OUT/gpu.txt"
test -f models/tiny-flux-fill/model_index.json || python3 -m maskedit.tiny_model models/tiny-flux-fill
STEPS=${STEPS:-8}
case "${1:-tests}" in
  tests)
    python3 -m pytest -q -ra -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" ;;
  calibrate)
    python3 -m maskedit_lab.engine.calibrate --preset flux-dev --device cuda --dtype bfloat16 --steps 4 \
      --out "$OUT/cost_model_flux-dev-flux-fill_h100.json" 2>&1 | tee "$OUT/calibrate.log" ;;
  bench)
    cp "$OUT"/cost_model_*.json perf_profiles/ 2>/dev/null
    python3 -m maskedit_lab.engine.bench_engine --preset flux-dev --device cuda --dtype bfloat16 --steps "$STEPS" \
      --reps 2 --budget-gib "${BUDGET_GIB:-40}" --ratios ${RATIOS:-0.05 0.1 0.2 0.3 0.5 0.9} \
      --out "$OUT/engine_h100.json" 2>&1 | tee "$OUT/bench.log" ;;
  unet)  # the real SDXL-inpainting UNet (generated weights) at 1024^2, 30 steps as in the issue's stock timing
    python3 -m maskedit_lab.engine.calibrate --preset sdxl --device cuda --dtype bfloat16 --steps 4 \
      --out "$OUT/cost_model_sdxl_h100.json" 2>&1 | tee "$OUT/calibrate_sdxl.log"
    cp "$OUT/cost_model_sdxl_h100.json" perf_profiles/
    python3 -m maskedit_lab.engine.bench_engine --preset sdxl --device cuda --dtype bfloat16 --steps "${STEPS_UNET:-30}" \
      --reps 2 --budget-gib "${BUDGET_GIB:-40}" --ratios ${RATIOS:-0.1 0.2 0.3 0.5} \
      --out "$OUT/engine_sdxl_h100.json" 2>&1 | tee "$OUT/bench_sdxl.log" ;;
  serving)
    python3 -m maskedit.tiny_model models/flux-width-flux-fill --preset flux-width
    python3 -m maskedit_lab.serving.bench_serving --preset flux-width --device cuda --dtype bfloat16 --steps "$STEPS" \
      --requests "${REQUESTS:-12}" --loads ${LOADS:-0.5 1 2 4} --out "$OUT/serving_h100.json" 2>&1 | tee "$OUT/serving.log" ;;
  *) echo "usage: $0 tests|calibrate|bench|unet|serving"; exit 2 ;;
esac
