"""The app factory: wires the route families, the error handlers, auth and the engine's lifetime."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers

import pagedserve
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.server.errors import APIError, error_response, install_handlers
from pagedserve.server.routes import admin, openai, ops, responses
from pagedserve.server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)

# open without --api-key: liveness probes and Prometheus scrapers do not carry the key
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics"})
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"})


def too_large(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit // 2**20} MiB."


class BodySizeLimit:
    """413 for a request body over the limit: at once when Content-Length announces it, else as soon as the
    streamed body passes it. Then the app is told the client went away, and what it would still send is
    dropped: the 413 is the answer, and nothing more of the body is read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refuse = error_response(APIError(413, too_large(self.limit), "RequestTooLargeError"))
        announced = dict(scope["headers"]).get(b"content-length")
        if announced is not None and announced.isdigit():
            if int(announced) > self.limit:
                return await refuse(scope, receive, send)
            # the server reads no more than the announced length: nothing to count, and every token the
            # response streams goes straight out
            return await self.app(scope, receive, send)
        seen, refused = 0, False

        async def counted():
            nonlocal seen, refused
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit and not refused:
                refused = True
                await refuse(scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def send_unless_refused(message):
            if not refused:
                await send(message)

        await self.app(scope, counted, send_unless_refused)


class RequestIdHeader:
    """X-Request-Id on every answer: the one the request carried, or a new one (for tracing across proxies)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class Gate:
    """The key on every route but the public ones; then a full server refuses a generation call before its
    body is even parsed. Plain ASGI: a response's chunks pass straight through (Starlette's
    ``BaseHTTPMiddleware`` would relay every streamed token through a task and a memory stream)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            return await error_response(refusal)(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        path, key = scope["path"], self.state.settings.api_key
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # behind --root-path the server names its routes with the prefix
            path = path[len(root):]
        if key and path not in PUBLIC_PATHS:
            header = Headers(scope=scope).get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                return APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).", "AuthenticationError")
        if path in GENERATE_PATHS and scope["method"] == "POST":
            try:
                self.state.admission.check_room(1)
            except APIError as e:
                return e
            except EngineDeadError as e:
                return APIError(503, str(e), "ServiceUnavailableError")
        return None


async def log_stats(state: ServerState) -> None:
    """vLLM's periodic line: throughputs over the interval, queue, KV usage, preemptions."""
    engine, interval = state.engine, state.settings.log_stats_interval
    c = engine.core.counters
    prev = (time.monotonic(), c.prompt_tokens, c.generation_tokens, c.num_preemptions)
    while True:
        await asyncio.sleep(interval)
        now = (time.monotonic(), c.prompt_tokens, c.generation_tokens, c.num_preemptions)
        dt = now[0] - prev[0]
        st = engine.core.last_stats
        if now[1:] != prev[1:] or st.num_running or st.num_waiting:
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, Preemptions: %d, GPU KV cache usage: %.1f%%",
                        (now[1] - prev[1]) / dt, (now[2] - prev[2]) / dt, st.num_running, st.num_waiting,
                        now[3] - prev[3], 100 * st.kv_cache_usage)
        prev = now


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    state = ServerState(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        tasks = []
        if settings.log_stats_interval > 0:
            tasks.append(asyncio.create_task(log_stats(state)))
        if state.degradation is not None:
            await state.degradation.start()
            tasks.append(asyncio.create_task(state.degradation.run()))
        yield  # the server drains requests before this (server.cli.Server.shutdown)
        for task in tasks:
            task.cancel()
        await engine.stop()
        if state.metrics.recorder is not None:
            state.metrics.recorder.close()

    docs = {} if settings.api_docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan, **docs)
    app.state.server = state
    app.state.engine, app.state.metrics = engine, state.metrics
    install_handlers(app)

    app.add_middleware(Gate, state=state)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_body_bytes)
    if settings.request_id_headers:
        app.add_middleware(RequestIdHeader)
    if settings.cors is not None:  # the outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, **settings.cors)

    routers = (openai.router, responses.router, ops.router, admin.router)
    for router in routers:
        app.include_router(router)
    # named in the 404 of a client that calls a route this server lacks (e.g. /v1/embeddings)
    app.state.openai_routes = sorted({re.sub(r":\w+}", "}", r.path) for router in routers for r in router.routes
                                      if r.path.startswith("/v1/")})
    return app
