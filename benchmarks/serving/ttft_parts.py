"""Where a server's TTFT goes: start `pagedserve serve`, run `bench serve` at a few levels of requests in flight
and read the server's own histograms around each run: the time from a request's arrival in the engine to its first
step (`vllm:request_queue_time_seconds`), from that step to its first token (`vllm:request_prefill_time_seconds`),
and the server's TTFT, beside the client's. What the client sees beyond the server's TTFT is the way in (HTTP,
validation, the hop to the engine thread) and the way out.

python -m benchmarks.serving.ttft_parts [--model Qwen/Qwen3-0.6B] [--in-flight 1,2,4,8,16]
    [--serve-args "--load-format dummy ..."] [--input-len 1024] [--output-len 256]
(16 prompts a level up to 4 in flight, four rounds of the level above; the tiny model runs on a CPU)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.args import positives, run_main, server_flags
from pagedserve.bench.launch import LocalServer, bench_serve
from pagedserve.tune.diagnose import parse_sample

REFERENCE = ("--load-format dummy --gpu-memory-utilization 0.88 --max-model-len 8192 --max-num-seqs 16 "
             "--max-num-batched-tokens 4096 --enable-chunked-prefill")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--in-flight", type=positives, default="1,2,4,8,16")
    p.add_argument("--serve-args", default=REFERENCE, help="The server's flags (default: the reference online test's).")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    ns = p.parse_args()
    flags = server_flags(p, ns.model, ns.serve_args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalServer(ns.model, flags, Path(tmp) / "server.log") as server:
        def scrape() -> dict[str, float]:
            return parse_sample(httpx.get(server.base_url + "/metrics", timeout=10).text, time.monotonic())

        for k, c in enumerate(ns.in_flight):
            before = scrape()
            run = bench_serve(server.base_url, [
                "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len),
                "--num-prompts", str(16 if c <= 4 else 4 * c), "--max-concurrency", str(c), "--num-warmups", "0",
                "--seed", str(k + 11), "--metric-percentiles", "50,95,99"], Path(tmp) / f"level{k}.json")
            after = scrape()

            def mean_ms(key: str) -> float:
                n = after[f"{key}_count"] - before[f"{key}_count"]
                return 1e3 * (after[f"{key}_sum"] - before[f"{key}_sum"]) / max(1.0, n)

            rows.append((c, run["mean_ttft_ms"], run["median_ttft_ms"], run["p99_ttft_ms"], mean_ms("ttft"),
                         mean_ms("queue"), mean_ms("prefill"), run["median_tpot_ms"]))
            print(f"{c} in flight: client TTFT mean {run['mean_ttft_ms']:.1f} ms | server TTFT mean "
                  f"{mean_ms('ttft'):.1f}, queue {mean_ms('queue'):.1f}, prefill {mean_ms('prefill'):.1f} ms", flush=True)
    print("\n| in flight | client TTFT mean / median / p99 ms | server TTFT ms | queue ms | prefill ms | median TPOT ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c, mean, median, p99, ttft, queue, prefill, tpot in rows:
        print(f"| {c} | {mean:.1f} / {median:.1f} / {p99:.1f} | {ttft:.1f} | {queue:.1f} | {prefill:.1f} | {tpot:.2f} |")


if __name__ == "__main__":
    run_main(main)
