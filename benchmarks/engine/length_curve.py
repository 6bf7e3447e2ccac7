"""How cost grows with prompt length: one server, `bench serve` at each input length and concurrency, against
the GPU's floors at that length.

Floors (at the spec-sheet peaks of the GPU it runs on, e.g. an H200's 989 dense bf16 TFLOP/s and 4.8 TB/s): a
prompt of L tokens needs 2 x params x L FLOPs of projections plus 2 x layers x heads x head_dim x L^2 of causal
attention, so TTFT cannot beat that over the peak; a decode step of c sequences reads every weight once plus each
sequence's K/V, so ITL cannot beat those bytes over the bandwidth, and output tok/s cannot exceed c over that ITL.

python -m benchmarks.engine.length_curve [--model Qwen/Qwen3-8B] [--lengths 512,2048,8192,32768]
    [--concurrency 1,64] [--output-len 256] [--result-dir DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.args import run_main, server_flags
from pagedserve.bench.launch import LocalServer, bench_serve
from pagedserve.config import EngineArgs, ModelConfig
from pagedserve.memory import kv_bytes_per_token, weight_bytes


def gpu_peaks() -> tuple[float, float, str]:
    """(dense bf16 FLOP/s, HBM bytes/s, preset) of the GPU this process sees, from the planner's presets;
    an H200's where it is none of them."""
    from pagedserve.sim.ladder import preset_of
    from pagedserve.tune.plan import GPU_PEAKS

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        preset = preset_of(props.name, props.total_memory)
        if preset is not None:
            return (*GPU_PEAKS[preset], preset)
    return (*GPU_PEAKS["H200-141GB"], "H200-141GB (assumed)")


def floors(model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, length: int, output_len: int,
           c: int, peaks: tuple[float, float, str]) -> tuple[float, float]:
    """(TTFT floor in s for one prompt alone, output tok/s ceiling at c sequences) at this length."""
    peak_flops, peak_bytes, _ = peaks
    flops = 2 * model.active_params() * length + 2 * model.num_layers * model.num_heads * model.head_dim * length ** 2
    mid = length + output_len // 2  # the average context over the decode
    step_bytes = weight_bytes(model, dtype) + c * mid * kv_bytes_per_token(model, kv_dtype)
    return flops / peak_flops, c / (step_bytes / peak_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=600_000,
                    help="At most this many prompt tokens a point (fewer prompts at long lengths).")
    ap.add_argument("--serve-args", default="--gpu-memory-utilization 0.9 --max-num-seqs 64 "
                                            "--max-num-batched-tokens 8192 --enable-chunked-prefill")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--result-dir", default="results/length-curve")
    ns = ap.parse_args()
    serve_args = server_flags(ap, ns.model, ns.serve_args)
    lengths = [int(x) for x in ns.lengths.split(",")]
    levels = [int(x) for x in ns.concurrency.split(",")]
    out = Path(ns.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the model and dtypes as the server on a GPU resolves them
    config = EngineArgs(model=ns.model, load_format="dummy", kv_cache_dtype=ns.kv_cache_dtype).create_config(plan_for="cuda")
    # a few tokens of slack: the tokenizer may add a BOS to the prompt
    flags = ["--load-format", "dummy", "--max-model-len", str(max(lengths) + ns.output_len + 16),
             "--kv-cache-dtype", ns.kv_cache_dtype, *serve_args]
    rows = []
    peaks = gpu_peaks()
    with LocalServer(ns.model, flags, out / "server.log") as server:
        for length in lengths:
            for c in levels:
                prompts = max(1, min(c, ns.max_prompt_tokens // length)) if c > 1 else 3
                r = bench_serve(server.base_url, [  # each point its own prompts: none cached by an earlier one
                    "--model", ns.model, "--random-input-len", str(length), "--random-output-len", str(ns.output_len),
                    "--num-prompts", str(prompts), "--max-concurrency", str(c), "--percentile-metrics", "ttft,itl,e2el",
                    "--metric-percentiles", "50,95", "--seed", str(len(rows))], out / f"len{length}-c{c}.json")
                ttft_floor, tput_ceiling = floors(config.model, config.dtype, config.kv_dtype, length, ns.output_len,
                                                  min(c, prompts), peaks)
                rows.append((length, c, prompts, r["output_throughput"], tput_ceiling, r["median_ttft_ms"],
                             1e3 * ttft_floor, r["median_itl_ms"], r.get("server_preemptions")))
                print(f"len {length} c {c}: {r['output_throughput']:.0f} tok/s, median TTFT {r['median_ttft_ms']:.0f} ms",
                      flush=True)
    print(f"\n{ns.model}, KV {ns.kv_cache_dtype}, output {ns.output_len}; {' '.join(flags)}; floors at the peaks of "
          f"{peaks[2]} ({peaks[0] / 1e12:.0f} TFLOP/s, {peaks[1] / 1e12:.2f} TB/s)")
    print("| input | concurrency (prompts) | output tok/s | HBM ceiling | of ceiling | median TTFT ms | compute floor ms "
          "| median ITL ms | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length, c, prompts, tput, ceil, ttft, tfloor, itl, pre in rows:
        print(f"| {length} | {c} ({prompts}) | {tput:,.0f} | {ceil:,.0f} | {100 * tput / ceil:.0f} % | {ttft:,.1f} | "
              f"{tfloor:,.1f} | {itl:.2f} | {pre} |")
    (out / "curve.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    run_main(main)
