#!/usr/bin/env bash
# The reference online test (benchmarks.engine.online_serve) at several commits, one after another on one
# machine, to find which change moved it: each commit's tree is exported from git and served from there;
# "." is the working tree. Prints each run's summary lines; results under /tmp/online-COMMIT.
# Usage (repository root, the server's dependencies importable): bash benchmarks/engine/online_bisect.sh 4f288a8 62e3c9c .
set -eu
for commit in "$@"; do
  if [ "$commit" = . ]; then
    tree=$PWD
  else
    tree=/tmp/tree-$commit
    rm -rf "$tree" && mkdir -p "$tree"
    git archive "$commit" | tar -x -C "$tree"
  fi
  echo "== $(date +%T) $commit"
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" python3 -m benchmarks.engine.online_serve \
     --result-dir "/tmp/online-$commit" 2>&1 | grep -E "^p95 TTFT|^ITL percentiles|^engine step|^server exit")
done
