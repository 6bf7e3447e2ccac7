"""``pagedserve calibrate``: time steps of known shape on this GPU and fit the cost model to them.

The steps are built directly as ``StepInputs`` (no scheduler), so the grid covers what a ladder will ask
for in a minute or two: decode batches at several context lengths, prompt chunks at several offsets, and
the two mixed. Each is run through the engine's own worker (CUDA graphs, attention kernels, sampler) and
timed from launch to the sampled tokens on the host (the median of a few runs), and for the host's part
before the launch returns.

Then the server's own work a step: a real server (uvicorn on loopback, the engine's scheduler, output
processing and streaming) over a worker whose steps take no time, driven by ``bench serve`` in its own
process at a few concurrencies; each step then lasts what the host spends on it. And a request's way in:
the TTFT of one request at a time over steps of 2 ms, less what the simulator gives for that run; how
far apart requests sent at once reach the engine: the spacing at which the simulator gives a burst of
them the median TTFT the server gave; and, from the same two runs, how the tokens' arrival at the client
scatters around the steps' ends.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

import pagedserve
from pagedserve.config import EngineConfig
from pagedserve.memory import dtype_name
from pagedserve.errors import ConfigError
from pagedserve.model.step import SamplingInputs, StepInputs
from pagedserve.model.runner import graph_sizes
from pagedserve.sim.cost import Calibration, CostModel, priced_step

_WARMUPS, _REPEATS = 2, 5
_HOST_LEVELS = (1, 4, 16, 64, 256)  # requests in flight at which the server's host work is timed
_BURST = 16  # requests sent at once to time their spacing on the way in
# a worker whose steps take no time: the server around it then runs as fast as its host allows
FREE_STEPS = CostModel(breakpoint=1, per_token=0, per_context=0, per_prefill_work=0, fixed=0, eager_floor=0,
                       mixed_floor=0, single=0)
_PACED = dataclasses.replace(FREE_STEPS, fixed=2e-3, single=2e-3)  # ... and one whose steps take 2 ms each


def synthetic_step(seqs: list[tuple[int, int]], block_size: int, num_blocks: int, vocab: int,
                   rng: np.random.Generator) -> StepInputs:
    """A step over sequences given as (query tokens, context length including them), each ending its
    prompt chunk or decoding (so each samples). Blocks are handed out in order, wrapping around the pool:
    the K/V they hold is whatever is there, which costs the same to read."""
    tables, ids, positions, slots, next_block = [], [], [], [], 0
    for q, s in seqs:
        n = math.ceil(s / block_size)
        table = (np.arange(next_block, next_block + n) % num_blocks).astype(np.int32)
        next_block += n
        pos = np.arange(s - q, s)
        tables.append(table)
        positions.append(pos)
        slots.append(table[pos // block_size].astype(np.int64) * block_size + pos % block_size)
        ids.append(rng.integers(0, vocab, q))
    width = max(len(t) for t in tables)
    padded = np.zeros((len(seqs), width), dtype=np.int32)
    for row, t in zip(padded, tables):
        row[:len(t)] = t
    query_lens = np.array([q for q, _ in seqs], dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(np.concatenate(ids).astype(np.int64), np.concatenate(positions).astype(np.int64),
                      np.concatenate(slots), query_lens, np.array([s for _, s in seqs], dtype=np.int32), padded,
                      np.cumsum(query_lens) - 1, empty, empty)


def step_grid(config: EngineConfig, num_blocks: int) -> list[list[tuple[int, int]]]:
    """The shapes timed: decode batches x contexts, prompt chunks x offsets, and decodes with a chunk: large
    ones (a burst of prompts) and the small ones a server's bound on prompt tokens beside decodes makes."""
    cap_tokens = num_blocks * config.block_size
    max_len, seqs_cap, chunk_cap = config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens

    def fits(shape: list[tuple[int, int]]) -> bool:
        return (len(shape) <= seqs_cap and sum(q for q, _ in shape) <= chunk_cap
                and sum(s for _, s in shape) <= cap_tokens and all(s <= max_len for _, s in shape))

    contexts = [c for c in (128, 512, 2048, 8192) if c <= max_len] or [max_len]
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= seqs_cap]
    shapes = [[(1, c)] * b for c in contexts for b in batches]
    chunks = [t for t in (16, 64, 256, 1024, 2048, 4096, 8192) if t <= chunk_cap]
    shapes += [[(t, t + offset)] for t in chunks for offset in (0, 2048, 6144)]
    shapes += [[(1, 1024)] * b + [(t, t)] for b in batches[2::2] for t in (256, 2048)]
    shapes += [[(1, 1024)] * b + [(t, t + offset)] for b in (1, 2, 8) for t in (64, 256) for offset in (0, 768)]
    return [s for s in shapes if fits(s)]


