"""Every error the API returns has OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.errors import InvalidRequestError, RequestFailedError
from pagedserve.server.async_engine import EngineDeadError

logger = logging.getLogger(__name__)


class ShuttingDownError(RuntimeError):
    """The server stopped a request that had not finished when its shutdown deadline came."""


def status_of(e: BaseException) -> tuple[int, str]:
    """The HTTP status and error type a request that failed with ``e`` is answered with."""
    if isinstance(e, (EngineDeadError, ShuttingDownError)):
        return 503, "ServiceUnavailableError"
    return 500, "InternalServerError"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status, headers=e.headers)


def unavailable(message: str, retry_after: int = 1) -> APIError:
    """503 with Retry-After: the request is fine, the server is at a limit for now."""
    return APIError(503, message, "ServiceUnavailableError", headers={"Retry-After": str(retry_after)})


def _validation_message(exc: RequestValidationError, content_type: str) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    if first.get("loc") == ("body",) and not content_type.startswith("application/json"):
        return (f"Send the request body as JSON with 'Content-Type: application/json' "
                f"(got {content_type or 'no Content-Type'}).", None)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg')} (got {first.get('input')!r}).", param


def install_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to its status and the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        return error_response(APIError(400, str(e), "BadRequestError", e.param))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        message, param = _validation_message(e, request.headers.get("content-type", ""))
        return error_response(APIError(400, message, "BadRequestError", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):  # unknown routes (404), wrong methods (405)
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "HTTPError")
        api = ", ".join(request.app.state.openai_routes)  # set by build_app, the one app these handlers serve
        message = {404: f"No route {request.url.path}; this server's OpenAI routes are {api}.",
                   405: f"{request.method} is not allowed on {request.url.path}."}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, message, kind, headers=getattr(e, "headers", None)))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(ShuttingDownError)
    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, e: Exception):
        status, kind = status_of(e)
        return error_response(APIError(status, str(e), kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):  # a bug, not bad input: still answer in the API's shape
        logger.exception("internal error")
        return error_response(APIError(500, f"Internal error: {type(e).__name__}: {e}", "InternalServerError"))
