"""The router's workers: who they are, whether they answer, how busy the router keeps them.

Health is known two ways. Actively, a background loop GETs every worker's
``/health`` each ``health_interval_s``, and each ``busy_health_interval_s``
while the router has requests on it; ``health_failures`` failed probes in a
row (a timeout, an answer other than 200: a frozen process, a stalled
engine) mark it down, a refused connection at once. Passively, a hop that
finds a worker unreachable marks it down at once, so the next request does
not wait for the loop to notice. A worker that is down is skipped by the
policies until a probe passes again, and every hop still waiting on it is
told (``down_signal``) so the request is retried elsewhere at once instead
of waiting out its hop timeout.

Load is what the router itself has in flight on each worker (requests, and
estimated prompt tokens for prefill): the router sees every request, so this
needs no scraping and is never stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
    failures: int = 0  # failed health probes in a row
    ups: int = 0  # times it was found up after being down (or unchecked): it may have restarted (pdkv.router.kv_aware)
    probing: bool = field(default=False, repr=False)
    probed_at: float = field(default=0.0, repr=False)  # monotonic start of the last probe
    _down: asyncio.Future[str] | None = field(default=None, repr=False)
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

    def down_signal(self) -> asyncio.Future[str]:
        """A future that completes, with the reason, the next time this worker is marked down."""
        if self._down is None or self._down.done():
            self._down = asyncio.get_running_loop().create_future()
        return self._down

    def went_down(self, why: str) -> None:
        """Not healthy any more: forget its receiver (a restart may move it), wake whoever waits on it."""
        self.healthy, self.error, self.info = False, why, None
        if self._down is not None and not self._down.done():
            self._down.set_result(why)


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
        """Stop picking ``worker`` and fail every hop waiting on it (they are retried elsewhere)."""
        if worker.healthy:
            log.warning("%s worker %s is down: %s", worker.role, worker.url, why)
        worker.went_down(why)

    def _mark_up(self, worker: WorkerState) -> None:
        worker.failures = 0
        if not worker.healthy:
            log.info("%s worker %s is up", worker.role, worker.url)
            worker.healthy, worker.error = True, ""
            worker.ups += 1

    async def _probe(self, worker: WorkerState) -> tuple[bool, str, bool]:
        """GET /health once: (ok, why not, whether the failure is final: nothing listens there)."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        worker.probing, worker.probed_at = True, time.monotonic()
        try:
            async with self.session.get(worker.url + "/health", timeout=timeout) as resp:
                return resp.status == 200, f"/health answered {resp.status}", False
        except aiohttp.ClientConnectorError as exc:
            return False, f"/health failed: {describe(exc)}", True
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, f"/health failed: {describe(exc)} (health_timeout_s {self.config.health_timeout_s:g})", False
        finally:
            worker.probing = False

    async def check(self, worker: WorkerState) -> bool:
        """Probe once and take the answer as it is (a new worker, an admin's check); returns the health."""
        ok, why, _ = await self._probe(worker)
        if ok:
            self._mark_up(worker)
        else:
            self.mark_down(worker, why)
        return ok

    async def _watch(self, worker: WorkerState) -> None:
        """One probe of the health loop: down after ``health_failures`` failures in a row, or one refusal."""
        ok, why, final = await self._probe(worker)
        if ok:
            self._mark_up(worker)
            return
        worker.failures += 1
        if final or worker.failures >= self.config.health_failures:
            self.mark_down(worker, f"{why}; {worker.failures} failed probe(s) in a row")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for role in ROLES for w in self.workers(role)))

    async def health_loop(self) -> None:
        """Probe each worker when it is due, forever (cancel to stop).

        Due: ``busy_health_interval_s`` after its last probe while the router has requests on it,
        ``health_interval_s`` otherwise. Probes run concurrently, so a worker that never answers
        delays nobody else's.
        """
        tick = min(self.config.busy_health_interval_s, self.config.health_interval_s)
        probes: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(tick)
                now = time.monotonic()
                for worker in [w for role in ROLES for w in self.workers(role)]:
                    interval = (
                        self.config.busy_health_interval_s
                        if worker.inflight_requests
                        else self.config.health_interval_s
                    )
                    if not worker.probing and now - worker.probed_at >= interval:
                        task = asyncio.get_running_loop().create_task(self._watch(worker))
                        probes.add(task)
                        task.add_done_callback(probes.discard)
        finally:
            for task in probes:
                task.cancel()
            await asyncio.gather(*probes, return_exceptions=True)

    async def decode_info(self, worker: WorkerState) -> dict[str, Any]:
        """A decode worker's /pdkv/info (its KV receiver's host and port), fetched once and cached."""
        if worker.info is None:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            try:
                async with self.session.get(worker.url + "/pdkv/info", timeout=timeout) as resp:
                    info = await resp.json() if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.mark_down(worker, f"/pdkv/info failed: {describe(exc)}")
                raise UpstreamError(
                    f"decode worker {worker.url}: /pdkv/info failed: {describe(exc)}", "info", worker_down=True
                ) from exc
            if (
                not isinstance(info, dict)
                or not info.get("remote_host")
                or not isinstance(info.get("remote_port"), int)
                or not _port_list(info.get("remote_ports", [info["remote_port"]]))
            ):
                raise UpstreamError(
                    f"decode worker {worker.url}: /pdkv/info names no KV receiver (is it a pdkv decode worker? for "
                    "vLLM workers use router.mode: vllm)",
                    "info",
                )
            info.setdefault("remote_ports", [info["remote_port"]])  # one receiver: a worker not at tensor parallel
            worker.info = info
        return worker.info


def _port_list(ports: Any) -> bool:
    """A vLLM decode worker's receivers, one per tensor-parallel rank: a non-empty list of ports."""
    return isinstance(ports, list) and 0 < len(ports) <= 1024 and all(type(p) is int and 0 < p < 65536 for p in ports)


def describe(exc: BaseException) -> str:
    """An exception as a short phrase; timeouts often have an empty message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
