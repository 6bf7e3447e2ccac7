#!/usr/bin/env bash
# Remake the calibrations pagedserve ships (pagedserve/sim/calibrations/) on this GPU: Qwen3-8B and
# Qwen3-0.6B, 16-bit and fp8 KV cache, with an engine wide enough for the grid (256 sequences, 8,192-token
# steps, 16k contexts). Usage: bash benchmarks/sim/calibrate_shipped.sh [OUT_DIR] [GPU_NAME] [KV_DTYPES]
# (KV_DTYPES: "auto fp8" by default; "fp8" alone after validate.sh, whose 16-bit calibrations are these)
set -eu
OUT=${1:-pagedserve/sim/calibrations}
GPU=${2:-h200}
KV_DTYPES=${3:-auto fp8}
mkdir -p "$OUT"
ENGINE="--load-format dummy --max-model-len 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9"
for model in Qwen/Qwen3-8B Qwen/Qwen3-0.6B; do
  short=$(echo "${model#*/}" | tr 'A-Z' 'a-z')
  for kv in $KV_DTYPES; do
    name="$GPU-$short-$([ $kv = auto ] && echo bf16 || echo fp8)"
    echo "== $(date +%T) $name"
    python3 -m pagedserve.cli calibrate "$model" $ENGINE --kv-cache-dtype $kv --output "$OUT/$name.json"
  done
done
