"""Prometheus metrics under vLLM's names (so existing dashboards and `pagedserve diagnose` read them).

Gauges and counters are read from the engine at scrape time (a collector), histograms are observed by
the frontend as outputs arrive. Each server has its own registry.
"""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pagedserve.engine.core import STEP_INTERVAL_BUCKETS, STEP_TOKEN_BUCKETS
from pagedserve.engine.request import Request
from pagedserve.errors import ConfigError
from pagedserve.outputs import RequestOutput

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: the token-count buckets (vLLM's)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class NvmlMemory:
    """The device's used memory as NVML (and ``nvidia-smi``) report it: every process and the CUDA
    context, not only torch's allocations. None where NVML or the driver is missing."""

    def __init__(self, device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except pynvml.NVMLError:  # an older torch or driver: fall back to the ordinal
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._info = pynvml.nvmlDeviceGetMemoryInfo
        except Exception:  # noqa: BLE001 - no NVML here: the gauge is simply absent
            self.handle = None

    def used(self) -> int | None:
        if self.handle is None:
            return None
        try:
            return int(self._info(self.handle).used)
        except Exception:  # noqa: BLE001
            return None


class _EngineCollector:
    """Reads the engine's state when /metrics is scraped."""

    def __init__(self, engine, model_name: str, server_state):
        self.engine = engine
        self.labels = {"model_name": model_name, "engine": "0"}
        self.server_state = server_state
        self.nvml = NvmlMemory(engine.config.device)

    def _histogram(self, name: str, doc: str, bounds, counts: list[int], total: float) -> HistogramMetricFamily:
        """A histogram from per-bucket counts (the last one past every bound)."""
        family = HistogramMetricFamily(name, doc, labels=list(self.labels))
        cumulative, buckets = 0, []
        for le, n in zip([*map(float, bounds), "+Inf"], counts):
            cumulative += n
            buckets.append((str(le), cumulative))
        family.add_metric(list(self.labels.values()), buckets, total)
        return family

    def _family(self, cls, name, doc, value):
        fam = cls(name, doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), value)
        return fam

    def collect(self):
        core = self.engine.core
        stats, counters = core.last_stats, core.counters
        in_use, peak = core.worker.device_memory()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield self._family(g, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._family(g, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", stats.kv_cache_usage)
        sched = core.scheduler
        yield self._family(g, "pagedserve:max_num_seqs", "Requests one step may hold, as in force now "
                           "(--max-num-seqs, or the active degradation profile's).", sched.max_num_seqs)
        yield self._family(g, "pagedserve:max_num_batched_tokens", "Tokens one step may process, as in force now "
                           "(--max-num-batched-tokens, or the active degradation profile's).",
                           sched.max_num_batched_tokens)
        yield self._family(c, "vllm:num_preemptions", "Cumulative preemptions.", counters.num_preemptions)
        yield self._family(c, "vllm:prompt_tokens", "Prefill tokens processed.", counters.prompt_tokens)
        yield self._family(c, "vllm:generation_tokens", "Tokens generated.", counters.generation_tokens)
        yield self._family(c, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           counters.prefix_cache_queries)
        yield self._family(c, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           counters.prefix_cache_hits)
        yield self._family(g, "pagedserve:device_memory_used_bytes",
                           "Device memory this engine holds now (process RSS on CPU).", in_use)
        yield self._family(g, "pagedserve:device_memory_peak_bytes",
                           "Peak device memory this engine has held since the last peak reset (process peak "
                           "RSS on CPU).", peak)
        peaks = core.peaks
        yield self._family(g, "pagedserve:num_requests_running_peak",
                           "Most requests running in one step since the last peak reset.", peaks.num_running)
        yield self._family(g, "pagedserve:num_requests_waiting_peak",
                           "Most requests waiting after a step was scheduled, since the last peak reset.",
                           peaks.num_waiting)
        yield self._family(g, "pagedserve:kv_cache_usage_peak_perc",
                           "Highest KV-cache usage since the last peak reset; 1 means 100 percent.",
                           peaks.kv_cache_usage)
        yield self._family(g, "pagedserve:peaks_reset_timestamp_seconds",
                           "Unix time of the last peak reset (start-up or POST /admin/reset_peaks).", peaks.since)
        nvml_used = self.nvml.used()
        if nvml_used is not None:
            yield self._family(g, "pagedserve:nvml_device_memory_used_bytes",
                               "Used memory of the whole device as NVML reports it (what nvidia-smi shows).",
                               nvml_used)
        if core.config.device.type == "cuda":  # on a CPU the host is the device: nothing to tell apart
            yield self._family(c, "pagedserve:device_wait_seconds",
                               "Time the engine waited for the GPU's results; a small share of the wall time "
                               "means the host (scheduling, streaming) bounds the steps, not the GPU.",
                               counters.device_wait_seconds)
        yield self._family(g, "pagedserve:num_requests_in_flight",
                           "Requests accepted by the API and not finished.", self.engine.num_in_flight)
        rejected = CounterMetricFamily("pagedserve:rejected_requests",
                                       "Requests refused with 503 at the entrance, by the limit they met.",
                                       labels=[*self.labels, "limit"])
        for limit, n in self.server_state.rejected.items():
            rejected.add_metric([*self.labels.values(), limit], n)
        yield rejected
        deg = self.server_state.degradation
        if deg is not None:
            active = GaugeMetricFamily("pagedserve:profile_active", "1 for the degradation profile in force.",
                                       labels=[*self.labels, "profile"])
            switches = CounterMetricFamily("pagedserve:profile_switches",
                                           "Switches between degradation profiles, by the profile switched to.",
                                           labels=[*self.labels, "profile"])
            for name in deg.spec.profiles:
                active.add_metric([*self.labels.values(), name], float(name == deg.controller.active))
                switches.add_metric([*self.labels.values(), name], deg.switches.get(name, 0))
            yield active
            yield switches
            if deg.window.long_prompt_tokens is not None:
                yield self._family(c, "pagedserve:long_prompts",
                                   f"Prompts over {deg.window.long_prompt_tokens} tokens that arrived (admitted or not).",
                                   deg.window.long_prompts_total)
        yield self._histogram("vllm:iteration_tokens_total", "Tokens per engine step.", STEP_TOKEN_BUCKETS,
                              counters.step_tokens, counters.step_tokens_sum)
        yield self._histogram("pagedserve:step_interval_seconds",
                              "Time between consecutive engine steps' results while it is busy: what a running "
                              "stream waits between tokens, before the server's own work.",
                              STEP_INTERVAL_BUCKETS, counters.step_intervals, counters.step_intervals_sum)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                      labels=[*self.labels, "finished_reason"])
        for reason, n in self.server_state.finished.items():
            success.add_metric([*self.labels.values(), reason], n)
        yield success
        budget = core.worker.budget
        # label values as vLLM's cache config holds them: cache_dtype as given ("auto", "fp8", ...)
        args = core.config.args
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "gpu_memory_utilization",
                                         "enable_prefix_caching"])
        info.add_metric([str(budget.block_size), str(budget.num_blocks), args.kv_cache_dtype,
                         str(args.gpu_memory_utilization), str(args.enable_prefix_caching)], 1)
        yield info


