"""The HTTP plumbing every role shares: bounded request bodies, error answers, bearer tokens, serving.

Workers and the router face the same clients, so they refuse the same way:
a body too large is a 413 before it is read, a body that trickles in is a
408, JSON that is not JSON (``NaN``, nesting deeper than ``MAX_JSON_DEPTH``,
bytes that are not UTF-8) is a 400, and whatever else goes wrong inside a
handler is logged with its traceback and answered as a 500 that carries no
traceback. A request aiohttp itself cannot parse (a malformed header, a
``Content-Length`` that is not a number) is a 400 from the connection
handler, before any middleware. Every answer is vLLM's error shape
(``pdkv.http.openai_wire``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from pdkv.config import HttpConfig
from pdkv.errors import RequestError
from pdkv.http.openai_wire import error_body
from pdkv.ratelog import Throttled

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Deeper JSON is refused: past a few hundred levels Python's json recursion fails (on decode or
# when the router re-encodes a hop), and no OpenAI request nests beyond a few dozen.
MAX_JSON_DEPTH = 100


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param), status=status)


def header_bytes(value: str) -> bytes:
    """A request header's value as the bytes the client sent.

    aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so a value that was not UTF-8 holds lone
    surrogates, which a plain ``.encode()`` refuses with ``UnicodeEncodeError``: a 500 for the client's mistake.
    """
    return value.encode("utf-8", "surrogateescape")


def forwardable_header(http: web.Request, name: str) -> str | None:
    """A header to send on to a worker as the client sent it, or None when absent; ``RequestError`` (400) when it
    is not UTF-8 (an HTTP client encodes the header it sends as UTF-8 and could not send this one)."""
    value = http.headers.get(name)
    if value is None:
        return None
    try:
        value.encode()
    except UnicodeEncodeError:
        raise RequestError(f"the {name} header is not valid UTF-8: {header_bytes(value)[:80]!r}", param=name) from None
    return value


def _no_constant(name: str) -> Any:
    raise RequestError(f"the request body is not valid JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # re-encoded for a hop it would be "Infinity": not JSON
        raise RequestError(f"the request body holds a number out of range: {text[:40]}")
    return value


def decode_json(raw: bytes) -> Any:
    """Parse a JSON body strictly: finite RFC 8259 numbers only, at most ``MAX_JSON_DEPTH`` levels deep."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/objects deeper than ``limit``; iterative, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


async def read_json(http: web.Request, limits: HttpConfig) -> Any:
    """The request's JSON body, read within ``limits`` (size, time); ``RequestError`` says what is wrong."""
    if http.content_length is not None and http.content_length > limits.max_body_bytes:
        raise RequestError(
            f"the request body is {http.content_length} bytes; this server takes at most {limits.max_body_bytes} "
            "(http.max_body_bytes)",
            413,
        )
    try:
        raw = await asyncio.wait_for(http.read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {limits.body_timeout_s:g}s (http.body_timeout_s)", 408
        ) from None
    except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past client_max_size
        raise RequestError(
            f"the request body is larger than {limits.max_body_bytes} bytes, the most this server takes "
            "(http.max_body_bytes)",
            413,
        ) from None
    return decode_json(raw)


