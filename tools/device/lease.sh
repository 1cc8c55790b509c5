#!/usr/bin/env bash
# A whole GPU lease in one device call: gpu_check.sh's stages in order, each under its own time limit, a stage that
# fails or overruns leaving the next ones their time, and everything packed into $OUT after every stage (the device
# returns at most 8 files, and nothing of a command killed at the call's limit but what $OUT already holds).
#
#   run(command="bash tools/device/lease.sh", carry=[".whl"], timeout_s=600)
#   STAGES="loader:60 calibrate:120" bash tools/device/lease.sh     # other stages or limits (seconds)
#   bash tools/device/lease.sh --dry-run                             # the same on the CPU (make test runs one stage)
#
# $OUT gets lease.log (every stage's output, with its exit status and time) and lease.tgz (gpu_check.sh's files:
# profiles, results, plots, logs). Unpack it here and commit what it holds (docs/gpu.md says where each goes).
# Default plan, ~9 minutes of stage limits: the loader by verify threads (seconds), calibration, the engine
# benchmark at the issue's mask ratios (~60 s each at FLUX.1-Fill-dev size), tests/gpu in bfloat16. Every stage's
# limit is also cut to what is left of the lease's own deadline (LEASE_DEADLINE_S, 560 s: under the call's 600 s
# with the last kill and pack inside it); a stage with under 10 s left is skipped. The exit status is the first
# failed stage's (124: it ran out), 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
FINAL=${OUT:-out/device}
mkdir -p "$FINAL"
FINAL=$(cd "$FINAL" && pwd)
STAGES=${STAGES:-loader:45 calibrate:120 bench:240 tests:140}
for stage in $STAGES; do  # checked before anything is made
  if ! [[ $stage =~ ^[a-z]+:[0-9]+$ ]]; then echo "lease: a stage is MODE:SECONDS, not '$stage'"; exit 2; fi
done
WORK=${LEASE_WORK:-$(mktemp -d)}
GPU_CHECK=${GPU_CHECK:-tools/device/gpu_check.sh}  # what runs each stage (a test gives one that overruns)
DEADLINE=$(( $(date +%s) + ${LEASE_DEADLINE_S:-560} ))
KILL_AFTER=5 PACK_S=10  # a stage's grace after its TERM; the archive's time after it
export RATIOS=${RATIOS:-0.2 0.05 0.5} CROP_TEMPLATE=${CROP_TEMPLATE:-0} GPU_DTYPES=${GPU_DTYPES:-bfloat16}
export PYTHONUNBUFFERED=1
log=$FINAL/lease.log
pack() { tar -C "$WORK" --exclude ./site --exclude ./models --exclude ./profiles -czf "$FINAL/lease.tgz.part" . &&
         mv "$FINAL/lease.tgz.part" "$FINAL/lease.tgz"; }
echo "lease: stages $STAGES; RATIOS=$RATIOS CROP_TEMPLATE=$CROP_TEMPLATE GPU_DTYPES=$GPU_DTYPES" | tee "$log"
status=0
for stage in $STAGES; do
  mode=${stage%%:*} limit=${stage##*:}
  t0=$(date +%s)
  left=$(( DEADLINE - t0 - KILL_AFTER - PACK_S ))
  if [ "$left" -lt 10 ]; then
    echo "== $mode: skipped, $left s left of the lease" | tee -a "$log"
    if [ $status = 0 ]; then status=124; fi
    continue
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  # Line-buffered all the way, so a stage killed at its limit leaves every line it printed in the log.
  OUT=$WORK timeout --kill-after=$KILL_AFTER "$limit" bash "$GPU_CHECK" ${DRY[@]+"${DRY[@]}"} "$mode" \
    2>&1 | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v -E '(it/s|s/it|point/s|s/point)\]$' >> "$log"
  rc=${PIPESTATUS[0]}
  echo "== $mode: exit $rc after $(( $(date +%s) - t0 )) s (limit $limit s; 124: ran out)" | tee -a "$log"
  if [ $status = 0 ] && [ "$rc" != 0 ]; then status=$rc; fi
  # A stage killed at its limit leaves its benchmark store in /dev/shm (tens of GB at FLUX.1 size): the machine is
  # this lease's alone, so clear it for the next stage (not in a dry run: this host's other work may use it).
  if [ ${#DRY[@]} = 0 ]; then rm -rf /dev/shm/maskedit-bench-*; fi
  pack
done
ls -la "$WORK" | tee -a "$log"
if [ -z "${LEASE_WORK:-}" ]; then rm -rf "$WORK"; fi
exit $status
