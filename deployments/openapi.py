"""The service's published OpenAPI schema, built from the request and response models the routes use.

The handlers parse bodies themselves (bounded reads, OpenAI-shaped errors), so FastAPI cannot see their
models; the schema is assembled here from `ROUTE_MODELS` instead, with every error status a route can answer.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from core.decision.types import DecisionRequest, DecisionResponse

from .openai_api import (ChatCompletionRequest, ChatCompletionResponse, DetokenizeRequest, DetokenizeResponse,
                         ErrorResponse, Health, ModelList, TextCompletionRequest, TextCompletionResponse,
                         TokenizeRequest, TokenizeResponse)
from .responses_api import ResponseObject, ResponsesRequest

# (path, method) -> (request body model or None, response model, streams)
ROUTE_MODELS = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletionResponse, True),
    ("/v1/completions", "post"): (TextCompletionRequest, TextCompletionResponse, True),
    ("/v1/responses", "post"): (ResponsesRequest, ResponseObject, True),
    ("/v1/systemone", "post"): (DecisionRequest, DecisionResponse, False),
    ("/v1/models", "get"): (None, ModelList, False),
    ("/tokenize", "post"): (TokenizeRequest, TokenizeResponse, False),
    ("/detokenize", "post"): (DetokenizeRequest, DetokenizeResponse, False),
    ("/healthz", "get"): (None, Health, False),
}
ERROR_STATUSES = {"400": "bad request: the message names the field", "401": "a missing or wrong API key",
                  "404": "unknown route or model", "413": "body over max_body_bytes",
                  "500": "a server fault", "503": "at capacity: retry after Retry-After seconds"}


def _ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_schema(app: FastAPI) -> dict:
    """OpenAPI 3.1 for every route of `app`, with the real request and response models (built once)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version="1", routes=app.routes)
    models = {m for req, resp, _ in ROUTE_MODELS.values() for m in (req, resp) if m} | {ErrorResponse}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    errors = {code: {"description": what, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
              for code, what in ERROR_STATUSES.items()}
    for (path, method), (req, resp, streams) in ROUTE_MODELS.items():
        op = schema["paths"][path][method]
        op.pop("parameters", None)
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(req)}}}
        content = {"application/json": {"schema": _ref(resp)}}
        if streams:
            content["text/event-stream"] = {"schema": {   # one server-sent event
                "type": "object", "required": ["data"],
                "properties": {"event": {"type": "string"},
                               "data": {"type": "string", "description": "a JSON chunk, an error, or [DONE]"}}}}
        op["responses"] = {"200": {"description": "OK", "content": content}} | (errors if path != "/healthz" else {
            "503": {"description": "a model deployment does not answer", "content": {
                "application/json": {"schema": _ref(Health)}}}})
    for path in list(schema["paths"]):
        if path.startswith("/debug"):
            schema["paths"][path]["get"]["responses"] = {"200": {"description": "the replicas' counters",
                                                                  "content": {"application/json": {}}}} | errors
    app.openapi_schema = schema
    return schema
