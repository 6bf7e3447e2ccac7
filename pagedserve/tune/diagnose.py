"""``pagedserve diagnose``: read a running server's /metrics (ours or vLLM's) over a short window and
name which of three situations applies, with the first parameter to change.

1. start-up failure: the server is not up (weights or the parallel configuration do not fit);
2. KV-cache / context pressure: preemptions, or the KV cache (nearly) full;
3. latency rising with memory not full: requests queue at the sequence cap, wait on the token budget,
   or decode slows with no queue (CPU scheduling / batch too large for the ITL target).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.bench.knee import HOST_BOUND
from pagedserve.bench.metrics import KV_FULL, info_labels, scrape
from pagedserve.errors import option

RISING = 1.5            # second-half mean latency over first-half mean that counts as "rising"

_NAMES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:time_per_output_token_seconds_sum": "itl_sum",
    "vllm:time_per_output_token_seconds_count": "itl_count",
    "vllm:request_queue_time_seconds_sum": "queue_sum",
    "vllm:request_queue_time_seconds_count": "queue_count",
    "vllm:request_prefill_time_seconds_sum": "prefill_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_count",
    "vllm:iteration_tokens_total_sum": "step_tokens_sum",
    "vllm:iteration_tokens_total_count": "step_tokens_count",
    "pagedserve:device_wait_seconds_total": "device_wait",
    "pagedserve:max_num_seqs": "max_num_seqs",
    "pagedserve:max_num_batched_tokens": "max_num_batched_tokens",
}


def parse_sample(text: str, t: float) -> dict[str, float]:
    """The metrics diagnose reads from one scrape, summed over label sets, with its time; ``kv_fp8`` 1 where the
    server's KV cache is fp8 already (its cache config, as vLLM reports it)."""
    fp8 = info_labels(text, "vllm:cache_config_info").get("cache_dtype", "").startswith("fp8")
    return {"t": t, **scrape(text, _NAMES)[0], "kv_fp8": float(fp8)}


@dataclass
class Diagnosis:
    situation: int | None          # 1, 2, 3 as in the module docstring; None: healthy
    title: str
    first_change: str
    evidence: list[str] = field(default_factory=list)

    def text(self) -> str:
        head = f"Situation {self.situation}: {self.title}" if self.situation else self.title
        return "\n".join([head, *[f"  - {e}" for e in self.evidence], f"First change: {self.first_change}"])


def _mean(samples, key_sum, key_count) -> float | None:
    if len(samples) < 2 or key_count not in samples[-1] or key_count not in samples[0]:
        return None
    n = samples[-1][key_count] - samples[0][key_count]
    return (samples[-1][key_sum] - samples[0][key_sum]) / n if n > 0 else None


