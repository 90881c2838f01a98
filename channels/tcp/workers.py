"""The initiator's worker threads: a few threads send the queued shares of every link and read the answers nobody
waits for, instead of a sender thread a stream and a reader (watcher) thread a link.

A share that does not go out on its caller's thread (``Link._send``) is queued on its stream, and a stream with
shares queued and no thread on it waits in the pool's ready queue, as does a link with answers to read that the link
watcher (``watching.LinkWatcher``) hands over. A worker takes the next from there: it sends a stream's shares in the
order they were queued until none is left (so a stream's shares never interleave or overtake one another, and no
two threads send on one stream), or reads a link's answers. There are ``streams`` threads to begin with (one link's
shares still go out side by side), however many decode workers the initiator sends to: the threads of a prefill
worker no longer grow with its peers (8 decode workers held 24 sender and watcher threads).

Nothing waits for a worker for long: when every worker has been busy for ``send_wait_s`` with something waiting (a
decode worker that stopped reading holds the thread sending to it, and one that trickles an answer the thread
reading it, until ``io_timeout``), the link watcher's tick starts one more; one beyond ``streams`` ends once it has
had nothing to do for ``SPARE_IDLE_S``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from pdkv.channels.tcp.conn import IO_ERRORS
from pdkv.channels.tcp.parking import SPARE_IDLE_S
from pdkv.channels.tcp.streams import Batch, Stream

log = logging.getLogger(__name__)

Job = Callable[[], None]


class LinkWorkers:
    """Sends the shares queued on every link's streams, and runs the link watcher's reads; see the module
    docstring."""

    def __init__(self, name: str, core: int, wait_s: float) -> None:
        self._name, self._core, self._wait_s = name, core, wait_s
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a stream became ready, or closing
        self._ready: collections.deque[tuple[Stream | Job, float]] = collections.deque()  # (what, since when)
        self._threads: list[threading.Thread] = []
        self._busy = 0  # threads sending a stream's shares or running a job
        self._closing = False
        with self._lock:
            for _ in range(core):
                self._spawn()

    def put(self, st: Stream, batch: Batch) -> None:
        """Queue ``batch`` on ``st``; a worker sends it after the stream's earlier shares."""
        with self._lock:
            if self._closing:
                return  # the channel is closing: its links failed, and their transfers with them
            st.queue.append(batch)
            if not st.scheduled:
                st.scheduled = True
                self._ready.append((st, time.monotonic()))
                self._work.notify()

    def run(self, job: Job) -> bool:
        """Run ``job`` (a link's answers to read, a failed link's sockets to close) on a worker; it must not raise.
        False once closing: it was dropped."""
        with self._lock:
            if self._closing:
                return False
            self._ready.append((job, time.monotonic()))
            self._work.notify()
            return True

    def drop(self, st: Stream) -> None:
        """Forget what waits on ``st`` (its link failed, and its transfers with it)."""
        with self._lock:
            st.queue.clear()

    def grow(self, now: float) -> None:
        """One more thread if every thread has been busy and something has waited ``send_wait_s`` (the watcher's
        tick)."""
        with self._lock:
            if self._closing or not self._ready or self._busy < len(self._threads):
                return
            if now - self._ready[0][1] < self._wait_s:
                return
            log.info(
                "tcp %s: every worker busy for %.0f ms with a stream or link waiting: starting worker %d",
                self._name,
                self._wait_s * 1e3,
                len(self._threads) + 1,
            )
            try:
                self._spawn()
            except RuntimeError as exc:  # no thread to be had (a pid or memory limit): it waits its turn
                log.error("tcp %s: cannot start a worker thread: %s", self._name, exc)

    def close(self) -> list[threading.Thread]:
        """Stop: every thread ends once nothing is left waiting (the links failed first: their shares are dropped, and
        the jobs run, a failed link's sockets to close among them); returns them."""
        with self._lock:
            self._closing = True
            self._work.notify_all()
            return list(self._threads)

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def _spawn(self) -> None:
        """One more worker thread (under the lock)."""
        t = threading.Thread(target=self._run, name=f"tcp-{self._name}-io", daemon=True)
        t.start()
        self._threads.append(t)

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            while (item := self._next(me)) is not None:
                try:
                    if isinstance(item, Stream):
                        self._send_all(item)
                    else:
                        item()
                except Exception:  # a bug of ours, not the peer's: the thread goes on
                    log.exception("tcp %s: a worker's job failed", self._name)
                finally:
                    with self._lock:
                        self._busy -= 1
        finally:
            with self._lock:
                self._threads.remove(me)

    def _next(self, me: threading.Thread) -> Stream | Job | None:
        """The next stream or job waiting (this thread busy from here); None: this thread ends (closing, or a spare
        that had nothing to do for SPARE_IDLE_S)."""
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
        """Send ``st``'s shares in order until none is left, then let it go; a failed send fails its link, which drops
        what waits on it."""
        while True:
            with self._lock:
                if not st.queue or self._closing:
                    st.queue.clear()
                    st.scheduled = False
                    return
                batch = st.queue.popleft()
            try:
                with st.conn.send_lock:
                    st.send(batch)
                if batch.on_sent is not None:
                    batch.on_sent()
            except IO_ERRORS as exc:
                st.fail(f"sending failed: {exc}")
            except Exception as exc:  # a bug of ours: the link cannot go on with a share half sent
                log.exception("tcp %s: sending a share failed", self._name)
                st.fail(f"sending failed: {exc!r}")
