"""The decode role: adopt the KV a prefill worker pushed, or compute the prompt here when it did not come.

``{"do_remote_prefill": true, "transfer_id", "first_token_id"}``: wait for
the landed KV, adopt its blocks and decode from P's first token (with
``first_event``, a streamed answer whose first event the client got from P:
continue that stream, without sending P's token again). The KV is
adopted only if P computed it for this very prompt: P's Reserve carries the
prompt's chained key and D compares it with the key of the prompt it was
asked to decode (nothing the client sends decides it). If the transfer
failed, timed out, was never started or was computed for another prompt,
compute the prompt locally (``pdkv_fallbacks``): a request is never lost to a
transfer fault, only slower.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from pdkv.channels.base import Channel
from pdkv.checksum import layer_digests
from pdkv.config import PdkvConfig
from pdkv.engine.base import EngineAdapter, Request
from pdkv.engine.sampling import MIN_LOGPROB, TokenLogprobs
from pdkv.errors import (
    InvalidRequestError,
    NotAnnouncedError,
    PdkvError,
    PromptMismatchError,
    TransferError,
    TransferTimeout,
)
from pdkv.transfer.incoming import ReceivedKV
from pdkv.transfer.params import DecodeHop, FirstTokenLogprobs, parse
from pdkv.transfer.receiver import KVReceiver
from pdkv.worker.metrics import WorkerMetrics
from pdkv.worker.openai_api import MAX_LOGPROBS, GenerationRequest, Handoff
from pdkv.worker.role import Plan, WorkerRole
from pdkv.worker.tiering import Tiering

log = logging.getLogger(__name__)


class DecodeRole(WorkerRole):
    """A decode worker's receiver and the planning of requests whose KV a prefill worker sends."""

    name = "decode"

    def __init__(
        self,
        config: PdkvConfig,
        engine: EngineAdapter,
        channel: Channel,
        tiering: Tiering,
        metrics: WorkerMetrics,
        advertise_host: str,
    ) -> None:
        super().__init__(config, engine, channel, tiering, metrics)
        self.receiver: KVReceiver = KVReceiver(
            channel,
            engine.layout,
            engine.kv_buffer,
            engine.allocator,
            engine.fingerprint,
            config.transfer,
            host=config.host,
            port=config.control_port,
            secret=config.secret,
            advertise_host=advertise_host,
        )

    def wants_transfer(self, kv: dict[str, Any]) -> bool:
        return bool(kv.get("do_remote_prefill"))

    def stats(self) -> Mapping[str, int]:
        return self.receiver.stats()

    def info(self) -> dict[str, Any]:
        host, port = self.receiver.address.removeprefix("tcp://").rsplit(":", 1)
        return {"receiver_address": self.receiver.address, "remote_host": host.strip("[]"), "remote_port": int(port)}

    def cancel_transfer(self, transfer_id: str) -> None:
        self.receiver.cancel(transfer_id, "cancelled by the router")

    async def plan_transfer(self, req: GenerationRequest) -> Plan:
        hop = parse(req.kv_transfer_params, DecodeHop)
        first = hop.first_token_id
        if first is not None and first >= self.engine.vocab_size:
            raise InvalidRequestError(
                f"kv_transfer_params.first_token_id must be a token id in [0, {self.engine.vocab_size}), got {first!r}",
                param="kv_transfer_params",
            )
        first_logprobs = self._first_logprobs(hop.first_token_logprobs, req.logprobs)
        handoff: Handoff = ""
        if hop.first_event is not None and req.stream:  # the client has P's token: we stream the rest of its answer
            if first is None:
                raise InvalidRequestError(
                    "kv_transfer_params.first_event needs the first_token_id whose event the client got",
                    param="kv_transfer_params",
                )
            handoff = "rest"
            req.request_id, req.created = hop.first_event.id, hop.first_event.created
        transfer_id = hop.transfer_id
        reason = None
        request = None
        if transfer_id is None:
            reason = "no_transfer_id"
        elif not hop.transfer_started:
            reason = "not_started"
        else:
            waited = time.monotonic()
            got, reason = await self._claim(transfer_id, self.prompt_key(req.prompt_token_ids, req.cache_salt))
            self.metrics.transfer_wait.labels(self.name).observe(time.monotonic() - waited)
            if got is not None:
                request = self._adopt(req, got)
                reason = None if request is not None else "adopt_failed"
        kv_params = None
        if request is not None and hop.return_kv_digest:
            kv_params = {
                "kv_digest": layer_digests(
                    self.engine.layout, self.engine.kv_buffer, request.block_table, request.num_computed
                )
            }
        on_chunk = None
        if request is None:
            log.warning(
                "request %s, transfer %s: computing the prompt locally (%s)", req.request_id, transfer_id, reason
            )
            self.metrics.fallbacks.labels(self.name, reason or "unknown").inc()
            request, cached = await self.new_request(req, req.sampling)
            on_chunk = self.tiering.offer(cached, None)
            if reason == "prompt_mismatch" and not handoff:
                first = None  # P's first token belongs to the prompt it prefilled (unless the client has it already)
        else:
            self.metrics.prompt_tokens.labels(self.name, "transferred").inc(len(req.prompt_token_ids))
        return Plan(
            request,
            first_token=first,
            first_logprobs=first_logprobs,
            on_chunk=on_chunk,
            kv_params=kv_params,
            handoff=handoff,
        )

    def _first_logprobs(self, given: FirstTokenLogprobs | None, wanted: int | None) -> TokenLogprobs | None:
        """P's log-probabilities of the first token (``kv_transfer_params.first_token_logprobs``), checked
        against our vocabulary."""
        if wanted is None or given is None:
            return None
        vocab = self.engine.vocab_size
        if (
            len(given.top) > MAX_LOGPROBS
            or not all(t < vocab and v >= MIN_LOGPROB for t, v in given.top)
            or given.logprob < MIN_LOGPROB
        ):
            raise InvalidRequestError(
                f"kv_transfer_params.first_token_logprobs must hold at most {MAX_LOGPROBS} [token id < {vocab}, "
                f"logprob >= {MIN_LOGPROB}] pairs, got {given!r}",
                param="kv_transfer_params",
            )
        return TokenLogprobs(given.logprob, tuple(given.top[:wanted]))

    async def _claim(self, transfer_id: str, prompt_key: bytes) -> tuple[ReceivedKV | None, str | None]:
        """The landed KV of this prompt, or why it will not come (a fallback reason).

        Claimed on the event loop, whether it landed before the decode request came (the usual case on one host:
        the router's hops back from P and on to D outlast the transfer's tail) or is still on its way: the
        receiver's book wakes the loop when it changes (``pdkv.transfer.claims``), with no hop to a thread and back.
        A cancelled claim cancels the transfer, so no blocks leak.
        """
        try:
            got = await self.receiver.claim(transfer_id, self.config.transfer.transfer_timeout_s, prompt_key)
        except PromptMismatchError:
            return None, "prompt_mismatch"
        except NotAnnouncedError:
            return None, "not_announced"
        except TransferTimeout:
            return None, "timeout"
        except TransferError:
            return None, "transfer_failed"
        return got, None

    def _adopt(self, req: GenerationRequest, got: ReceivedKV) -> Request | None:
        """Turn landed blocks into an engine request whose prompt KV is present."""
        if got.num_tokens != len(req.prompt_token_ids):
            self.engine.allocator.free(got.blocks)
            return None
        try:
            request = self.engine.adopt_request(
                req.prompt_token_ids, req.sampling, got.blocks, req.request_id, req.cache_salt
            )
        except PdkvError:
            self.engine.allocator.free(got.blocks)
            raise
        self.engine.mark_computed(request, got.num_tokens)
        return request

    def close(self) -> None:
        self.receiver.close()
