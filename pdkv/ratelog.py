"""Log lines that anyone on the network can provoke, said at a bounded rate with a count of the ones left unsaid.

A flood of connections that fail their handshake, or of accepts that fail
for want of file descriptors, must not become a flood of log lines (15,000
warnings in 33 s, 82,000 tracebacks in 25 s, before these): each kind of
event is logged at most ``lines`` times a window, and the first line after a
window that had to keep quiet says how many went unsaid. Counting them is
the caller's (its metrics), so none is lost.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

REFUSAL_LOG_S = 10.0
"""The window in which at most ``REFUSAL_LOG_LINES`` lines of one kind of refusal are logged; the ones beyond are
counted into the next window's first line."""
REFUSAL_LOG_LINES = 10


class Throttled:
    """At most ``lines`` log lines per kind of event every ``interval_s``; the first line after a window that
    had to keep quiet says how many went unsaid."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = REFUSAL_LOG_S, lines: int = REFUSAL_LOG_LINES
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._lines = lines
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int]] = {}  # kind -> (when its window began, lines said in it)
        self._unsaid: collections.Counter[str] = collections.Counter()

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` unless ``lines`` of ``kind`` went out in this window (then count it)."""
        now = time.monotonic()
        with self._lock:
            began, said = self._windows.get(kind, (-self._interval_s, 0))
            if now - began >= self._interval_s:
                began, said = now, 0
            if said >= self._lines:
                self._unsaid[kind] += 1
                return
            self._windows[kind] = (began, said + 1)
            unsaid = self._unsaid.pop(kind, 0)
        if unsaid:
            msg += f" (and {unsaid} more like it unsaid before this)"
        self._log.log(level, msg, *args)