def time_step(worker, inp: StepInputs) -> tuple[float, float]:
    """Median seconds from starting the step to its tokens on the host, and of the host's part before the
    launch returns (on a GPU; on the CPU the step computes in that part, and nothing overlaps)."""
    cuda = worker.device.type == "cuda"
    times, launches = [], []
    for i in range(_WARMUPS + _REPEATS):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = worker.execute(inp, SamplingInputs.greedy_only())
        t1 = time.perf_counter()
        pending.wait()
        if i >= _WARMUPS:
            times.append(time.perf_counter() - t0)
            launches.append(t1 - t0 if cuda else 0.0)
    return statistics.median(times), statistics.median(launches)


def git_commit() -> str | None:
    """The commit measured: PAGEDSERVE_COMMIT (for a copy without .git), else the checkout's HEAD."""
    if os.environ.get("PAGEDSERVE_COMMIT"):
        return os.environ["PAGEDSERVE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(pagedserve.__file__)).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


@contextlib.contextmanager
def paced_server(config, budget, cost: CostModel, *flags: str) -> Iterator[tuple[str, object]]:
    """A real server for ``config`` (a serving one; uvicorn on loopback, in a thread) over a worker whose
    steps each sleep what ``cost`` prices them at: (its URL, the server). ``flags``: more serve flags."""
    from pagedserve.args import Parser, engine_flags
    from pagedserve.bench.launch import free_port
    from pagedserve.server.cli import add_serve_parser, build_server, serving_in_thread
    from pagedserve.sim.executor import SimulatedWorker

    port = free_port()
    parser = Parser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", config.args.model, *engine_flags(config.args), "--port", str(port),
                            "--disable-log-stats", "--uvicorn-log-level", "warning", *flags])
    server = build_server(ns, worker=SimulatedWorker(config, budget, cost, paced=True))
    with serving_in_thread(server):
        yield f"http://127.0.0.1:{port}", server


