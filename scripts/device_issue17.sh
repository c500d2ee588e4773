#!/usr/bin/env bash
# Issue 17 on one GPU (an H200): the main job's stage costs for every model size, measured, and
# torch's schedules across 2, 4 and 8 GPUs predicted from them. Run after
#   bash scripts/gpu_run.sh build
# Writes 7 files into $OUT (or out/ where OUT is unset): issue17.log (the GPU, both scripts'
# output), stage_costs.json, predicted_schedules.md, predicted_schedules.json and
# predicted_<model>_m16.png for small, gpt2-medium and 1b.
# About 2-3 minutes on an H200 (20 repeats per stage and action; the 1b model, 24 blocks of hidden
# 2048 at context 2048, is most of it); the measurement is cut off at 7 minutes. Extra arguments
# go to measure_stage_costs.py (e.g. --model small --repeats 5).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
log="$out/issue17.log"
start=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true; } > "$log" 2>&1
status=0
# A model size that fails is reported and skipped; the JSON keeps the sizes measured, which are predicted.
timeout 420 bash scripts/gpu_run.sh python benchmarks/measure_stage_costs.py --out "$out" "$@" 2>&1 \
  | tee -a "$log" || status=$?
if [ -f "$out/stage_costs.json" ]; then
  bash scripts/gpu_run.sh python benchmarks/predict_gpu_schedules.py --costs "$out/stage_costs.json" --out "$out" \
    2>&1 | tee -a "$log" || status=$?
fi
echo "issue 17 on the device: $(( $(date +%s) - start )) s, exit status $status, results in $out" | tee -a "$log"
exit "$status"
