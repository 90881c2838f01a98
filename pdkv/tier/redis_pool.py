"""Closing the Redis tier's idle connections that their server closed or reset.

redis-py's pool is a stack: it hands out the connection released last and
checks a connection only when it hands it out. The pool grows to the most
connections the worker's threads used at once, so after a burst the ones at
the bottom sit idle, maybe for the rest of the process's life (a decode
worker asks the tier only when it computes a prompt itself). When the server
drops such a connection (a restart, ``CLIENT KILL``, its ``tcp-keepalive``
giving up on a client behind a dead link), the client's socket is closed
(FIN) or reset (RST: redis-py's own keep-alive probe reaching a server that
forgot the connection) under the pool, and its fd stayed open for good: a
socket in CLOSE_WAIT, or in no kernel table at all. The two-host soak found
decode workers keeping one per few rounds of link faults (issue 31).

``Sweeper`` looks at the idle connections of its pools every ``SWEEP_S``: an
idle connection has nothing to read, so one whose socket polls readable (EOF,
a reset, bytes no command asked for) is unusable and is closed. Its
``Connection`` stays in the pool and connects again when next handed out.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

SWEEP_S = 2.0  # how often the idle connections are looked at: a poll(2) each, under the pool's lock


def _unusable(connection: Any) -> bool:
    """Whether an idle connection's socket has anything to report: EOF, an error, or bytes no command asked for."""
    sock = getattr(connection, "_sock", None)
    if sock is None:  # not connected: nothing to close
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def close_unusable(pool: Any) -> int:
    """Close the idle connections of a redis-py ``ConnectionPool`` whose server went away; how many there were."""
    closed = 0
    # redis-py has no public way to look at idle connections: its lock (an idle connection is not handed out
    # while it is looked at) and its idle list
    with pool._lock:  # noqa: SLF001
        for connection in pool._available_connections:  # noqa: SLF001
            if _unusable(connection):
                connection.disconnect()
                closed += 1
    return closed


class Sweeper:
    """A daemon thread that runs ``close_unusable`` on each of ``pools()`` every ``every_s`` until ``close``.

    ``pools()`` gives redis-py ``ConnectionPool`` objects (their lock and idle list are read: redis-py has no
    public way to look at idle connections)."""

    def __init__(self, url: str, pools: Callable[[], Iterable[Any]], every_s: float = SWEEP_S) -> None:
        self.url, self._pools, self.every_s = url, pools, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdkv-redis-sweep", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            closed = sum(close_unusable(pool) for pool in self._pools())
            if closed:
                log.info("redis tier %s: closed %d idle connection(s) the server had dropped", self.url, closed)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
