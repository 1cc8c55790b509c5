#!/usr/bin/env bash
# One device call's worth of GPU checks for the engine (issue 15), run on the GPU machine from the repository
# root with the wheels of tools/device/wheels.sh carried in .whl/. Writes everything under $OUT (default out/device).
#
#   run(command="bash tools/device/gpu_check.sh tests", carry=[".whl"])       # gpu tests, every dtype (~5 min)
#   run(command="bash tools/device/gpu_check.sh calibrate", carry=[".whl"])   # FLUX.1-Fill-dev size, bf16
#   run(command="bash tools/device/gpu_check.sh bench", carry=[".whl"])       # engine benchmark, bf16, 8 steps
#   run(command="bash tools/device/gpu_check.sh loader", carry=[".whl"])      # row loader by verify threads (s)
#   run(command="bash tools/device/gpu_check.sh unet", carry=[".whl"])        # SDXL-inpainting size, bf16 (issue 20)
#   run(command="bash tools/device/gpu_check.sh serving", carry=[".whl"])     # Triton on the GPU vs stock Diffusers
#                                                 (needs tools/device/triton_pack.sh's tritonserver in .whl/ too)
#   run(command="bash tools/device/gpu_check.sh calibrate bench", ...)        # several modes, in order, in one call
#
# A short lease: RATIOS="0.05 0.2 0.5" (bench), CROP_TEMPLATE=0 (no PADDING_MASK_CROP table), GPU_DTYPES=bfloat16
# (tests); or one `timeout S bash tools/device/gpu_check.sh MODE` per stage, so one stage's overrun spares the rest.
#
# Then copy $OUT's profile to perf_profiles/ and its engine_<gpu>.json/.png to perf_profiles/results/.
#
#   bash tools/device/gpu_check.sh --dry-run MODE...   # (or DEVICE=cpu) the same steps and commands on this CPU
#
# The dry run is what keeps this script from rotting: tiny presets, one step (two where calibration needs a warm-up),
# two calibration ratios, float32, the packages of the environment it runs in (no wheels), every file it writes
# (models, profiles, results) under $OUT. make test runs every mode of it (tests/unit/test_device_scripts.py), so a
# GPU run can only fail on the GPU itself. The first failing command stops the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
if [ "${1:-}" = "--dry-run" ]; then DEVICE=cpu; shift; fi
MODES=("${@:-tests}")
for mode in "${MODES[@]}"; do
  case "$mode" in
    tests|calibrate|bench|loader|unet|serving) ;;
    *) echo "usage: $0 [--dry-run] MODE... (tests, calibrate, bench, loader, unet, serving), not '$mode'"; exit 2 ;;
  esac
done
OUT=${OUT:-out/device}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 DEVICE
PY=${PYTHON:-python3}
if [ "$DEVICE" = cpu ]; then
  echo "dry run on the CPU: tiny presets, one step, this environment's packages, files under $OUT"
  SITE=$OUT/site MODELS=$OUT/models PROFILES=$OUT/profiles DTYPE=float32
  FLUX=tiny UNET=sdxl-tiny WIDTH=tiny STEPS=1 STEPS_UNET=1 CAL_STEPS=2 CAL_RATIOS=(--ratios 0.2 0.5) REPS=1
  RATIOS=0.2 BUDGET_GIB=1 CROP=(--crop-template 256) REQUESTS=3 LOADS=1 TEMPLATES=1
  SYSTEMS=(--systems diffusers service)  # the GPU run's baseline and ours (it adds the cache-policy variants)
  LOADER=(--blocks 4 --tokens 256 --dim 64 --reps 1)
  mkdir -p "$SITE"
else
  SITE=/tmp/site MODELS=models PROFILES=$PWD/perf_profiles DTYPE=bfloat16
  FLUX=flux-dev UNET=sdxl WIDTH=flux-width STEPS=${STEPS:-8} STEPS_UNET=${STEPS_UNET:-30} CAL_STEPS=4 REPS=2
  CAL_RATIOS=()
  CROP=(${CROP_TEMPLATE:+--crop-template "$CROP_TEMPLATE"}) TEMPLATES=${TEMPLATES:-4} SYSTEMS=() LOADER=()
  BUDGET_GIB=${BUDGET_GIB:-40} REQUESTS=${REQUESTS:-12} LOADS=${LOADS:-0.5 1 2 4}
  # Once per machine (one call may run this script once per stage); the stamp is written only after a whole install,
  # so a stage killed half-way through it installs again next time rather than running on half a site.
  if [ ! -f "$SITE/.installed" ]; then
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl 2>&1 | tail -2
    if [ -f .whl/tritonserver.tar.xz ]; then tar -C "$SITE" -xJf .whl/tritonserver.tar.xz; fi
    touch "$SITE/.installed"
  fi
