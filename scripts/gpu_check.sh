#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool:
#   the GPU-marked tests, then the anchor benchmarks. Results go under $OUT (or ./gpu-results).
# Usage: bash scripts/gpu_check.sh [tests|bench|all] [extra args for bench_anchors.py]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 scripts/bench_anchors.py --out "$OUT/anchors.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
exit $status
