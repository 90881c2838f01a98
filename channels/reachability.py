"""Which peers a channel found it cannot reach, and for how long it fails them at once instead of trying again.

A peer advertising an address this host cannot reach would otherwise cost every request a connect timeout
and a silent recompute; the verdict is logged, counted (``peer_unreachable``) and kept for
``unreachable_retry_s``. A peer this channel did reach before (a link that was up) is more likely back soon (a
route that flapped, a switch that restarted), and until it is tried again every request to it is recomputed; so its
verdict starts at ``FIRST_RETRY_S`` and doubles with each failure in a row, up to ``unreachable_retry_s``, as
gRPC's reconnects back off. A lapsed verdict lets one caller try (the circuit breaker's half-open state):
the others go on failing at once until it has reported, instead of each waiting out a connect of its own.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from pdkv.errors import PeerUnreachableError

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
"""A peer reached before: how long its first verdict lasts (then 1 s, 2 s, ... up to ``unreachable_retry_s``)."""


class Reachability:
    """Verdicts on peers, for one channel of one agent."""

    def __init__(
        self,
        channel: str,
        agent: str,
        retry_s: float,
        counters: collections.Counter[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.channel, self.agent, self.retry_s, self.counters, self._clock = channel, agent, retry_s, counters, clock
        self._until: dict[str, tuple[float, str]] = {}  # peer -> (retry after, why)
        self._failures: dict[str, int] = {}  # peer -> failures in a row
        self._reached: set[str] = set()  # peers reached at their current address
        self._lock = threading.Lock()

    def check(self, peer: str, trial: bool = False) -> None:
        """Raise ``PeerUnreachableError`` while a verdict on ``peer`` holds. ``trial``: the caller goes on to try the
        peer (``Channel.connect``), so once the verdict lapsed it holds again for everyone else until this caller
        reports (``reached`` or ``record``) or the next wait ends."""
        with self._lock:
            verdict = self._until.get(peer)
            if verdict is None:
                return
            retry_at, why = verdict
            now = self._clock()
            left = retry_at - now
            if left <= 0:
                if trial:
                    self._until[peer] = (now + self._wait(peer), why)
                return
        raise PeerUnreachableError(f"{self.channel}: peer {peer!r} is unreachable (tried again in {left:.1f}s): {why}")

    def reached(self, peer: str) -> None:
        """``peer`` was reached: no verdict, and a later failure is tried again soon."""
        with self._lock:
            self._until.pop(peer, None)
            self._failures.pop(peer, None)
            self._reached.add(peer)

    def forget(self, peer: str) -> None:
        """Drop everything known of ``peer``: it has new metadata (another address), so the next connect tries it at
        once, and a failure there is a new address's, not a reached peer's; or it was removed."""
        with self._lock:
            self._until.pop(peer, None)
            self._failures.pop(peer, None)
            self._reached.discard(peer)

    def record(self, peer: str, why: str) -> PeerUnreachableError:
        """Record, log and count that ``peer`` cannot be reached; returns the error to raise."""
        with self._lock:
            self._failures[peer] = self._failures.get(peer, 0) + 1
            wait = self._wait(peer)
            self._until[peer] = (self._clock() + wait, why)
            self.counters["peer_unreachable"] += 1
        log.warning(
            "%s channel of %r: peer %r is unreachable, so no KV can move to it (every request will be recomputed; "
            "tried again in %.1fs): %s",
            self.channel,
            self.agent,
            peer,
            wait,
            why,
        )
        return PeerUnreachableError(f"{self.channel}: peer {peer!r} is unreachable (tried again in {wait:.1f}s): {why}")

    def _wait(self, peer: str) -> float:
        """How long a verdict on ``peer`` holds now (caller holds the lock): ``retry_s`` for a peer never reached,
        else backing off from ``FIRST_RETRY_S``."""
        if peer not in self._reached:
            return self.retry_s
        return min(self.retry_s, FIRST_RETRY_S * 2 ** max(0, self._failures.get(peer, 1) - 1))
