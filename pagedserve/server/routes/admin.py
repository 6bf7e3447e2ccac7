"""Operator calls: peak windows for load tests, the prefix-cache reset vLLM's server also has, and the
degradation profile in force (read it, switch and pin it, or hand it back to the triggers)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pagedserve.engine.core import EngineCore
from pagedserve.errors import InvalidRequestError
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


class ProfileChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    profile: str


def _degradation(state: ServerState):
    if state.degradation is None:
        raise APIError(404, "This server runs without degradation profiles (start it with --profiles FILE).",
                       "NotFoundError")
    return state.degradation


@router.get("/admin/profile")
async def get_profile(state: ServerState = Depends(server_state)):
    return _degradation(state).status()


@router.post("/admin/profile")
async def set_profile(body: ProfileChoice, state: ServerState = Depends(server_state)):
    """``{"profile": "protect"}`` switches and pins; ``{"profile": "auto"}`` hands back to the triggers."""
    deg = _degradation(state)
    names = list(deg.spec.profiles)
    if body.profile != "auto" and body.profile not in names:
        raise InvalidRequestError("profile", f"profile {body.profile!r}: choose one of {', '.join(names)}, or auto.")
    await deg.set_manual(None if body.profile == "auto" else body.profile)
    return deg.status()
