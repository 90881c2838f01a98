"""The router's workers: who they are, whether they answer, how busy the router keeps them.

Health is known two ways. Actively, a background loop GETs every worker's
``/health`` each ``health_interval_s``. Passively, a hop that finds a
worker unreachable marks it down at once, so the next request does not wait
for the loop to notice. A worker that is down is skipped by the policies
until a check passes again.

Load is what the router itself has in flight on each worker (requests, and
estimated prompt tokens for prefill): the router sees every request, so this
needs no scraping and is never stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from pdkv.config import RouterConfig
from pdkv.errors import UpstreamError

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(eq=False)
class WorkerState:
    """One registered worker as the router sees it."""

    role: Role
    url: str
    healthy: bool = False
    error: str = "not checked yet"
    inflight_requests: int = 0
    inflight_tokens: int = 0
    ups: int = 0  # times a health check found it up after it was down (or unchecked): it may have restarted
    # A decode worker's /pdkv/info (where its KV receiver listens), dropped whenever a check
    # fails: a restarted worker may listen on a new port.
    info: dict[str, Any] | None = field(default=None, repr=False)

    def snapshot(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "url": self.url,
            "healthy": self.healthy,
            "error": self.error,
            "inflight_requests": self.inflight_requests,
            "inflight_tokens": self.inflight_tokens,
        }


def normalize_url(url: str) -> str:
    return url.rstrip("/")


class WorkerPool:
    """Registered prefill and decode workers, their health and the router's load on each."""

    def __init__(self, session: aiohttp.ClientSession, config: RouterConfig) -> None:
        self.session = session
        self.config = config
        self._workers: dict[Role, dict[str, WorkerState]] = {role: {} for role in ROLES}

    # -- membership -----------------------------------------------------------------
    def add(self, role: Role, url: str) -> tuple[WorkerState, bool]:
        """Register a worker (not yet healthy: check it); returns it and whether it is new."""
        url = normalize_url(url)
        known = self._workers[role].get(url)
        if known is not None:
            return known, False
        worker = WorkerState(role, url)
        self._workers[role][url] = worker
        return worker, True

    def remove(self, role: Role, url: str) -> WorkerState | None:
        """Stop picking a worker; requests already on it finish normally."""
        return self._workers[role].pop(normalize_url(url), None)

    def workers(self, role: Role) -> list[WorkerState]:
        return list(self._workers[role].values())

    def candidates(self, role: Role, exclude: Iterable[WorkerState] = ()) -> list[WorkerState]:
        """Healthy workers of ``role`` not in ``exclude``, in registration order."""
        skip = set(exclude)
        return [w for w in self._workers[role].values() if w.healthy and w not in skip]

    # -- health -----------------------------------------------------------------------
    def mark_down(self, worker: WorkerState, why: str) -> None:
        if worker.healthy:
            log.warning("%s worker %s is down: %s", worker.role, worker.url, why)
        worker.healthy, worker.error, worker.info = False, why, None

    async def check(self, worker: WorkerState) -> bool:
        """GET /health once; updates and returns the worker's health."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self.session.get(worker.url + "/health", timeout=timeout) as resp:
                ok, why = resp.status == 200, f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, why = False, f"/health failed: {describe(exc)}"
        if not ok:
            self.mark_down(worker, why)
        elif not worker.healthy:
            log.info("%s worker %s is up", worker.role, worker.url)
            worker.healthy, worker.error = True, ""
            worker.ups += 1
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for role in ROLES for w in self.workers(role)))

    async def health_loop(self) -> None:
        """Check every worker each ``health_interval_s``, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all()

    async def decode_info(self, worker: WorkerState) -> dict[str, Any]:
        """A decode worker's /pdkv/info (its KV receiver's host and port), fetched once and cached."""
        if worker.info is None:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            try:
                async with self.session.get(worker.url + "/pdkv/info", timeout=timeout) as resp:
                    info = await resp.json() if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.mark_down(worker, f"/pdkv/info failed: {describe(exc)}")
                raise UpstreamError(f"decode worker {worker.url}: /pdkv/info failed: {describe(exc)}", "info", worker_down=True) from exc
            if not isinstance(info, dict) or not info.get("remote_host") or not isinstance(info.get("remote_port"), int):
                raise UpstreamError(f"decode worker {worker.url}: /pdkv/info names no KV receiver (is it a pdkv decode worker? for vLLM workers use router.mode: vllm)", "info")
            worker.info = info
        return worker.info


def describe(exc: BaseException) -> str:
    """An exception as a short phrase; timeouts often have an empty message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
