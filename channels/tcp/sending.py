"""The initiator's sender threads: a few threads send the queued shares of every link, instead of one thread a stream.

A share that does not go out on its caller's thread (``Link._send``) is queued on its stream, and a stream with
shares queued and no thread on it waits in the pool's ready queue. A sender thread takes a stream from there and
sends its shares in the order they were queued until none is left; so a stream's shares never interleave or
overtake one another, and no two threads send on one stream. There are ``streams`` threads to begin with (one
link's shares still go out side by side), however many decode workers the initiator sends to: the threads of a
prefill worker no longer grow with its peers (16 decode workers held 48 sender and watcher threads).

No stream waits for a sender thread for long: when every thread has been inside a send for ``send_wait_s`` with a
stream waiting (a decode worker that stopped reading holds the thread sending to it until ``io_timeout``), the
link watcher (``watching.LinkWatcher``) starts one more thread for it; one beyond ``streams`` ends once it has had
nothing to send for ``SPARE_IDLE_S``. There are never more threads than streams with shares to send.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from pdkv.channels.tcp.conn import IO_ERRORS
from pdkv.channels.tcp.parking import SPARE_IDLE_S
from pdkv.channels.tcp.streams import Batch, Stream

log = logging.getLogger(__name__)


class SendPool:
    """Sends the shares queued on every link's streams; see the module docstring."""

    def __init__(self, name: str, core: int, wait_s: float) -> None:
        self._name, self._core, self._wait_s = name, core, wait_s
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a stream became ready, or closing
        self._ready: collections.deque[tuple[Stream, float]] = collections.deque()  # (stream, since when)
        self._threads: list[threading.Thread] = []
        self._busy = 0  # threads sending a stream's shares
        self._closing = False
        with self._lock:
            for _ in range(core):
                self._spawn()

    def put(self, st: Stream, batch: Batch) -> None:
        """Queue ``batch`` on ``st``; a thread sends it after the stream's earlier shares."""
        with self._lock:
            if self._closing:
                return  # the channel is closing: its links failed, and their transfers with them
            st.queue.append(batch)
            if not st.scheduled:
                st.scheduled = True
                self._ready.append((st, time.monotonic()))
                self._work.notify()

    def drop(self, st: Stream) -> None:
        """Forget what waits on ``st`` (its link failed, and its transfers with it)."""
        with self._lock:
            st.queue.clear()

    def grow(self, now: float) -> None:
        """One more thread if every thread has been busy and a stream has waited ``send_wait_s`` (the watcher's
        tick)."""
        with self._lock:
            if self._closing or not self._ready or self._busy < len(self._threads):
                return
            if now - self._ready[0][1] < self._wait_s:
                return
            log.info(
                "tcp %s: every sender thread busy for %.0f ms with a stream waiting: starting sender thread %d",
                self._name,
                self._wait_s * 1e3,
                len(self._threads) + 1,
            )
            try:
                self._spawn()
            except RuntimeError as exc:  # no thread to be had (a pid or memory limit): it waits its turn
                log.error("tcp %s: cannot start a sender thread: %s", self._name, exc)

    def close(self) -> list[threading.Thread]:
        """Stop: every thread ends once it finished the stream it sends (the links failed first); returns them."""
        with self._lock:
            self._closing = True
            self._ready.clear()
            self._work.notify_all()
            return list(self._threads)

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def _spawn(self) -> None:
        """One more sender thread (under the lock)."""
        t = threading.Thread(target=self._run, name=f"tcp-{self._name}-tx", daemon=True)
        t.start()
        self._threads.append(t)

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            while (st := self._next(me)) is not None:
                self._send_all(st)
        finally:
            with self._lock:
                self._threads.remove(me)

    def _next(self, me: threading.Thread) -> Stream | None:
        """The next stream with shares waiting (this thread busy from here); None: this thread ends (closing, or a
        spare that had nothing to send for SPARE_IDLE_S)."""
        with self._lock:
            while not self._ready:
                if self._closing:
                    return None
                spare = self._threads.index(me) >= self._core
                if not self._work.wait(SPARE_IDLE_S if spare else None) and spare and not self._ready:
                    return None
            self._busy += 1
            return self._ready.popleft()[0]

    def _send_all(self, st: Stream) -> None:
        """Send ``st``'s shares in order until none is left, then let it go."""
        while True:
            with self._lock:
                if not st.queue or self._closing:
                    st.queue.clear()
                    st.scheduled = False
                    self._busy -= 1
                    return
                batch = st.queue.popleft()
            try:
                with st.conn.send_lock:
                    st.send(batch)
                if batch.on_sent is not None:
                    batch.on_sent()
            except IO_ERRORS as exc:
                st.fail(f"sending failed: {exc}")  # fails the link, which drops what waits on it
