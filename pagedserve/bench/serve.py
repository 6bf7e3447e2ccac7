"""``pagedserve bench serve``: an online load test that talks only HTTP to any OpenAI-compatible server.

Requests arrive by a gamma process (``--burstiness`` 1 = Poisson) at ``--request-rate``, optionally
capped by ``--max-concurrency`` in-flight requests. When the server exposes Prometheus ``/metrics``
(ours or vLLM's) it is scraped during the run for preemptions, KV-cache usage, device memory and queue
depth, which a client alone cannot see.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pagedserve.bench.datasets import SampleRequest
from pagedserve.bench.metrics import RequestResult, calculate_metrics, histogram_quantile, scrape
from pagedserve.config import json_object
from pagedserve.errors import BenchmarkError, ConfigError, InvalidRequestError
from pagedserve.sampling_params import SamplingParams

TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class BenchConfig:
    base_url: str
    endpoint: str
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    arrivals: list[float] | None = None  # each request's send offset (a replayed recording), over the rate
    replay_speed: float | None = None
    ignore_eos: bool = False
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})  # and --extra-body: in every request
    seed: int = 0
    num_warmups: int = 1
    api_key: str | None = None
    scrape_interval: float = 0.25
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


def _backend(endpoint: str) -> str:
    """vLLM bench's name for the API of ``endpoint``."""
    return ("openai-responses" if endpoint.endswith("/responses") else
            "openai-chat" if endpoint.endswith("chat/completions") else "openai")


def replayed_rate(offsets: list[float]) -> float | str:
    """The mean rate a replayed recording sent at (its gaps' count over their span)."""
    return (len(offsets) - 1) / offsets[-1] if offsets[-1] > 0 else "inf"


# the Responses events that carry generated tokens (TTFT at the first, ITL between them)
RESPONSES_TOKEN_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta",
                          "response.function_call_arguments.delta", "response.refusal.delta")


# what the benchmark itself sets in a request: --extra-body may not change them
_MEASURED_FIELDS = ("model", "prompt", "messages", "input", "max_tokens", "max_completion_tokens",
                    "max_output_tokens", "stream", "stream_options", "ignore_eos")


def request_sampling(ns: argparse.Namespace) -> dict:
    """The sampling fields and --extra-body that go into every request, checked by the rules the server applies
    (pagedserve's ranges are vLLM's), so a bad value stops the command before any request or server starts."""
    given = {k: v for k in ("temperature", "top_p", "top_k", "min_p") if (v := getattr(ns, k)) is not None}
    try:
        SamplingParams(**given)
    except InvalidRequestError as e:
        raise ConfigError(f"--{e.param.replace('_', '-')}: {e}") from None
    extra = {}
    if ns.extra_body is not None:
        extra = json_object(ns.extra_body, "--extra-body", '{"chat_template_kwargs": {"enable_thinking": false}}')
        taken = sorted(set(extra) & set(_MEASURED_FIELDS))
        if taken:
            raise ConfigError(f"--extra-body: {', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by the "
                              f"benchmark, which streams every request and takes its lengths from the dataset flags; "
                              f"leave {'it' if len(taken) == 1 else 'them'} out.")
    return {**given, **extra}


def request_body(cfg: BenchConfig, sample: SampleRequest) -> dict:
    """One streamed request of ``sample`` to ``cfg.endpoint``, with the run's sampling (greedy unless told), run to
    its output length."""
    text = sample.prompt if isinstance(sample.prompt, str) else " ".join(map(str, sample.prompt))
    if cfg.endpoint.endswith("/responses"):
        return {**cfg.sampling, "model": cfg.model, "input": text, "max_output_tokens": sample.expected_output_len,
                "stream": True, "ignore_eos": cfg.ignore_eos}
    body = {**cfg.sampling, "model": cfg.model, "max_tokens": sample.expected_output_len, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = sample.prompt
    return body


def read_event(endpoint: str, chunk: dict) -> tuple[str | None, dict | None, str | None]:
    """(the text of a token the event carries, or None if it carries none; the usage it reports, as
    {"prompt_tokens", "completion_tokens"}; an error) of one streamed event of ``endpoint``."""
    if endpoint.endswith("/responses"):
        kind = chunk.get("type")
        if kind in ("error", "response.failed"):
            return None, None, chunk.get("message") or str(chunk.get("response", {}).get("error"))
        if kind in ("response.completed", "response.incomplete"):
            u = chunk["response"].get("usage") or {}
            return None, {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens")}, None
        token = chunk.get("delta") if kind in RESPONSES_TOKEN_EVENTS else None
        return (token if kind == "response.output_text.delta" else "" if token is not None else None), None, None
    if "error" in chunk:
        return None, None, chunk["error"].get("message", str(chunk["error"]))
    choices = chunk.get("choices")
    if not choices:
        return None, chunk.get("usage"), None
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
    return text or "", chunk.get("usage"), None


async def send_request(session: aiohttp.ClientSession, cfg: BenchConfig, sample: SampleRequest,
                       t0: float) -> RequestResult:
    """Stream one request and time every chunk that carries a token (vLLM's request functions)."""
    body = request_body(cfg, sample)
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
                token, usage, error = read_event(cfg.endpoint, json.loads(data))
                if error is not None:
                    res.error = error
                    return res
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    if usage_tokens is not None and sample.prompt_len == 0:
                        res.prompt_len = usage.get("prompt_tokens") or 0
                if token is None:
                    continue
                now = time.perf_counter()
                if not res.ttft:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last)
                last = now
                pieces.append(token)
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
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "pagedserve:device_memory_used_bytes": "device_memory_bytes",
    "pagedserve:device_memory_peak_bytes": "device_memory_peak_bytes",
    "pagedserve:num_requests_running_peak": "num_requests_running_peak",
    "pagedserve:num_requests_waiting_peak": "num_requests_waiting_peak",
    "pagedserve:kv_cache_usage_peak_perc": "kv_cache_usage_peak",
    "pagedserve:nvml_device_memory_used_bytes": "nvml_device_memory_bytes",
    "pagedserve:device_wait_seconds_total": "device_wait_seconds",
}

