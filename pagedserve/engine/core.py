"""The engine core: scheduler + block pool + model runner, stepping on token ids only.

It knows nothing of text: tokenization, detokenization and stop strings live in the frontend
(``pagedserve.engine.processor``), so that in the server they never hold up a step.

Each ``step`` launches the next step before it waits for the one in flight: while the device runs
step N+1, the host takes in step N's tokens, hands them to the frontend (detokenizing, streaming) and
schedules and prepares step N+2. With one step in flight the device never waits for the host unless the
host's work per step is longer than the device's. The price is that a request stopped by a token
(EOS, a stop id or string) has already been given one more step, whose token is dropped.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.block_pool import BlockPool
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedserve.engine.step_builder import StepBuilder
from pagedserve.model.runner import PendingSamples, graph_sizes
from pagedserve.model.worker import Worker

logger = logging.getLogger(__name__)


class DeviceOOMError(MemoryError):
    """The device ran out of memory inside a step; the message says which flag buys headroom."""


@dataclass
class CoreOutput:
    """One request's news from one step: a new token and/or that it finished."""

    request_id: str
    token_id: int | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None     # sampled token first, then the top-N
    logprob_ids: list[int] | None = None
    rank: int | None = None
    # prompt_logprobs: for each prompt token scored this step, (logprobs, logprob ids, rank) as above
    prompt_scores: list[tuple[list[float], list[int], int]] | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None                # the request failed (a step raised): why


