"""Single-request decode latency (issue target 1) and where a step's time goes.

python benchmarks/latency.py --model Qwen/Qwen3-8B --input-len 1024 --output-len 256

Prints TTFT, inter-token latency (mean / p50 / p99 over the steps after the first token), the GPU time of
one captured decode graph replay (CUDA events), and the host time of each phase of a step. The host
phases run while the device computes the step launched before (the engine keeps one step in flight),
so the wait for that step's token is where the device time shows up on the host.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.memory import GiB, weight_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    llm = LLM(ns.model, load_format="dummy", dtype=ns.dtype, max_model_len=ns.input_len + ns.output_len + 16,
              gpu_memory_utilization=ns.gpu_memory_utilization, max_num_seqs=16)
    engine = llm.engine
    core = engine.core
    prompt = np.random.default_rng(0).integers(0, 500, ns.input_len).tolist()
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up

    phases = {"schedule": [], "execute": [], "update+outputs": []}
    sched, runner = core.scheduler, core.runner
    orig_schedule, orig_execute = sched.schedule, runner.execute

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            phases[key].append(time.perf_counter() - t)
            return r
        return wrapper

    sched.schedule, runner.execute = timed(orig_schedule, "schedule"), timed(orig_execute, "execute")
    itls, ttfts = [], []
    for rep in range(ns.repeats):
        engine.add_request(f"r{rep}", prompt, params)
        t0 = time.perf_counter()
        stamps = []  # when each token reached the caller (a step returns the previous step's token)
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            produced = engine.step()
            now = time.perf_counter()
            if produced:
                stamps.append(now)
            phases["update+outputs"].append(now - ts)
        ttfts.append(stamps[0] - t0)
        itls.extend(np.diff(stamps))
    sched.schedule, runner.execute = orig_schedule, orig_execute
    steps = len(phases["schedule"])
    # schedule() runs on every call; execute() only on calls that launch a step
    upd = np.array(phases["update+outputs"]).sum() - np.sum(phases["schedule"]) - np.sum(phases["execute"])
    itl = np.array(itls) * 1000

    # GPU time of one bs=1 decode graph replay
    gpu_ms = None
    if runner._graphs:
        graph = runner._graphs[1][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        gpu_ms = start.elapsed_time(end) / 50
    w = weight_bytes(engine.config.model, engine.config.dtype)
    print(f"model {ns.model} ({engine.config.dtype}), weights {w / GiB:.2f} GiB, {ns.input_len} in / {ns.output_len} out, "
          f"{ns.repeats} runs")
    print(f"TTFT: mean {np.mean(ttfts) * 1000:.1f} ms")
    print(f"ITL: mean {itl.mean():.3f} ms, p50 {np.percentile(itl, 50):.3f} ms, p99 {np.percentile(itl, 99):.3f} ms")
    if gpu_ms is not None:
        print(f"GPU time of one decode step (bs=1 graph replay, context of the last request): {gpu_ms:.3f} ms")
        print(f"weights-only HBM floor at 4.3 TB/s: {w / 4.3e12 * 1000:.3f} ms")
    print(f"per step (mean over {steps} steps): schedule {np.mean(phases['schedule']) * 1e3:.3f} ms, "
          f"execute (host: inputs + launch) {np.mean(phases['execute']) * 1e3:.3f} ms, "
          f"wait for the previous step's token + update + detokenize {upd / steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