# result key -> (exact peak since the window's reset, instantaneous gauge sampled by the poll)
_PEAKS = {
    "server_peak_kv_cache_usage": ("kv_cache_usage_peak", "kv_cache_usage"),
    "server_peak_num_requests_running": ("num_requests_running_peak", "num_requests_running"),
    "server_peak_num_requests_waiting": ("num_requests_waiting_peak", "num_requests_waiting"),
    "server_peak_device_memory_bytes": ("device_memory_peak_bytes", "device_memory_bytes"),
    "server_peak_nvml_device_memory_bytes": (None, "nvml_device_memory_bytes"),
}
SERVER_KEYS = ("server_preemptions", "server_prefix_cache_hit_rate", "server_device_wait_share",
               "server_step_interval_p50_ms", "server_step_interval_p99_ms", *_PEAKS)
STEP_INTERVALS = "pagedserve:step_interval_seconds"


class MetricsScraper:
    """Reads the server's /metrics during a run, over a connection of its own (never queued behind the
    load's streams). A pagedserve server keeps exact peaks over a window that ``begin`` opens, so it is
    polled only every ``EXACT_PEAKS_INTERVAL`` seconds (for what has no exact peak: NVML's memory): each
    render holds the server's event loop a millisecond or two, which at the frequent poll delayed ~2 % of
    the streamed tokens by that much. For other servers (vLLM) peaks are the highest of the polled gauges,
    so the poll is frequent. A failed scrape is counted and the poll goes on; figures nothing was read for
    are None ("n/a"), never 0."""

    EXACT_PEAKS_INTERVAL = 5.0

    def __init__(self, base_url: str, interval: float, headers: dict[str, str]):
        self.base_url, self.interval, self.headers = base_url, interval, headers
        self.samples: list[dict] = []  # the scraped values, the time, and the step-interval histogram
        self.failures = 0
        self.last_error = ""
        self.exact_peaks = False
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "MetricsScraper":
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2),
                                              timeout=aiohttp.ClientTimeout(total=10), headers=self.headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def begin(self) -> None:
        """Open a peak window on the server (if it has one) and take the first sample."""
        try:
            async with self._session.post(self.base_url + "/admin/reset_peaks") as resp:
                self.exact_peaks = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.exact_peaks = False
        await self.scrape()

    async def scrape(self) -> None:
        try:
            async with self._session.get(self.base_url + "/metrics") as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                text = await resp.text()
                values, intervals = scrape(text, SCRAPED, STEP_INTERVALS)
                self.samples.append({"t": time.perf_counter(), **values, "step_intervals": intervals})
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"

    async def run(self, stop: asyncio.Event) -> None:
        interval = max(self.interval, self.EXACT_PEAKS_INTERVAL) if self.exact_peaks else self.interval
        while not stop.is_set():
            await self.scrape()
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass

    def summary(self) -> dict:
        out: dict = {k: None for k in SERVER_KEYS}
        out.update(server_metrics_scrapes=len(self.samples), server_metrics_scrape_failures=self.failures,
                   server_peaks_exact=False)
        if self.failures:
            out["server_metrics_last_error"] = self.last_error
        if not self.samples:
            return out
        first, last = self.samples[0], self.samples[-1]
        if "preemptions" in first and "preemptions" in last:
            out["server_preemptions"] = last["preemptions"] - first["preemptions"]
        looked_up = last.get("prefix_cache_queries", 0) - first.get("prefix_cache_queries", 0)
        if looked_up > 0 and "prefix_cache_hits" in first:  # the prompt tokens the run found cached
            out["server_prefix_cache_hit_rate"] = (last["prefix_cache_hits"] - first["prefix_cache_hits"]) / looked_up
        if "device_wait_seconds" in first and "device_wait_seconds" in last and last["t"] > first["t"]:
            out["server_device_wait_share"] = ((last["device_wait_seconds"] - first["device_wait_seconds"])
                                               / (last["t"] - first["t"]))
        if "step_intervals" in first and "step_intervals" in last:
            for q in (50, 99):
                seconds = histogram_quantile(first["step_intervals"], last["step_intervals"], q / 100)
                out[f"server_step_interval_p{q}_ms"] = None if seconds is None else 1e3 * seconds
        for key, (exact, sampled) in _PEAKS.items():
            if self.exact_peaks and exact is not None and exact in last:
                out[key] = last[exact]
                out["server_peaks_exact"] = True
            else:
                seen = [s[sampled] for s in self.samples if sampled in s]
                out[key] = max(seen) if seen else None
        return out


