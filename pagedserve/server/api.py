"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, tokenizer, health, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pagedserve
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import RequestOutput, combine
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_num_queued_reqs: int | None = None
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0  # seconds between stats log lines; 0: off


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status, headers=e.headers)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg')} (got {first.get('input')!r}).", param


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs (one per prompt); closing it aborts all of them."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Disconnected(Exception):
    pass


async def until_disconnect(request: Request, coro):
    """Run ``coro`` unless the client goes away first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _Disconnected()


async def sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """SSE frames of ``events``, an in-stream error if one is raised (the status is already sent), [DONE]."""
    try:
        async for obj in events:
            yield sse(obj)
    except Exception as e:  # noqa: BLE001
        yield sse(error_body(500, str(e), "InternalServerError"))
    yield "data: [DONE]\n\n"


async def final_outputs(request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput] | None:
    """Each stream's finished output, in order; None if the client went away first (all are aborted)."""
    async def collect():
        deltas: list[list[RequestOutput]] = [[] for _ in streams]
        async for i, out in merged(streams):
            deltas[i].append(out)
        return [combine(d) for d in deltas]

    try:
        return await until_disconnect(request, collect())
    except _Disconnected:
        return None


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    served = settings.served_model_names
    metrics = ServerMetrics(engine, served[0])
    engine.observer = metrics
    max_model_len = engine.config.max_model_len

    async def log_stats() -> None:
        """vLLM's periodic line: throughputs over the interval, queue, KV usage, preemptions."""
        c = engine.core.counters
        prev = (time.monotonic(), c.prompt_tokens, c.generation_tokens, c.num_preemptions)
        while True:
            await asyncio.sleep(settings.log_stats_interval)
            now = (time.monotonic(), c.prompt_tokens, c.generation_tokens, c.num_preemptions)
            dt = now[0] - prev[0]
            st = engine.core.last_stats
            if now[1:] != prev[1:] or st.num_running or st.num_waiting:
                logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                            "Running: %d reqs, Waiting: %d reqs, Preemptions: %d, GPU KV cache usage: %.1f%%",
                            (now[1] - prev[1]) / dt, (now[2] - prev[2]) / dt, st.num_running, st.num_waiting,
                            now[3] - prev[3], 100 * st.kv_cache_usage)
            prev = now

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        stats_task = asyncio.create_task(log_stats()) if settings.log_stats_interval > 0 else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        if not await engine.wait_idle(settings.shutdown_timeout):
            logger.warning("shutdown: %d requests still in flight after %.0f s", engine.num_in_flight,
                           settings.shutdown_timeout)
        await engine.stop()

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        return error_response(APIError(400, str(e), "BadRequestError", e.param))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        message, param = _validation_message(e)
        return error_response(APIError(400, message, "BadRequestError", param))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):
        return error_response(APIError(503, str(e), "ServiceUnavailableError"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):  # a bug, not bad input: still answer in the API's shape
        logger.exception("internal error")
        return error_response(APIError(500, f"Internal error: {type(e).__name__}: {e}", "InternalServerError"))

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                return error_response(APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                                               "AuthenticationError"))
        return await call_next(request)

    def check_model(name: str | None) -> str:
        if name is not None and name not in served:
            raise APIError(400, f"The model `{name}` does not exist. Served: {', '.join(served)}.",
                           "NotFoundError", "model")
        return name or served[0]

    def admit(n: int) -> None:
        limit = settings.max_num_queued_reqs
        if limit is not None and engine.num_in_flight + n > limit:
            metrics.rejected += n
            raise APIError(503, f"The server is at its limit of {limit} requests in flight "
                                f"(--max-num-queued-reqs); retry later.", "ServiceUnavailableError",
                           headers={"Retry-After": "1"})
        if engine.dead is not None:
            raise EngineDeadError(f"The engine stopped: {engine.dead!r}")

    def start(base_id: str, prompts: list, params) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt before starting any, so a bad one rejects the whole call cleanly."""
        made = [engine.inputs.make_request(f"{base_id}-{i}", p, dataclasses.replace(params))
                for i, p in enumerate(prompts)]
        admit(len(made))
        return [engine.add(req, text) for req, text in made]

    # ---------------------------------------------------------------- completions

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        model = check_model(body.model)
        params = body.sampling_params()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = start(rid, body.prompts(), params)

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

    # ---------------------------------------------------------------- chat

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        model = check_model(body.model)
        params = body.sampling_params()
        messages = [m.as_dict() for m in body.messages]
        prompt = engine.inputs.apply_chat_template(messages, **(body.chat_template_kwargs or {}))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = start(rid, [prompt], params)
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

    # ---------------------------------------------------------------- the rest

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
             "root": engine.config.source.name, "max_model_len": max_model_len} for name in served]}

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return error_response(APIError(503, f"The engine stopped: {engine.dead!r}", "ServiceUnavailableError"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": pagedserve.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if body.messages is not None:
            tokens = engine.inputs.apply_chat_template([m.as_dict() for m in body.messages])
        elif body.prompt is not None:
            tokens = engine.inputs.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise InvalidRequestError("prompt", "Give either prompt or messages.")
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        tok = engine.inputs.tokenizer
        if tok is None:
            raise InvalidRequestError("tokens", "This model runs without a tokenizer.")
        vocab = engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError("tokens", f"Token ids must be in [0, {vocab}).")
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


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
