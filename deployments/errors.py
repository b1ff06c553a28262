"""Errors that cross from the model deployments to the ingress as plain data.

A model deployment never lets a user error escape as an exception (that would reach the ingress as a
wrapped RayTaskError): it returns or yields `{"error": {...}}` in OpenAI's shape, and the ingress maps
`type` to an HTTP status in one place.
"""
from __future__ import annotations

STATUS = {
    "invalid_request_error": 400,
    "not_found_error": 404,
    "overloaded_error": 503,
    "server_error": 500,
}
# Error codes whose status differs from their type's.
CODE_STATUS = {"invalid_api_key": 401, "body_too_large": 413}


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
