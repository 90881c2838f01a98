"""The second hop of a request: the decode worker generates the answer, which the router relays to the client.

Until the client got a byte, any failure is the hop's (``UpstreamError``: ``pdkv.router.proxy`` tries another
pair); after that the stream ends with an in-band error event, as the workers' own streams do.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from pdkv.config import RouterConfig
from pdkv.errors import UpstreamError
from pdkv.http.openai_routes import sse_response
from pdkv.http.openai_wire import SSE_DONE
from pdkv.router.answers import ErrorAnswers
from pdkv.router.call import Call, log
from pdkv.router.failover import Failover
from pdkv.router.failures import hop_timeout
from pdkv.router.metrics import ROLE, RouterMetrics
from pdkv.router.modes import decode_body
from pdkv.router.pool import WorkerState
from pdkv.router.upstream import Upstream, check_content_type, check_status, parse_json


class DecodeHop:
    """Runs a request's decode hop on one decode worker and hands the client its answer, whole or streamed."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        upstream: Upstream,
        failover: Failover,
        answers: ErrorAnswers,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.upstream = upstream
        self.failover = failover
        self.answers = answers

    async def answer(
        self, call: Call, decode: WorkerState, params: dict[str, Any] | None, out: web.StreamResponse | None = None
    ) -> web.StreamResponse:
        """The client's answer from ``decode`` (``params``: the prefill hop's ``kv_transfer_params``, None: alone);
        ``out``: the client's stream, begun with P's first event (``pdkv.router.handoff``)."""
        sock_read = self.config.read_timeout_s if call.stream else None  # a whole answer comes at once: total bounds it
        timeout = aiohttp.ClientTimeout(
            total=hop_timeout(call.deadline, self.config.decode_timeout_s),
            sock_connect=self.config.connect_timeout_s,
            sock_read=sock_read,
        )
        started = time.monotonic()
        async with self.upstream.post(decode, "decode", call, decode_body(call.body, params), timeout) as resp:
            if resp.status == 200 and call.stream:
                check_content_type(decode, resp, "text/event-stream")
                response: web.StreamResponse = await self._relay(call, decode, resp, out)
            else:
                data = await self.upstream.guard(decode, "decode", resp.read())
                check_status(decode, "decode", resp, data)
                check_content_type(decode, resp, "application/json")
                parse_json(decode, "decode", data)  # relayed as bytes, but never a broken answer as a 200
                call.outcome = "ok"
                response = web.Response(body=data, content_type="application/json")
        self.metrics.hop.labels("decode").observe(time.monotonic() - started)
        return response

    async def _relay(
        self, call: Call, decode: WorkerState, resp: aiohttp.ClientResponse, out: web.StreamResponse | None
    ) -> web.StreamResponse:
        """Stream the decode worker's events to the client (on ``out`` when it has P's first event already); until
        the decode worker's first is sent, a failure is retryable.

        A client that hangs up makes a write to it raise ``ConnectionResetError`` (upstream failures
        are ``UpstreamError`` by then, see ``Upstream.guard``). That is the client's choice, not a fault:
        one line is logged, and leaving here closes the upstream stream unread, which stops the
        decode worker's generation and frees its blocks. Its transfer was claimed before its first
        event, so nothing is left to cancel on the decode side.
        """
        async with contextlib.aclosing(_sse_events(resp.content)) as events:
            first = await self._next_event(decode, events, abandon=True)
            if first is None:
                raise UpstreamError(
                    f"decode worker {decode.url} ended its stream before the first event", "empty_stream"
                )
            try:
                if out is None:
                    out = sse_response()
                    await out.prepare(call.http)
                await self.send(call, out, first)
                try:
                    # the client has bytes: a worker marked down mid-answer is waited for (a frozen one
                    # may thaw) until read_timeout_s; a retry could only end the answer with an error
                    last = first
                    while (event := await self._next_event(decode, events, abandon=False)) is not None:
                        await self.send(call, out, event)
                        last = event
                    if last != SSE_DONE:
                        raise UpstreamError(f"decode worker {decode.url} ended its stream without [DONE]", "truncated")
                    call.outcome = "ok"
                except UpstreamError as exc:  # the client has bytes already: say it in-band, as the workers do
                    self.failover.failed(call, decode, exc, [])
                    await self.answers.end_in_band(call, out, exc)
                await out.write_eof()
            except ConnectionResetError:
                call.outcome = "cancelled"
                log.info(
                    "request %s: the client disconnected mid-stream; closing the stream from decode worker %s",
                    call.request_id,
                    decode.url,
                )
        return out

    async def send(self, call: Call, out: web.StreamResponse, event: bytes) -> None:
        """One event to the client. The first is its time to first token; the second teaches ``disaggregate: auto``
        what the way it was served cost: the first decode step's token, whichever worker sent the first (with the
        handoff, P's token comes before the decode hop ran, and would make a slow link look free)."""
        await out.write(event)
        call.events_sent += 1
        if call.events_sent == 1:
            self.metrics.ttft.labels(ROLE).observe(time.monotonic() - call.arrived)
        elif call.events_sent == 2 and call.way_cost is not None:
            call.way_cost.observe(
                time.monotonic() - call.arrived, call.prompt.est_tokens, self.config.disaggregate_weight
            )

    async def _next_event(self, decode: WorkerState, events: AsyncIterator[bytes], abandon: bool) -> bytes | None:
        """The next whole event of the stream (None at its end); one cut short is a ``truncated`` failure."""
        try:
            event = await self.upstream.guard(decode, "decode", anext(events), abandon)
        except StopAsyncIteration:
            return None
        if not event.endswith(b"\n\n"):
            raise UpstreamError(f"decode worker {decode.url} cut its stream mid-event: {event[:200]!r}", "truncated")
        return event


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Whole server-sent events (``...\\n\\n``), so a failure never leaves half an event at the client."""
    buf = b""
    async for chunk in content.iter_any():
        buf += chunk
        while (end := buf.find(b"\n\n")) >= 0:
            yield buf[: end + 2]
            buf = buf[end + 2 :]
    if buf:
        yield buf
