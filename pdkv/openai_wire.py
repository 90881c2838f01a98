"""The OpenAI wire shapes every HTTP role shares: SSE framing and the error body.

They live apart from ``pdkv.worker.openai_api`` (which re-exports them)
because that module needs the engine, and so torch: the router speaks the
same shapes and starts in half a second with a tenth of the memory.
"""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict[str, Any]:
    """OpenAI's error object: clients (the official one included) read ``error.message``."""
    return {"error": {"message": message, "type": kind, "code": code}}