@dataclass
class EnginePeaks:
    """The highest load since the last reset, taken right after each step is scheduled (where running,
    waiting and KV usage peak), so that a poll of the metrics cannot miss a peak between two polls."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    since: float = field(default_factory=time.time)  # wall-clock time of the last reset

    def observe(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        if num_running > self.num_running:
            self.num_running = num_running
        if num_waiting > self.num_waiting:
            self.num_waiting = num_waiting
        if kv_cache_usage > self.kv_cache_usage:
            self.kv_cache_usage = kv_cache_usage


# upper bounds of the steps' token counts that vllm:iteration_tokens_total buckets (vLLM's)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_INTERVAL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.012, 0.016, 0.020, 0.030, 0.050, 0.100, 0.250)


@dataclass
class EngineCounters:
    """Cumulative counters for metrics (vllm:*_total)."""

    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # steps by their token count: step_tokens[i] counts those in (bucket i-1, bucket i]; the last, the rest
    step_tokens: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    step_tokens_sum: int = 0
    # time the host waited for a launched step's results: near the wall time when the device bounds the
    # steps, near zero when the host does (the device then idles between steps)
    device_wait_seconds: float = 0.0
    # seconds between consecutive steps' results while the engine is busy: what a running stream waits
    # between tokens before the server's own work (buckets as step_tokens')
    step_intervals: list[int] = field(default_factory=lambda: [0] * (len(STEP_INTERVAL_BUCKETS) + 1))
    step_intervals_sum: float = 0.0

    def count_step(self, num_tokens: int) -> None:
        self.num_steps += 1
        self.step_tokens[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        self.step_tokens_sum += num_tokens

    def count_interval(self, seconds: float) -> None:
        self.step_intervals[bisect.bisect_left(STEP_INTERVAL_BUCKETS, seconds)] += 1
        self.step_intervals_sum += seconds


class EngineCore:
    def __init__(self, config: EngineConfig, worker=None, log_budget: bool = True):
        """``worker``: what executes the steps (default: a ``Worker`` on the configured device); anything with
        its ``config``, ``budget``, ``execute``, ``device_memory``, ``reset_peak_memory`` and ``shutdown`` will do.
        ``log_budget=False``: a caller that builds many cores of one budget logs it once itself."""
        t0 = time.perf_counter()
        self.worker = worker if worker is not None else Worker(config)
        self.config = config = self.worker.config  # --max-model-len auto: as the worker fitted it to the cache
        self.builder = StepBuilder(config.block_size, config.model.vocab_size, config.args.seed)
        budget = self.worker.budget
        self.pool = BlockPool(budget.num_blocks, config.block_size, config.blocks_per_max_len_request,
                              config.args.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill,
                                   config.max_mixed_prefill_tokens, config.args.scheduling_policy,
                                   graph_sizes(config)[1])
        self.counters = EngineCounters()
        self.peaks = EnginePeaks()
        self.last_stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self._in_flight: tuple[SchedulerOutput, PendingSamples | None] | None = None
        self._uncollected: list[SchedulerOutput] = []  # the steps a failing step() leaves without outputs
        self._last_result: float | None = None  # when the last step's results came, while steps follow on
        if log_budget:
            for line in budget.report_lines():
                logger.info(line)
            logger.info("init engine (load model, size KV cache) took %.2f seconds", time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any."""
        self.worker.shutdown()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def set_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the step limits between two steps (``None`` keeps one); checked against the start-up budget."""
        sched = self.scheduler
        seqs = sched.max_num_seqs if max_num_seqs is None else max_num_seqs
        tokens = sched.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        self.config.check_runtime_limits(seqs, tokens)
        sched.set_limits(seqs, tokens)

    def reset_peaks(self) -> EnginePeaks:
        """Start a new peak window (running, waiting, KV usage, device memory); returns the one that ended."""
        ended = self.peaks
        sched = self.scheduler
        self.peaks = EnginePeaks()
        self.peaks.observe(len(sched.running), len(sched.waiting), self.pool.usage)
        self.worker.reset_peak_memory()
        return ended

    def abort(self, request_ids) -> list[CoreOutput]:
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [CoreOutput(r.request_id, None, "abort", num_preemptions=r.num_preemptions) for r in finished]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def fail_step(self, error: BaseException) -> list[CoreOutput]:
        """After ``step`` raised: finish the requests of the steps it was launching and collecting, with the
        error, so that they free their blocks and nothing waits on their tokens; the others go on."""
        ids = {it.request.request_id for sched in self._uncollected for it in sched.scheduled}
        self._in_flight, self._uncollected, self._last_result = None, [], None
        self.builder.forget()
        finished = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        why = f"{type(error).__name__}: {error}"
        return [CoreOutput(r.request_id, None, "abort", num_preemptions=r.num_preemptions, error=why)
                for r in finished]

    def step(self) -> list[CoreOutput]:
        """Launch the next step, then return what the step launched before it produced."""
        sched = self.scheduler.schedule()
        self._uncollected = [sched] + ([self._in_flight[0]] if self._in_flight is not None else [])
        self.peaks.observe(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage)
        self.counters.prefix_cache_queries += sched.prefix_cache_queries
        self.counters.prefix_cache_hits += sched.prefix_cache_hits
        launched = None
        if not sched.is_empty:
            launched = (sched, self._launch(sched))
            self.counters.num_preemptions += len(sched.preempted)
            self.counters.count_step(sched.total_tokens)
        previous, self._in_flight = self._in_flight, launched
        outputs = []
        if previous is not None:
            outputs = self._collect(*previous)
            now = time.perf_counter()
            if self._last_result is not None:
                self.counters.count_interval(now - self._last_result)
            self._last_result = now if launched is not None else None  # idle next: no interval to count
        self._uncollected = []
        # after the collect: requests the previous step finished have left the running list
        self.last_stats = self.scheduler.stats(sched)
        return outputs

    def _launch(self, sched: SchedulerOutput) -> PendingSamples | None:
        try:
            return self.worker.execute(*self.builder.build(sched, self.pool))
        except torch.OutOfMemoryError as e:
            raise DeviceOOMError(
                f"Out of device memory in a step of {sched.total_tokens} tokens over {len(sched.scheduled)} "
                f"requests, with the KV cache {100 * self.pool.usage:.0f}% used (it is preallocated, so this is "
                f"activations or workspaces outgrowing the headroom). Lower --max-num-batched-tokens (the "
                f"activation peak) or --gpu-memory-utilization (more headroom); `pagedserve plan` shows the "
                f"split. ({e})") from e

    def _collect(self, sched: SchedulerOutput, pending: PendingSamples | None) -> list[CoreOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        tokens, lp, lp_ids, ranks, scores = [], None, None, None, None
        if pending is not None:
            t0 = time.perf_counter()
            tokens, lp, lp_ids, ranks, scores = pending.wait()
            self.counters.device_wait_seconds += time.perf_counter() - t0
        scored = self._prompt_scores(sched, scores) if scores is not None else {}
        produced = self.scheduler.update_from_output(sched, tokens)

        producing = {req.request_id for _, req in produced} if scored else set()
        outputs = [CoreOutput(rid, None, prompt_scores=s) for rid, s in scored.items()
                   if rid not in producing and not self._finished(rid)]
        for row, req in produced:
            n_lp = req.sampling_params.logprobs
            finished = req.status.finished
            out = CoreOutput(req.request_id, req.all_token_ids[-1],
                             finish_reason=req.status.finish_reason if finished else None,
                             stop_reason=req.stop_reason, first_scheduled_time=req.first_scheduled_time,
                             num_preemptions=req.num_preemptions)
            if n_lp is not None:
                out.logprobs, out.logprob_ids, out.rank = lp[row][:1 + n_lp], lp_ids[row][:1 + n_lp], ranks[row]
            out.prompt_scores = scored.get(req.request_id)
            outputs.append(out)
            if req.num_output_tokens == 1:
                self.counters.prompt_tokens += req.num_prompt_tokens

        self.counters.generation_tokens += len(produced)
        return outputs

    def _finished(self, request_id: str) -> bool:
        """Gone from the scheduler: finished or aborted while its step ran."""
        return request_id not in self.scheduler.requests

    @staticmethod
    def _prompt_scores(sched: SchedulerOutput, scores: tuple[list, list, list]) -> dict[str, list]:
        """The step's prompt-token scores, split by request (rows come in schedule order)."""
        lp, ids, ranks = scores
        out, at = {}, 0
        for it in sched.scheduled:
            if it.num_scored:
                k = 1 + it.request.sampling_params.prompt_logprobs
                out[it.request.request_id] = [(lp[r][:k], ids[r][:k], ranks[r]) for r in range(at, at + it.num_scored)]
                at += it.num_scored
        return out
