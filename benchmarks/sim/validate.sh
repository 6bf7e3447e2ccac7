#!/usr/bin/env bash
# The simulator against the GPU it was calibrated on: calibrate a model (16-bit KV cache; the steps, the
# server's host work and a request's way in), measure a ladder, run the same ladder on the new
# calibration, and print the rung-by-rung comparison.
# Usage: bash benchmarks/sim/validate.sh RESULT_DIR [GPU_NAME] [STAGE ...]   (with pagedserve importable)
# Stages, in this order by default; each fits one 10-minute device command:
#   8b       Qwen3-8B: calibrate, then the reference ladder 1..32 (the mission's serve flags)
#   0.6b     Qwen3-0.6B: the same
#   preempt  Qwen3-0.6B with a 1 GiB KV cache (about seven requests' worth): a ladder that preempts,
#            simulated on the 0.6b stage's calibration
#   stored   no GPU: the three ladders as measured on the H200 and on an H100 (benchmarks/sim/measured/, kept
#            in the repository) against the shipped calibrations of each GPU, simulated here
#   transfer no GPU: each GPU's ladders on the other's calibrations, carried over with `--gpu PRESET`
# The calibrations (RESULT_DIR/cal) are made as calibrate_shipped.sh makes the 16-bit ones it ships.
set -eu
R=${1:-results/sim-validate}
GPU=${2:-h200}
shift $(( $# < 2 ? $# : 2 ))
STAGES=${*:-8b 0.6b preempt}
mkdir -p "$R/cal"
ENGINE="--load-format dummy --max-model-len 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9"
DOC="--load-format dummy --gpu-memory-utilization 0.88 --max-model-len 8192 --max-num-seqs 16 --max-num-batched-tokens 4096 --enable-chunked-prefill"
WORK="--random-input-len 1024 --random-output-len 256 --concurrency 1,2,4,8,16,32 --disable-tqdm"

simulated() {  # NAME MODEL CALIBRATION SERVE_FLAGS MEASURED_DIR [SWEEP FLAGS]: simulate, compare with the measured
  python3 -m pagedserve.cli bench sweep --model "$2" --serve-args "$4" $WORK --simulate "$3" ${6:-} \
    --result-dir "$R/$1-simulated"
  python3 -m benchmarks.sim.accuracy "$5" "$R/$1-simulated"
}

latest() {  # GPU LADDER: the kept measurement of that ladder on that GPU with the latest date
  for d in benchmarks/sim/measured/$1-*/$2; do echo "$(grep -o '"date": "[^"]*"' $d/sweep.json | head -1) $d"; done \
    | sort | tail -1 | awk '{print $NF}'
}

graphs_then() {  # KEPT_LADDER_DIR: the capture flag its tree ran with (its folder is GPU-COMMIT)
  # trees before 6c87e54 stopped every model's prompt graphs at 512 tokens; the default is 4096 since
  local commit=$(basename "$(dirname "$1")"); commit=${commit#*-}
  if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "validate.sh: the stored stages need the git history to place $commit" >&2
    exit 2
  fi
  git merge-base --is-ancestor 6c87e54 "$commit" || echo "--max-cudagraph-capture-size 512"
}

stored() {  # MEASURED_GPU CALIBRATION_GPU [SWEEP FLAGS]: the three kept ladders of one GPU, simulated
  local d g
  d=$(latest $1 qwen3-8b); g=$(graphs_then $d)
  simulated "$1-qwen3-8b" Qwen/Qwen3-8B "$2-qwen3-8b-bf16" "$DOC $g" $d "${3:-}"
  d=$(latest $1 qwen3-0.6b); g=$(graphs_then $d)
  simulated "$1-qwen3-0.6b" Qwen/Qwen3-0.6B "$2-qwen3-0.6b-bf16" "$DOC $g" $d "${3:-}"
  d=$(latest $1 qwen3-0.6b-preempt); g=$(graphs_then $d)
  simulated "$1-qwen3-0.6b-preempt" Qwen/Qwen3-0.6B "$2-qwen3-0.6b-bf16" "$DOC $g --kv-cache-memory 1GiB" $d "${3:-}"
}

ladders() {  # NAME MODEL CALIBRATION SERVE_FLAGS: measure, then as simulated()
  python3 -m pagedserve.cli bench sweep --model "$2" --serve-args "$4" $WORK --result-dir "$R/$1-measured"
  simulated "$@" "$R/$1-measured"
}

for stage in $STAGES; do
  echo "== $(date +%T) $stage"
  case $stage in
    8b|0.6b)
      model="Qwen/Qwen3-$(echo $stage | tr 'b' 'B')"
      cal="$R/cal/$GPU-qwen3-$stage-bf16.json"
      python3 -m pagedserve.cli calibrate "$model" $ENGINE --output "$cal"
      ladders "qwen3-$stage" "$model" "$cal" "$DOC" ;;
    preempt)
      ladders "qwen3-0.6b-preempt" Qwen/Qwen3-0.6B "$R/cal/$GPU-qwen3-0.6b-bf16.json" "$DOC --kv-cache-memory 1GiB" ;;
    stored) stored h200 h200; stored h100 h100 ;;
    transfer) stored h100 h200 "--gpu H100-80GB"; stored h200 h100 "--gpu H200-141GB" ;;
    *) echo "unknown stage $stage (8b, 0.6b, preempt, stored, transfer)"; exit 2 ;;
  esac
done
echo "== $(date +%T) done"
