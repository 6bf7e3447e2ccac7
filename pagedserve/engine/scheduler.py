"""The continuous-batching scheduler (vLLM V1 semantics).

Each step has two budgets: at most ``max_num_seqs`` running requests and at most
``max_num_batched_tokens`` tokens; while requests decode and few prompt tokens wait, prompt tokens are
held to ``max_mixed_prefill_tokens`` of them, so a new prompt lengthens the running requests' steps by a
bounded amount (a burst of prompts lifts the bound and drains at full speed); a few fewer where that makes
the step's tokens, decodes included, one of the sizes the model runs without padding. Running requests go
first, in admission order (a decode takes 1 token, an unfinished prefill its next chunk); then waiting
requests FCFS. Prefill and decode share the step. When a running request cannot get a block, the most recently
admitted running request is preempted: its blocks are freed, it will be recomputed, and it goes back to
the front of the queue. The "priority" policy keeps both queues ordered by (priority, arrival) instead:
the most urgent requests are served first, and the least urgent running request is the one preempted.

The engine schedules step N+1 while step N runs (so the host's work hides behind the device's): a
request's token from step N is then pending. It is scheduled as the next decode input all the same
(the runner takes its value from the device), a request whose pending token ends it by length is not
scheduled again, and tokens that arrive for a request finished meanwhile (aborted, or stopped by the
token before) are dropped.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Sequence
from itertools import islice
from dataclasses import dataclass, field

from pagedserve.engine.block_pool import BlockPool
from pagedserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int           # first token position computed this step
    num_tokens: int      # tokens computed this step
    samples: bool        # the step reaches the end of the known tokens: a new token is sampled
    scores_from: int = 0  # prompt_logprobs: the step scores prompt tokens scores_from + 1 ...
    num_scored: int = 0   # ... this many (each from the position before it)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    prefix_cache_queries: int = 0   # prompt tokens of the requests admitted this step
    prefix_cache_hits: int = 0      # of those, tokens found in the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """One step's view, kept for metrics, logs and benchmarks."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_prefill_tokens: int
    num_decode_tokens: int


