"""The prefill role: compute a prompt and push its KV, chunk by chunk, to the decode worker the request names.

``{"do_remote_decode": true, "remote_host", "remote_port", "transfer_id"}``
(and ``"codec"``: one of this worker's codecs, ``none`` or its
``transfer.codec``, for this request's chunks; the router's ``disaggregate:
auto`` sends it): load the prompt's cached prefix from the cache tier
(``pdkv.worker.tiering``), reserve room on that decode worker's receiver,
compute the rest chunk by chunk while each chunk, loaded or computed, is
pushed, and return the first token with the ``kv_transfer_params`` the decode
worker needs. With ``"stream_first": true`` on a streamed request, that answer
is the client's first event, left open, which the router relays at once: the
decode worker streams the rest of the same answer (``first_event`` in its
params). (vLLM's NixlConnector has D pull from P; pdkv pushes, so P is
told where D is: ``remote_host``/``remote_port`` are D's receiver, from D's
/pdkv/info.) A transfer that cannot open leaves the prompt computed here and
says why in ``transfer_error``: the decode worker then computes it itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pdkv.channels.base import Channel
from pdkv.checksum import layer_digests
from pdkv.config import PdkvConfig
from pdkv.engine.base import EngineAdapter, Request
from pdkv.engine.sampling import TokenLogprobs
from pdkv.errors import InvalidRequestError, PdkvError, PeerUnreachableError
from pdkv.transfer.outgoing import OutgoingTransfer
from pdkv.transfer.params import MAX_STREAM_ID, PushGuard, PushTo, parse
from pdkv.transfer.sender import KVSender
from pdkv.worker.metrics import WorkerMetrics
from pdkv.worker.openai_api import GenerationRequest, Handoff
from pdkv.worker.push import ChunkPusher
from pdkv.worker.role import Plan, WorkerRole
from pdkv.worker.tiering import Tiering

log = logging.getLogger(__name__)

NOT_OPENED = "the KV transfer could not be opened (the prefill worker's log says why); the decode worker computes it"
"""What the caller is told of any failed open: the same whether the receiver's port was closed, silent or refused
us, so that P's HTTP port tells nobody what listens where."""


class PrefillRole(WorkerRole):
    """A prefill worker's sender, pusher and transfer planning."""

    name = "prefill"

    def __init__(
        self,
        config: PdkvConfig,
        engine: EngineAdapter,
        channel: Channel,
        tiering: Tiering,
        metrics: WorkerMetrics,
        agent: str,
    ) -> None:
        super().__init__(config, engine, channel, tiering, metrics)
        self.agent = agent  # the remote_engine_id a decode worker is told
        self.sender: KVSender = KVSender(
            channel, engine.layout, engine.kv_buffer, engine.fingerprint, config.transfer, secret=config.secret
        )
        self.pusher: ChunkPusher = ChunkPusher()
        self.guard = PushGuard.of(config.secret, config.transfer.allowed_receivers)

    def wants_transfer(self, kv: dict[str, Any]) -> bool:
        return bool(kv.get("do_remote_decode"))

    def stats(self) -> Mapping[str, int]:
        return self.sender.stats()

    async def plan_transfer(self, req: GenerationRequest) -> Plan:
        error, outcome, told = None, "not_started", None
        try:
            target = parse(req.kv_transfer_params, PushTo)
        except InvalidRequestError as exc:  # served all the same, without a transfer
            target, error = PushTo(), str(exc)
        address = target.address
        if address is not None:
            self.guard.check(target)  # a 403 before anything is computed or dialled
        request, cached = await self.new_request(req, dataclasses.replace(req.sampling, max_tokens=1))
        n = request.num_prompt_tokens
        xfer: OutgoingTransfer | None = None
        transfer_id = target.transfer_id or req.request_id
        if address is None:
            error = error or "kv_transfer_params has no remote_host/remote_port of the decode worker's receiver"
        else:
            told = NOT_OPENED  # should the open fail: the caller learns nothing of the address (it is logged)
            key = self.prompt_key(request.prompt_token_ids, request.cache_salt)
            opening = asyncio.ensure_future(
                asyncio.to_thread(self.sender.open, transfer_id, address, n, request.block_table, key, target.codec)
            )
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
            log.warning("request %s, transfer %s: KV will not be transferred: %s", req.request_id, transfer_id, error)
            self.metrics.transfers.labels(self.name, outcome).inc()
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": self.agent,
            "num_prompt_tokens": n,
            "transfer_started": xfer is not None,
        }
        if error is not None:
            params["transfer_error"] = told or error
        handoff: Handoff = ""
        if target.stream_first and req.stream and len(req.request_id) <= MAX_STREAM_ID:
            # our event is the client's first: D continues the same stream
            handoff = "first"
            params["first_event"] = {"id": req.request_id, "created": req.created}
        digest = self._digest_hook(target.return_kv_digest, params)
        first_token = functools.partial(_tell_first_token, params)
        if xfer is None:
            return Plan(
                request,
                decode=False,
                on_chunk=self.tiering.offer(cached, digest),
                kv_params=params,
                on_first_token=first_token,
                handoff=handoff,
            )
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
        return Plan(
            request,
            decode=False,
            on_chunk=self.tiering.offer(cached, on_chunk),
            release=release,
            kv_params=params,
            on_first_token=first_token,
            handoff=handoff,
        )

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

    def _digest_hook(self, wanted: bool, params: dict[str, Any]) -> Callable[[Request, int, int], None] | None:
        """With ``return_kv_digest``, record per-layer digests of the prompt's KV once it is computed."""
        if not wanted:
            return None

        def on_chunk(r: Request, _start: int, end: int) -> None:
            if end == r.num_prompt_tokens:
                params["kv_digest"] = layer_digests(self.engine.layout, self.engine.kv_buffer, r.block_table, end)

        return on_chunk

    def _settled(self, xfer: OutgoingTransfer, request: Request) -> None:
        """Runs when no write of ours can touch the request's blocks: free them and record the transfer."""
        self.engine.free(request)
        if xfer.error is None:
            self.metrics.transfers.labels(self.name, "ok").inc()
            self.metrics.transfer_bytes.labels(self.name).inc(xfer.bytes_sent)
            for series, value in xfer.completion.wire_times():
                self.metrics.wire_series[series].labels(self.name).observe(value)
        else:
            self.metrics.transfers.labels(self.name, "failed").inc()

    def close(self) -> None:
        self.pusher.close()
        self.sender.close()


def _tell_first_token(params: dict[str, Any], token: int, logprobs: TokenLogprobs | None) -> None:
    """The decode worker decodes on from P's first token: it goes in the ``kv_transfer_params`` P answers with."""
    params["first_token_id"] = token
    if logprobs is not None:  # D decodes on from this token without its logits: it reports these
        params["first_token_logprobs"] = {"logprob": logprobs.logprob, "top": [list(p) for p in logprobs.top]}
