"""OpenAI request bodies (pydantic) and their mapping to ``SamplingParams``."""

from __future__ import annotations

import json
import logging
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.tools import forced_schema


INT64 = (-(2**63), 2**63 - 1)
INT32_MAX = 2**31 - 1
logger = logging.getLogger(__name__)


class _Body(BaseModel):
    # numbers must be finite; booleans are not numbers nor numbers booleans (StrictInt / StrictBool below)
    model_config = ConfigDict(allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


# fields OpenAI or vLLM clients send that would change what is asked for and that this server does not do:
# a 400 that says so, rather than a warning and an answer to another question
_REFUSED = {
    "best_of": (lambda v, n: isinstance(v, int) and v != n,
                "best_of must equal n: choosing the best of several samples is not supported; ask for n samples "
                "and choose among them."),
    "suffix": (lambda v, n: bool(v), "suffix (text to follow the completion) is not supported."),
    "functions": (lambda v, n: bool(v), "The legacy functions field is not supported: send tools (and tool_choice)."),
    "function_call": (lambda v, n: v not in (None, "none"),
                      "The legacy function_call field is not supported: send tool_choice."),
    "use_beam_search": (lambda v, n: bool(v), "Beam search is not supported: sample with n instead."),
}


class _SamplingFields(_Body):
    # unknown fields are accepted, as OpenAI clients send extras freely, and named in a warning (as vLLM does)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    n: StrictInt = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)  # finite: the body model refuses inf and nan
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    priority: StrictInt = Field(default=0, ge=INT64[0], le=INT64[1])  # --scheduling-policy priority: lower first
    cache_salt: StrictStr | None = Field(default=None, min_length=1)  # prefix-cache blocks shared within a salt
    return_tokens_as_token_ids: StrictBool | None = None  # logprobs' tokens as "token_id:N" (None: the server's)
    return_token_ids: StrictBool = False  # the prompt's and the output's token ids beside the text
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0)  # vLLM's: each prompt token's, and the top N

    def salted(self, prompt: str | list[int]) -> str | list[int] | dict:
        """The prompt as the engine takes it: with the request's cache salt, if it has one."""
        if self.cache_salt is None:
            return prompt
        return {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "cache_salt": self.cache_salt}

    def model_post_init(self, _) -> None:
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """``defaults``: the model's recommended values (generation_config.json) for the fields left unset."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "stream_options needs stream: true.")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs", "prompt_logprobs come whole with the answer, not in a "
                                                         "stream: leave out stream, or prompt_logprobs.")
        asked = [k for k in (prompt_logprobs, self.prompt_logprobs) if k is not None]  # echo's and the field's
        prompt_logprobs = max(asked) if asked else None
        for name, value in (self.model_extra or {}).items():
            if name in _REFUSED and _REFUSED[name][0](value, self.n):
                raise InvalidRequestError(name, _REFUSED[name][1])
        unset = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        chosen = {k: v if (v := getattr(self, k)) is not None else defaults.get(k, neutral)
                  for k, neutral in unset.items()}
        return SamplingParams(
            n=self.n, **chosen, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self._logit_bias(), structured_outputs=self._structured(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens)

    def _structured(self) -> dict | None:
        """The one structured-output request among the fields that can make it, as ``SamplingParams`` takes it."""
        specs = self._forced_output()
        fmt = self.response_format
        if fmt is not None and fmt.get("type") != "text":
            if fmt.get("type") == "json_object":
                specs["response_format"] = {"json_object": True}
            elif fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict) \
                    and "schema" in fmt["json_schema"]:
                specs["response_format"] = {"json": fmt["json_schema"]["schema"]}
            else:
                raise InvalidRequestError("response_format", "response_format must be {\"type\": \"text\"}, "
                                          "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                                          "\"json_schema\": {\"schema\": ...}}.")
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                specs[name] = {kind: getattr(self, name)}
        if self.structured_outputs is not None:
            specs["structured_outputs"] = self.structured_outputs
        if len(specs) > 1:
            raise InvalidRequestError(sorted(specs)[1], f"Ask for one structured output, not {len(specs)}: "
                                                        f"{', '.join(sorted(specs))}.")
        return next(iter(specs.values()), None)

    def _forced_output(self) -> dict:
        return {}

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias", "logit_bias keys must be token ids (integers as strings), got "
                                                    f"{sorted(self.logit_bias)!r}.") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=16, ge=0)  # 0: only with echo (the prompt's logprobs)
    logprobs: StrictInt | None = Field(default=None, ge=0)  # up to the server's --max-logprobs
    echo: StrictBool = False  # the prompt comes back ahead of the completion, with its logprobs if asked

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt", "The prompt is empty.")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, as evaluation harnesses ask."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: dict) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens", "max_tokens must be at least 1 (0 only with echo: true).")
        # echo_only still runs the request one token, which its response leaves out
        return self._sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs, defaults,
                                     self.logprobs if self.echo else None)


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: str
    text: StrictStr | None = None


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr | dict[str, Any]


class ToolCall(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # other fields (name, reasoning_content, ...) reach the chat template as sent
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequestError("messages", "Only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                                      "are supported.")
            content = "".join(part.text for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [self._call(c) for c in self.tool_calls]
        return message

    @staticmethod
    def _call(call: ToolCall) -> dict:
        """A call as templates read it: arguments as a mapping (some templates write them with ``tojson``)."""
        args = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise InvalidRequestError("messages", f"A tool call's arguments are not JSON ({e.msg}): "
                                                      f"{args[:80]!r}.") from None
        return {**call.model_dump(exclude_none=True), "function": {"name": call.function.name, "arguments": args}}


class FunctionDefinition(_Body):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)  # up to the server's --max-logprobs
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True  # false: the reasoning is left out of the answer

    @cached_property
    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function): tool_choice left out is "auto"
        with tools and "none" without, as in OpenAI's API."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return "none", None
        if not self.tools:
            what = repr(choice) if isinstance(choice, str) else "naming a function"
            raise InvalidRequestError("tool_choice", f"tool_choice {what} needs tools: send the functions the "
                                                     "model may call in tools.")
        names = [t.function.name for t in self.tools]
        if len(set(names)) < len(names):
            raise InvalidRequestError("tools", f"Two tools share a name: {sorted(names)}.")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequestError("tool_choice", f"tool_choice names {choice.function.name!r}, which is not "
                                                         f"among the tools ({', '.join(names)}).")
            return "named", choice.function.name
        return choice, None

    def _forced_output(self) -> dict:
        mode, name = self.tool_mode
        if mode not in ("named", "required"):
            return {}
        schema = forced_schema([t.function.model_dump() for t in self.tools], name, self.parallel_tool_calls)
        return {"tool_choice": {"json": schema}}

    def template_args(self, trust_request_template: bool, tools_when_none: bool = True) -> dict:
        """Keyword arguments for the chat template (``template_args``), the tools left out when the request
        will not call them and the server says so (--exclude-tools-when-tool-choice-none)."""
        with_tools = tools_when_none or self.tool_mode[0] != "none"
        return template_args(self, trust_request_template, self.tools if with_tools else None)

    def sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true.")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_completion_tokens or self.max_tokens, lp, defaults)


def template_args(body, trust_request_template: bool, tools: list[Tool] | None) -> dict:
    """Keyword arguments for the chat template of a request that renders messages (chat, /tokenize). A
    template sent by the client is rendered only when the server trusts request templates: a template is
    code, and a slow one stalls the server."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = body.chat_template or kwargs.pop("chat_template", None)
    if template is not None and not trust_request_template:
        raise InvalidRequestError("chat_template", "This server does not render chat templates sent in requests "
                                                   "(start it with --trust-request-chat-template to allow them).")
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequestError("continue_final_message", "continue_final_message continues the last "
                                  "message; it cannot be combined with add_generation_prompt (set it to false).")
    if tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    return {**kwargs, "chat_template": template, "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message}


class TokenizeRequest(_Body):
    """A prompt, or chat messages rendered as a chat request would render them (vLLM's fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


class ResponsesRequest(_Body):
    """OpenAI's Responses API body: the conversation in ``input``, after a stored response's when
    ``previous_response_id`` names one. It is carried over to a chat request, so both APIs share the
    template, the sampling fields (vLLM's extras too: seed, top_k, stop, ...) and the output parsers."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    background: StrictBool = False

    def input_messages(self) -> list[dict]:
        return chat_messages([{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input)

    def to_chat(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat request of ``conversation`` (chat messages: a stored one's, then ``input_messages``)."""
        if self.background:
            raise InvalidRequestError("background", "Background responses are not kept by this server; leave out "
                                                    "background (or stream the response).")
        extra = dict(self.model_extra or {})  # vLLM's sampling extras go on to the chat request as they came
        if extra.get("n", 1) != 1:
            raise InvalidRequestError("n", "A response has one output: leave out n (or send 1).")
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        messages += conversation
        if not messages:
            raise InvalidRequestError("input", "The input is empty: send a string or at least one input item.")
        body = {**extra, "model": self.model, "messages": messages, "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.get("name")}}
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        try:
            return ChatCompletionRequest(**body)
        except ValidationError as e:  # a field carried over as it came (a sampling extra): name it
            err = e.errors()[0]
            raise InvalidRequestError(".".join(map(str, err["loc"])), err["msg"]) from None


def _chat_tool(tool: dict) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) as the chat API has it."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InvalidRequestError("tools", f"Only function tools ({{\"type\": \"function\", \"name\": ...}}) run "
                                           f"on this server, got {str(tool)[:120]}.")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _chat_format(fmt: dict) -> dict:
    """text.format ({"type": "json_schema", "name", "schema"} flat) as chat's response_format."""
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    if any(not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text")
           or not isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequestError(where, "Only text content (input_text / output_text parts) runs on this server.")
    return "".join(p["text"] for p in parts)


def chat_messages(items: list[dict]) -> list[dict]:
    """Responses input items as chat messages: messages as they are (developer as system), a run of
    function calls as one assistant message's tool calls, a call's output as a tool message; reasoning
    items are left out (templates drop earlier reasoning)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"input.{i}.role", f"An input message's role is user, assistant, system "
                                                             f"or developer, got {role!r}.")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":
            raise InvalidRequestError(f"input.{i}.type", f"Input items of type {kind!r} do not run on this server "
                                                         f"(message, function_call, function_call_output do).")
    return messages