class Scheduler:
    BOUND_STEPS = 8  # a prompt backlog the mixed-step bound clears within this many steps keeps the bound

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool, max_mixed_prefill_tokens: int = 0,
                 policy: str = "fcfs", step_sizes: Sequence[int] = ()):
        self.pool = pool
        self.by_priority = policy == "priority"
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_mixed_prefill_tokens = max_mixed_prefill_tokens  # 0: the token budget alone
        # token counts a step with prompt tokens runs at unpadded (its CUDA graphs); a step just above one
        # is padded to the next, which costs up to a third more
        self.step_sizes = sorted(step_sizes)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # the running requests with prompt tokens (or a recompute) still to schedule, kept as they change,
        # so the mixed-step bound reads the prompt backlog without a pass over every running request
        self.prefilling: set[Request] = set()

    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """New step limits from the next step on (the engine core validates them). Running requests are
        never dropped: above a lowered ``max_num_seqs`` no new request is admitted until enough finish."""
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.by_priority:
            self._insort(self.waiting, request)
        else:
            self.waiting.append(request)

    @staticmethod
    def _insort(queue, req: Request) -> None:
        """Put ``req`` after every request as urgent as it or more (lower priority value, earlier arrival)."""
        bisect.insort(queue, req, key=lambda r: (r.priority, r.arrival_time))

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; their blocks go back to the pool."""
        finished = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self.prefilling.discard(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self.pool.free(req)
            finished.append(req)
        return finished

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        prompt_budget = budget
        if self.max_mixed_prefill_tokens and self._holds_prompts_down():
            prompt_budget = min(budget, self._mixed_prompt_tokens())

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.ends_in_flight(self.max_model_len) or (req.reads_newest_token and req.num_pending_tokens):
                i += 1  # (a grammar or a bad word: what it may sample next depends on the token in flight)
                continue
            n = req.num_tokens_with_pending - req.num_computed_tokens
            prefilling = n > 1  # a prompt chunk (or a preempted request's recompute), not a decode
            n = min(n, budget, prompt_budget) if prefilling else n
            if n <= 0:  # no prompt tokens left for this step
                i += 1
                continue
            scheduled = True
            while not self.pool.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._schedule(req, n, out)
            budget -= n
            if prefilling:
                prompt_budget -= n
            i += 1

        if not out.preempted:
            while self.waiting and prompt_budget > 0 and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]  # new or preempted: nothing computed, no blocks held
                if req.num_pending_tokens:  # preempted while its token was in flight: wait for it
                    break
                # a scored prompt needs every position's logits: nothing comes from the cache
                cached = self.pool.lookup(req) if req.sampling_params.prompt_logprobs is None else []
                num_cached = len(cached) * self.pool.block_size
                n = req.num_tokens - num_cached
                room = min(budget, prompt_budget)
                if n > room:
                    if not self.enable_chunked_prefill:
                        break
                    n = room
                if not self.pool.allocate_slots(req, n, cached):
                    break
                out.prefix_cache_queries += req.num_tokens
                out.prefix_cache_hits += num_cached
                req.num_computed_tokens = num_cached
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.first_scheduled_time is None:
                    req.first_scheduled_time, req.num_cached_tokens = now, num_cached
                if self.by_priority:  # the running list stays in urgency order: its last is the one to preempt
                    self._insort(self.running, req)
                else:
                    self.running.append(req)
                self._schedule(req, n, out)
                budget -= n
                prompt_budget -= n

        assert out.total_tokens <= self.max_num_batched_tokens
        return out

    def _holds_prompts_down(self) -> bool:
        """Whether this step's prompt tokens are held to ``max_mixed_prefill_tokens``: while requests decode
        and the prompt tokens that could start now (prefills under way, and the waiting requests there are
        seats for) would go through within ``BOUND_STEPS`` steps under the bound. A larger backlog (a burst)
        lifts it: then the waiting prompts' TTFT counts for more than the running streams' ITL."""
        if len(self.running) == len(self.prefilling):  # nothing decodes
            return False
        backlog = sum(r.num_tokens_with_pending - r.num_computed_tokens for r in self.prefilling)
        seats = max(0, self.max_num_seqs - len(self.running))
        backlog += sum(r.num_tokens for r in islice(self.waiting, seats))
        return backlog <= self.BOUND_STEPS * self.max_mixed_prefill_tokens

    def _mixed_prompt_tokens(self) -> int:
        """The prompt tokens of a step held down: the bound, less what brings the step (the running requests'
        decodes and these) down to a step size, where that size is nearer than the next one up (whose padding
        would cost more than the tokens left for the next step) and keeps at least half the bound."""
        bound, sizes = self.max_mixed_prefill_tokens, self.step_sizes
        decodes = len(self.running) - len(self.prefilling)
        total = decodes + bound
        i = bisect.bisect_right(sizes, total)  # sizes[i - 1] <= total < sizes[i]
        if not i or sizes[i - 1] - decodes < bound // 2:
            return bound
        if i < len(sizes) and sizes[i] - total < total - sizes[i - 1]:  # padding up wastes less than shaving defers
            return bound
        return sizes[i - 1] - decodes

    def _schedule(self, req: Request, n: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        samples = start + n == req.num_tokens_with_pending
        item = ScheduledRequest(req, start, n, samples)
        if req.sampling_params.prompt_logprobs is not None:  # once each, also when recomputed after preemption
            item.scores_from = max(start, req.num_prompt_scored)
            end = min(start + n, req.num_prompt_tokens - 1)
            item.num_scored = max(0, end - item.scores_from)
            req.num_prompt_scored = max(req.num_prompt_scored, end)
        out.scheduled.append(item)
        req.num_pending_tokens += samples
        if samples and n == 1 and start >= req.num_prompt_tokens:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n
        # advanced at schedule time, so a chunk's successor can be scheduled in the very next step
        req.num_computed_tokens += n
        if req.num_tokens_with_pending - req.num_computed_tokens > 1:
            self.prefilling.add(req)
        else:
            self.prefilling.discard(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.prefilling.discard(req)
        self.pool.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        if self.by_priority:
            self._insort(self.waiting, req)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[int, Request]]:
        """Append the sampled tokens (one per sampling request, in schedule order); return
        (row in ``sampled``, request) for the requests that produced a token this step. Finished ones
        leave the running (or, if preempted meanwhile, the waiting) list."""
        produced = []
        now = time.monotonic()
        any_finished = False
        for row, (item, token) in enumerate(zip((it for it in out.scheduled if it.samples), sampled, strict=True)):
            req = item.request
            req.num_pending_tokens -= 1
            if req.status.finished:  # aborted, or ended by its previous token, while this step ran
                continue
            req.append_token(token)
            if req.grammar is not None:
                req.grammar.accept(token)
            if req.first_token_time is None:
                req.first_token_time = now
            produced.append((row, req))
            was_waiting = req.status == RequestStatus.PREEMPTED
            if req.check_stop(self.max_model_len):
                del self.requests[req.request_id]
                self.pool.free(req)
                if was_waiting:
                    self.waiting.remove(req)
                else:
                    self.prefilling.discard(req)
                    any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.status.finished]
        return produced

    def stats(self, out: SchedulerOutput) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_cache_usage=self.pool.usage,
            num_preemptions=len(out.preempted), num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens)
