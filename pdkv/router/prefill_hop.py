"""The first hop of a disaggregated request: a prefill worker computes the prompt and pushes its KV to the decode
worker; what it answers becomes the decode hop's ``kv_transfer_params``.

A prefill worker is never worth failing a request for: a failed one is replaced by the next, with a fresh transfer
id (the failed one's is abandoned on the decode worker), and with none left the decode worker computes the prompt
alone.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, NamedTuple

import aiohttp

from pdkv.config import RouterConfig
from pdkv.errors import UpstreamError
from pdkv.router.abandoning import Abandoner
from pdkv.router.call import Call
from pdkv.router.failover import Failover
from pdkv.router.failures import hop_timeout
from pdkv.router.handoff import split_prefill_stream
from pdkv.router.metrics import RouterMetrics
from pdkv.router.modes import PairMode, prefill_body
from pdkv.router.policy import Policy
from pdkv.router.pool import WorkerPool, WorkerState
from pdkv.router.upstream import Upstream, check_status, parse_json


class Prefilled(NamedTuple):
    """What the prefill hop leaves the decode hop."""

    params: dict[str, Any] | None  # the decode hop's kv_transfer_params; None: the decode worker computes alone
    transfer_id: str | None
    first_event: bytes | None  # the client's first event, from P (pdkv.router.handoff); None: D sends it


class PrefillHop:
    """Runs a request's prefill hop on one prefill worker after another until one answers."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        policy: Policy,
        mode: PairMode,
        metrics: RouterMetrics,
        upstream: Upstream,
        failover: Failover,
        abandoner: Abandoner,
    ) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.mode = mode
        self.metrics = metrics
        self.upstream = upstream
        self.failover = failover
        self.abandoner = abandoner
        self._transfer_ids = itertools.count()

    async def transfer_params(
        self, call: Call, decode: WorkerState, failures: list[str], codec: str | None = None
    ) -> Prefilled:
        """The decode hop's ``kv_transfer_params`` and transfer id (None, None: decode alone), and P's first event
        when the client is to get it from P (``pdkv.router.handoff``)."""
        stream_first = call.stream and self.mode.hands_off and self.config.stream_first_token
        tried: list[WorkerState] = []
        last: UpstreamError | None = None
        for _ in range(self.config.max_retries + 1):
            prefill = self.failover.next_try("prefill", call.prompt, tried, last)
            if prefill is None:
                break
            transfer_id = f"{call.request_id}-{next(self._transfer_ids)}"
            params = await self.mode.prefill_params(
                self.pool, decode, transfer_id, codec
            )  # an UpstreamError here is the decode worker's
            done = False
            try:
                answer, first_event = await self._hop(call, prefill, params, stream_first)
                done = True
            except UpstreamError as exc:
                self.failover.failed(call, prefill, exc, failures)
                last = exc
                continue
            finally:
                if not done:
                    self.abandoner.abandon(decode, transfer_id)
            kv, why = self.mode.decode_params(answer)
            if why is not None:
                self.metrics.fallbacks.labels(why).inc()
            self.policy.served(prefill, call.prompt)
            return Prefilled(kv, transfer_id, first_event if kv is not None else None)
        self.metrics.fallbacks.labels("prefill_failed" if tried else "no_prefill").inc()
        return Prefilled(None, None, None)

    async def _hop(
        self, call: Call, prefill: WorkerState, params: dict[str, Any], stream_first: bool
    ) -> tuple[Any, bytes | None]:
        """One prefill worker's answer to the prefill hop, parsed, and the client's first event if P streamed it;
        its load counted on it while it computes."""
        timeout = aiohttp.ClientTimeout(
            total=hop_timeout(call.deadline, self.config.prefill_timeout_s), sock_connect=self.config.connect_timeout_s
        )
        started = time.monotonic()
        prefill.inflight_requests += 1
        prefill.inflight_tokens += call.prompt.est_tokens
        try:
            body = prefill_body(call.body, params, stream_first)
            async with self.upstream.post(prefill, "prefill", call, body, timeout) as resp:
                data = await self.upstream.guard(prefill, "prefill", resp.read())
                check_status(prefill, "prefill", resp, data)
        finally:
            prefill.inflight_requests -= 1
            prefill.inflight_tokens -= call.prompt.est_tokens
        if stream_first and resp.content_type == "text/event-stream":
            answer, first_event = split_prefill_stream(prefill, data)
        else:
            answer, first_event = parse_json(prefill, "prefill", data), None
        self.metrics.hop.labels("prefill").observe(time.monotonic() - started)
        return answer, first_event
