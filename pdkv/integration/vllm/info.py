"""``GET /pdkv/info`` on a vLLM OpenAI server, for the router.

The router asks a decode worker where its KV receiver listens before it sends
the prefill hop; a vLLM server knows nothing of pdkv, so ``pdkv launch
--engine vllm`` adds this as vLLM ``--middleware`` and passes the answer in
``PDKV_VLLM_INFO`` (the receiver's address is fixed at launch, in the
connector's config).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

INFO_ENV = "PDKV_VLLM_INFO"
SECRET_ENV = "PDKV_VLLM_SECRET"  # the launcher passes the shared secret here, not in --kv-transfer-config on argv


async def pdkv_info(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Starlette HTTP middleware: answer ``/pdkv/info``, pass everything else on."""
    if request.url.path != "/pdkv/info":
        return await call_next(request)
    from starlette.responses import JSONResponse

    return JSONResponse(json.loads(os.environ.get(INFO_ENV) or "{}"))
