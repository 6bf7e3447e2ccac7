#!/usr/bin/env bash
# The operator's runs on one H200, one after another: the ladder over --max-num-seqs 16/32/64 with the
# reference serve flags (0.88 / 8192 / 16 seqs / 4096 tokens), `tune` with those flags, and a burst of 8k-token prompts against the tuned server.
# Usage: bash benchmarks/serving/h200_mission.sh RESULT_DIR [STAGE ...]   (stages: grid tune burst; default all;
# with pagedserve importable: PYTHONPATH=repo root)
set -u
R=${1:-results/h200}
shift || true
STAGES=${*:-grid tune burst}
mkdir -p "$R"
DOC="--load-format dummy --gpu-memory-utilization 0.88 --max-model-len 8192 --max-num-seqs 16 --max-num-batched-tokens 4096 --enable-chunked-prefill"
WORK="--random-input-len 1024 --random-output-len 256"
run() { echo "== $(date +%T) $*"; "$@"; echo "== $(date +%T) exit $?"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
has grid && run python3 -m pagedserve.cli bench sweep --model Qwen/Qwen3-8B --serve-args "$DOC" --grid max_num_seqs=16,32,64 \
    $WORK --concurrency 1,2,4,8,16,32,64 --result-dir "$R/grid" --disable-tqdm
has tune && run python3 -m pagedserve.cli tune Qwen/Qwen3-8B $DOC $WORK --concurrency 1,2,4,8,16,32 --result-dir "$R/tune" \
    --disable-tqdm
has burst && run python3 -m benchmarks.serving.profile_burst --model Qwen/Qwen3-8B --serve-args "$DOC" --profiles "$R/tune/profiles.yaml" \
    $(echo $WORK | sed 's/random-//g') --burst-prompts 32 --burst-input-len 8000 --burst-seconds 8 \
    --before 20 --after 60 --recovery-dwell-s 20 --recovery-hold-s 10 --result-dir "$R/burst"
echo "== $(date +%T) done"
