"""Where the time of an offline run's steps goes: GPU kernels by name, GPU busy time against wall time.

python -m benchmarks.engine.profile_steps --model Qwen/Qwen3-0.6B --num-seqs 256 --first-step 200 --num-steps 100
python -m benchmarks.engine.profile_steps --model Qwen/Qwen3-8B --num-seqs 1000 --input-len 1024 --output-len 1024 --max-model-len 2064

Runs the same workload as offline_throughput.py through the engine's step loop and records
``--num-steps`` steps with torch.profiler, starting at ``--first-step``. Prints the wall time per step,
the GPU kernel time per step (the gap between them is the GPU waiting for the host), and the kernels
that take the most time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import add_workload_args, make_llm, workload

from benchmarks.args import run_main
from pagedserve import SamplingParams
from pagedserve.outputs import RequestOutputKind


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--first-step", type=int, default=200)
    ap.add_argument("--num-steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=15)
    ns = ap.parse_args()
    prompts, outs = workload(ns)
    llm = make_llm(ns.model, ns)
    engine = llm.engine
    for i, (p, o) in enumerate(zip(prompts, outs)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True),
                           RequestOutputKind.FINAL_ONLY)
    for _ in range(ns.first_step):
        engine.step()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    stats = []
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(ns.num_steps):
            engine.step()
            s = engine.core.last_stats
            stats.append((s.num_prefill_tokens, s.num_decode_tokens))
        sync()
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if t > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.key] += t / 1e3  # ms
    gpu = sum(kernels.values())
    n = ns.num_steps
    pre = np.array([s[0] for s in stats])
    dec = np.array([s[1] for s in stats])
    print(f"{ns.model}: steps {ns.first_step}..{ns.first_step + n}: mean {dec.mean():.0f} decodes and "
          f"{pre.mean():.0f} prefill tokens a step ({(pre > 0).sum()} steps with prefill)")
    print(f"wall {wall * 1e3 / n:.2f} ms/step (under the profiler), GPU kernels {gpu / n:.2f} ms/step "
          f"({100 * gpu / (wall * 1e3):.0f} % busy)")
    for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:ns.top]:
        print(f"  {t / n:8.3f} ms/step  {100 * t / gpu:5.1f} %  {name[:110]}")


if __name__ == "__main__":
    run_main(main)
