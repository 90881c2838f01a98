"""The first hop of a disaggregated request: a prefill worker computes the prompt and pushes its KV to the decode
worker; what it answers becomes the decode hop's ``kv_transfer_params``.

A prefill worker is never worth failing a request for: a failed one is replaced by the next, with a fresh transfer
id (the failed one's is abandoned on the decode worker), and with none left the decode worker computes the prompt
alone.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import aiohttp

from pdkv.config import RouterConfig
from pdkv.errors import UpstreamError
from pdkv.router.abandoning import Abandoner
from pdkv.router.call import Call
from pdkv.router.failover import Failover
from pdkv.router.failures import hop_timeout
from pdkv.router.metrics import RouterMetrics
from pdkv.router.modes import PairMode, prefill_body
from pdkv.router.policy import Policy
from pdkv.router.pool import WorkerPool, WorkerState
from pdkv.router.upstream import Upstream, check_status, parse_json


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
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The decode hop's ``kv_transfer_params`` and transfer id; (None, None): decode alone."""
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
                answer = await self._hop(call, prefill, params)
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
            return kv, transfer_id
        self.metrics.fallbacks.labels("prefill_failed" if tried else "no_prefill").inc()
        return None, None

    async def _hop(self, call: Call, prefill: WorkerState, params: dict[str, Any]) -> Any:
        """One prefill worker's answer to the prefill hop, parsed; its load counted on it while it computes."""
        timeout = aiohttp.ClientTimeout(
            total=hop_timeout(call.deadline, self.config.prefill_timeout_s), sock_connect=self.config.connect_timeout_s
        )
        started = time.monotonic()
        prefill.inflight_requests += 1
        prefill.inflight_tokens += call.prompt.est_tokens
        try:
            async with self.upstream.post(prefill, "prefill", call, prefill_body(call.body, params), timeout) as resp:
                data = await self.upstream.guard(prefill, "prefill", resp.read())
                check_status(prefill, "prefill", resp, data)
        finally:
            prefill.inflight_requests -= 1
            prefill.inflight_tokens -= call.prompt.est_tokens
        answer = parse_json(prefill, "prefill", data)
        self.metrics.hop.labels("prefill").observe(time.monotonic() - started)
        return answer
