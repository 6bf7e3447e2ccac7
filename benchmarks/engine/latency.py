"""Single-request decode latency and where a step's time goes.

python -m benchmarks.engine.latency --model Qwen/Qwen3-8B --input-len 1024 --output-len 256 [--gemv cuda,cublas]
    [--decode-segments 4,16] [--o-proj-staged on,off]

Prints TTFT, inter-token latency (mean / p50 / p99 over the steps after the first token), the GPU time of
one captured decode graph replay (CUDA events), and the host time of each phase of a step. The host
phases run while the device computes the step launched before (the engine keeps one step in flight),
so the wait for that step's token is where the device time shows up on the host.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time

import numpy as np
import torch


from benchmarks.args import on_off, run_main
from benchmarks.kernels.harness import graph_ms
from pagedserve import LLM, SamplingParams
from pagedserve.bench.latency import run_latency
from pagedserve.memory import GiB, weight_bytes
from pagedserve.model.cuda_gemv import CudaGemv
from pagedserve.model.layers import use_gemv

WARP_CHOICES = CudaGemv.WARP_CHOICES  # the engine's, restored by settings without -fixed
ROWS = CudaGemv.ROWS  # ... and without -rows1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemv", default="", help="comma-separated kernels for the projections of decode steps of one or "
                    "two sequences (and of 3-16 on the tensor cores): cublas, or cuda with -unfused (norms as "
                    "kernels of their own) and/or -nopdl (plain launches), -fixed (WARPS for every shape), -rows1 "
                    "(one sequence's steps alone; two on the tensor-core kernel), -nomma (3-16 rows on cuBLAS) "
                    "and :WARPSxUNROLL to measure one after another, decode graphs captured again for each")
    ap.add_argument("--decode-segments", default="",
                    help="comma-separated split factors for the graphed decodes, each crossed with every --gemv")
    ap.add_argument("--fused-decode", type=on_off, help="comma-separated on/off: decode-only steps' attention in "
                    "one kernel (on, the default) or as norm/rotary/store + attention + merge (off), crossed with "
                    "the rest")
    ap.add_argument("--decode-pdl", type=on_off, help="comma-separated on/off: one sequence's fused decode launched "
                    "as a programmatic dependent of the q/k/v projection (on, the default on sm_90+) or plainly, "
                    "crossed with the rest")
    ap.add_argument("--o-proj-staged", type=on_off, help="comma-separated on/off: o_proj's weights copied into "
                    "shared memory while one sequence's attention runs, with that attention's first key tile "
                    "prefetched into L2 (on, the default on sm_90+), or neither (off); crossed with the rest")
    ap.add_argument("--profile", type=int, nargs="?", const=1, metavar="BS",
                    help="also print a kernel profile of the decode graph replays of BS sequences (default 1)")
    ns = ap.parse_args()
    llm = LLM(ns.model, load_format="dummy", dtype=ns.dtype, max_model_len=ns.input_len + ns.output_len + 16,
              gpu_memory_utilization=ns.gpu_memory_utilization, max_num_seqs=16)
    engine = llm.engine
    core = engine.core
    prompt = np.random.default_rng(0).integers(0, 500, ns.input_len).tolist()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up

    gemvs = ns.gemv.split(",") if ns.gemv else [None]
    w = weight_bytes(engine.config.model, engine.config.dtype)
    print(f"model {ns.model} ({engine.config.dtype}), weights {w / GiB:.2f} GiB, {ns.input_len} in / {ns.output_len} out, "
          f"{ns.repeats} runs; weights-only HBM floor at 4.3 TB/s: {w / 4.3e12 * 1000:.3f} ms")
    first = None
    check = SamplingParams(temperature=0, max_tokens=min(64, ns.output_len), ignore_eos=True)
    segments = [int(n) for n in ns.decode_segments.split(",")] if ns.decode_segments else [None]
    fused, pdls, stagings = ns.fused_decode or [None], ns.decode_pdl or [None], ns.o_proj_staged or [None]
    settings = list(itertools.product(gemvs, segments, fused, pdls, stagings))
    for k, (gemv, segs, fuse, pdl, staged) in enumerate(settings):
        if any(v is not None for v in (gemv, segs, fuse, pdl, staged)):
            recapture(core.worker.runner, gemv, segs, fuse, pdl, staged)
        measure(llm, ns.input_len, ns.output_len, ns.repeats, seed=k + 1)  # prompts no earlier setting cached
        if ns.profile:
            profile_replays(core.worker.runner, ns.profile)
        tokens = llm.generate([prompt], check, use_tqdm=False)[0].outputs[0].token_ids
        first = first or tokens
        if len(settings) > 1:
            print(f"{check.max_tokens} greedy tokens {'identical to' if tokens == first else 'DIFFER from'} the first setting's")


def recapture(runner, gemv: str | None, segs: int | None, fuse: bool | None, pdl: bool | None,
              staged: bool | None) -> None:
    """Decode graphs captured again with small batches' projections on ``gemv`` (a --gemv setting), decodes
    split over ``segs`` segments, the fused decode on or off and launched as a programmatic dependent or
    not, o_proj staged or not (None: as configured)."""
    if not runner._graphs:
        sys.exit("--gemv / --decode-segments / --fused-decode / --decode-pdl / --o-proj-staged: the runner has no "
                 "decode graphs to capture again")
    if staged is not None:
        CudaGemv.STAGE = staged
    if fuse is not None:
        runner.backend.FUSED_DECODE = fuse
    if pdl is not None:
        runner.backend.DECODE_PDL = pdl
    if gemv is not None:
        CudaGemv.FUSE_NORM, CudaGemv.PDL = "unfused" not in gemv, "nopdl" not in gemv
        CudaGemv.WARP_CHOICES = () if "fixed" in gemv else WARP_CHOICES
        CudaGemv.ROWS = (1,) if "rows1" in gemv else ROWS
        CudaGemv.MMA = "nomma" not in gemv
        if ":" in gemv:  # cuda:WARPSxUNROLL
            CudaGemv.WARPS, CudaGemv.UNROLL = map(int, gemv.split(":")[1].split("x"))
        use_gemv(runner.model, CudaGemv.build(runner.device) if gemv.startswith("cuda") else None)
    if segs is not None:
        runner.backend.decode_segments = lambda batch, max_seq_len: segs
    runner._graphs.clear()
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_decode_graphs()
    print(f"\n-- decode projections on {gemv or 'the default'}, decodes over {segs or 'the backend`s choice of'} "
          f"segments, fused decode {'as configured' if fuse is None else 'on' if fuse else 'off'}, its dependent "
          f"launch {'as configured' if pdl is None else 'on' if pdl else 'off'}, o_proj staged: "
          f"{'as configured' if staged is None else 'on' if staged else 'off'}")


def measure(llm, input_len: int, output_len: int, repeats: int, seed: int) -> None:
    """`pagedserve bench latency` at one request, with the host time of each phase of a step."""
    core = llm.engine.core
    phases = {"schedule": [], "execute": [], "prompt": []}
    sched, runner = core.scheduler, core.worker.runner
    orig_schedule, orig_execute = sched.schedule, runner.execute

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            # execute's first argument is the step's inputs: a prompt step's host time is reported apart
            phases["prompt" if key == "execute" and not a[0].decode_only else key].append(time.perf_counter() - t)
            return r
        return wrapper

    sched.schedule, runner.execute = timed(orig_schedule, "schedule"), timed(orig_execute, "execute")
    try:
        result = run_latency(llm, input_len, output_len, batch_size=1, num_iters_warmup=0, num_iters=repeats,
                             seed=seed, temperature=0.0)
    finally:
        sched.schedule, runner.execute = orig_schedule, orig_execute
    steps = len(phases["schedule"])
    step_wall = result["avg_latency"] * repeats / steps
    print(f"TTFT: mean {result['mean_ttft_ms']:.1f} ms; the prompt's steps' host time (inputs + launch): median "
          f"{np.median(phases['prompt']) * 1e3:.3f} ms over {len(phases['prompt'])}")
    print(f"ITL: mean {result['mean_itl_ms']:.3f} ms, p50 {result['median_itl_ms']:.3f} ms, p99 {result['p99_itl_ms']:.3f} ms")
    if runner._graphs:  # GPU time of decode graph replays, at the context the last request left
        times = {bs: graph_ms(graph[0]) for bs, graph in sorted(runner._graphs.items()) if bs <= 64}
        print("GPU time of one decode graph replay: " + ", ".join(f"bs={bs} {t:.3f} ms" for bs, t in times.items()))
    execute = np.mean(phases["execute"] + phases["prompt"])
    print(f"per step (mean over {steps} steps): schedule {np.mean(phases['schedule']) * 1e3:.3f} ms, "
          f"execute (host: inputs + launch) {execute * 1e3:.3f} ms (decode steps alone "
          f"{np.mean(phases['execute']) * 1e3:.3f}), the rest of the step's wall time (waiting for the previous "
          f"step's token, update, detokenize) {(step_wall - np.mean(phases['schedule']) - execute) * 1e3:.3f} ms")


def profile_replays(runner, bs: int, reps: int = 20) -> None:
    """Kernel-level profile of the decode graph replays of ``bs`` sequences (kernels inside a graph are traced one
    by one)."""
    from torch.profiler import ProfilerActivity, profile

    if bs not in runner._graphs:
        sys.exit(f"--profile {bs}: no decode graph of that size (sizes: {sorted(runner._graphs)})")
    replay = runner._graphs[bs][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    print(f"\n== kernels of {reps} bs={bs} decode graph replays")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    run_main(main)
