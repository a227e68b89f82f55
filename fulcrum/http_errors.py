"""Every error an HTTP app of fulcrum sends (the server's and the router's alike), in OpenAI's shape, on every
route: fulcrum's own errors, the framework's (validation, unknown route, unreadable body) and anything unexpected;
and the OpenAPI document made to list the status codes the app really answers with."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fulcrum.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestFailedError,
    ShuttingDownError,
)
from fulcrum.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("fulcrum.http")
RETRY_AFTER_S = 1

# status code -> OpenAI's error type name, as vLLM spells them
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

# fulcrum's errors -> status code
STATUS = {
    InvalidRequestError: 400,
    ModelNotFoundError: 404,
    EngineOverloadedError: 503,
    ShuttingDownError: 503,
    EngineDeadError: 500,
    RequestFailedError: 500,
}


def status_of(e: BaseException) -> int:
    return next((code for kind, code in STATUS.items() if isinstance(e, kind)), 500)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _described(e: BaseException) -> tuple[int, str, str | None]:
    return status_of(e), str(e) or type(e).__name__, getattr(e, "param", None)


def error_of(e: BaseException) -> JSONResponse:
    return error(*_described(e))


def sse_error(e: BaseException) -> str:
    """Headers are sent once a stream starts: a failure ends it with an error event (then [DONE])."""
    return f"data: {json.dumps(error_body(*_described(e)))}\n\n"


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    # a union (the completions prompt) reports one branch per error; the field is what a user needs
    param = ".".join(x for x in loc if x != "str" and not x.startswith(("list[", "constrained-", "function-"))) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    cause = first.get("ctx", {}).get("error")
    if getattr(cause, "param", None):  # raised by our own validators, which know the field
        return msg, cause.param
    if len(errors) > 1 and param and all(e.get("loc", [])[:2] == first.get("loc", [])[:2] for e in errors):
        msg = f"{msg} (and {len(errors) - 1} other reasons: it matches none of the accepted shapes)"
    return f"{param or 'request'}: {msg}", param


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # the framework's own: unknown route, wrong method, a body it could not read (bad UTF-8, too deep)
        message = exc.detail if isinstance(exc.detail, str) else "the request cannot be served"
        if exc.status_code in (404, 405):
            message = f"{request.method} {request.url.path}: {message.lower()} on this server"
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body cannot be read as JSON (invalid UTF-8, or nested too deeply)"
        return error(exc.status_code, message, headers=getattr(exc, "headers", None))

    for kind in STATUS:

        @app.exception_handler(kind)
        async def on_fulcrum_error(request: Request, exc: Exception):
            return error_of(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")


# the error responses each API route documents
ERROR_RESPONSES = {
    code: {"model": ErrorResponse, "description": ERROR_TYPES[code]} for code in (400, 401, 404, 415, 500, 503)
}


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every route with a body; this server answers 400 instead."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for methods in schema.get("paths", {}).values():
            for op in methods.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
