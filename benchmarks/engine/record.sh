#!/usr/bin/env bash
# The performance page's figures of record for Qwen3-8B, each stage the command of its summary row, sized so
# that a stage or two fit one 10-minute device command; prints each command's closing lines and keeps its
# whole output under RESULT_DIR.
# Usage (repository root, the server's dependencies importable):
#   bash benchmarks/engine/record.sh RESULT_DIR [STAGE ...]
# Stages (default: check latency online): check (gpu_check), latency (one request, 1024 in / 256 out), online
# (the reference online test), fp8 and bf16 (1000 x 1024/1024 offline with an fp8 or the 16-bit KV cache;
# an H200's memory), length (the cost against prompt length), prefix (prefix caching).
set -u
R=${1:-results/record}
shift || true
STAGES=${*:-check latency online}
mkdir -p "$R"
OFFLINE="--model Qwen/Qwen3-8B --num-seqs 1000 --input-len 1024 --output-len 1024 --max-model-len 2064"
run() {  # NAME COMMAND...: run it, keep its output, print its end
  local name=$1
  shift
  echo "== $(date +%T) $name: $*"
  "$@" > "$R/$name.log" 2>&1
  echo "== $(date +%T) $name exit $?"
  grep -v -e '^INFO' -e 'it/s' "$R/$name.log" | tail -n 12
}
for stage in $STAGES; do
  case $stage in
    check) run check python3 -m benchmarks.gpu_check ;;
    latency) run latency python3 -m benchmarks.engine.latency --model Qwen/Qwen3-8B --input-len 1024 --output-len 256 \
      --repeats 2 ;;
    online) run online python3 -m benchmarks.engine.online_serve --result-dir "$R/online" ;;
    fp8) run fp8 python3 -m benchmarks.engine.offline_throughput $OFFLINE --kv-cache-dtype fp8 --max-num-seqs 512 ;;
    bf16) run bf16 python3 -m benchmarks.engine.offline_throughput $OFFLINE --max-num-seqs 384 ;;
    length) run length python3 -m benchmarks.engine.length_curve --result-dir "$R/length" ;;
    prefix) run prefix python3 -m benchmarks.engine.prefix_cache --result-dir "$R/prefix" ;;
    *) echo "unknown stage $stage (check latency online fp8 bf16 length prefix)"; exit 2 ;;
  esac
done
