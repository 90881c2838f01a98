"""Abandoning a transfer whose decode hop never ran: the decode worker's reservation is freed now, not at its lease's
expiry (pdkv mode; a mode without a cancel endpoint has nothing to free)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from pdkv.config import RouterConfig
from pdkv.router.call import log
from pdkv.router.metrics import RouterMetrics
from pdkv.router.modes import PairMode
from pdkv.router.pool import WorkerPool, WorkerState, describe
from pdkv.router.upstream import message


class Abandoner:
    """Cancels abandoned transfers on their decode worker, best effort; each is counted in
    ``pdkv_router_transfer_cancels`` by outcome."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        mode: PairMode,
        metrics: RouterMetrics,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        control_headers: dict[str, str],
    ) -> None:
        self.config = config
        self.pool = pool
        self.mode = mode
        self.metrics = metrics
        self.spawn = spawn  # runs a coroutine that must outlive a cancelled handler
        self.control_headers = control_headers  # what a worker's control endpoints want (its secret's token)

    def abandon(self, decode: WorkerState, transfer_id: str) -> None:
        """Cancel a transfer on the decode worker, in the background: the caller may itself be cancelled."""
        url = self.mode.cancel_url(decode, transfer_id)
        if url is not None:
            self.spawn(self._cancel_transfer(url))

    async def _cancel_transfer(self, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self.pool.session.delete(url, timeout=timeout, headers=self.control_headers) as resp:
                data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:  # best effort: the receiver's lease frees it anyway
            self.metrics.cancels.labels("unanswered").inc()
            log.info("could not cancel %s: %s", url, describe(exc))
            return
        self.metrics.cancels.labels("ok" if resp.status == 200 else "refused").inc()
        if resp.status != 200:  # 401: the router's secret is not the decode worker's
            log.warning("cancelling %s: the decode worker answered %s: %s", url, resp.status, message(data))
