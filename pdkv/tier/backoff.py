"""How a shared level stops paying a timeout per call while its server is down.

After a failure a target (a server, a cluster node) is skipped for
``retry_s``: calls then answer misses at once instead of each waiting for a
connect or read timeout on the request's path. The failure is logged once per
window, so a dead server costs one warning, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class Backoff:
    """When each target may be asked again; logs a failure once per window."""

    def __init__(self, label: str, retry_s: float) -> None:
        """``label``: how the log names the level (``redis tier redis://...``)."""
        self.label = label
        self.retry_s = retry_s
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def down(self, target: str) -> bool:
        with self._lock:
            until = self._until.get(target)
            if until is None:
                return False
            if time.monotonic() < until:
                return True
            del self._until[target]
            return False

    def any_down(self) -> bool:
        with self._lock:
            return bool(self._until)

    def failed(self, target: str, what: str, exc: BaseException) -> None:
        with self._lock:
            first = target not in self._until
            self._until[target] = time.monotonic() + self.retry_s
        if first:
            log.warning(
                "%s: %s on %s failed (%s); serving misses and skipping it for %.0fs",
                self.label,
                what,
                target,
                exc,
                self.retry_s,
            )
