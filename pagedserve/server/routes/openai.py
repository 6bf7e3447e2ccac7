"""OpenAI's API: ``/v1/completions``, ``/v1/chat/completions`` (streamed as SSE or not) and ``/v1/models``."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.outputs import RequestOutput
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.state import ServerState, server_state
from pagedserve.server.streaming import final_outputs, merged, sse_stream

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    model = state.check_model(body.model)
    params = body.sampling_params()
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    streams = await state.start(rid, body.prompts(), params)

    def choice(i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        return {"index": i, "text": c.text, "logprobs": _completion_logprobs(c, params.logprobs),
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None}

    if body.stream:
        async def events():
            head = {"id": rid, "object": "text_completion", "created": created, "model": model}
            prompt_tokens, completion_tokens = 0, 0
            async for i, out in merged(streams):
                completion_tokens += len(out.outputs[0].token_ids)
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
                yield {**head, "choices": [choice(i, out)]}
            if body.include_usage:
                yield {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    finals = await final_outputs(raw, streams)
    if finals is None:
        return Response(status_code=499)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice(i, out) for i, out in enumerate(finals)], "usage": _usage_of(finals)}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    model = state.check_model(body.model)
    params = body.sampling_params()
    messages = [m.as_dict() for m in body.messages]
    template_args = body.template_args(state.settings.trust_request_chat_template)
    state.admission.check_room(1)
    prompt = await asyncio.to_thread(state.engine.inputs.apply_chat_template, messages, **template_args)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    streams = await state.start(rid, [prompt], params)
    want_lp = params.logprobs is not None

    if body.stream:
        async def events():
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
            completion_tokens, final = 0, None
            async for _, out in merged(streams):
                c = out.outputs[0]
                completion_tokens += len(c.token_ids)
                final = out if out.finished else None
                yield {**head, "choices": [{
                    "index": 0, "delta": {"content": c.text},
                    "logprobs": _chat_logprobs(c, params.logprobs) if want_lp else None,
                    "finish_reason": c.finish_reason if out.finished else None,
                    "stop_reason": c.stop_reason if out.finished else None}]}
            if body.include_usage and final is not None:
                yield {**head, "choices": [], "usage": _usage(len(final.prompt_token_ids), completion_tokens)}

        return StreamingResponse(sse_stream(events()), media_type="text/event-stream")

    finals = await final_outputs(raw, streams)
    if finals is None:
        return Response(status_code=499)
    out = finals[0]
    c = out.outputs[0]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                         "logprobs": _chat_logprobs(c, params.logprobs) if want_lp else None,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
            "usage": _usage_of([out])}


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    config = state.engine.config
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
         "root": config.source.name, "max_model_len": config.max_model_len} for name in state.served]}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _usage_of(finals: list[RequestOutput]) -> dict:
    return _usage(sum(len(o.prompt_token_ids) for o in finals), sum(len(o.outputs[0].token_ids) for o in finals))


def _top(entry: dict, n: int) -> list:
    """The top-n alternatives of one position (the sampled token is among them only if it ranks there)."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= n), key=lambda lp: lp.rank)


def _completion_logprobs(c, n: int | None) -> dict | None:
    if c.logprobs is None:
        return None
    pairs = list(zip(c.token_ids, c.logprobs))
    return {"tokens": [e[t].decoded_token for t, e in pairs],
            "token_logprobs": [e[t].logprob for t, e in pairs],
            "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(e, n)} for _, e in pairs]}


def _chat_logprobs(c, n: int | None) -> dict | None:
    if c.logprobs is None:
        return None
    return {"content": [
        {"token": e[t].decoded_token, "logprob": e[t].logprob,
         "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob} for lp in _top(e, n)]}
        for t, e in zip(c.token_ids, c.logprobs)]}
