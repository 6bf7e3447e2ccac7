#!/usr/bin/env bash
# The simulator against the GPU it was calibrated on, in one go: calibrate Qwen3-8B and Qwen3-0.6B (16-bit
# KV cache; the steps, the server's host work and a request's way in), measure the reference ladder 1..32
# for each, run the same ladders on the new calibrations, and print the rung-by-rung comparison.
# Usage: bash benchmarks/sim/validate.sh RESULT_DIR [GPU_NAME]   (with pagedserve importable)
# Its calibrations (RESULT_DIR/cal) are made as calibrate_shipped.sh makes the 16-bit ones it ships.
set -eu
R=${1:-results/sim-validate}
GPU=${2:-h200}
mkdir -p "$R/cal"
ENGINE="--load-format dummy --max-model-len 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9"
DOC="--load-format dummy --gpu-memory-utilization 0.88 --max-model-len 8192 --max-num-seqs 16 --max-num-batched-tokens 4096 --enable-chunked-prefill"
WORK="--random-input-len 1024 --random-output-len 256 --concurrency 1,2,4,8,16,32 --disable-tqdm"
for model in Qwen/Qwen3-8B Qwen/Qwen3-0.6B; do
  short=$(echo "${model#*/}" | tr 'A-Z' 'a-z')
  cal="$R/cal/$GPU-$short-bf16.json"
  echo "== $(date +%T) $model"
  python3 -m pagedserve.cli calibrate "$model" $ENGINE --output "$cal"
  python3 -m pagedserve.cli bench sweep --model "$model" --serve-args "$DOC" $WORK --result-dir "$R/$short-measured"
  python3 -m pagedserve.cli bench sweep --model "$model" --serve-args "$DOC" $WORK --simulate "$cal" \
      --result-dir "$R/$short-simulated"
  python3 -m benchmarks.sim.accuracy "$R/$short-measured" "$R/$short-simulated"
done
echo "== $(date +%T) done"