def bench_server(config, budget, cost: CostModel, levels, log=print, burst: int = 0,
                 flags: tuple[str, ...] = ()) -> list[dict]:
    """The server of ``config`` (a serving one) over a paced worker priced by ``cost``, driven by ``bench
    serve`` (its own process) at each level of requests in flight (two rounds of them through the closed
    loop), then, with ``burst``, one round of that many requests sent at once: the runs' shapes, their mean
    time a step and requests a step, their median TTFT and the p95 less the p5 of their inter-token
    latencies. ``flags``: more serve flags."""
    from pagedserve.bench.launch import bench_serve

    # long outputs and short prompts: requests stay long enough for the client to keep its concurrency
    out_len, in_len = min(512, config.max_model_len // 2), min(64, config.max_model_len // 4)
    runs = []
    with paced_server(config, budget, cost, *flags) as (url, server), tempfile.TemporaryDirectory() as tmp:
        counters = server.config.app.state.engine.core.counters
        asked = [(n, False) for n in levels if n <= config.max_num_seqs] + ([(burst, True)] if burst else [])
        for k, (c, at_once) in enumerate(asked):
            steps, tokens, cpu = counters.num_steps, counters.generation_tokens, time.process_time()
            prompts = c if at_once else max(8, 2 * c)
            run = bench_serve(url, [  # each level its own prompts: none found in the prefix cache
                "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--num-prompts", str(prompts),
                "--max-concurrency", str(c), "--num-warmups", "0", "--seed", str(k)], Path(tmp) / "host.json")
            steps, tokens = counters.num_steps - steps, counters.generation_tokens - tokens
            itl = np.concatenate([np.asarray(x, dtype=float) for x in run["itls"]])
            runs.append({"seqs": tokens / steps, "seconds": run["duration"] / steps, "in_flight": c,
                         "input_len": in_len, "output_len": out_len, "prompts": prompts,
                         "median_ttft": run["median_ttft_ms"] / 1e3,
                         "itl_spread": float(np.percentile(itl, 95) - np.percentile(itl, 5)) if len(itl) else 0.0,
                         "cpu_per_token": (time.process_time() - cpu) / tokens})  # the server's threads
            log(f"server over a worker of {1e3 * cost.fixed:g} ms steps, {c} in flight"
                f"{' sent at once' if at_once else ''}: {tokens / steps:.1f} requests a step, "
                f"{1e3 * run['duration'] / steps:.3f} ms a step, median TTFT {run['median_ttft_ms']:.1f} ms")
    return runs


def _simulated(config, budget, cost: CostModel, run: dict) -> dict:
    """The simulator's result for ``run`` (a ``bench_server`` run: its shapes, distinct prompts)."""
    from pagedserve.bench.datasets import SampleRequest
    from pagedserve.sim.load import simulate_load

    n = run["input_len"]
    samples = [SampleRequest(list(range(i * n, (i + 1) * n)), n, run["output_len"]) for i in range(run["prompts"])]
    return simulate_load(config, budget, cost, samples, max_concurrency=run["in_flight"])


def request_latency(config, budget, cost: CostModel, run: dict) -> float:
    """What a request's way in adds to its TTFT: the median TTFT of ``run`` (``bench_server`` over a worker
    priced by ``cost``, one request at a time), less the simulator's for the same run and cost."""
    return run["median_ttft"] - _simulated(config, budget, cost, run)["median_ttft_ms"] / 1e3


def ingress_spacing(config, budget, cost: CostModel, run: dict) -> float:
    """How far apart requests sent at once reach the engine: the spacing at which the simulator gives
    ``run`` (``bench_server`` over a worker priced by ``cost``, which holds the request latency; its first
    round sent at once) its measured median TTFT. That grows with the spacing: a bisection finds it (to 10 us)."""
    def median_ttft(spacing: float) -> float:
        return _simulated(config, budget, cost.with_ingress_spacing(spacing), run)["median_ttft_ms"] / 1e3

    lo, hi = 0.0, max(run["median_ttft"], 1e-3)
    if median_ttft(lo) >= run["median_ttft"]:
        return 0.0
    while hi - lo > 1e-5:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_ttft(mid) < run["median_ttft"] else (lo, mid)
    return hi


def way_in(serving, budget, cost: CostModel, log=print,
           keep_latency: bool = False) -> tuple[CostModel, list[dict]]:
    """``cost`` (with its host terms) with the way in measured through the server of ``serving`` over
    steps of 2 ms (the server's threads then share the GIL as they do over a GPU): one request at a time
    (its request latency, unless ``keep_latency``), then a burst sent at once (the ingress spacing); the
    delivery jitter from both. Returns it and the two runs."""
    paced = dataclasses.replace(_PACED, host_fixed=cost.host_fixed, host_per_seq=cost.host_per_seq)
    one, burst = bench_server(serving, budget, paced, (1,), log, burst=min(_BURST, serving.max_num_seqs))
    cost = cost.with_delivery([one, burst])
    paced = dataclasses.replace(paced, delivery_jitter=cost.delivery_jitter,
                                delivery_jitter_per_seq=cost.delivery_jitter_per_seq)
    if not keep_latency:
        cost = cost.with_request_latency(request_latency(serving, budget, paced, one))
    paced = dataclasses.replace(paced, request_latency=cost.request_latency)
    return cost.with_ingress_spacing(ingress_spacing(serving, budget, paced, burst)), [one, burst]


def calibrate(args, log=print) -> Calibration:
    """Start the engine's worker for ``args`` (``EngineArgs``), time the grid and fit the cost model."""
    from pagedserve.model.worker import Worker

    config = args.create_config()
    worker = Worker(config)
    try:
        rng = np.random.default_rng(0)
        shapes = step_grid(config, worker.budget.num_blocks)
        samples, sizes, budget = [], graph_sizes(config), worker.budget
        for k, shape in enumerate(shapes):
            inp = synthetic_step(shape, config.block_size, worker.budget.num_blocks, config.model.vocab_size, rng)
            t = len(inp.ids)
            kind, (computed, ctx, work, keys) = priced_step(inp, sizes)
            seconds, launch = time_step(worker, inp)
            samples.append({"tokens": t, "computed": computed, "decode_context": ctx, "prefill_work": work,
                            "prefill_keys": keys, "seqs": len(shape), "kind": kind, "seconds": seconds,
                            "launch": launch})
            log(f"[{k + 1}/{len(shapes)}] {len(shape)} seqs, {t} tokens, {ctx} decode context: {1e3 * seconds:.3f} ms")
        if config.device.type == "cuda":
            gpu = torch.cuda.get_device_name(config.device)
            total = torch.cuda.get_device_properties(config.device).total_memory
        else:
            gpu, total = "cpu", 0
    finally:
        worker.shutdown()
    # the host: steps that cost nothing, so each lasts what the server's own work takes
    serving = args.create_config(serving=True)
    host = bench_server(serving, budget, FREE_STEPS, _HOST_LEVELS, log)
    cost, err = CostModel.fit_steps(samples, host)
    cost, way_in_runs = way_in(serving, budget, cost, log)
    return Calibration(model=args.model, dtype=dtype_name(config.dtype),
                       kv_cache_dtype=dtype_name(config.kv_dtype), gpu=gpu, gpu_memory_bytes=total,
                       engine_args={k: v for k, v in vars(args).items() if v is not None},
                       cost=cost, mape=err, samples=samples, host_samples=host, way_in_samples=way_in_runs,
                       date=datetime.date.today().isoformat(), commit=git_commit(),
                       pagedserve_version=pagedserve.__version__)


def cmd_calibrate(ns: argparse.Namespace) -> None:
    from pagedserve.args import engine_args_from, output_path

    args = engine_args_from(ns)
    if args.tensor_parallel_size != 1:
        raise ConfigError("--tensor-parallel-size: calibrate times one GPU; the simulator models one GPU.")
    out = output_path(ns.output, "--output")
    cal = calibrate(args)
    cal.save(out)
    print(cal.describe())
    print(f"Wrote {ns.output}; use it with `pagedserve bench sweep --model {args.model} --simulate {ns.output}` or "
          f"`pagedserve tune {args.model} --simulate {ns.output}`.")
