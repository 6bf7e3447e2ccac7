"""OpenAI's API: ``/v1/completions``, ``/v1/chat/completions`` (streamed as SSE or not) and ``/v1/models[/NAME]``; and
SageMaker's ``/invocations``, which takes either request."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.reasoning import PROMPT_TAIL_TOKENS, ReasoningSplitter, prompt_state
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat_output import ChatOutputParser
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.state import ServerState, server_state
from pagedserve.server.streaming import final_outputs, merged, sse_stream
from pagedserve.server.tools import TOOL_CALL_PARSERS, NamedCallParser, RequiredCallsParser

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    model = state.check_model(body.model)
    params = body.sampling_params(state.engine.config.generation.sampling)
    tokenizer = state.engine.tokenizer
    if body.echo and tokenizer is None:
        raise InvalidRequestError("echo", "echo returns the prompt as text, and this model runs without a tokenizer.")
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    streams = await state.start(rid, [body.salted(p) for p in body.prompts()], params, body.priority, body.stream)
    if body.echo_only:
        streams = [_prompt_only(s) for s in streams]
    named = _token_names(body, state, tokenizer)
    offsets = [0] * len(streams)  # where each choice's next text starts (logprobs' text_offset)
    echoed = [not body.echo] * len(streams)  # each choice's prompt goes out once, ahead of its text
    told_prompt = [False] * len(streams)
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}

    def choice(i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text, ids, entries, first = c.text, c.token_ids, c.logprobs, None
        if not echoed[i]:
            echoed[i] = True
            text = (out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)) + text
            if entries is not None:  # the prompt's logprobs ahead of the completion's
                ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
                first = named(out.prompt_token_ids[0], None)
        lp = None
        if entries is not None:
            lp, offsets[i] = _completion_logprobs(ids, entries, params.logprobs, offsets[i], named, first)
        token_ids = {}
        if body.return_token_ids:
            token_ids = {"token_ids": list(c.token_ids)}
            if not told_prompt[i]:  # a stream tells the prompt's ids once, in a choice's first chunk
                told_prompt[i], token_ids["prompt_token_ids"] = True, list(out.prompt_token_ids)
        return {"index": i, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None, **token_ids,
                **_prompt_logprobs(body, out, named)}

    return await _respond(body, raw, streams, _Usage(params.n, state.settings.prompt_tokens_details), head, choice,
                          lambda finals, usage: {**head, "choices": [choice(i, out) for i, out in enumerate(finals)],
                                                 "usage": usage})


async def start_chat(body: ChatCompletionRequest, state: ServerState,
                     rid: str) -> tuple[list, list[ChatOutputParser], SamplingParams]:
    """Render a conversation and start its ``n`` requests: their output streams, each one's output parser
    (reasoning, tool calls) and the sampling parameters (shared by the chat and the Responses API)."""
    settings = state.settings
    mode, function = body.tool_mode
    if mode == "auto" and settings.tool_call_parser is None:
        raise InvalidRequestError("tool_choice", "tool_choice \"auto\" needs a server started with "
                                                 "--enable-auto-tool-choice and --tool-call-parser; or send "
                                                 "tool_choice \"required\", a named function or \"none\".")
    params = body.sampling_params(state.engine.config.generation.sampling)
    if mode == "auto" and TOOL_CALL_PARSERS[settings.tool_call_parser].keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the call markers are special tokens
    messages = [m.as_dict() for m in body.messages]
    template_args = body.template_args(settings.trust_request_chat_template, settings.tools_when_none)
    state.admission.check_room(params.n, body.priority)
    prompt = await asyncio.to_thread(state.engine.inputs.apply_chat_template, messages,
                                     truncated=params.truncate_prompt_tokens is not None, **template_args)
    streams = await state.start(rid, [body.salted(prompt)], params, body.priority, body.stream)
    reasoning_parser = state.engine.config.args.reasoning_parser
    if reasoning_parser is not None:
        prompt_reasons = prompt_state(state.engine.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:]))

    def parser() -> ChatOutputParser:
        reasoning = None if reasoning_parser is None else ReasoningSplitter(reasoning_parser, prompt_reasons)
        tools = (TOOL_CALL_PARSERS[settings.tool_call_parser]() if mode == "auto" else
                 NamedCallParser(function) if mode == "named" else
                 RequiredCallsParser() if mode == "required" else None)
        return ChatOutputParser(reasoning, tools, body.include_reasoning, one_call=not body.parallel_tool_calls)

    return streams, [parser() for _ in streams], params


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    model = state.check_model(body.model)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    streams, parsers, params = await start_chat(body, state, rid)
    want_lp = params.logprobs is not None
    named = _token_names(body, state, state.engine.tokenizer)

    def logprobs(c):
        return _chat_logprobs(c, params.logprobs, named) if want_lp else None

    started = [False] * len(streams)
    want_ids = body.return_token_ids

    def ids_of(c) -> dict:
        return {"token_ids": list(c.token_ids)} if want_ids else {}

    def delta(j: int, out: RequestOutput) -> dict | None:
        c = out.outputs[0]
        d = parsers[j].feed(c.text, last=out.finished)
        if not (d or out.finished or want_lp or want_ids):
            return None  # text held back (a tag may be starting): nothing to send yet
        message = d.stream_json()
        if not started[j]:  # the role goes out with the first token, so a client's TTFT is the token's
            started[j] = True
            message = {"role": "assistant", **message}
        return {"index": j, "delta": message, "logprobs": logprobs(c),
                "finish_reason": parsers[j].finish_reason(c.finish_reason) if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None, **ids_of(c)}

    def prompt_ids(out: RequestOutput) -> dict:
        return {"prompt_token_ids": list(out.prompt_token_ids)} if want_ids else {}

    def final(finals: list[RequestOutput], usage: dict) -> dict:
        choices = []
        for j, out in enumerate(finals):
            c = out.outputs[0]
            choices.append({"index": j, "message": parsers[j].feed(c.text, last=True).message_json(),
                            "logprobs": logprobs(c), "finish_reason": parsers[j].finish_reason(c.finish_reason),
                            "stop_reason": c.stop_reason, **ids_of(c)})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage, **prompt_ids(finals[0]), **_prompt_logprobs(body, finals[0], named)}

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    return await _respond(body, raw, streams, _Usage(params.n, state.settings.prompt_tokens_details), head, delta,
                          final, prompt_ids)


async def _respond(body, raw: Request, streams: list, usage: _Usage, head: dict,
                   chunk: Callable[[int, RequestOutput], dict | None],
                   final: Callable[[list[RequestOutput], dict], dict],
                   first: Callable[[RequestOutput], dict] = lambda out: {}):
    """Stream the outputs as SSE (``chunk(index, output)`` for each output as it comes, unless None, with
    the usage so far if asked for continuously, the first chunk with ``first(output)``'s fields; then the
    usage if asked), or wait for them all and answer ``final(outputs, usage)``; 499 when the client left
    before the end."""
    if body.stream:
        every = body.include_usage and body.stream_options.continuous_usage_stats

        async def events():
            opening = True
            async for i, out in merged(streams):
                usage.add(i, out)
                if (choice := chunk(i, out)) is not None:
                    extra = first(out) if opening else {}
                    opening = False
                    yield {**head, **extra, "choices": [choice], **({"usage": usage.json()} if every else {})}
            if body.include_usage:
                yield {**head, "choices": [], "usage": usage.json()}

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")
    finals = await final_outputs(raw, streams)
    if finals is None:
        return Response(status_code=499)
    for i, out in enumerate(finals):
        usage.add(i, out)
    return final(finals, usage.json())


@router.post("/invocations")
async def invocations(raw: Request, state: ServerState = Depends(server_state)):
    """A chat completion when the body has messages, a completion when it has a prompt (as vLLM routes it)."""
    try:
        body = await raw.json()
    except ValueError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": str(e),
                                       "ctx": {"error": str(e)}}]) from e
    if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
        raise InvalidRequestError(None, "/invocations takes a chat completion request (with messages) or a "
                                        "completion request (with prompt): give exactly one of the two.")
    chat = "messages" in body
    kind, handler = (ChatCompletionRequest, chat_completions) if chat else (CompletionRequest, completions)
    try:
        request = kind.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    return await handler(request, raw, state)


def _model_card(state: ServerState, name: str) -> dict:
    config = state.engine.config
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "root": config.source.name, "max_model_len": config.max_model_len}


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    return {"object": "list", "data": [_model_card(state, name) for name in state.served]}


@router.get("/v1/models/{name:path}")  # OpenAI's retrieve; a served name may hold a slash (Qwen/Qwen3-8B)
async def model(name: str, state: ServerState = Depends(server_state)):
    return _model_card(state, state.check_model(name))


class _Usage:
    """Token usage of one call: a prompt counts once, however many samples (n) it has; with ``details``
    (--enable-prompt-tokens-details), how many of its tokens the prefix cache gave."""

    def __init__(self, n: int, details: bool):
        self.n, self.details, self.prompts, self.cached, self.completion = n, details, {}, {}, 0

    def add(self, index: int, out: RequestOutput) -> None:
        self.prompts[index // self.n] = len(out.prompt_token_ids)
        self.cached.setdefault(index // self.n, out.num_cached_tokens)  # the first sample's: the others share it
        self.completion += len(out.outputs[0].token_ids)

    def json(self) -> dict:
        prompt = sum(self.prompts.values())
        usage = {"prompt_tokens": prompt, "completion_tokens": self.completion,
                 "total_tokens": prompt + self.completion}
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached.values())}
        return usage



TokenNamer = Callable[[int, Logprob | None], str]


def _token_names(body, state: ServerState, tokenizer) -> TokenNamer:
    """How logprobs name a token: its text, or "token_id:N" (--return-tokens-as-token-ids, or the request's
    return_tokens_as_token_ids), which names every token exactly, even one that is part of a character."""
    as_ids = body.return_tokens_as_token_ids
    if as_ids if as_ids is not None else state.settings.tokens_as_ids:
        return lambda tid, lp: f"token_id:{tid}"
    return lambda tid, lp: tokenizer.decode([tid]) if lp is None else lp.decoded_token


def _top(entry: dict, n: int) -> list:
    """The top-n alternatives of one position as (id, Logprob) (the sampled token is among them only if
    it ranks there)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
                  key=lambda pair: pair[1].rank)


