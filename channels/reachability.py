"""Which peers a channel found it cannot reach, and for how long it fails them at once instead of trying again.

A peer advertising an address this host cannot reach would otherwise cost every request a connect timeout
and a silent recompute; the verdict is logged, counted (``peer_unreachable``) and kept for
``unreachable_retry_s``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from pdkv.errors import PeerUnreachableError

log = logging.getLogger(__name__)


class Reachability:
    """Verdicts on peers, for one channel of one agent."""

    def __init__(self, channel: str, agent: str, retry_s: float, counters: collections.Counter[str]) -> None:
        self.channel, self.agent, self.retry_s, self.counters = channel, agent, retry_s, counters
        self._until: dict[str, tuple[float, str]] = {}  # peer -> (retry after, why)
        self._lock = threading.Lock()

    def check(self, peer: str) -> None:
        """Raise ``PeerUnreachableError`` if ``peer`` was found unreachable less than ``retry_s`` ago."""
        with self._lock:
            verdict = self._until.get(peer)
        if verdict is not None:
            retry_at, why = verdict
            left = retry_at - time.monotonic()
            if left > 0:
                raise PeerUnreachableError(
                    f"{self.channel}: peer {peer!r} is unreachable (tried again in {left:.1f}s): {why}"
                )

    def forget(self, peer: str) -> None:
        """Drop a verdict on ``peer``: it has new metadata (another address), so the next connect tries it at once."""
        with self._lock:
            self._until.pop(peer, None)

    def record(self, peer: str, why: str) -> PeerUnreachableError:
        """Record, log and count that ``peer`` cannot be reached; returns the error to raise."""
        with self._lock:
            self._until[peer] = (time.monotonic() + self.retry_s, why)
            self.counters["peer_unreachable"] += 1
        log.warning(
            "%s channel of %r: peer %r is unreachable, so no KV can move to it (every request will be recomputed): %s",
            self.channel,
            self.agent,
            peer,
            why,
        )
        return PeerUnreachableError(f"{self.channel}: peer {peer!r} is unreachable: {why}")
