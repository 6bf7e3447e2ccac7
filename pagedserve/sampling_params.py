"""Per-request sampling parameters (vLLM's names and defaults), validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedserve.checks import token_ids, wrong_type
from pagedserve.errors import InvalidRequestError


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16   # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0     # subtracted once from every token already in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits, in [-100, 100] (OpenAI's)
    # structured output, one of STRUCTURED_KINDS: {"json": schema}, {"json_object": True}, {"regex": r"..."},
    # {"choice": ["a", "b"]} or {"grammar": EBNF}
    structured_outputs: dict | None = None
    logprobs: int | None = None   # number of top logprobs to return per token (plus the sampled one)
    prompt_logprobs: int | None = None  # ... per prompt token (plus the prompt's own): scores the prompt
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed: a word's last token is barred after the rest of it
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens; -1: its last max_model_len
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)
    # the argmax of the model's own logits, nothing sampled and no logit changed (set on construction:
    # the engine asks it of every request every step)
    plain_greedy: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(param, f"{param} {why}, got {getattr(self, param)!r}.")

        wrong = wrong_type(self)
        if wrong:
            raise bad(wrong[0], f"must be {wrong[1]}")
        if self.n < 1:
            raise bad("n", "must be a positive integer")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "must be positive and finite")
        if self.logprobs is not None and self.logprobs < 0:  # the engine's --max-logprobs caps them
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be non-negative")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad("stop", "must be a string or a list of strings")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "must be non-empty strings")
        self._stop = tuple(stops)
        stop_ids = token_ids(self.stop_token_ids or [])
        if stop_ids is None:
            raise bad("stop_token_ids", "must be token ids")
        self.stop_token_ids = stop_ids
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            keys = token_ids(self.logit_bias)
            if keys is None:
                raise bad("logit_bias", "keys must be token ids")
            self.logit_bias = dict(zip(keys, self.logit_bias.values()))
            if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.structured_outputs is not None:
            self.structured_outputs = self._structured(self.structured_outputs)
        if self.allowed_token_ids is not None:
            ids = token_ids(self.allowed_token_ids) if isinstance(self.allowed_token_ids, (list, tuple)) else None
            if not ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            self.allowed_token_ids = ids
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of words (non-empty strings)")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1):
            raise bad("truncate_prompt_tokens", "must be a positive number of tokens, or -1 for max_model_len")
        self.plain_greedy = self.greedy and not (self.penalized or self.logit_bias or self.structured_outputs
                                                 or self.allowed_token_ids or self.bad_words)

    STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")

    @classmethod
    def _structured(cls, spec) -> dict:
        """The one kind a ``structured_outputs`` dict names, checked in shape (the engine compiles it)."""
        kinds = ", ".join(cls.STRUCTURED_KINDS)
        if not isinstance(spec, dict):
            raise InvalidRequestError("structured_outputs",
                                      f"structured_outputs must be an object with one of {kinds}.")
        given = {k: v for k, v in spec.items() if v is not None and v is not False}
        if len(given) != 1 or next(iter(given)) not in cls.STRUCTURED_KINDS:
            raise InvalidRequestError("structured_outputs", f"structured_outputs needs exactly one of {kinds}, got "
                                                            f"{sorted(given)}.")
        (kind, value), = given.items()
        ok = {"json": isinstance(value, (dict, str)), "json_object": value is True, "regex": isinstance(value, str),
              "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value),
              "grammar": isinstance(value, str)}[kind]
        if not ok:
            raise InvalidRequestError("structured_outputs", f"structured_outputs.{kind} has the wrong type: {value!r}.")
        return given

    def child(self, index: int) -> "SamplingParams":
        """The parameters of one of the ``n`` parallel samples: one sequence each, a seeded request's
        children seeded apart (seed + index) so that they differ yet reproduce."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop
