"""The reference online test: start `pagedserve serve` with the reference flags (0.88 / 8192 / 16 seqs / 4096
tokens, chunked prefill), run `bench serve` against it (1024 in, 256 out, 128 prompts at 8 req/s), report
p95 TTFT, ITL and peak memory and how the ITLs split into modes, keep the server's /metrics beside the
result, then stop the server with SIGTERM.

python -m benchmarks.engine.online_serve [--result-dir DIR] [--model Qwen/Qwen3-8B]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.args import run_main, server_flags

ROOT = Path(__file__).resolve().parents[2]
SERVER_FLAGS = ("--gpu-memory-utilization 0.88 --max-model-len 8192 --max-num-seqs 16 --max-num-batched-tokens 4096 "
                "--enable-chunked-prefill")
BENCH_FLAGS = "--random-input-len 1024 --random-output-len 256 --num-prompts 128 --request-rate 8"
# bench serve's flags for the ITL percentiles the report reads
PERCENTILE_FLAGS = ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99"]


def report(r: dict) -> None:
    """The run's summary lines from ``bench serve``'s result: TTFT, ITL and its modes, the engine's steps."""
    peak = (r.get("server_peak_device_memory_bytes") or 0) / 2**30
    print(f"p95 TTFT {r['p95_ttft_ms']:.1f} ms | p95 ITL {r['p95_itl_ms']:.2f} ms | median ITL "
          f"{r['median_itl_ms']:.2f} ms | output {r['output_throughput']:.0f} tok/s | peak device memory "
          f"{peak:.1f} GiB | preemptions "
          f"{r.get('server_preemptions')} | failed {r['failed']}")
    itl = sorted(x * 1000 for stream in r["itls"] for x in stream)
    median = itl[len(itl) // 2]
    long = sum(x > 2 * median for x in itl) / len(itl)
    # ITLs are bimodal: decode-only steps, and the steps a newly admitted prompt's prefill shares;
    # where the second mode's share crosses 5 %, the p95 jumps between the two
    pct = {p: itl[min(len(itl) - 1, int(p / 100 * len(itl)))] for p in (90, 94, 95, 96, 99)}
    print("ITL percentiles (ms): " + ", ".join(f"p{p} {v:.2f}" for p, v in pct.items())
          + f"; {100 * long:.1f} % of ITLs are over twice the median")
    if r.get("server_step_interval_p99_ms") is not None:  # long ITLs from long steps, or from streaming
        print(f"engine step interval p50 {r['server_step_interval_p50_ms']:.2f} ms, "
              f"p99 {r['server_step_interval_p99_ms']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--result-dir", default="results")
    ap.add_argument("--serve-args", "--server-flags", default=SERVER_FLAGS,
                    help="The server's flags, one string (--server-flags: an older name).")
    ap.add_argument("--bench-flags", default=BENCH_FLAGS)
    ns = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    serve = [sys.executable, "-m", "pagedserve.cli", "serve", ns.model, "--load-format", "dummy", "--port", str(ns.port),
             *server_flags(ap, ns.model, ns.serve_args)]
    print("$", " ".join(serve[2:]), flush=True)
    server = subprocess.Popen(serve, env=env)
    url = f"http://127.0.0.1:{ns.port}"
    try:
        t0 = time.time()
        while True:
            if server.poll() is not None:
                sys.exit(f"server exited with {server.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 400:
                sys.exit("server did not come up in 400 s")
            time.sleep(1)
        print(f"server up after {time.time() - t0:.0f} s", flush=True)
        bench = [sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--model", ns.model, "--host", "127.0.0.1",
                 "--port", str(ns.port), *ns.bench_flags.split(), *PERCENTILE_FLAGS, "--disable-tqdm",
                 "--result-dir", ns.result_dir, "--result-filename", "online_seed.json"]
        print("$", " ".join(bench[2:]), flush=True)
        subprocess.run(bench, env=env, check=True)
        # the server's own view (its TTFT, queue and prefill histograms, step intervals), kept for reading later
        (Path(ns.result_dir) / "metrics.txt").write_text(httpx.get(f"{url}/metrics", timeout=10).text)
        report(json.loads((Path(ns.result_dir) / "online_seed.json").read_text()))
    finally:
        server.send_signal(signal.SIGTERM)
        print(f"server exit status after SIGTERM: {server.wait(timeout=120)}")


if __name__ == "__main__":
    run_main(main)
