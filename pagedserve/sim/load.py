"""``bench serve``'s load, simulated: the same arrivals (a rate, a burstiness, a cap on requests in flight)
fed to the real engine core over a ``SimulatedWorker``, timed on a virtual clock, and measured with the
same metrics (``bench.metrics``), so a simulated rung reads like a measured one.

The clock follows the engine's pipeline: a step launches at the host's time and starts when the device is
free (the step before ends); ``core.step`` returns the tokens of the step launched before, at its end.
A step lasts the longer of the device's time and the server's host work, which the engine's one step in
flight overlaps; a request reaches the engine the calibration's request latency after the client sends it,
and not sooner than its ingress spacing after the request before (a closed loop's requests that end in one
step are sent at once, and reach the engine one by one: the first may start alone). Each token reaches the
client a delay after its step ends, drawn (seeded) from the calibration's delivery jitter; the engine's
clock does not wait for it.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from pagedserve.bench.datasets import SampleRequest
from pagedserve.bench.metrics import METRIC_KEYS, RequestResult, calculate_metrics
from pagedserve.bench.serve import arrival_delays
from pagedserve.bench.sweep import PERCENTILES
from pagedserve.engine.core import EngineCore
from pagedserve.engine.request import Request
from pagedserve.memory import MemoryBudget
from pagedserve.sampling_params import SamplingParams
from pagedserve.sim.cost import CostModel
from pagedserve.sim.executor import SimulatedWorker


def simulate_load(config, budget: MemoryBudget, cost: CostModel, samples: list[SampleRequest], *,
                  max_concurrency: int | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                  seed: int = 0, goodput: dict[str, float] | None = None,
                  arrivals: list[float] | None = None) -> dict:
    """One run of ``samples`` (token-id prompts) on a fresh engine core, sent at ``arrivals`` (seconds; a
    replayed recording) or by the rate and burstiness; returns what ``run_benchmark`` returns, less the
    per-request arrays, with the engine's own peaks and preemptions."""
    worker = SimulatedWorker(config, budget, cost)
    core = EngineCore(config, worker=worker, log_budget=False)
    n = len(samples)
    arrivals = arrival_delays(n, request_rate, burstiness, seed) if arrivals is None else arrivals
    results = [RequestResult(prompt_len=s.prompt_len) for s in samples]
    stamps: list[list[float]] = [[] for _ in samples]
    waiting: deque[int] = deque()     # arrived, waiting for a slot under the cap
    entering: deque[tuple[float, int]] = deque()  # sent, on their way to the engine: (when it takes them in, i)
    in_flight: dict[str, int] = {}
    now, next_arrival, done = 0.0, 0, 0
    entered = -math.inf  # when the request sent last reaches the engine
    delays = np.random.default_rng(seed)
    step_end: float | None = None     # when the step in flight ends
    while done < n:
        while next_arrival < n and arrivals[next_arrival] <= now:
            waiting.append(next_arrival)
            next_arrival += 1
        while waiting and (max_concurrency is None or len(in_flight) < max_concurrency):
            i = waiting.popleft()
            results[i].start_time = now
            in_flight[str(i)] = i
            entered = max(now + cost.request_latency, entered + cost.ingress_spacing)
            entering.append((entered, i))
        while entering and entering[0][0] <= now:
            t, i = entering.popleft()
            s = samples[i]
            params = SamplingParams(temperature=0.0, max_tokens=s.expected_output_len, ignore_eos=True)
            core.add_request(Request(str(i), list(s.prompt), params, (), s.expected_output_len, arrival_time=t))
        if not core.has_unfinished:  # idle until the next arrival, or the next request reaching the engine
            upcoming = [entering[0][0]] if entering else []
            if next_arrival < n:
                upcoming.append(float(arrivals[next_arrival]))
            now = min(upcoming)
            continue
        launched_at = now
        outputs = core.step()
        if step_end is not None:  # these are the tokens of the step that just ended
            now = max(now, step_end)
        finished_at, step_end = now, None
        if worker.launched:
            step_end = max(launched_at, finished_at) + worker.launched.pop()
        delivery = cost.delivery_seconds(len(outputs))
        for out in outputs:
            i = in_flight.get(out.request_id)
            if i is None:
                continue
            if out.token_id is not None:  # a stream's tokens arrive in order
                seen = finished_at + (delays.exponential(delivery) if delivery > 0 else 0.0)
                stamps[i].append(max(seen, stamps[i][-1]) if stamps[i] else seen)
            if out.finish_reason is not None:
                del in_flight[out.request_id]
                done += 1
    if core.pool.num_free_blocks != budget.num_blocks:  # every finished request gives its blocks back
        raise RuntimeError(f"{budget.num_blocks - core.pool.num_free_blocks} KV blocks still held after every "
                           f"request finished")
    for r, ts in zip(results, stamps):
        r.success, r.output_tokens = True, len(ts)
        r.ttft, r.latency = ts[0] - r.start_time, ts[-1] - r.start_time
        r.itl = [b - a for a, b in zip(ts, ts[1:])]
    peaks = core.peaks
    return {
        "num_prompts": n,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        **calculate_metrics(results, now, PERCENTILES, list(METRIC_KEYS), goodput or {}),
        "server_preemptions": core.counters.num_preemptions,
        "server_device_wait_share": worker.device_wait / now if now > 0 else None,
        "server_peak_kv_cache_usage": peaks.kv_cache_usage,
        "server_peak_num_requests_running": peaks.num_running,
        "server_peak_num_requests_waiting": peaks.num_waiting,
        "server_peak_device_memory_bytes": worker.device_memory()[1],
        "server_peak_nvml_device_memory_bytes": None,
        "server_peaks_exact": True,
        "server_metrics_scrapes": 0,
        "server_metrics_scrape_failures": 0,
        "error_counts": {},
        "max_input_len": max(s.prompt_len for s in samples),
        "simulated_steps": core.counters.num_steps,
    }
