#!/usr/bin/env bash
# Issue 17 on one GPU (an H200): the main job's stage costs for every model size, measured, and
# torch's schedules across 2, 4 and 8 GPUs predicted from them. Run after
#   bash scripts/gpu_run.sh build
# Writes into $OUT (or out/ where OUT is unset): stage_costs.json, measure.log, predicted_schedules.md,
# predicted_schedules.json, predict.log and predicted_<model>_<r>ranks_m16.png.
# About 2-3 minutes on an H200 (20 repeats per stage; the 1b model, 24 blocks of hidden 2048 at
# context 2048, is most of it); the measurement is cut off at 7 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true; } > "$out/gpu.txt" 2>&1
timeout 420 bash scripts/gpu_run.sh python benchmarks/measure_stage_costs.py --out "$out" "$@" 2>&1 \
  | tee "$out/measure.log"
bash scripts/gpu_run.sh python benchmarks/predict_gpu_schedules.py --costs "$out/stage_costs.json" --out "$out" 2>&1 \
  | tee "$out/predict.log"
echo "issue 17 on the device: $(( $(date +%s) - start )) s, results in $out"