class LengthRecorder:
    """``--record-lengths FILE``: a JSON line for each request that ran to its end (arrival time, prompt
    tokens and how many of them the prefix cache gave, output tokens, why it ended): the shape of the
    traffic without its text, which `bench --dataset-name lengths` replays."""

    def __init__(self, path: str):
        try:
            self.file = open(path, "a", buffering=1)  # line-buffered: a killed server loses no whole line
        except OSError as e:
            raise ConfigError(f"--record-lengths {path}: cannot append to it ({e.strerror}).") from None

    def record(self, res: RequestOutput, output_tokens: int) -> None:
        arrival = time.time() - (time.monotonic() - res.metrics.arrival_time)
        self.file.write(json.dumps({"arrival": round(arrival, 4), "prompt_tokens": len(res.prompt_token_ids),
                                    "cached_tokens": res.num_cached_tokens, "output_tokens": output_tokens,
                                    "finish_reason": res.outputs[0].finish_reason}) + "\n")

    def close(self) -> None:
        self.file.close()


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}   # by the ingress limit that refused them
        self.degradation = None               # the profile switcher, when the server has profiles
        self.window = None                    # its signal window: fed TTFTs and ITLs as they happen
        self.recorder: LengthRecorder | None = None  # --record-lengths
        self.registry.register(_EngineCollector(engine, model_name, self))

        def hist(name, doc, buckets):  # labelled as the collector's families are
            return Histogram(name, doc, ["model_name", "engine"], buckets=buckets,
                             registry=self.registry).labels(model_name, "0")

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduling to the first token.",
                            LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Time from the first token to the last.",
                           LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "Time from first scheduling to the last token.",
                              LATENCY_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "A request's mean time between output tokens (decode time / (output tokens - 1)).",
                         ITL_BUCKETS)
        tokens = one_two_five(engine.config.max_model_len)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens of a finished request.", tokens)
        self.generation_tokens = hist("vllm:request_generation_tokens", "Output tokens of a finished request.", tokens)
        self.max_tokens = hist("vllm:request_params_max_tokens", "A request's max_tokens (resolved).", tokens)
        self.n = hist("vllm:request_params_n", "A prompt's n (parallel samples).", N_BUCKETS)
        self._last_token: dict[str, tuple[float, int]] = {}  # request -> time of its last token, tokens so far

    def admitted(self, requests: list[Request], n: int) -> None:
        """The requests of one API call, as they enter the engine (one prompt's ``n`` samples each)."""
        for req in requests:
            self.max_tokens.observe(req.max_tokens)
        for _ in range(len(requests) // n):
            self.n.observe(n)

    def observe(self, results: list[RequestOutput]) -> None:
        """Called on the loop with each step's outputs."""
        for res in results:  # DELTA outputs: each with tokens carries this step's new one
            m = res.metrics
            new = len(res.outputs[0].token_ids)
            prev, count = self._last_token.get(res.request_id, (None, 0))
            if new and prev is None:
                ttft = m.first_token_time - m.arrival_time
                self.ttft.observe(ttft)
                if self.window is not None:
                    self.window.ttft(m.first_token_time, ttft)
                if m.first_scheduled_time is not None:
                    self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            elif new:
                itl = m.last_token_time - prev
                self.itl.observe(itl)
                if self.window is not None:
                    self.window.itl(m.last_token_time, itl)
            count += new
            if new:
                self._last_token[res.request_id] = (m.last_token_time, count)
            if res.finished:
                self._last_token.pop(res.request_id, None)
                reason = res.outputs[0].finish_reason or "abort"
                self.finished[reason] = self.finished.get(reason, 0) + 1
                if m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)
                self._finished(res, count)

    def _finished(self, res: RequestOutput, count: int) -> None:
        """The per-request histograms of a request that ran to its end."""
        m = res.metrics
        self.prompt_tokens.observe(len(res.prompt_token_ids))
        self.generation_tokens.observe(count)
        if self.recorder is not None:
            self.recorder.record(res, count)
        if m.first_token_time is None or m.last_token_time is None or m.first_scheduled_time is None:
            return
        self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        self.decode.observe(m.last_token_time - m.first_token_time)
        self.inference.observe(max(0.0, m.last_token_time - m.first_scheduled_time))
        if count > 1:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (count - 1))

    def aborted(self, request_id: str) -> None:
        """A request whose client went away before it finished."""
        self._last_token.pop(request_id, None)
        self.finished["abort"] = self.finished.get("abort", 0) + 1

    def failed(self, request_id: str) -> None:
        """A request that ended with an error (a failed step, an output that could not be processed)."""
        self._last_token.pop(request_id, None)
        self.finished["error"] = self.finished.get("error", 0) + 1
