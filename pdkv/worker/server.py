"""A prefill or decode worker: the engine loop, the transfer wiring, and its HTTP API.

Both roles serve the same OpenAI API; what differs is what ``kv_transfer_params``
in a request makes them do, in the shape vLLM's disaggregated proxies use:

* prefill, ``{"do_remote_decode": true, "remote_host", "remote_port",
  "transfer_id"}`` (and ``"codec"``: one of this worker's codecs, ``none`` or
  its ``transfer.codec``, for this request's chunks; the router's
  ``disaggregate: auto`` sends it): load the prompt's cached prefix from the cache tier
  (``pdkv.worker.tiering``), reserve room on that decode worker's receiver,
  compute the rest chunk by chunk while each chunk, loaded or computed, is
  pushed, return the first token with the ``kv_transfer_params`` the decode
  worker needs. Every prompt computed here, in any role, is offered to the tier.
  (vLLM's NixlConnector has D pull from P; pdkv pushes, so P is told where D
  is: ``remote_host``/``remote_port`` are D's receiver, from D's /pdkv/info.)
* decode, ``{"do_remote_prefill": true, "transfer_id", "first_token_id"}``:
  wait for the landed KV, adopt its blocks and decode from P's first token.
  The KV is adopted only if P computed it for this very prompt: P's Reserve
  carries the prompt's chained key and D compares it with the key of the
  prompt it was asked to decode (nothing the client sends decides it). If the
  transfer failed, timed out, was never started or was computed for another
  prompt, compute the prompt locally (``pdkv_fallbacks``): a request is never
  lost to a transfer fault, only slower.
* no ``kv_transfer_params``: an ordinary local generation.

``DELETE /pdkv/transfers/{transfer_id}`` on a decode worker: the router gave
up on that transfer before its decode request came; the reservation is freed
now, and a prefill that comes late can no longer take that id. With a
``secret`` set, this and every other ``/pdkv/`` endpoint that changes
something want ``Authorization: Bearer <pdkv.auth.control_token(secret)>``
(the router sends it).

Request bodies are read within ``http`` limits (``pdkv.web``) and parsed
(tokenized) on a thread of their own, so a huge prompt never stalls the
event loop and the health checks it answers. ``/health`` answers 503 when
the engine has work but finished no step for ``stall_timeout_s``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from pdkv.auth import control_token
from pdkv.channels import create_channel
from pdkv.checksum import layer_digests
from pdkv.config import PdkvConfig
from pdkv.engine.base import EngineAdapter, Request
from pdkv.engine.sampling import MIN_LOGPROB, SamplingParams, TokenLogprobs
from pdkv.errors import (
    InvalidRequestError,
    NotAnnouncedError,
    OutOfBlocksError,
    PdkvError,
    PeerUnreachableError,
    PromptMismatchError,
    RequestError,
    TransferError,
    TransferTimeout,
)
from pdkv.keys import chunk_keys
from pdkv.netaddr import is_loopback
from pdkv.openai_http import add_openai_routes, end_with_error, sse_response
from pdkv.openai_wire import SSE_DONE, sse
from pdkv.receiver import KVReceiver, ReceivedKV
from pdkv.sender import KVSender, OutgoingTransfer
from pdkv.web import application, bearer_middleware, error_response, read_json
from pdkv.worker import openai_api as api
from pdkv.worker.engine_loop import EngineLoop, Job
from pdkv.worker.kv_events import TierEvents
from pdkv.worker.metrics import WorkerMetrics
from pdkv.worker.push import ChunkPusher
from pdkv.worker.tiering import CachedPrefix, Tiering

log = logging.getLogger(__name__)


Event = tuple[int, "str | None", "TokenLogprobs | None"]
"""One generated token as the engine thread reports it: (token, finish reason, log-probabilities)."""


@dataclasses.dataclass
class _Plan:
    """What the engine will run for one HTTP request, and what to tell the client."""

    job_request: Request
    first_token: int | None = None
    first_logprobs: TokenLogprobs | None = None
    decode: bool = True
    on_chunk: Callable[[Request, int, int], None] | None = None
    release: Callable[[Request], None] | None = None
    kv_params: dict[str, Any] | None = None


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
        self.loop = EngineLoop(engine, chunk_size=self.chunk_size)
        # What a request's "model" may name: the model's own name and what the config called it.
        self.served_models = frozenset({engine.model_name, config.model})
        # Parsing tokenizes (the GIL released): two threads of its own, never queued behind the
        # default executor's threads, which wait for transfers.
        self._parser = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pdkv-parse")
        advertised = config.advertised_host()  # a wildcard host without advertise_host fails here, at start
        channel_options = config.channel_options()
        warn_if_data_plane_local(config.host, channel_options["host"])
        self.channel = create_channel(config.channel.name, self.agent, channel_options)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.pusher: ChunkPusher | None = None
        if self.role == "prefill":
            self.sender = KVSender(self.channel, engine.layout, engine.kv_buffer, engine.fingerprint, config.transfer, secret=config.secret)
            self.pusher = ChunkPusher()
        else:
            self.receiver = KVReceiver(self.channel, engine.layout, engine.kv_buffer, engine.allocator, engine.fingerprint, config.transfer, host=config.host, port=config.control_port, secret=config.secret, advertise_host=advertised)
        m = self.metrics
        m.gauge("pdkv_running_requests", "Requests on the engine", lambda: self.loop.num_running)
        m.gauge("pdkv_free_blocks", "Free KV blocks", lambda: engine.allocator.num_free)
        m.gauge("pdkv_reserved_blocks", "KV blocks held by transfer reservations", lambda: self._stat("reserved_blocks"))
        m.gauge("pdkv_reservations", "Open transfer reservations", lambda: self._stat("reservations"))
        m.gauge("pdkv_inflight_bytes", "Bytes posted to the channel and not yet landed", lambda: self._stat("inflight_bytes"))
        m.gauge("pdkv_open_transfers", "Outgoing transfers not yet settled", lambda: self._stat("open_transfers"))
        side = self.receiver or self.sender
        assert side is not None
        # the channel counts its own events (auth_failures of data connections) under the same names: exported summed
        m.events(lambda: collections.Counter(side.stats()) + collections.Counter(self.channel.stats()), frozenset({"free_blocks", "free_staging_slots", "reservations", "reserved_blocks", "inflight_bytes", "open_transfers"}))

    def _stat(self, name: str) -> float:
        side = self.receiver or self.sender
        return float(side.stats().get(name, 0)) if side is not None else 0.0

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
        return web.json_response({"object": "list", "data": [{"id": self.engine.model_name, "object": "model", "created": 0, "owned_by": "pdkv"}]})

    async def health(self, _: web.Request) -> web.Response:
        stalled = self.loop.stalled_for()
        if stalled > self.config.stall_timeout_s:
            message = f"engine stalled: {self.loop.num_running} requests and no step finished for {stalled:.0f}s (stall_timeout_s {self.config.stall_timeout_s:g})"
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
        }
        if self.receiver is not None:
            host, port = self.receiver.address.removeprefix("tcp://").rsplit(":", 1)
            info.update(receiver_address=self.receiver.address, remote_host=host, remote_port=int(port))
        if self.kv_events is not None:
            pub = self.kv_events.publisher
            info["kv_events"] = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": pub.config.topic, "block_size": self.chunk_size, "resync": "/pdkv/kv-events/resync"}
        return web.json_response(info)

    async def _resync_kv_events(self, _: web.Request) -> web.Response:
        """A subscriber lost track of this worker's blocks: publish them all again (pdkv.worker.kv_events)."""
        if self.kv_events is None:
            raise RequestError("this worker publishes no KV events (kv_events.enable_kv_cache_events is false)", status=404)
        blocks = await asyncio.to_thread(self.kv_events.resync)
        return web.json_response({"blocks": blocks})

    async def _cancel_transfer(self, http: web.Request) -> web.Response:
        """The router gave up on a transfer before its decode request came (prefill failed, client gone):
        free its reservation now instead of when its lease runs out."""
        if self.receiver is None:
            return error_response(404, "only a decode worker holds transfers")
        transfer_id = http.match_info["transfer_id"]
        self.receiver.cancel(transfer_id, "cancelled by the router")
        return web.json_response({"cancelled": transfer_id})

    async def generate(self, http: web.Request, path: str, chat: bool) -> web.StreamResponse:
        """A completions (``chat`` false) or chat completions request; ``path`` says the same, so it goes unread."""
        arrived = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            body = await read_json(http, self.config.http)
            req = await loop.run_in_executor(self._parser, api.parse_request, body, self.engine, chat, self.served_models)
            plan = await self._plan(req)
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
        )
        # Submitted here, not on the first read of the events: whatever ends this handler early
        # (the client gone while headers are written, a failed write, a cancel) still reaches the
        # ``finally``, and the engine thread stops the job and frees its blocks and transfer.
        self.loop.submit(job)
        try:
            if req.stream:
                return await self._stream(http, req, plan, _events(out), arrived)
            return await self._collect(req, plan, _events(out), arrived)
        except PdkvError as exc:
            self.metrics.requests.labels(self.role, "error").inc()
            return error_response(500, str(exc))
        finally:
            job.cancelled.set()  # a no-op once the job finished

    def _logprobs_format(self, req: api.GenerationRequest) -> api.LogprobsFormat | None:
        return None if req.logprobs is None else api.LogprobsFormat(self.engine.tokenizer, req.chat)

    async def _collect(self, req: api.GenerationRequest, plan: _Plan, events: AsyncIterator[Event], arrived: float) -> web.Response:
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        finish = None
        async for token, finish, lp in events:
            if not tokens:
                self._first_token(plan, token, lp, arrived)
            tokens.append(token)
            logprobs.append(lp)
        self._done(len(tokens))
        text = self.engine.tokenizer.decode(tokens)
        fmt = self._logprobs_format(req)
        return web.json_response(api.full_response(req, text, tokens, finish, plan.kv_params, None if fmt is None else fmt.block(tokens, logprobs)))

    async def _stream(self, http: web.Request, req: api.GenerationRequest, plan: _Plan, events: AsyncIterator[Event], arrived: float) -> web.StreamResponse:
        """Stream the answer as server-sent events.

        A client that hangs up surfaces as ``ConnectionResetError`` from a write whenever the write comes
        before aiohttp cancels the handler (no ``handler_cancellation``, or a write racing the cancel).
        Left to aiohttp it is logged as a server error with a traceback, yet it is the client's choice:
        one line is logged, and the handler's ``finally`` stops the job and frees its blocks.
        """
        resp = sse_response()
        try:
            await resp.prepare(http)
            detok = api.Detokenizer(self.engine.tokenizer)
            fmt = self._logprobs_format(req)
            count = 0
            try:
                async for token, finish, lp in events:
                    if count == 0:
                        self._first_token(plan, token, lp, arrived)
                    count += 1
                    block = None if fmt is None else fmt.block([token], [lp])
                    await resp.write(api.stream_event(req, detok.push(token, final=finish is not None), token, finish, first=count == 1, logprobs=block))
            except PdkvError as exc:  # headers are gone: report in-band, as OpenAI does
                self.metrics.requests.labels(self.role, "error").inc()
                await end_with_error(resp, str(exc), 500)
                return resp
            if plan.kv_params is not None:
                await resp.write(sse({"id": req.request_id, "object": "kv_transfer_params", "kv_transfer_params": plan.kv_params}))
            if req.include_usage:
                await resp.write(api.usage_event(req, count))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("request %s: the client disconnected mid-stream; stopping it", req.request_id)
            return resp
        self._done(count)
        return resp

    def _first_token(self, plan: _Plan, token: int, logprobs: TokenLogprobs | None, arrived: float) -> None:
        self.metrics.ttft.labels(self.role).observe(time.monotonic() - arrived)
        if plan.kv_params is not None and self.role == "prefill":
            plan.kv_params["first_token_id"] = token
            if logprobs is not None:  # D decodes on from this token without its logits: it reports these
                plan.kv_params["first_token_logprobs"] = {"logprob": logprobs.logprob, "top": [list(p) for p in logprobs.top]}

    def _done(self, generated: int) -> None:
        self.metrics.requests.labels(self.role, "ok").inc()
        self.metrics.generated_tokens.labels(self.role).inc(generated)

    # -- planning: what each role does with kv_transfer_params -----------------------------
    async def _plan(self, req: api.GenerationRequest) -> _Plan:
        kv = req.kv_transfer_params
        if self.role == "prefill" and kv.get("do_remote_decode"):
            return await self._plan_prefill(req)
        if self.role == "decode" and kv.get("do_remote_prefill"):
            return await self._plan_decode(req)
        request, cached = await self._new_request(req, req.sampling)
        return _Plan(request, on_chunk=self.tiering.offer(cached, None))

    async def _new_request(self, req: api.GenerationRequest, sampling: SamplingParams) -> tuple[Request, CachedPrefix]:
        """A request whose prompt is computed here, after its cached prefix was loaded from the tier."""
        request = self.engine.new_request(req.prompt_token_ids, sampling, req.request_id)
        cached = await self.tiering.load(request)
        self.metrics.prompt_tokens.labels(self.role, "computed").inc(request.num_prompt_tokens - cached.tokens)
        return request, cached

    def _prompt_key(self, prompt: list[int]) -> bytes:
        """The prompt's last chained chunk key: P reserves with it, D adopts KV only under the same key."""
        return chunk_keys(prompt, self.engine.fingerprint, self.chunk_size)[-1]

    async def _plan_prefill(self, req: api.GenerationRequest) -> _Plan:
        assert self.sender is not None and self.pusher is not None
        kv = req.kv_transfer_params
        request, cached = await self._new_request(req, dataclasses.replace(req.sampling, max_tokens=1))
        n = request.num_prompt_tokens
        transfer_id = str(kv.get("transfer_id") or req.request_id)
        host, port = kv.get("remote_host"), kv.get("remote_port")
        xfer: OutgoingTransfer | None = None
        error, outcome = None, "not_started"
        if not host or not isinstance(port, int):
            error = "kv_transfer_params has no remote_host/remote_port of the decode worker's receiver"
        else:
            key = self._prompt_key(request.prompt_token_ids)
            codec = kv.get("codec") if isinstance(kv.get("codec"), str) else None  # the router's per-request choice
            opening = asyncio.ensure_future(asyncio.to_thread(self.sender.open, transfer_id, f"tcp://{host}:{port}", n, request.block_table, key, codec))
            try:
                xfer = await asyncio.shield(opening)
            except PeerUnreachableError as exc:  # the channel warned and counted it at the handshake
                error, outcome = str(exc), "unreachable"
            except PdkvError as exc:
                error = str(exc)
            except asyncio.CancelledError:  # the client went away mid-open: undo both once the open returns
                opening.add_done_callback(lambda f: self._abandon_open(f, request))
                raise
        if error is not None:
            log.warning("request %s: KV will not be transferred: %s", req.request_id, error)
            self.metrics.transfers.labels(self.role, outcome).inc()
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": self.agent,
            "num_prompt_tokens": n,
            "transfer_started": xfer is not None,
        }
        if error is not None:
            params["transfer_error"] = error
        digest = self._digest_hook(kv, params)
        if xfer is None:
            return _Plan(request, decode=False, on_chunk=self.tiering.offer(cached, digest), kv_params=params)
        pusher, cs = self.pusher, self.chunk_size
        queued = [0]

        def on_chunk(r: Request, start: int, end: int) -> None:
            if digest is not None:
                digest(r, start, end)
            for index in range(start // cs, -(-end // cs)):
                pusher.push(xfer, index)
                queued[0] += 1

        def release(r: Request) -> None:
            if queued[0] < xfer.num_chunks:  # prefill failed or was cancelled part-way
                xfer.cancel("prefill ended before every chunk was computed")
            xfer.on_settled(lambda x: self._settled(x, r))

        if cached.tokens:  # the chunks loaded from the tier go to the decode worker too
            on_chunk(request, 0, cached.tokens)
        return _Plan(request, decode=False, on_chunk=self.tiering.offer(cached, on_chunk), release=release, kv_params=params)

    def _abandon_open(self, opening: asyncio.Future[OutgoingTransfer], request: Request) -> None:
        """A prefill request cancelled while its transfer was opening: cancel the transfer, free the blocks.

        The request never reached the engine, so nothing else would free it.
        """
        xfer = None if opening.cancelled() or opening.exception() is not None else opening.result()
        if xfer is None:
            self.engine.free(request)
            return
        xfer.cancel("the prefill request was cancelled")
        xfer.on_settled(lambda _x: self.engine.free(request))

    def _digest_hook(self, kv: dict[str, Any], params: dict[str, Any]) -> Callable[[Request, int, int], None] | None:
        """With ``return_kv_digest``, record per-layer digests of the prompt's KV once it is computed."""
        if not kv.get("return_kv_digest"):
            return None

        def on_chunk(r: Request, _start: int, end: int) -> None:
            if end == r.num_prompt_tokens:
                params["kv_digest"] = layer_digests(self.engine.layout, self.engine.kv_buffer, r.block_table, end)

        return on_chunk

    def _settled(self, xfer: OutgoingTransfer, request: Request) -> None:
        """Runs when no write of ours can touch the request's blocks: free them and record the transfer."""
        self.engine.free(request)
        if xfer.error is None:
            seconds = max(xfer.finished_at - xfer.started, 1e-9)
            self.metrics.transfers.labels(self.role, "ok").inc()
            self.metrics.transfer_bytes.labels(self.role).inc(xfer.bytes_sent)
            self.metrics.transfer_seconds.labels(self.role).observe(seconds)
            self.metrics.transfer_gbps.labels(self.role).observe(xfer.bytes_sent / seconds / 1e9)
        else:
            self.metrics.transfers.labels(self.role, "failed").inc()

    async def _plan_decode(self, req: api.GenerationRequest) -> _Plan:
        assert self.receiver is not None
        kv = req.kv_transfer_params
        first = kv.get("first_token_id")
        if first is not None and (not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < self.engine.vocab_size):
            raise InvalidRequestError(f"kv_transfer_params.first_token_id must be a token id in [0, {self.engine.vocab_size}), got {first!r}", param="kv_transfer_params")
        first_logprobs = self._first_logprobs(kv.get("first_token_logprobs"), req.logprobs)
        transfer_id = kv.get("transfer_id")
        reason = None
        request = None
        if not isinstance(transfer_id, str) or not transfer_id:
            reason = "no_transfer_id"
        elif not kv.get("transfer_started", True):
            reason = "not_started"
        else:
            got, reason = await self._claim(transfer_id, self._prompt_key(req.prompt_token_ids))
            if got is not None:
                request = self._adopt(req, got)
                reason = None if request is not None else "adopt_failed"
        kv_params = None
        if request is not None and kv.get("return_kv_digest"):
            kv_params = {"kv_digest": layer_digests(self.engine.layout, self.engine.kv_buffer, request.block_table, request.num_computed)}
        on_chunk = None
        if request is None:
            log.warning("request %s: computing the prompt locally (%s)", req.request_id, reason)
            self.metrics.fallbacks.labels(self.role, reason or "unknown").inc()
            request, cached = await self._new_request(req, req.sampling)
            on_chunk = self.tiering.offer(cached, None)
            if reason == "prompt_mismatch":
                first = None  # P's first token belongs to the prompt it prefilled, not to this one
        else:
            self.metrics.prompt_tokens.labels(self.role, "transferred").inc(len(req.prompt_token_ids))
        return _Plan(request, first_token=first, first_logprobs=first_logprobs, on_chunk=on_chunk, kv_params=kv_params)

    def _first_logprobs(self, given: Any, wanted: int | None) -> TokenLogprobs | None:
        """P's log-probabilities of the first token (``kv_transfer_params.first_token_logprobs``), checked."""
        if wanted is None or given is None:
            return None
        vocab = self.engine.vocab_size

        def logprob(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and MIN_LOGPROB <= v <= 0

        top = given.get("top") if isinstance(given, dict) else None
        if not (
            isinstance(top, list) and len(top) <= api.MAX_LOGPROBS and logprob(given.get("logprob"))
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and 0 <= p[0] < vocab and logprob(p[1]) for p in top)
        ):
            raise InvalidRequestError(f"kv_transfer_params.first_token_logprobs must be {{logprob, top: [[token id, logprob], ...]}}, got {given!r}", param="kv_transfer_params")
        return TokenLogprobs(float(given["logprob"]), tuple((int(t), float(v)) for t, v in top[:wanted]))

    async def _claim(self, transfer_id: str, prompt_key: bytes) -> tuple[ReceivedKV | None, str | None]:
        """Wait for the landed KV of this prompt off the event loop; a cancelled wait leaks no blocks."""
        assert self.receiver is not None
        receiver, allocator = self.receiver, self.engine.allocator
        lock = threading.Lock()
        state: dict[str, Any] = {"abandoned": False, "got": None}

        def wait() -> ReceivedKV:
            got = receiver.wait(transfer_id, self.config.transfer.transfer_timeout_s, prompt_key)
            with lock:
                if state["abandoned"]:
                    allocator.free(got.blocks)
                else:
                    state["got"] = got
            return got

        try:
            got = await asyncio.to_thread(wait)
        except PromptMismatchError:
            return None, "prompt_mismatch"
        except NotAnnouncedError:
            return None, "not_announced"
        except TransferTimeout:
            return None, "timeout"
        except TransferError:
            return None, "transfer_failed"
        except asyncio.CancelledError:
            receiver.cancel(transfer_id, "the decode request was cancelled")
            with lock:
                state["abandoned"] = True
                if state["got"] is not None:
                    allocator.free(state["got"].blocks)
            raise
        return got, None

    def _adopt(self, req: api.GenerationRequest, got: ReceivedKV) -> Request | None:
        """Turn landed blocks into an engine request whose prompt KV is present."""
        if got.num_tokens != len(req.prompt_token_ids):
            self.engine.allocator.free(got.blocks)
            return None
        try:
            request = self.engine.adopt_request(req.prompt_token_ids, req.sampling, got.blocks, req.request_id)
        except PdkvError:
            self.engine.allocator.free(got.blocks)
            raise
        self.engine.mark_computed(request, got.num_tokens)
        return request

    # -- shutdown ---------------------------------------------------------------------------
    async def _on_cleanup(self, _app: web.Application) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self.loop.close()
        self._parser.shutdown(wait=False, cancel_futures=True)
        if self.pusher is not None:
            self.pusher.close()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        self.channel.close()
        self.tiering.close()
        if self.kv_events is not None:  # after the tier: its last writes behind are announced too
            self.kv_events.close()


def warn_if_data_plane_local(host: str, channel_host: str) -> None:
    """A worker serving another host whose channel stays on loopback cannot move KV to or from any other host: say so at start."""
    if is_loopback(channel_host) and not is_loopback(host):
        log.warning(
            "channel.options.host is %s while the worker serves %s: peers on other hosts cannot reach this worker's "
            "data plane, and every transfer with them will fail (drop channel.options.host to follow --host)",
            channel_host, host,
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

