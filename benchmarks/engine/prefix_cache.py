"""Prefix caching on the GPU: TTFT of prompts that share a prefix against prompts that share nothing, with the
server's prefix cache on and off.

Each prompt is PREFIX shared tokens + INPUT own tokens (vLLM's --random-prefix-len); the other workload
has PREFIX + INPUT own tokens and nothing shared, so both prefill the same lengths without a cache.

python -m benchmarks.engine.prefix_cache [--model Qwen/Qwen3-8B] [--prefix-len 1024] [--input-len 1024]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.args import run_main, server_flags
from pagedserve.bench.launch import LocalServer, bench_serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--serve-args", default="--gpu-memory-utilization 0.88 --max-model-len 8192 --max-num-seqs 16 "
                                            "--max-num-batched-tokens 4096 --enable-chunked-prefill")
    ap.add_argument("--result-dir", default="results/prefix-cache")
    ns = ap.parse_args()
    serve_args = server_flags(ap, ns.model, ns.serve_args)
    out = Path(ns.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    workloads = {"shared prefix": ["--random-prefix-len", str(ns.prefix_len), "--random-input-len", str(ns.input_len)],
                 "nothing shared": ["--random-input-len", str(ns.prefix_len + ns.input_len)]}
    rows = []
    for cache in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        flags = ["--load-format", "dummy", cache, *serve_args]
        with LocalServer(ns.model, flags, out / f"server{cache}.log") as server:
            for k, (name, data) in enumerate(workloads.items()):
                r = bench_serve(server.base_url, [  # each workload its own seed: none shares the other's tokens
                    "--model", ns.model, *data, "--random-output-len", str(ns.output_len), "--num-prompts",
                    str(ns.num_prompts), "--max-concurrency", str(ns.max_concurrency), "--percentile-metrics", "ttft,itl",
                    "--metric-percentiles", "50,95", "--seed", str(k)],
                    out / f"{cache.strip('-')}-{name.replace(' ', '-')}.json")
                rows.append(("off" if "no-" in cache else "on", name, r["median_ttft_ms"],
                             r["p95_ttft_ms"], r["output_throughput"]))
                print(f"cache {rows[-1][0]}, {name}: median TTFT {rows[-1][2]:.1f} ms", flush=True)
    print(f"\n{ns.model}; {ns.num_prompts} prompts of {ns.prefix_len} + {ns.input_len} in, {ns.output_len} out, "
          f"{ns.max_concurrency} in flight; serve {ns.serve_args}")
    print("| prefix cache | workload | median TTFT ms | p95 TTFT ms | output tok/s |\n|---|---|---|---|---|")
    for cache, name, med, p95, tput in rows:
        print(f"| {cache} | {name} | {med:,.1f} | {p95:,.1f} | {tput:,.0f} |")


if __name__ == "__main__":
    run_main(main)
