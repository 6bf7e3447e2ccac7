"""OpenAI request bodies (pydantic) and their mapping to ``SamplingParams``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    # unknown fields are accepted and ignored, as OpenAI clients send extras freely
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                raise InvalidRequestError(name, f"{name} is not supported by this server; leave it at {neutral}.")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "stream_options needs stream: true.")
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt", "The prompt is empty.")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo", "echo is not supported.")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" for part in content):
                raise InvalidRequestError("messages", "Only text content parts are supported.")
            content = "".join(part.get("text", "") for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true.")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_completion_tokens or self.max_tokens, lp)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]

