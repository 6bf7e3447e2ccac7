"""A request as the engine core sees it: token ids, progress, status and timestamps."""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from pagedserve.engine.structured import Grammar
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything after PREEMPTED is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)
class Request:
    """``num_computed_tokens`` chases ``num_tokens``: that one rule covers prefill chunks, decode and
    recompute after preemption (vLLM V1's design: the scheduler has no prefill/decode phases).

    The engine schedules a step while the previous one still runs on the device, so a request's newest
    token may be sampled but not yet known on the host: ``num_pending_tokens`` counts those, and the
    scheduler treats them as tokens (their values reach the model runner on the device).

    ``all_token_ids`` is an ``array`` of int64, not a list: the garbage collector visits a list's every
    element at each full collection (with hundreds of long requests alive, tens of milliseconds of stalled
    loop), an array's none."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int                        # resolved: never beyond max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    grammar: Grammar | None = None         # structured output: the tokens allowed next
    allowed_tokens: np.ndarray | None = None  # allowed_token_ids as [ceil(vocab / 32)] int32 bits
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of the words never to complete
    all_token_ids: array = field(init=False)
    reads_newest_token: bool = field(init=False)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    num_prompt_scored: int = 0             # prompt_logprobs: positions whose next prompt token is scored
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0             # prompt tokens found in the prefix cache when first scheduled
    priority: int = 0                      # --scheduling-policy priority: lower values are served first
    cache_salt: str | None = None          # prefix-cache blocks are shared only among requests of one salt

    def __post_init__(self) -> None:
        self.all_token_ids = array("q", self.prompt_token_ids)
        # what it may sample next depends on its newest token (a grammar's state, a bad word's first tokens), so it
        # sits out a step while that token is still on the device
        self.reads_newest_token = self.grammar is not None or any(len(w) > 1 for w in self.bad_words)

    def barred_tokens(self) -> list[int]:
        """The tokens that would complete one of its bad words now: a word's last token, where its output ends with
        the rest of the word."""
        output = len(self.all_token_ids) - len(self.prompt_token_ids)
        return [w[-1] for w in self.bad_words if len(w) == 1 or (
            len(w) <= output + 1 and tuple(self.all_token_ids[1 - len(w):]) == w[:-1])]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus those a step in flight is sampling."""
        return len(self.all_token_ids) + self.num_pending_tokens

    def ends_in_flight(self, max_model_len: int) -> bool:
        """The token a step in flight is sampling is the request's last by length: nothing to schedule."""
        total = self.num_tokens_with_pending
        return bool(self.num_pending_tokens) and (
            total - self.num_prompt_tokens >= self.max_tokens or total >= max_model_len)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> array:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request (EOS, stop id, length)."""
        params = self.sampling_params
        token = self.all_token_ids[-1]
        if self.grammar is not None and self.grammar.terminated:  # it allows no further token
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
