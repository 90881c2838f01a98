"""What the router tells a client it cannot serve: a status that says what to do, and when to come back.

A client (the OpenAI SDK, a gateway, a benchmark client) acts on the status:

* 503 with ``Retry-After``: no decode attempt could serve the request (every
  worker refused, was unreachable, overloaded, timed out, or none is healthy).
  Try again later; ``Retry-After`` says when the router may have a worker to
  offer, from its own health view (``retry_after``).
* 502: the workers answered, but every answer was malformed or cut short
  (not JSON, the wrong content type, a stream that ended early). Retrying
  soon is unlikely to help; the upstream is broken.
* 504: the client's own deadline (``X-Request-Timeout``) passed first.

A worker's own 4xx is the client's fault and goes back unchanged (told apart by
``pdkv.router.upstream.check_status``, passed back by ``pdkv.router.proxy``).
"""

from __future__ import annotations

import math
import re
import time

from aiohttp import web

from pdkv.config import RouterConfig
from pdkv.errors import DeadlinePassed, RequestError
from pdkv.router.pool import Role, WorkerPool, WorkerState

DEADLINE_HEADER = "X-Request-Timeout"
"""The seconds a client gives a request (a decimal number), as gateways take a per-request timeout."""

# Upstream failures that are a broken answer rather than a missing worker: the only ones that make a 502.
BROKEN_ANSWERS = frozenset({"bad_answer", "bad_content_type", "truncated", "empty_stream"})

_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")


def failed_status(reasons: list[str]) -> int:
    """The status of a request whose decode attempts all failed, by their ``UpstreamError.reason``: 502 when every
    attempt got a broken answer, else 503 (at least one worker was missing, busy or slow: it may be back)."""
    return 502 if reasons and all(r in BROKEN_ANSWERS for r in reasons) else 503


def retry_after(pool: WorkerPool, role: Role, config: RouterConfig, now: float | None = None) -> int:
    """Whole seconds until the router may again have a worker of ``role`` to offer, within
    ``[retry_after_min_s, retry_after_max_s]``.

    A healthy worker (busy, or failing this request only) may take the next request at once; a worker marked down
    is back no sooner than its next health probe passes, which the health loop starts at most one tick after it is
    due and which takes at most ``health_timeout_s``. With no worker registered at all, nothing comes back by itself
    (an operator must register one): the cap.
    """
    now = time.monotonic() if now is None else now
    waits = [_back_in(w, config, now) for w in pool.workers(role)]
    wait = min(waits, default=float(config.retry_after_max_s))
    return min(max(math.ceil(wait), config.retry_after_min_s), config.retry_after_max_s)


def _back_in(worker: WorkerState, config: RouterConfig, now: float) -> float:
    """Seconds until ``worker`` may be found up (``pdkv.router.pool.WorkerPool.health_loop``'s schedule)."""
    if worker.healthy:
        return 0.0
    if worker.probing:  # a probe is under way: its answer is due within health_timeout_s of its start
        return max(worker.probed_at + config.health_timeout_s - now, 0.0)
    tick = min(config.busy_health_interval_s, config.health_interval_s)
    interval = config.busy_health_interval_s if worker.inflight_requests else config.health_interval_s
    return max(worker.probed_at + interval + tick - now, 0.0) + config.health_timeout_s


def request_deadline(http: web.Request, arrived: float) -> float | None:
    """The monotonic time by which the client wants its answer (``X-Request-Timeout`` seconds after it arrived), or
    None when it set none; ``RequestError`` (400) for a value that is not a positive number of seconds."""
    value = http.headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    if not _SECONDS.fullmatch(value.strip()) or float(value) <= 0:
        raise RequestError(
            f"the {DEADLINE_HEADER} header must be a positive number of seconds such as 30 or 2.5, got {value!r:.40}",
            param=DEADLINE_HEADER,
        )
    return arrived + float(value)


def time_left(deadline: float | None) -> float:
    """Seconds left before the client's deadline (infinite without one); ``DeadlinePassed`` when none are."""
    if deadline is None:
        return math.inf
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlinePassed(f"the request's deadline ({DEADLINE_HEADER}) passed before the router could answer")
    return left


def hop_timeout(deadline: float | None, timeout: float) -> float:
    """A hop's own ``timeout`` cut to what is left of the client's deadline; ``DeadlinePassed`` when nothing is."""
    return min(timeout, time_left(deadline))
