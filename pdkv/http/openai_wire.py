"""The OpenAI wire shapes every HTTP role shares: SSE framing and the error body.

They live apart from ``pdkv.worker.openai_api`` because that module needs
the engine: the router speaks the same shapes and never imports the engine.
"""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"

# The error ``type`` per status, as vLLM's OpenAI server names them (after the openai client's exceptions).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_body(message: str, code: int = 400, param: str | None = None) -> dict[str, Any]:
    """vLLM's error object, ``{"error": {message, type, param, code}}``: OpenAI clients read ``error.message``."""
    kind = ERROR_TYPES.get(code, "BadRequestError" if 400 <= code < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
