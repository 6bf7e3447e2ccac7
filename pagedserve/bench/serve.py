"""``pagedserve bench serve``: an online load test that talks only HTTP to any OpenAI-compatible server.

Requests arrive by a gamma process (``--burstiness`` 1 = Poisson) at ``--request-rate``, optionally
capped by ``--max-concurrency`` in-flight requests. When the server exposes Prometheus ``/metrics``
(ours or vLLM's) it is scraped during the run for preemptions, KV-cache usage, device memory and queue
depth, which a client alone cannot see.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pagedserve.bench.datasets import SampleRequest
from pagedserve.bench.metrics import RequestResult, calculate_metrics, scrape_values

TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class BenchConfig:
    base_url: str
    endpoint: str
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    num_warmups: int = 1
    api_key: str | None = None
    scrape_interval: float = 0.5
    show_progress: bool = True


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send offsets in seconds. Gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); the cumulative
    offsets are rescaled so the last lands exactly at n/rate, as vLLM does (less seed noise)."""
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive.")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    return offsets * (n / rate) / offsets[-1]


async def send_request(session: aiohttp.ClientSession, cfg: BenchConfig, sample: SampleRequest,
                       t0: float) -> RequestResult:
    """Stream one request and time every chunk (vLLM's completions/chat request functions)."""
    chat = cfg.endpoint.endswith("/chat/completions")
    body = {"model": cfg.model, "max_tokens": sample.expected_output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if chat:
        text = sample.prompt if isinstance(sample.prompt, str) else " ".join(map(str, sample.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = sample.prompt
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res = RequestResult(prompt_len=sample.prompt_len)
    st = time.perf_counter()
    res.start_time = st - t0
    last = st
    pieces = []
    usage_tokens = None
    try:
        async with session.post(cfg.base_url + cfg.endpoint, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", str(chunk["error"]))
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    if usage_tokens is not None and sample.prompt_len == 0:
                        res.prompt_len = chunk["usage"].get("prompt_tokens", 0)
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if not res.ttft:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                last = now
                c = chunk["choices"][0]
                pieces.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
        if not res.ttft:
            res.error = "Never received a valid chunk to calculate TTFT."
            return res
        res.latency = last - st
        res.generated_text = "".join(pieces)
        res.output_tokens = usage_tokens if usage_tokens is not None else len(res.itl) + 1
        res.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


SCRAPED = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "pagedserve:device_memory_used_bytes": "device_memory_bytes",
    "pagedserve:device_memory_peak_bytes": "device_memory_peak_bytes",
}


class MetricsScraper:
    """Polls /metrics during the run; reports deltas of counters and peaks of gauges."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float):
        self.session, self.url, self.interval = session, url, interval
        self.samples: list[dict[str, float]] = []
        self.available = True

    async def scrape(self) -> None:
        try:
            async with self.session.get(self.url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    self.available = False
                    return
                self.samples.append(scrape_values(await resp.text(), SCRAPED))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            self.available = False

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.available:
            await self.scrape()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def summary(self) -> dict:
        if not self.samples:
            return {}
        def peak(key):
            vals = [s[key] for s in self.samples if key in s]
            return max(vals) if vals else None
        first, last = self.samples[0], self.samples[-1]
        out = {
            "server_preemptions": (last.get("preemptions", 0) - first.get("preemptions", 0))
            if "preemptions" in last else None,
            "server_peak_kv_cache_usage": peak("kv_cache_usage"),
            "server_peak_num_requests_running": peak("num_requests_running"),
            "server_peak_num_requests_waiting": peak("num_requests_waiting"),
            "server_peak_device_memory_bytes": peak("device_memory_peak_bytes") or peak("device_memory_bytes"),
        }
        return {k: v for k, v in out.items() if v is not None}


async def run_benchmark(cfg: BenchConfig, samples: list[SampleRequest], percentiles: list[float],
                        percentile_metrics: list[str], goodput: dict[str, float]) -> dict:
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        for _ in range(cfg.num_warmups):
            warm = await send_request(session, cfg, SampleRequest(samples[0].prompt, samples[0].prompt_len,
                                                                  min(16, samples[0].expected_output_len)), 0.0)
            if not warm.success:
                raise RuntimeError(f"Warm-up request failed: {warm.error}. Is the server up at {cfg.base_url} "
                                   f"and serving model {cfg.model!r}?")
        scraper = MetricsScraper(session, cfg.base_url + "/metrics", cfg.scrape_interval)
        await scraper.scrape()
        stop = asyncio.Event()
        scrape_task = asyncio.create_task(scraper.run(stop))
        delays = arrival_delays(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(samples), desc="Requests", disable=not cfg.show_progress, dynamic_ncols=True)
        t0 = time.perf_counter()

        async def one(sample: SampleRequest, delay: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
            if sem is None:
                r = await send_request(session, cfg, sample, t0)
            else:
                async with sem:
                    r = await send_request(session, cfg, sample, t0)
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(s, d) for s, d in zip(samples, delays)))
        duration = time.perf_counter() - t0
        bar.close()
        stop.set()
        await scrape_task
        await scraper.scrape()
    out = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint.endswith("chat/completions") else "openai",
        "endpoint_type": "openai-chat" if cfg.endpoint.endswith("chat/completions") else "openai",
        "model_id": cfg.model,
        "num_prompts": len(samples),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        **calculate_metrics(results, duration, percentiles, percentile_metrics, goodput),
        **scraper.summary(),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    return out


def format_table(result: dict, percentile_metrics: list[str], percentiles: list[float]) -> str:
    from pagedserve.bench.metrics import _pct_name

    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda k, v: lines.append(f"{k:<44}{v:>16}")  # noqa: E731
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", f"{result['duration']:.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", f"{result['request_throughput']:.2f}")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", f"{result['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}")
    row("Peak output token throughput (tok/s):", f"{result['max_output_tokens_per_s']:.2f}")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in percentile_metrics:
        lines.append("{s:{c}^60}".format(s=f" {names[key]} ", c="-"))
        row(f"Mean {key.upper()} (ms):", f"{result[f'mean_{key}_ms']:.2f}")
        row(f"Median {key.upper()} (ms):", f"{result[f'median_{key}_ms']:.2f}")
        for p in percentiles:
            row(f"P{_pct_name(p)} {key.upper()} (ms):", f"{result[f'p{_pct_name(p)}_{key}_ms']:.2f}")
    if any(k.startswith("server_") for k in result):
        lines.append("{s:{c}^60}".format(s=" Server (scraped from /metrics) ", c="-"))
        if "server_preemptions" in result:
            row("Preemptions during the run:", int(result["server_preemptions"]))
        if "server_peak_kv_cache_usage" in result:
            row("Peak KV-cache usage (%):", f"{100 * result['server_peak_kv_cache_usage']:.1f}")
        if "server_peak_num_requests_running" in result:
            row("Peak running requests:", int(result["server_peak_num_requests_running"]))
        if "server_peak_num_requests_waiting" in result:
            row("Peak waiting requests:", int(result["server_peak_num_requests_waiting"]))
        if "server_peak_device_memory_bytes" in result:
            row("Peak device memory (GiB):", f"{result['server_peak_device_memory_bytes'] / 2**30:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
