"""Errors on the HTTP path: OpenAI's error body, the one mapping from error types to status codes, the handlers.

A model deployment never lets a user error escape as an exception (that would reach the Ingress as a wrapped
RayTaskError): the decision model returns a `DecisionRefused` record and the chat model yields a `StreamError`
record; the Ingress raises either as an `APIError` (`APIError.of`, the one place either becomes OpenAI's error
body), and `error_response` turns `type` (or a `code` whose status differs) into the HTTP status, here and
nowhere else.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.chat.protocol import StreamError
from core.decision.protocol import DecisionRefused

from .openai_shapes import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

STATUS = {
    "invalid_request_error": 400,
    "not_found_error": 404,
    "overloaded_error": 503,
    "server_error": 500,
}
# Error codes whose status differs from their type's.
CODE_STATUS = {"invalid_api_key": 401, "body_too_large": 413}
RETRY_AFTER_S = "1"


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))


class APIError(Exception):
    """An error answer: OpenAI's error body, and any headers to send with it."""

    def __init__(self, body: dict, headers: dict | None = None):
        self.body, self.headers = body, headers or {}

    @classmethod
    def of(cls, e: StreamError | DecisionRefused) -> "APIError":
        """The error a model's refusal is to the client: a chat stream's StreamError as it says; a decision
        request's refusal a 400 naming every bad key (`errors`: each key's reason)."""
        if isinstance(e, DecisionRefused):
            body = error(e.message, param=next(iter(e.errors), None))
            body["error"]["errors"] = dict(e.errors)
            return cls(body)
        return cls(error(e.message, e.type, e.param, e.code))


def status_of(body: dict) -> int:
    err = body["error"]
    return CODE_STATUS.get(err.get("code"), STATUS.get(err.get("type"), 500))


def error_response(body: dict, headers: dict | None = None) -> JSONResponse:
    status = status_of(body)
    if status == 503:
        headers = {"Retry-After": RETRY_AFTER_S, **(headers or {})}
    return JSONResponse({"error": body["error"]}, status_code=status, headers=headers)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    parts, param = [], None
    for e in errs[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or loc or None
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", param


def install_handlers(app: FastAPI) -> None:
    """Every error leaves `app` as OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.body, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(error(msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = str(exc.detail) if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
        return JSONResponse({"error": error(msg, kind)["error"]}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(error("internal error", "server_error"))