async def run_benchmark(cfg: BenchConfig, samples: list[SampleRequest], percentiles: list[float],
                        percentile_metrics: list[str], goodput: dict[str, float]) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session, \
            MetricsScraper(cfg.base_url, cfg.scrape_interval, headers) as scraper:
        # the first prompt's halves swapped: about as long (text re-tokenizes only at the cut), but its first
        # block is none a measured prompt starts with, so none finds it cached
        first, half = samples[0], len(samples[0].prompt) // 2
        warm_prompt = first.prompt[half:] + first.prompt[:half]
        for _ in range(cfg.num_warmups):
            warm = await send_request(session, cfg, SampleRequest(warm_prompt, first.prompt_len,
                                                                  min(16, first.expected_output_len)), 0.0)
            if not warm.success:
                raise BenchmarkError(f"Warm-up request failed: {warm.error}. Is the server up at {cfg.base_url} "
                                     f"and serving model {cfg.model!r}?")
        await scraper.begin()
        stop = asyncio.Event()
        scrape_task = asyncio.create_task(scraper.run(stop))
        delays = cfg.arrivals or arrival_delays(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(samples), desc="Requests", disable=not cfg.show_progress, dynamic_ncols=True,
                   leave=False)
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
        "backend": _backend(cfg.endpoint),
        "endpoint_type": _backend(cfg.endpoint),
        "model_id": cfg.model,
        "num_prompts": len(samples),
        "request_rate": replayed_rate(cfg.arrivals) if cfg.arrivals else
                        "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness if not cfg.arrivals else None,
        "replay_speed": cfg.replay_speed,
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


def served_model(base: str, api_key: str | None) -> str:
    """The first model a server lists (the name to send when the user gave none)."""
    import httpx

    from pagedserve.errors import ConfigError

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.get(f"{base}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"No --model given and {base}/v1/models did not name one ({e}).") from e


def format_table(result: dict, percentile_metrics: list[str], percentiles: list[float]) -> str:
    from pagedserve.bench.metrics import _pct_name

    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda k, v: lines.append(f"{k:<44}{v:>16}")  # noqa: E731
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result["replay_speed"] is not None:
        row("Recorded arrivals replayed at (x):", f"{result['replay_speed']:g}")
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
    lines.append("{s:{c}^60}".format(s=" Server (scraped from /metrics) ", c="-"))
    na = "n/a"
    pre, kv = result["server_preemptions"], result["server_peak_kv_cache_usage"]
    run, wait = result["server_peak_num_requests_running"], result["server_peak_num_requests_waiting"]
    mem, nvml = result["server_peak_device_memory_bytes"], result["server_peak_nvml_device_memory_bytes"]
    row("Preemptions during the run:", na if pre is None else int(pre))
    hits = result["server_prefix_cache_hit_rate"]
    row("Prompt tokens found in the prefix cache (%):", na if hits is None else f"{100 * hits:.1f}")
    row("Peak KV-cache usage (%):", na if kv is None else f"{100 * kv:.1f}")
    row("Peak running requests:", na if run is None else int(run))
    row("Peak waiting requests:", na if wait is None else int(wait))
    row("Peak device memory (GiB):", na if mem is None else f"{mem / 2**30:.2f}")
    if nvml is not None:
        row("Peak device memory, NVML (GiB):", f"{nvml / 2**30:.2f}")
    if result.get("server_device_wait_share") is not None:  # low: the GPU idles, the host bounds the steps
        row("Engine waiting on the GPU (%):", f"{100 * result['server_device_wait_share']:.1f}")
    if result.get("server_step_interval_p99_ms") is not None:  # against the ITLs: steps or streaming
        p50, p99 = result["server_step_interval_p50_ms"], result["server_step_interval_p99_ms"]
        row("Engine step interval p50 / p99 (ms):", f"{p50:.2f} / {p99:.2f}")
    row("Peaks:", "exact (server)" if result["server_peaks_exact"] else "polled" if result["server_metrics_scrapes"] else na)
    if result["server_metrics_scrape_failures"]:
        row("Failed /metrics scrapes:", result["server_metrics_scrape_failures"])
    lines.append("=" * 60)
    return "\n".join(lines)
