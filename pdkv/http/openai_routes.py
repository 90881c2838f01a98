"""The OpenAI HTTP surface the router and the workers both serve: one route table, one way to stream.

A client talks to the router or straight to a worker alike, so both apps
declare the OpenAI routes (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``) and the operational ones (``/health``, ``/metrics``) from this
table, and stream server-sent events with the same headers and the same
in-band ending when a stream fails after its headers went out. Each app adds
its own ``/pdkv/`` routes after these. It needs aiohttp, so it lives apart
from ``pdkv.http.openai_wire`` (the bytes of the wire, which need nothing).
"""

from __future__ import annotations

import functools
from typing import Protocol

from aiohttp import web

from pdkv.http.openai_wire import SSE_DONE, error_body, sse

# The generation routes: path, and whether its body is a chat (``messages``) or a plain ``prompt``.
GENERATION_ROUTES = (("/v1/completions", False), ("/v1/chat/completions", True))


class OpenAIServer(Protocol):
    """What an app serves behind the OpenAI routes."""

    async def generate(self, http: web.Request, path: str, chat: bool) -> web.StreamResponse:
        """A ``GENERATION_ROUTES`` request: ``path`` is its route, ``chat`` whether the body is a chat."""
        ...

    async def models(self, http: web.Request) -> web.Response: ...

    async def health(self, http: web.Request) -> web.Response: ...

    def render_metrics(self) -> bytes:
        """The Prometheus exposition of this server's metrics."""
        ...


def add_openai_routes(app: web.Application, server: OpenAIServer) -> None:
    """Route the OpenAI and operational endpoints of ``app`` to ``server``."""
    for path, chat in GENERATION_ROUTES:
        app.router.add_post(path, functools.partial(server.generate, path=path, chat=chat))
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", functools.partial(_metrics, server))


async def _metrics(server: OpenAIServer, _: web.Request) -> web.Response:
    return web.Response(body=server.render_metrics(), content_type="text/plain", charset="utf-8")


def sse_response() -> web.StreamResponse:
    """A streamed answer of server-sent events, not yet prepared."""
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


async def end_with_error(resp: web.StreamResponse, message: str, status: int) -> None:
    """End a stream whose headers are gone: the error as an in-band event, then ``[DONE]``, as OpenAI does."""
    await resp.write(sse(error_body(message, status)))
    await resp.write(SSE_DONE)
