"""OpenAI's Responses API (``/v1/responses``): the request is carried over to a chat request (same template,
sampling and output parsers) and its output told as Responses items — reasoning, a message, function
calls — whole, or streamed as Responses events. With ``--max-stored-responses`` the last responses are
kept, to be read back and continued (``previous_response_id``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.outputs import RequestOutput
from pagedserve.server.chat_output import ChatDelta
from pagedserve.server.errors import status_of
from pagedserve.server.protocol import ResponsesRequest, chat_messages
from pagedserve.server.routes.openai import start_chat
from pagedserve.server.state import ServerState, server_state
from pagedserve.server.streaming import final_outputs, merged, sse

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, raw: Request, state: ServerState = Depends(server_state)):
    model = state.check_model(body.model)
    earlier = ([] if body.previous_response_id is None else
               state.responses.get(body.previous_response_id, "previous_response_id")[1])
    conversation = earlier + body.input_messages()
    rid = f"resp_{uuid.uuid4().hex}"
    (stream,), (parser,), params = await start_chat(body.to_chat(conversation), state, rid)
    store = body.store and state.responses.size > 0
    echo = {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls, "text": body.text or {"format": {"type": "text"}},
            "previous_response_id": body.previous_response_id, "store": store}
    told = ResponseBuilder(rid, model, echo, state.engine.tokenizer)

    def keep() -> None:  # the conversation goes on from this response's output (reasoning left out)
        if store:
            state.responses.put(told.final, conversation + chat_messages([dict(i) for i in told.items]))
    if body.stream:
        async def events() -> AsyncIterator[dict]:
            yield told.event("response.created", response=told.response("in_progress"))
            yield told.event("response.in_progress", response=told.response("in_progress"))
            tokens = 0
            async for _, out in merged([stream]):  # DELTA outputs: each holds its new tokens only
                tokens += len(out.outputs[0].token_ids)
                for event in told.feed(parser.feed(out.outputs[0].text, last=out.finished)):
                    yield event
                if out.finished:
                    for event in told.finish(out, tokens):
                        yield event
                    keep()

        return StreamingResponse(_sse(events(), told), media_type="text/event-stream")
    finals = await final_outputs(raw, [stream])
    if finals is None:
        return Response(status_code=499)
    out = finals[0]
    told.feed(parser.feed(out.outputs[0].text, last=True))
    told.finish(out, len(out.outputs[0].token_ids))
    keep()
    return told.final


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: ServerState = Depends(server_state)):
    return state.responses.get(response_id)[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: ServerState = Depends(server_state)):
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def _sse(events: AsyncIterator[dict], told: ResponseBuilder) -> AsyncIterator[bytes]:
    """Responses events as SSE (``event:`` lines, no [DONE]); an error once streaming has begun is an
    ``error`` event, as OpenAI's."""
    try:
        async for event in events:
            yield f"event: {event['type']}\n".encode() + sse(event)
    except Exception as e:  # noqa: BLE001 - the status is already sent
        _, kind = status_of(e)
        yield b"event: error\n" + sse(told.event("error", code=kind, message=str(e), param=None))


class ResponseBuilder:
    """One response's output items, built from its chat deltas: the events that tell them as they grow,
    and the whole response at the end. An item stays open while its kind of text goes on; another kind
    closes it (reasoning, then the message, then the calls is the usual order)."""

    def __init__(self, rid: str, model: str, echo: dict, tokenizer):
        self.rid, self.model, self.echo, self.tokenizer = rid, model, echo, tokenizer
        self.created = int(time.time())
        self.items: list[dict] = []
        self.open: dict | None = None          # the item text is being added to
        self.calls: dict[int, dict] = {}        # a parser's call index -> its function_call item
        self.seq = 0
        self.final: dict | None = None

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def response(self, status: str, usage: dict | None = None, incomplete: dict | None = None) -> dict:
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": [dict(i) for i in self.items], "error": None,
                "incomplete_details": incomplete,
                "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "metadata": {},
                "user": None, "usage": usage, **self.echo}

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=dict(item, content=[]) if "content" in item else dict(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = self.items.index(item), []
        item["status"] = "completed"
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0])]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]))
        return events + [self.event("response.output_item.done", output_index=index, item=dict(item))]

    def feed(self, delta: ChatDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                                       "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
            self.open["content"][0]["text"] += delta.reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=delta.reasoning))
        if delta.content:
            if self.open is None or self.open["type"] != "message":
                events += self._start({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                       "status": "in_progress",
                                       "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.open["content"][0]["text"] += delta.content
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=delta.content,
                                     logprobs=[]))
        for entry in delta.tool_calls:
            call = self.calls.get(entry["index"])
            if call is None:
                call = self.calls[entry["index"]] = {
                    "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": entry["id"], "name": entry["function"]["name"], "arguments": ""}
                events += self._start(call)
            pieces = entry["function"].get("arguments", "")
            call["arguments"] += pieces
            if pieces:
                events.append(self.event("response.function_call_arguments.delta", item_id=call["id"],
                                         output_index=self.items.index(call), delta=pieces))
        return events

    def finish(self, out: RequestOutput, output: int) -> list[dict]:
        """Close the last item and end the response (``out``: its last output; ``output``: the tokens it
        generated): completed, or incomplete when max_output_tokens cut it; the usage counts the
        reasoning's tokens apart."""
        events = self._close()
        prompt = len(out.prompt_token_ids)
        thought = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": output, "total_tokens": prompt + output, "output_tokens_details": {
                     "reasoning_tokens": len(self.tokenizer.encode(thought, add_special_tokens=False))
                     if thought else 0}}
        cut = out.outputs[0].finish_reason == "length"
        self.final = self.response("incomplete" if cut else "completed", usage,
                                   {"reason": "max_output_tokens"} if cut else None)
        return events + [self.event("response.incomplete" if cut else "response.completed", response=self.final)]
