"""Handing a transfer's landed KV to the decode request that asked for it: waited for on a thread (``wait``) or on
an asyncio event loop (``claim``).

A decode worker's HTTP handlers run on asyncio. Its KV usually lands while the router's hops back from P and on to
D are under way, so a request whose KV is not there yet used to wait on a pool thread: a hop there, a wake-up of
that thread by the book's ``notify_all``, and a hop back to the loop. ``claim`` waits on the loop itself: the book's
lock (``BookLock``) wakes each loop that awaits a claim the moment the book changes, and the KV is claimed there.
Both ways share one rule for when to give up (``Claims._look``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdkv.config import TransferConfig
from pdkv.errors import NotAnnouncedError, TransferError, TransferTimeout
from pdkv.transfer.book import IncomingBook
from pdkv.transfer.incoming import ReceivedKV, State

BUSY_RETRY_S = 0.0005  # a claim that found the book's lock held looks again this soon (or when the book changes)


class BookLock(threading.Condition):
    """The decode side's one lock, whose ``notify_all`` also wakes the event loops awaiting ``Claims.claim``.

    Each waker only schedules a wake-up on its own loop (``call_soon_threadsafe``): nothing of the claimer's runs
    on the thread that changed the book, which holds this lock.
    """

    def __init__(self) -> None:
        super().__init__()
        # added and removed by the loops without this lock (a loop never blocks on it): read as one snapshot
        self.wakers: set[Callable[[], None]] = set()

    def notify_all(self) -> None:
        super().notify_all()
        for wake in tuple(self.wakers):  # one C-level copy: a loop adding its waker meanwhile cannot break it
            wake()


@dataclass(frozen=True)
class _Waiting:
    """One wait for one transfer's KV: what it asks for and until when."""

    transfer_id: str
    prompt_key: bytes | None
    timeout: float
    deadline: float
    unannounced: float  # give up at this time if no sender has announced (reserved) the transfer by then


@dataclass(frozen=True)
class _GaveUp:
    error: type[TransferError]
    why: str


class Claims:
    """The receiver's two ways for a decode request to take its transfer's KV (``KVReceiver.wait``, ``claim``)."""

    def __init__(
        self,
        book: IncomingBook,
        lock: BookLock,
        config: TransferConfig,
        counters: collections.Counter[str],
        cancel: Callable[[str, str], None],
    ) -> None:
        self.book, self.lock, self.config, self.counters, self.cancel = book, lock, config, counters, cancel

    def wait(self, transfer_id: str, timeout: float | None, prompt_key: bytes | None) -> ReceivedKV:
        """``KVReceiver.wait``: block this thread until the KV is claimed or the wait gives up."""
        waiting = self._start(transfer_id, timeout, prompt_key)
        with self.lock:
            while isinstance(step := self._look(waiting), float):
                self.lock.wait(step)
        return self._end(waiting, step)

    async def claim(self, transfer_id: str, timeout: float | None, prompt_key: bytes | None) -> ReceivedKV:
        """``wait`` on the running event loop, with no thread: each change of the book wakes it through the loop.

        The loop never blocks on the book's lock: a thread may hold it while it lands a chunk (a staged chunk's
        scatter takes milliseconds), and the streams of every other request on this loop would wait. A busy book
        is looked at again ``BUSY_RETRY_S`` later, or at once if it changes. A cancelled claim cancels the
        transfer, freeing its blocks."""
        waiting = self._start(transfer_id, timeout, prompt_key)
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under a claim it abandoned
                loop.call_soon_threadsafe(changed.set)

        self.lock.wakers.add(wake)
        try:
            while True:
                changed.clear()  # before looking: a change after the look sets it again
                step: ReceivedKV | float | _GaveUp = BUSY_RETRY_S
                if self.lock.acquire(blocking=False):
                    try:
                        step = self._look(waiting)
                    finally:
                        self.lock.release()
                if not isinstance(step, float):
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), step)
        except asyncio.CancelledError:
            self.cancel(transfer_id, "the decode request was cancelled")
            raise
        finally:
            self.lock.wakers.discard(wake)
        return self._end(waiting, step)

    def _start(self, transfer_id: str, timeout: float | None, prompt_key: bytes | None) -> _Waiting:
        timeout = self.config.transfer_timeout_s if timeout is None else timeout
        now = time.monotonic()
        return _Waiting(transfer_id, prompt_key, timeout, now + timeout, now + self.config.announce_timeout_s)

    def _look(self, waiting: _Waiting) -> ReceivedKV | float | _GaveUp:
        """Under the lock: the KV, claimed; else how long to wait before looking again; else why the wait ends."""
        got = self._settled(waiting.transfer_id, waiting.prompt_key)
        if got is not None:
            return got
        announced = waiting.transfer_id in self.book.res
        now = time.monotonic()
        if not announced and now >= waiting.unannounced:
            self.counters["unannounced"] += 1
            why = (
                f"no sender announced transfer {waiting.transfer_id!r} within "
                f"announce_timeout_s={self.config.announce_timeout_s:.3g}s"
            )
            return _GaveUp(NotAnnouncedError, why)
        if now >= waiting.deadline:
            why = f"KV of transfer {waiting.transfer_id!r} did not arrive within {waiting.timeout:.3g}s"
            return _GaveUp(TransferTimeout, why)
        return (waiting.deadline if announced else min(waiting.deadline, waiting.unannounced)) - now

    def _end(self, waiting: _Waiting, step: ReceivedKV | _GaveUp) -> ReceivedKV:
        """The claimed KV, or the wait's failure raised once the transfer is cancelled (nothing of it leaks)."""
        if isinstance(step, ReceivedKV):
            return step
        self.cancel(waiting.transfer_id, f"decode side stopped waiting: {step.why}")
        raise step.error(step.why)

    def _settled(self, transfer_id: str, prompt_key: bytes | None) -> ReceivedKV | None:
        """The KV of a landed transfer, claimed; None while it is still coming (the caller holds the lock)."""
        book = self.book
        r = book.res.get(transfer_id)
        if r is not None and r.state is State.READY:
            return book.claim(r, prompt_key)
        if r is not None and r.state is State.FAILED:
            raise TransferError(f"KV transfer {transfer_id!r} failed: {r.error}")
        if r is None and transfer_id in book.gone:
            raise TransferError(f"KV transfer {transfer_id!r} is over: {book.gone[transfer_id]}")
        return None