fi
export PYTHONPATH=$SITE:$PWD/common:$PWD/python_backends:$PWD/client:$PWD/router:$PWD/lab:$PWD
if [ "$DEVICE" = cpu ]; then
  echo "cpu (dry run), $(nproc) cores" | tee "$OUT/gpu.txt"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
df -h /dev/shm | tee -a "$OUT/gpu.txt"
# The versions; the GPU's name in file names (h100, h200, ...; cpu), as the cost profiles name it; where each preset's
# model is (the lab's commands build it there if missing): $MODELS/<its family's directory for it>, as their defaults.
names=$("$PY" -c "import sys, torch, diffusers
from maskedit.cache.cost_model import device_slug
from maskedit.families import preset_family as f
import xxhash
print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'xxhash', xxhash.VERSION)
print(device_slug(sys.argv[1]), *(sys.argv[2] + '/' + f(p).dir_name(p) for p in sys.argv[3:]), sep='\n')" \
  "$DEVICE" "$MODELS" "$FLUX" "$UNET" "$WIDTH")
mapfile -t v <<< "$names"
echo "${v[0]}" | tee -a "$OUT/gpu.txt"
SLUG=${v[1]} FLUX_DIR=${v[2]} UNET_DIR=${v[3]} WIDTH_DIR=${v[4]}
calibrate() {  # PRESET MODEL_DIR STEPS -> $OUT/cost_model_<model>[_<gpu>].json
  MASKEDIT_PROFILES_DIR=$OUT "$PY" -m maskedit_lab.engine.calibrate --preset "$1" --model-dir "$2" \
    --device "$DEVICE" --dtype "$DTYPE" --steps "$3" ${CAL_RATIOS[@]+"${CAL_RATIOS[@]}"} 2>&1 \
    | tee "$OUT/calibrate_$1.log"
}
bench() {  # PRESET MODEL_DIR STEPS RATIOS NAME, with the profiles of $PROFILES (this run's calibration copied in)
  mkdir -p "$PROFILES"
  cp "$OUT"/cost_model_*.json "$PROFILES"/ 2>/dev/null || echo "no profile calibrated in this run: $PROFILES's"
  MASKEDIT_PROFILES_DIR=$PROFILES "$PY" -m maskedit_lab.engine.bench_engine --preset "$1" --model-dir "$2" \
    --device "$DEVICE" --dtype "$DTYPE" --steps "$3" --reps "$REPS" --budget-gib "$BUDGET_GIB" --ratios $4 \
    ${CROP[@]+"${CROP[@]}"} --out "$OUT/$5_$SLUG.json" 2>&1 | tee "$OUT/bench_$1.log"
}
for mode in "${MODES[@]}"; do
  echo "== $mode"
  case "$mode" in
    tests)  # DEVICE=cpu: tests/gpu on the CPU in float32, the GPU-only checks left out (tests/gpu/__init__.py)
      tests_model=${MASKEDIT_MODEL_DIR:-models/tiny-flux-fill}  # as make model (the lab's commands build theirs)
      if [ ! -f "$tests_model/model_index.json" ]; then "$PY" -m maskedit.build_model "$tests_model"; fi
      "$PY" -m pytest -q -ra -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" ;;
    calibrate)
      calibrate "$FLUX" "$FLUX_DIR" "$CAL_STEPS" ;;
    bench)
      bench "$FLUX" "$FLUX_DIR" "$STEPS" "${RATIOS:-0.05 0.1 0.2 0.3 0.5 0.9}" engine ;;
    loader)  # the row loader's host time per step at FLUX.1 widths, by verify threads (seconds; no model)
      "$PY" -m maskedit_lab.engine.bench_loader --device "$DEVICE" ${LOADER[@]+"${LOADER[@]}"} \
        --out "$OUT/loader_$SLUG.json" 2>&1 | tee "$OUT/loader.log" ;;
    unet)  # the real SDXL-inpainting UNet (generated weights) at 1024^2, 30 steps as in the issue's stock timing
      calibrate "$UNET" "$UNET_DIR" "$CAL_STEPS"
      bench "$UNET" "$UNET_DIR" "$STEPS_UNET" "${RATIOS:-0.1 0.2 0.3 0.5}" engine_sdxl ;;
    serving)
      "$PY" -m maskedit_lab.serving.bench_serving --preset "$WIDTH" --model-dir "$WIDTH_DIR" \
        --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" --requests "$REQUESTS" --loads $LOADS \
        --templates "$TEMPLATES" ${SYSTEMS[@]+"${SYSTEMS[@]}"} --out "$OUT/serving_$SLUG.json" 2>&1 \
        | tee "$OUT/serving.log" ;;
  esac
done