def diagnose(samples: list[dict[str, float]], max_num_seqs: int | None = None, url: str = "URL",
             unreachable: str | None = None, max_num_batched_tokens: int | None = None) -> Diagnosis:
    """Classify a window of scrapes (oldest first). An empty list means the server could not be read
    (``unreachable``: why the last scrape failed). The server's limits place its peaks: as given, else as a
    pagedserve server reports them in force (its profile's, when it switches)."""
    if not samples:
        return Diagnosis(1, "start-up failure: the server does not answer /metrics",
                         f"check that the server runs and listens at {url}; if it exited, read its start-up log: it "
                         f"names the memory that did not fit; run `pagedserve plan MODEL --gpu ...` with the same "
                         f"flags to see the budget before starting",
                         [f"no metrics could be scraped from {url}/metrics"
                          + (f" (last try: {unreachable})" if unreachable else "")])
    first, last = samples[0], samples[-1]
    reported = {k: int(last[k]) for k in ("max_num_seqs", "max_num_batched_tokens") if k in last}
    if max_num_seqs is None:
        max_num_seqs = reported.get("max_num_seqs")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = reported.get("max_num_batched_tokens")
    preempted = last.get("preemptions", 0.0) - first.get("preemptions", 0.0)
    kv_peak = max(s.get("kv_usage", 0.0) for s in samples)
    waiting_peak = max(s.get("waiting", 0.0) for s in samples)
    running_peak = max(s.get("running", 0.0) for s in samples)
    half = len(samples) // 2
    early, late = samples[: half + 1], samples[half:]
    ttft_early, ttft_late = _mean(early, "ttft_sum", "ttft_count"), _mean(late, "ttft_sum", "ttft_count")
    itl_early, itl_late = _mean(early, "itl_sum", "itl_count"), _mean(late, "itl_sum", "itl_count")
    queue = _mean(samples, "queue_sum", "queue_count")
    evidence = [f"window {last['t'] - first['t']:.1f} s, {len(samples)} scrapes",
                f"preemptions in the window: {preempted:.0f}; peak KV-cache usage {100 * kv_peak:.1f} %",
                f"peak running {running_peak:.0f}, peak waiting {waiting_peak:.0f}"]
    if reported:
        evidence.append("limits in force at the last scrape (the server's /metrics): "
                        + ", ".join(f"{option(k)} {v}" for k, v in reported.items()))
    for name, a, b in (("TTFT", ttft_early, ttft_late), ("ITL", itl_early, itl_late)):
        if a is not None and b is not None:
            evidence.append(f"mean {name} {1000 * a:.1f} ms -> {1000 * b:.1f} ms (first half -> second half)")
    if queue is not None:
        evidence.append(f"mean queue time {1000 * queue:.1f} ms")
    prefill = _mean(samples, "prefill_sum", "prefill_count")
    if prefill is not None:
        evidence.append(f"mean prefill time {1000 * prefill:.1f} ms (first scheduled to first token)")
    step_tokens = _mean(samples, "step_tokens_sum", "step_tokens_count")
    if step_tokens is not None:
        budget = (f" ({100 * step_tokens / max_num_batched_tokens:.0f} % of --max-num-batched-tokens "
                  f"{max_num_batched_tokens})" if max_num_batched_tokens else "")
        evidence.append(f"mean tokens a step {step_tokens:.0f}{budget}")
    gpu_wait = None
    if "device_wait" in first and "device_wait" in last and last["t"] > first["t"]:
        gpu_wait = (last["device_wait"] - first["device_wait"]) / (last["t"] - first["t"])
        evidence.append(f"the engine waited on the GPU {100 * gpu_wait:.0f} % of the window (little: the GPU idles "
                        f"between steps and the host bounds them)")

    if preempted > 0 or kv_peak >= KV_FULL:
        fp8 = "" if last.get("kv_fp8") else "--kv-cache-dtype fp8 doubles the cache after a quality check. "
        return Diagnosis(2, "KV-cache / context pressure (the kind that ends in OOM or preemption storms)",
                         "lower --max-num-seqs (or --max-model-len, or cap input tokens at the entrance); "
                         f"{fp8}Do not just raise --gpu-memory-utilization: it takes the headroom CUDA workspaces "
                         "need.", evidence)
    rising = any(a is not None and b is not None and b > RISING * a and b > 0.05
                 for a, b in ((ttft_early, ttft_late), (itl_early, itl_late)))
    if waiting_peak > 0 or rising:
        at_cap = max_num_seqs is not None and running_peak >= max_num_seqs
        if waiting_peak > 0 and (at_cap or max_num_seqs is None):
            change = ("raise --max-num-seqs (memory is not full), or shed load at the entrance "
                      "(--max-num-queued-reqs) if ITL must stay low")
            why = "requests queue at the sequence cap while memory is free"
        elif waiting_peak > 0:
            change = ("raise --max-num-batched-tokens, or --max-mixed-prefill-tokens (0: no bound) if prompts wait "
                      "beside decoding requests: requests wait for the step's token budget, not for memory")
            why = "requests wait below the sequence cap: the token budget is the bound"
        elif gpu_wait is not None and gpu_wait < HOST_BOUND:
            change = ("less host work a token: --stream-interval 4 (a streamed frame every 4 tokens, a quarter of "
                      "the writes), or fewer streams per server process (lower --max-num-seqs, run more server "
                      "processes); the GPU waits on the host's scheduling and streaming, so token-budget flags will "
                      "not help")
            why = "latency rises with no queue while the GPU idles between steps: the host (CPU scheduling) bounds it"
        else:
            change = ("lower --max-mixed-prefill-tokens (prompt tokens a step takes beside decodes) or "
                      "--max-num-batched-tokens to protect decode ITL from long prefills, then check the host: a "
                      "slow scheduler step shows as ITL rising with no queue")
            why = "latency rises with no queue and memory free: batch token budget or CPU scheduling"
        return Diagnosis(3, f"latency rising with memory not full ({why})", change, evidence)
    return Diagnosis(None, "Healthy: no preemptions, KV cache below 90 %, no queue, latency flat",
                     f"nothing now; to find how much more load it takes, run the concurrency ladder against it: "
                     f"`pagedserve bench sweep --base-url {url} --concurrency 1,2,4,8,16,32,64 "
                     f"--random-input-len <your typical prompt> --random-output-len <your typical output>`; or, "
                     f"on a pagedserve server started with --record-lengths traffic.jsonl, replay today's traffic "
                     f"faster: `pagedserve bench sweep --base-url {url} --dataset-name lengths --dataset-path "
                     f"traffic.jsonl --replay-speeds 1,2,4,8` (the knee in multiples of today's load)",
                     evidence)


def scrape_window(url: str, seconds: float, interval: float = 1.0) -> tuple[list[dict[str, float]], str | None]:
    """The scrapes of ``url``'s /metrics over ``seconds``, and why the last failed one failed (None: none did)."""
    import httpx

    samples, failed = [], None
    end = time.monotonic() + seconds
    while True:
        try:
            r = httpx.get(url.rstrip("/") + "/metrics", timeout=5)
            if r.status_code == 200:
                samples.append(parse_sample(r.text, time.monotonic()))
            else:
                failed = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            failed = f"{type(e).__name__}: {e}"
        if time.monotonic() >= end:
            return samples, failed
        time.sleep(interval)
