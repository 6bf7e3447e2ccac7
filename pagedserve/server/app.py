"""The app factory: wires the route families, the error handlers, auth and the engine's lifetime."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

import pagedserve
from pagedserve.server.async_engine import AsyncEngine
from pagedserve.server.errors import APIError, error_response, install_handlers
from pagedserve.server.routes import admin, openai, ops
from pagedserve.server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)

# open without --api-key: liveness probes and Prometheus scrapers do not carry the key
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


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
        yield
        for task in tasks:
            task.cancel()
        if not await engine.wait_idle(settings.shutdown_timeout):
            logger.warning("shutdown: %d requests still in flight after %.0f s", engine.num_in_flight,
                           settings.shutdown_timeout)
        await engine.stop()

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    app.state.server = state
    app.state.engine, app.state.metrics = engine, state.metrics
    install_handlers(app)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if settings.api_key and request.url.path not in PUBLIC_PATHS:
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                return error_response(APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                                               "AuthenticationError"))
        return await call_next(request)

    app.include_router(openai.router)
    app.include_router(ops.router)
    app.include_router(admin.router)
    return app
