"""Operator calls: peak windows for load tests, and the prefix-cache reset vLLM's server also has."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from pagedserve.engine.core import EngineCore
from pagedserve.server.errors import APIError
from pagedserve.server.state import ServerState, server_state

router = APIRouter()


@router.post("/admin/reset_peaks")
async def reset_peaks(state: ServerState = Depends(server_state)):
    """Start a new peak window for the ``pagedserve:*_peak`` gauges; returns the window that ended."""
    ended = await state.engine.call(EngineCore.reset_peaks)
    return {"ended": dataclasses.asdict(ended)}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: ServerState = Depends(server_state)):
    if not await state.engine.call(lambda core: core.pool.reset_prefix_cache()):
        raise APIError(409, "The prefix cache cannot be reset while requests hold KV blocks; retry when idle.",
                       "ConflictError")
    return Response(status_code=200)
