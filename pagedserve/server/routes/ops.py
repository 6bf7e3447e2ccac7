"""Operations: ``/health`` (and SageMaker's ``/ping``), ``/version``, ``/metrics`` (Prometheus), and
``/tokenize`` / ``/detokenize``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pagedserve
from pagedserve.errors import InvalidRequestError
from pagedserve.server.errors import APIError, error_response
from pagedserve.server.protocol import DetokenizeRequest, TokenizeRequest, template_args
from pagedserve.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    engine = state.engine
    if engine.dead is not None:
        return error_response(APIError(503, f"The engine stopped: {engine.dead!r}", "ServiceUnavailableError"))
    return Response(status_code=200)


@router.get("/ping")
@router.post("/ping")
async def ping(state: ServerState = Depends(server_state)):
    """SageMaker's health check."""
    return await health(state)


@router.get("/version")
async def version():
    return {"version": pagedserve.__version__}


@router.get("/metrics")
async def prometheus(state: ServerState = Depends(server_state)):
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)):
    state.check_model(body.model)
    inputs = state.engine.inputs
    if (body.messages is None) == (body.prompt is None):
        raise InvalidRequestError("prompt", "Give either prompt or messages (one of them).")
    if body.messages is not None:
        messages = [m.as_dict() for m in body.messages]
        args = template_args(body, state.settings.trust_request_chat_template, body.tools)
        tokens = await asyncio.to_thread(inputs.apply_chat_template, messages, **args)
    else:
        tokens = await asyncio.to_thread(inputs.encode, body.prompt, body.add_special_tokens)
    answer = {"count": len(tokens), "max_model_len": state.engine.config.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = inputs.tokenizer.convert_ids_to_tokens(tokens)
    return answer


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)):
    state.check_model(body.model)
    tok = state.engine.inputs.tokenizer
    if tok is None:
        raise InvalidRequestError("tokens", "This model runs without a tokenizer.")
    vocab = state.engine.config.model.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError("tokens", f"Token ids must be in [0, {vocab}).")
    return {"prompt": tok.decode(body.tokens)}
