"""Talking to one worker: each upstream step's failures as ``UpstreamError``, and the checks that tell a broken
answer from a good one.

Every hop of a request (``pdkv.router.prefill_hop``, ``pdkv.router.decode_hop``) and ``/v1/models`` awaits its
worker through ``Upstream.guard``, so a worker marked down while a hop waits on it fails that hop at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp

from pdkv.errors import UpstreamError, UpstreamRejected
from pdkv.router.call import Call
from pdkv.router.metrics import RouterMetrics
from pdkv.router.pool import WorkerPool, WorkerState, describe

T = TypeVar("T")

# 408 and 429 are the worker's state, not the request's fault: another worker may take it.
_RETRYABLE_4XX = (408, 429)


class Upstream:
    """The router's side of each worker's connection: posts a hop, and guards every step it awaits."""

    def __init__(self, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    @contextlib.asynccontextmanager
    async def post(
        self, worker: WorkerState, hop: str, call: Call, body: dict[str, Any], timeout: aiohttp.ClientTimeout
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST one hop; the response is released (its connection closed if unread) on exit."""
        self.metrics.picks.labels(hop, worker.url).inc()
        resp = await self.guard(
            worker,
            hop,
            self.pool.session.post(worker.url + call.path, json=body, headers=call.headers, timeout=timeout),
        )
        async with resp:
            yield resp

    def _worth_abandoning(self, worker: WorkerState) -> bool:
        """Whether a hop waiting on ``worker``, just marked down, has somewhere better to go.

        A prefill hop always has (another prefill worker, or the decode worker computing alone); a
        decode hop only if another decode worker is healthy: retried on the same worker it would
        start over, for nothing.
        """
        return worker.role == "prefill" or bool(self.pool.candidates(worker.role, [worker]))

    async def guard(self, worker: WorkerState, hop: str, step: Awaitable[T], abandon: bool = True) -> T:
        """Await one upstream step; its failures become ``UpstreamError`` (down: the worker looks dead).

        With ``abandon`` (every step before the client got a byte), the step is abandoned the moment
        the worker is marked down (a refused connection elsewhere, failed health probes) if the
        request has somewhere better to go: a frozen worker never answers, and waiting for the
        hop's own timeout would hold the request for minutes. Abandoned as ``asyncio.timeout`` does
        it, by cancelling this task at its await (no task per step: that would delay each step by a
        loop iteration, and aiohttp drops what a stream had buffered once its connection is lost).
        """
        if not abandon:
            return await _result(worker, hop, step)
        task = asyncio.current_task()
        assert task is not None
        down = worker.down_signal()
        state = {"waiting": True, "fired": False}

        def abort(_: asyncio.Future[str]) -> None:
            # the callback may run after the step finished: then it must not cancel
            if state["waiting"] and self._worth_abandoning(worker):
                state["fired"] = True
                task.cancel()

        down.add_done_callback(abort)
        try:
            return await _result(worker, hop, step)
        except asyncio.CancelledError:
            # Ours: turned into the hop's failure. Someone else's too (the client went away; only
            # Python >= 3.11 can tell): passed on.
            uncancel = getattr(task, "uncancel", None)
            if not state["fired"] or (uncancel is not None and uncancel() > 0):
                raise
            raise UpstreamError(
                f"{hop} worker {worker.url} was marked down while this hop waited on it: {down.result()}",
                "unhealthy",
                worker_down=True,
            ) from None
        finally:
            state["waiting"] = False
            down.remove_done_callback(abort)


async def _result(worker: WorkerState, hop: str, step: Awaitable[T]) -> T:
    """A finished upstream step's result; its failures as ``UpstreamError``."""
    try:
        return await step
    except TimeoutError as exc:
        raise UpstreamError(f"{hop} worker {worker.url} timed out ({describe(exc)})", "timeout") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError(
            f"{hop} worker {worker.url} is unreachable: {describe(exc)}", "connect", worker_down=True
        ) from exc
    except aiohttp.ClientPayloadError as exc:  # the answer began and was cut short: a broken answer, not a missing one
        raise UpstreamError(
            f"{hop} worker {worker.url} cut its answer short: {describe(exc)}", "truncated", worker_down=True
        ) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(
            f"{hop} worker {worker.url} dropped the connection: {describe(exc)}", "disconnected", worker_down=True
        ) from exc


def check_status(worker: WorkerState, hop: str, resp: aiohttp.ClientResponse, data: bytes) -> None:
    """A hop's answer that is not a 200: the client's fault (a 4xx, ``UpstreamRejected``) or the worker's."""
    if resp.status == 200:
        return
    if 400 <= resp.status < 500 and resp.status not in _RETRYABLE_4XX:
        raise UpstreamRejected(resp.status, data, resp.content_type)
    raise UpstreamError(f"{hop} worker {worker.url} answered {resp.status}: {message(data)}", f"http_{resp.status}")


def check_content_type(worker: WorkerState, resp: aiohttp.ClientResponse, expected: str) -> None:
    """A 200 whose Content-Type is not what the request asked for (a stream, or JSON) is a broken answer."""
    if resp.content_type != expected:
        raise UpstreamError(
            f"decode worker {worker.url} answered 200 with Content-Type {resp.content_type!r}, not {expected!r}",
            "bad_content_type",
        )


def parse_json(worker: WorkerState, hop: str, data: bytes) -> Any:
    """A hop's JSON answer; one that is not JSON is a broken answer (``bad_answer``)."""
    try:
        return json.loads(data)
    except ValueError:
        raise UpstreamError(
            f"{hop} worker {worker.url} answered with invalid JSON: {data[:200]!r}", "bad_answer"
        ) from None


def message(data: bytes) -> str:
    """An error body's message, or its first bytes."""
    try:
        return str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return repr(data[:200])
