"""What one request to a shared store may cost: a wall-clock deadline on its answer that closes its connection, and
the most bytes its answer may declare.

A store on the network may be slow, broken or hostile. The clients' own
timeouts bound each socket read, not a request: a store that trickles a byte
just inside the read timeout holds a request for as long as it likes, and a
value declared a gigabyte long is read whole before anything can look at it.
So each request a shared level makes runs inside ``request(timeout_s,
limit)``, and the client's connection (``pdkv.tier.redis_bounded``'s parser,
``pdkv.tier.s3_bounded``'s HTTP connection) asks ``current()`` for its
bounds:

* it refuses an answer that declares more than ``limit`` bytes (a Redis bulk
  length, an HTTP Content-Length) before reading any of it, and reads no
  more than that;
* once the request is sent, its whole answer must arrive within
  ``timeout_s`` (``answering`` starts the clock): while the connection waits
  for it, it is ``attach``-ed, and when the deadline passes a watchdog thread
  shuts its socket down, which ends the read in progress at once; the
  connection (its socket now closed) is never handed out again half-read.

Sending is not on the clock: a put of a prompt's chunks may take longer than
``timeout_s`` on a slow link, and each send is bounded by the socket timeout
already (Python's ``sendall`` with a timeout bounds the whole call). A read
sends a few bytes: it waits at most about ``timeout_s`` in all.

Either way the request fails with ``StoreAnswerError`` (or the client's own
error wrapping it), which the level counts as a failure and serves as misses,
as it does a store that is down. ``limit`` for a read is the most a value read
into the caller's buffers can be (``value_limit``); an answer that carries no
value gets ``ANSWER_BYTES``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pdkv.errors import StoreAnswerError
from pdkv.tier.base import HEADER_BYTES, TAG_BYTES

ANSWER_BYTES = 1 << 20  # the most an answer that carries no value (a status, a list of errors, XML) may declare
_local = threading.local()


def value_limit(outs: Sequence[torch.Tensor]) -> int:
    """The most bytes a stored value read into one of ``outs`` can be: header, payload, and a seal's tag (whether or
    not the level seals: a reader without a secret still reads sealed values). Anything longer is not a chunk."""
    return HEADER_BYTES + max((o.numel() * o.element_size() for o in outs), default=0) + TAG_BYTES


def shut(sock: socket.socket | None) -> None:
    """Shut ``sock`` down both ways: a read blocked on it returns at once (a plain ``close`` would leave it blocked).
    The base class's method, so that a TLS socket is shut at the TCP level without touching its TLS state from
    another thread."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class Request:
    """One request's bounds: the answer's byte ``limit`` and a ``deadline`` (``time.monotonic()``)."""

    def __init__(self, what: str, timeout_s: float, limit: int) -> None:
        self.what, self.timeout_s, self.limit = what, timeout_s, limit
        self.deadline: float | None = None  # set by ``answering``
        self.expired = False
        self._closers: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def check_declared(self, declared: int, where: str) -> None:
        """Refuse an answer that declares more than ``limit`` bytes, before any of it is read."""
        if declared > self.limit:
            raise StoreAnswerError(
                f"{where} declared a {declared}-byte answer to {self.what}, and it can be at most {self.limit} bytes "
                "(a chunk's value, or an answer without one): not read, connection closed"
            )

    def late(self) -> StoreAnswerError:
        """The error of a request whose deadline passed."""
        return StoreAnswerError(
            f"no whole answer to {self.what} within {self.timeout_s:g}s (the level's timeout_s, per request): "
            "connection closed"
        )

    def answering(self) -> None:
        """The request is sent: its answer must be whole within ``timeout_s`` from now (the first call starts the
        clock; later ones, for the rest of the answer, leave it running)."""
        with self._lock:
            if self.deadline is not None:
                return
            self.deadline = time.monotonic() + self.timeout_s
        _watchdog.arm(self, self.deadline)

    def attach(self, close: Callable[[], None]) -> int:
        """Until ``detach`` or the request's end, ``close()`` is called (from the watchdog thread) if the deadline
        passes; raises ``late()`` at once when it has passed already. Returns what ``detach`` takes."""
        with self._lock:
            if self.expired:
                raise self.late()
            token = next(self._ids)
            self._closers[token] = close
            return token

    def detach(self, token: int) -> None:
        """``close`` is not called any more (when this returns, it is not running either)."""
        with self._lock:
            self._closers.pop(token, None)

    @contextlib.contextmanager
    def watching(self, close: Callable[[], None]) -> Iterator[None]:
        """``close()`` is called if the deadline passes while the block runs, never after it ended."""
        token = self.attach(close)
        try:
            yield
        finally:
            self.detach(token)

    def end(self) -> None:
        """The request is over: whatever it watched is not closed any more, whenever the deadline passes."""
        with self._lock:
            self._closers.clear()

    def expire(self) -> None:
        """The deadline passed: close whatever is being waited on now (the watchdog calls this)."""
        with self._lock:
            self.expired = True
            closers = list(self._closers.values())
            for close in closers:  # under the lock: a block that ended has no closer left to call
                close()


class _Watchdog:
    """One daemon thread for the process, expiring requests at their deadlines (a heap; an ended request's entry is
    dropped when it comes up)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, request: Request, deadline: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), request))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdkv-tier-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, request = heapq.heappop(self._heap)
            request.expire()


_watchdog = _Watchdog()


def current() -> Request | None:
    """The request this thread runs now (None outside ``request``: the client works unbounded, as it would alone)."""
    return getattr(_local, "request", None)


@contextlib.contextmanager
def request(what: str, timeout_s: float, limit: int = ANSWER_BYTES) -> Iterator[Request]:
    """Run one request to a store: its answer whole within ``timeout_s`` of being sent, and at most ``limit``
    bytes. Once the deadline passed, the block fails with ``Request.late()`` whatever it raised or returned: a
    client may take an answer cut short by the shut socket for a whole one (HTTP headers ended by EOF, a body
    botocore does not check against its length)."""
    bounds = Request(what, timeout_s, limit)
    outer = current()
    _local.request = bounds
    try:
        yield bounds
    except Exception as exc:
        if bounds.expired and not isinstance(exc, StoreAnswerError):
            raise bounds.late() from exc
        raise
    else:
        if bounds.expired:
            raise bounds.late()
    finally:
        bounds.end()
        _local.request = outer


def answer_field(answer: Any, field: str, what: str) -> str:
    """``answer[field]`` as a non-empty string, or ``StoreAnswerError`` naming what the store left out."""
    value = answer.get(field) if isinstance(answer, dict) else None
    if not isinstance(value, str) or not value:
        raise StoreAnswerError(f"the store's answer to {what} has no {field}: a malformed answer")
    return value
