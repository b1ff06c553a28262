"""The service's published OpenAPI schema, built from the request models and the answer shapes the routes use.

The handlers parse bodies themselves (bounded reads, OpenAI-shaped errors), so FastAPI cannot see their
models; the schema is assembled here from `ROUTE_MODELS` instead, with every error status a route can answer.
The answers' schemas come from openai_shapes.py, the TypedDicts the handlers build them with.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from .openai_requests import ChatCompletionRequest, DetokenizeRequest, TextCompletionRequest, TokenizeRequest
from .openai_shapes import (ChatCompletionChunk, ChatCompletionResponse, DetokenizeResponse, ErrorResponse, Health,
                            ModelList, ResponseObject, TextCompletionChunk, TextCompletionResponse, TokenizeResponse)
from .responses_api import ResponsesRequest
from .systemone import DecisionRequest, DecisionResponse

# (path, method) -> (request body model or None, response model, the stream's chunk: None when the route does
# not stream, True for the Responses API's events, whose schema is OpenAI's ResponseStreamEvent)
ROUTE_MODELS = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    ("/v1/completions", "post"): (TextCompletionRequest, TextCompletionResponse, TextCompletionChunk),
    ("/v1/responses", "post"): (ResponsesRequest, ResponseObject, True),
    ("/v1/systemone", "post"): (DecisionRequest, DecisionResponse, None),
    ("/v1/models", "get"): (None, ModelList, None),
    ("/tokenize", "post"): (TokenizeRequest, TokenizeResponse, None),
    ("/detokenize", "post"): (DetokenizeRequest, DetokenizeResponse, None),
    ("/healthz", "get"): (None, Health, None),
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
    models = {m for shapes in ROUTE_MODELS.values() for m in shapes if m not in (None, True)} | {ErrorResponse}
    _, defs = TypeAdapter.json_schemas([(m, "validation", TypeAdapter(m))
                                        for m in sorted(models, key=lambda m: m.__name__)],
                                       ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    errors = {code: {"description": what, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
              for code, what in ERROR_STATUSES.items()}
    for (path, method), (req, resp, chunk) in ROUTE_MODELS.items():
        op = schema["paths"][path][method]
        op.pop("parameters", None)
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(req)}}}
        content = {"application/json": {"schema": _ref(resp)}}
        if chunk is not None:
            data = {"type": "string", "description": "a JSON chunk, an error, or [DONE]"}
            if chunk is not True:
                data = {"description": data["description"], "anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}
            content["text/event-stream"] = {"schema": {   # one server-sent event
                "type": "object", "required": ["data"],
                "properties": {"event": {"type": "string"}, "data": data}}}
        op["responses"] = {"200": {"description": "OK", "content": content}} | (errors if path != "/healthz" else {
            "503": {"description": "a model deployment does not answer", "content": {
                "application/json": {"schema": _ref(Health)}}}})
    for path in list(schema["paths"]):
        if path.startswith("/debug"):
            schema["paths"][path]["get"]["responses"] = {"200": {"description": "the replicas' counters",
                                                                  "content": {"application/json": {}}}} | errors
    app.openapi_schema = schema
    return schema
