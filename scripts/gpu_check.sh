#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool. Results go under $OUT
# (or ./gpu-results): logs, and the CSV / JSON / PNG files of `moekit bench` and `moekit check`.
#
#   bash scripts/gpu_check.sh [tests|bench|check|all] [extra pytest args for `tests`]
#
# tests: the GPU-marked tests (real preset shapes, determinism, CUDA-graph replay, cutlass).
# bench: `moekit bench` at the anchor points of shared/anchors/README.md: the expert GEMMs alone
#        (--mode gemm) and the whole layer, for GLM-4.5V-FP8 TP2, Mixtral-8x7B FP8 and
#        DeepSeek-V3 TP8, every backend plus auto.
# check: `moekit check` on the same models.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
moekit() { python3 -m moekit.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
status=0

ANCHOR_M="1 8 64 192 1024 4096 8192"
LAYER_M="1 8 32 64 192 512 1024 2048 4096 8192"
# model, tp, scheme of each anchor
MODELS=("glm-4.5v-fp8 2 fp8-channel-token" "mixtral-8x7b 1 fp8-channel-token" "deepseek-v3 8 fp8-block128")

if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  moekit info 2>&1 | tee "$OUT/info.log"
  for m in "${MODELS[@]}"; do
    read -r model tp scheme <<<"$m"
    gemm_backends="triton cutlass"; [[ $scheme == fp8-block128 ]] && gemm_backends=triton  # no block cutlass
    moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode gemm --backends $gemm_backends \
      --batch-sizes $ANCHOR_M --no-check --out "$OUT/bench-gemm-$model" 2>&1 | tee "$OUT/bench-gemm-$model.log"
    moekit bench --model "$model" --tp "$tp" --scheme "$scheme" --mode layer --model-estimate \
      --batch-sizes $LAYER_M --out "$OUT/bench-layer-$model" 2>&1 | tee "$OUT/bench-layer-$model.log"
  done
fi
if [[ $what == check || $what == all ]]; then
  for m in "${MODELS[@]}"; do
    read -r model tp scheme <<<"$m"
    moekit check --model "$model" --tp "$tp" --scheme "$scheme" --out "$OUT/check-$model" 2>&1 | tee "$OUT/check-$model.log"
    status=$(( status || PIPESTATUS[0] ))
  done
fi
exit $status
