"""A prefill or decode worker's HTTP API: the routes, request parsing, the engine job and the answer.

Both roles serve the same OpenAI API (``pdkv.http.openai_routes``); what differs is
what ``kv_transfer_params`` in a request make them do, in the shape vLLM's
disaggregated proxies use, and that is the role object's, chosen once at
start: ``pdkv.worker.prefill`` (``do_remote_decode``: compute the prompt and
push its KV to the decode worker named) and ``pdkv.worker.decode``
(``do_remote_prefill``: adopt that KV and decode from P's first token, or
compute the prompt here when it did not come). No ``kv_transfer_params``: an
ordinary local generation. Every prompt computed here, in any role, is
offered to the cache tier (``pdkv.worker.tiering``).

``DELETE /pdkv/transfers/{transfer_id}`` on a decode worker: the router gave
up on that transfer before its decode request came; the reservation is freed
now, and a prefill that comes late can no longer take that id. With a
``secret`` set, this and every other ``/pdkv/`` endpoint that changes
something want ``Authorization: Bearer <pdkv.auth.control_token(secret)>``
(the router sends it).

Request bodies are read within ``http`` limits (``pdkv.http.web``); a long one
is parsed (tokenized) on a thread of its own, so a huge prompt never stalls the
event loop and the health checks it answers, a short one on the event loop,
where it costs less than the hop to a thread. ``/health`` answers 503 when
the engine has work but finished no step for ``stall_timeout_s``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from pdkv.auth import control_token
from pdkv.channels import create_channel
from pdkv.config import PdkvConfig
from pdkv.engine.base import EngineAdapter
from pdkv.engine.sampling import TokenLogprobs
from pdkv.errors import OutOfBlocksError, PdkvError, RequestError
from pdkv.http.openai_routes import add_openai_routes, end_with_error, sse_response
from pdkv.http.openai_wire import SSE_DONE, sse
from pdkv.http.web import accept_failures, application, bearer_middleware, error_response, read_json
from pdkv.netaddr import is_loopback
from pdkv.transfer.gauges import GAUGES
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender
from pdkv.worker import openai_api as api
from pdkv.worker.decode import DecodeRole
from pdkv.worker.engine_loop import EngineLoop, Job
from pdkv.worker.kv_events import TierEvents
from pdkv.worker.metrics import WorkerMetrics
from pdkv.worker.prefill import PrefillRole
from pdkv.worker.push import ChunkPusher
from pdkv.worker.role import Plan, WorkerRole
from pdkv.worker.tiering import Tiering

log = logging.getLogger(__name__)


# Request bodies up to this size are parsed on the event loop (``Worker._parse``): about 500 tokens of text.
INLINE_PARSE_BYTES = 2048

Event = tuple[int, "str | None", "TokenLogprobs | None"]
"""One generated token as the engine thread reports it: (token, finish reason, log-probabilities)."""


class Worker:
    """One prefill or decode worker around an engine. ``app()`` is its aiohttp application."""

    def __init__(self, config: PdkvConfig, engine: EngineAdapter) -> None:
        if config.role not in ("prefill", "decode"):
            raise PdkvError(f"a worker's role must be prefill or decode, got {config.role!r}")
        self.config = config
        self.role = config.role
        self.engine = engine
        self.agent = f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.chunk_size = config.transfer.chunk_size
        self.metrics = WorkerMetrics(self.role)
        self.tiering = Tiering.from_config(config.tier, engine, self.chunk_size, self.metrics)
        self.kv_events = TierEvents.start(config.kv_events, self.tiering.tier, self.chunk_size, config.host)
        if self.kv_events is not None:
            self.tiering.on_prompt = self.kv_events.note
        self.loop = EngineLoop(engine, chunk_size=self.chunk_size, first_token_yield_s=config.first_token_yield_s)
        # What a request's "model" may name: the model's own name and what the config called it.
        self.served_models = frozenset({engine.model_name, config.model})
        # Parsing tokenizes (the GIL released): two threads of its own, never queued behind the
        # default executor's threads, which wait for transfers.
        self._parser = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pdkv-parse")
        advertised = config.advertised_host()  # a wildcard host without advertise_host fails here, at start
        channel_options = config.channel_options()
        warn_if_data_plane_local(config.host, channel_options["host"])
        self.channel = create_channel(config.channel.name, self.agent, channel_options)
        self.kv_role: WorkerRole
        if self.role == "prefill":
            self.kv_role = PrefillRole(config, engine, self.channel, self.tiering, self.metrics, self.agent)
        else:
            self.kv_role = DecodeRole(config, engine, self.channel, self.tiering, self.metrics, advertised)
        m = self.metrics
        m.gauge("pdkv_running_requests", "Requests on the engine", lambda: self.loop.num_running)
        m.gauge("pdkv_free_blocks", "Free KV blocks", lambda: engine.allocator.num_free)
        m.gauge(
            "pdkv_reserved_blocks", "KV blocks held by transfer reservations", lambda: self._stat("reserved_blocks")
        )
        m.gauge(
            "pdkv_pooled_blocks",
            "KV blocks granted ahead to senders (pools: held between requests, not leaked)",
            lambda: self._stat("pooled_blocks"),
        )
        m.gauge(
            "pdkv_pooled_slots",
            "Staging slots granted ahead to senders whose chunks are staged (staged pools)",
            lambda: self._stat("pooled_slots"),
        )
        m.gauge("pdkv_reservations", "Open transfer reservations", lambda: self._stat("reservations"))
        m.gauge(
            "pdkv_inflight_bytes",
            "Bytes posted to the channel and not yet landed",
            lambda: self._stat("inflight_bytes"),
        )
        m.gauge("pdkv_open_transfers", "Outgoing transfers not yet settled", lambda: self._stat("open_transfers"))
        # the channel counts its own events (auth_failures of data connections) under the same names: exported summed
        m.events(
            lambda: (
                collections.Counter(self.kv_role.stats())
                + collections.Counter(self.channel.stats())
                + collections.Counter(http_accept_failures=accept_failures.count)
            ),
            GAUGES,
        )

    def _stat(self, name: str) -> float:
        return float(self.kv_role.stats().get(name, 0))

    # The role's transfer endpoint (None where the role has no such end).
    @property
    def sender(self) -> KVSender | None:
        return self.kv_role.sender

    @property
    def pusher(self) -> ChunkPusher | None:
        return self.kv_role.pusher

    @property
    def receiver(self) -> KVReceiver | None:
        return self.kv_role.receiver

    # -- HTTP ------------------------------------------------------------------------
    def app(self) -> web.Application:
        control = bearer_middleware(
            control_token(self.config.secret) if self.config.secret else "",
            lambda http: http.path.startswith("/pdkv/") and http.method != "GET",
            "pdkv.auth.control_token(secret)",
        )
        app = application(self.config.http, [control])
        add_openai_routes(app, self)
        app.router.add_get("/pdkv/info", self._info)
        app.router.add_delete("/pdkv/transfers/{transfer_id}", self._cancel_transfer)
        app.router.add_post("/pdkv/kv-events/resync", self._resync_kv_events)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.engine.model_name, "object": "model", "created": 0, "owned_by": "pdkv"}],
            }
        )

    async def health(self, _: web.Request) -> web.Response:
        stalled = self.loop.stalled_for()
        if stalled > self.config.stall_timeout_s:
            message = (
                f"engine stalled: {self.loop.num_running} requests and no step finished for {stalled:.0f}s "
                f"(stall_timeout_s {self.config.stall_timeout_s:g})"
            )
            return web.json_response({"status": message, "role": self.role}, status=503)
        return web.json_response({"status": "ok", "role": self.role})

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def _info(self, _: web.Request) -> web.Response:
        info: dict[str, Any] = {
            "role": self.role,
            "agent": self.agent,
            "model": self.engine.model_name,
            "fingerprint": self.engine.fingerprint,
            "channel": self.channel.name,
            "chunk_size": self.chunk_size,
            "layout": msgspec.to_builtins(self.engine.layout),
            "tier": self.config.tier.describe_levels() if self.tiering.tier is not None else [],  # levels built
        }
        info.update(self.kv_role.info())
        if self.kv_events is not None:
            pub = self.kv_events.publisher
            info["kv_events"] = {
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "topic": pub.config.topic,
                "block_size": self.chunk_size,
                "resync": "/pdkv/kv-events/resync",
                "curve": pub.curve is not None,  # whether a subscriber needs CURVE keys (pdkv.kv_events.curve)
            }
        return web.json_response(info)

    async def _resync_kv_events(self, _: web.Request) -> web.Response:
        """A subscriber lost track of this worker's blocks: publish them all again (pdkv.worker.kv_events)."""
        if self.kv_events is None:
            raise RequestError(
                "this worker publishes no KV events (kv_events.enable_kv_cache_events is false)", status=404
            )
        blocks = await asyncio.to_thread(self.kv_events.resync)
        return web.json_response({"blocks": blocks})

    async def _cancel_transfer(self, http: web.Request) -> web.Response:
        """The router gave up on a transfer before its decode request came (prefill failed, client gone):
        free its reservation now instead of when its lease runs out."""
        transfer_id = http.match_info["transfer_id"]
        self.kv_role.cancel_transfer(transfer_id)
        return web.json_response({"cancelled": transfer_id})

    async def generate(self, http: web.Request, path: str, chat: bool) -> web.StreamResponse:
        """A completions (``chat`` false) or chat completions request; ``path`` says the same, so it goes unread."""
        arrived = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            body = await read_json(http, self.config.http)
            req = await self._parse(http, body, chat)
            plan = await self.kv_role.plan(req)
        except RequestError:  # answered by the error middleware
            self.metrics.requests.labels(self.role, "invalid").inc()
            raise
        except OutOfBlocksError as exc:
            self.metrics.requests.labels(self.role, "rejected").inc()
            return error_response(503, f"no room for this request right now: {exc}")
        out: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        job = Job(
            request=plan.job_request,
            on_token=lambda t, f, lp: loop.call_soon_threadsafe(out.put_nowait, (t, f, lp)),
            on_error=lambda e: loop.call_soon_threadsafe(out.put_nowait, e),
            decode=plan.decode,
            first_token=plan.first_token,
            on_chunk=plan.on_chunk,
            release=plan.release,
            logprobs=req.logprobs,
            first_logprobs=plan.first_logprobs,
            first_out=threading.Event() if req.stream else None,
        )
        # Submitted here, not on the first read of the events: whatever ends this handler early
        # (the client gone while headers are written, a failed write, a cancel) still reaches the
        # ``finally``, and the engine thread stops the job and frees its blocks and transfer.
        self.loop.submit(job)
        try:
            if req.stream:
                return await self._stream(http, req, plan, _events(out), arrived, job.first_out)
            return await self._collect(req, plan, _events(out), arrived)
        except PdkvError as exc:
            self.metrics.requests.labels(self.role, "error").inc()
            return error_response(500, str(exc))
        finally:
            job.cancelled.set()  # a no-op once the job finished
            if job.first_out is not None:
                job.first_out.set()  # a handler that ended before its first write keeps the engine waiting no longer

    async def _parse(self, http: web.Request, body: Any, chat: bool) -> api.GenerationRequest:
        """The validated request; a long body is parsed (tokenized) on a parser thread, a short one here.

        The hop to a thread and back costs a loaded host 0.3-0.6 ms per request (twice per P/D request:
        once on P, once on D), while tokenizing costs about 1 ms per 4 KB of text (a 300-byte prompt
        0.07 ms; token ids far less): up to ``INLINE_PARSE_BYTES`` the hop costs about as much as the work
        or more, and only a longer prompt is worth keeping off the event loop.
        """
        if http.content_length is not None and http.content_length <= INLINE_PARSE_BYTES:
            return api.parse_request(body, self.engine, chat, self.served_models)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._parser, api.parse_request, body, self.engine, chat, self.served_models)

    async def _collect(
        self, req: api.GenerationRequest, plan: Plan, events: AsyncIterator[Event], arrived: float
    ) -> web.Response:
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        finish = None
        async for token, why, lp in events:
            finish = why  # the last event's reason is the answer's
            if not tokens:
                self._first_token(plan, token, lp, arrived)
            tokens.append(token)
            logprobs.append(lp)
        self._done(len(tokens))
        text = self.engine.tokenizer.decode(tokens)
        fmt = api.LogprobsFormat.of(req, self.engine.tokenizer)
        return web.json_response(
            api.full_response(
                req, text, tokens, finish, plan.kv_params, None if fmt is None else fmt.block(tokens, logprobs)
            )
        )

    async def _stream(
        self,
        http: web.Request,
        req: api.GenerationRequest,
        plan: Plan,
        events: AsyncIterator[Event],
        arrived: float,
        first_out: threading.Event | None = None,
    ) -> web.StreamResponse:
        """Stream the answer as server-sent events.

        A client that hangs up surfaces as ``ConnectionResetError`` from a write whenever the write comes
        before aiohttp cancels the handler (no ``handler_cancellation``, or a write racing the cancel).
        Left to aiohttp it is logged as a server error with a traceback, yet it is the client's choice:
        one line is logged, and the handler's ``finally`` stops the job and frees its blocks.
        """
        resp = sse_response()
        try:
            await resp.prepare(http)
            stream = api.StreamEvents(req, self.engine.tokenizer, plan.handoff)
            try:
                async for token, finish, lp in events:
                    if stream.count == 0:
                        self._first_token(plan, token, lp, arrived)
                    event = stream.next(token, finish, lp)
                    if event is not None:
                        await resp.write(event)
                    if stream.count == 1 and first_out is not None:
                        first_out.set()  # the engine thread may step on (``EngineLoop._emit``)
            except PdkvError as exc:  # headers are gone: report in-band, as OpenAI does
                self.metrics.requests.labels(self.role, "error").inc()
                await end_with_error(resp, str(exc), 500)
                return resp
            if plan.kv_params is not None:
                await resp.write(
                    sse({"id": req.request_id, "object": "kv_transfer_params", "kv_transfer_params": plan.kv_params})
                )
            if req.include_usage:
                await resp.write(api.usage_event(req, stream.count))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("request %s: the client disconnected mid-stream; stopping it", req.request_id)
            return resp
        self._done(stream.count)
        return resp

    def _first_token(self, plan: Plan, token: int, logprobs: TokenLogprobs | None, arrived: float) -> None:
        self.metrics.ttft.labels(self.role).observe(time.monotonic() - arrived)
        if plan.on_first_token is not None:
            plan.on_first_token(token, logprobs)

    def _done(self, generated: int) -> None:
        self.metrics.requests.labels(self.role, "ok").inc()
        self.metrics.generated_tokens.labels(self.role).inc(generated)

    # -- shutdown ---------------------------------------------------------------------------
    async def _on_cleanup(self, _app: web.Application) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self.loop.close()
        self._parser.shutdown(wait=False, cancel_futures=True)
        self.kv_role.close()
        self.channel.close()
        self.tiering.close()
        if self.kv_events is not None:  # after the tier: its last writes behind are announced too
            self.kv_events.close()


def warn_if_data_plane_local(host: str, channel_host: str) -> None:
    """A worker serving another host whose channel stays on loopback cannot move KV to or from any other host: say
    so at start."""
    if is_loopback(channel_host) and not is_loopback(host):
        log.warning(
            "channel.options.host is %s while the worker serves %s: peers on other hosts cannot reach this worker's "
            "data plane, and every transfer with them will fail (drop channel.options.host to follow --host)",
            channel_host,
            host,
        )


async def _events(out: asyncio.Queue[Event | BaseException]) -> AsyncIterator[Event]:
    """Yield the job's (token, finish, logprobs) until it finishes; its errors are raised as ``PdkvError``."""
    finished = False
    while not finished:
        item = await out.get()
        if isinstance(item, BaseException):
            raise item if isinstance(item, PdkvError) else PdkvError(f"generation failed: {item}")
        finished = item[1] is not None
        yield item