def error_middleware() -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """``RequestError`` -> its 4xx; any other exception -> logged, and a 500 without a traceback."""

    @web.middleware
    async def middleware(http: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(http)
        except RequestError as exc:
            resp = error_response(exc.status, str(exc), exc.param)
            if exc.status in (408, 413):  # what is left of the body is not worth a keep-alive (see runner)
                resp.force_close()
            return resp
        except web.HTTPException:
            raise
        except ConnectionResetError:  # the client went away mid-request (a half-sent body): no one to answer
            log.info("%s %s: the client went away", http.method, http.path)
            return web.Response(status=400)
        except Exception:
            log.exception("%s %s failed", http.method, http.path)
            return error_response(
                500, f"internal error serving {http.method} {http.path}; the server's log has the details"
            )

    return middleware


def bearer_middleware(
    token: str, guarded: Callable[[web.Request], bool], hint: str
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Requests for which ``guarded`` holds want ``Authorization: Bearer <token>`` (no check when token is empty)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(http: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            token
            and guarded(http)
            and not hmac.compare_digest(header_bytes(http.headers.get("Authorization", "")), expected)
        ):
            return error_response(401, f"{http.method} {http.path} wants 'Authorization: Bearer <{hint}>'")
        return await handler(http)

    return middleware


def application(limits: HttpConfig, middlewares: list[Any] | None = None) -> web.Application:
    """An aiohttp application with the shared limits and error handling (outermost) in place."""
    return web.Application(
        client_max_size=limits.max_body_bytes, middlewares=[error_middleware(), *(middlewares or [])]
    )


class _OpenAIErrorProtocol(web.RequestHandler):
    """aiohttp's connection handler, with its own error answers in OpenAI's error shape.

    A request aiohttp cannot parse (a Content-Length that is not a number, a control byte in a header, a
    malformed chunked body's framing) is answered by the connection handler, before any middleware runs: as
    plain text, which an OpenAI client cannot read. Same status, same logging, vLLM's body.
    """

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises when an answer has already begun
        if status >= 500 or not message:  # never a traceback (aiohttp's debug mode puts one in the message)
            message = f"{HTTPStatus(status).phrase}: the server could not handle this request"
        resp = error_response(status, message)
        resp.force_close()
        return resp


ACCEPT_FAILED = "socket.accept() out of system resource"  # what asyncio says of a failed accept (selector_events)


class AcceptFailures:
    """This process's failed HTTP accepts, counted (``count``) and said at a bounded rate.

    asyncio logs each one with its traceback, up to the listener's backlog
    every second: out of file descriptors under a flood of connections, 82,000
    tracebacks in 25 s buried everything else in a worker's log. ``install``
    puts this in their place on the serving loop; whatever else the loop
    reports goes where it went before.
    """

    def __init__(self) -> None:
        self.count = 0
        self._said = Throttled(log)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Once per loop (every runner's setup calls it)."""
        previous = loop.get_exception_handler()
        if getattr(previous, "accept_failures", None) is self:
            return

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if _retry_after_close(context):
                return
            if context.get("message") != ACCEPT_FAILED:
                if previous is not None:
                    previous(loop, context)
                else:
                    loop.default_exception_handler(context)
                return
            self.count += 1
            self._said.log(
                logging.WARNING,
                "accept",
                "cannot accept an HTTP connection: %s (out of file descriptors? raise the open-files limit, "
                "`ulimit -n`)",
                context.get("exception"),
            )

        handle.accept_failures = self  # type: ignore[attr-defined]
        loop.set_exception_handler(handle)


def _retry_after_close(context: dict[str, Any]) -> bool:
    """Whether ``context`` is an accept retry that fired after its server closed: nothing failed.

    After a failed accept asyncio stops listening and schedules ``_start_serving`` a second later, once for each
    accept of the burst that failed (up to the backlog). A worker that stops within that second closes its socket
    first, and each retry then raises ``ValueError`` on the closed descriptor: a traceback apiece in the log of a
    worker that only shut down.
    """
    return "._start_serving(" in context.get("message", "") and isinstance(context.get("exception"), ValueError)


accept_failures = AcceptFailures()
"""The process's own: file descriptors run out per process, and one event loop serves a process's HTTP."""


class _OpenAIErrorServer(web.Server):
    """An aiohttp server whose connections answer their own errors in OpenAI's shape (``_OpenAIErrorProtocol``)."""

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        handler.__class__ = _OpenAIErrorProtocol  # the same object layout, one method replaced
        return handler


class _Runner(web.AppRunner):
    """``web.AppRunner`` whose server answers malformed requests in OpenAI's error shape too, on a loop that says
    failed accepts at a bounded rate (``AcceptFailures``)."""

    async def setup(self) -> None:
        accept_failures.install(asyncio.get_running_loop())
        await super().setup()
        assert self.server is not None
        self.server.__class__ = _OpenAIErrorServer  # aiohttp builds its Server itself; no argument picks the class


def runner(app: web.Application, limits: HttpConfig) -> web.AppRunner:
    """How every role serves: handler cancellation on, idle connections closed after ``idle_timeout_s``.

    handler_cancellation: a client that drops its connection cancels its handler. For a worker
    that stops the engine job and frees its blocks and reservation instead of generating for
    nobody; for the router it closes the upstream hops, which does the same on the workers.
    keepalive_timeout bounds a connection with no complete request, idle or half-sent headers alike
    (aiohttp's own default is an hour); lingering_time what an early answer waits for the rest of
    its body (aiohttp's: 10 s, which a client that trickles bytes holds open ten times over).
    """
    return _Runner(
        app,
        handle_signals=False,
        handler_cancellation=True,
        keepalive_timeout=limits.idle_timeout_s,
        lingering_time=limits.linger_s,
    )
