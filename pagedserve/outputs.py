"""What ``LLM.generate`` returns and the server streams (vLLM's shapes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each output of a request holds (vLLM's names)."""

    CUMULATIVE = enum.auto()  # everything so far, at every step
    DELTA = enum.auto()       # only what is new since the last output (streaming without O(n^2) copies)
    FINAL_ONLY = enum.auto()  # one output, when the request finishes


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)
    # prompt_logprobs: per prompt token, its logprob and the top-N (None for the first, which has no context)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave when the request was first scheduled


def combine(deltas: list[RequestOutput]) -> RequestOutput:
    """One request's DELTA outputs joined into the cumulative output they add up to."""
    last = deltas[-1]
    parts = [d.outputs[0] for d in deltas]
    logprobs = None if parts[0].logprobs is None else [e for c in parts for e in c.logprobs]
    c = last.outputs[0]
    completion = CompletionOutput(c.index, "".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                                  c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, [completion], last.finished, last.metrics,
                         next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
                         last.num_cached_tokens)