def _completion_logprobs(ids: list[int], entries: list, n: int | None, offset: int, named: TokenNamer,
                         first_text: str | None = None) -> tuple[dict, int]:
    """OpenAI's completion logprobs of tokens ``ids`` and where the next token's text starts: offsets count
    the tokens' text (a streamed chunk's text may hold back part of a character), continuing from
    ``offset``. An entry None (a prompt's first token: nothing before it) has no logprob; its text is
    ``first_text``."""
    tokens = [first_text if e is None else named(t, e[t]) for t, e in zip(ids, entries)]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok or "")
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(ids, entries)],
            "text_offset": offsets,
            "top_logprobs": [None if e is None else {named(t, lp): lp.logprob for t, lp in _top(e, n)}
                             for e in entries]}, offset


def _prompt_logprobs(body, out: RequestOutput, named: TokenNamer) -> dict:
    """vLLM's prompt_logprobs field where the request asks for it: None for the first prompt token (nothing before
    it), then for each the prompt token's and the top N's {token id: {"logprob", "rank", "decoded_token"}}."""
    if body.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": [
        None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": named(t, lp)}
                                for t, lp in e.items()} for e in out.prompt_logprobs]}


async def _prompt_only(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A request run for its prompt alone: the token it had to generate is not the client's."""
    try:
        async for out in stream:
            c = out.outputs[0]
            bare = dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                       cumulative_logprob=None if c.logprobs is None else 0.0)
            yield dataclasses.replace(out, outputs=[bare])
    finally:
        await stream.aclose()  # closed early (a client gone): so is the request


def _utf8(token: str | None) -> list[int] | None:
    return None if token is None else list(token.encode("utf-8", errors="replace"))


def _chat_logprobs(c, n: int | None, named: TokenNamer) -> dict | None:
    if c.logprobs is None:
        return None
    return {"content": [
        {"token": named(t, e[t]), "logprob": e[t].logprob, "bytes": _utf8(e[t].decoded_token),
         "top_logprobs": [{"token": named(alt, lp), "logprob": lp.logprob, "bytes": _utf8(lp.decoded_token)}
                          for alt, lp in _top(e, n)]}
        for t, e in zip(c.token_ids, c.logprobs)]}
