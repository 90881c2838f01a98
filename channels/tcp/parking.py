"""The target's serve threads: a few threads serve every proven connection, instead of one thread each.

A connection idle between frames is *parked*: armed in one epoll set (one-shot), owned by no thread. The serve
threads that have nothing to do all wait in that set; the kernel wakes one of them when bytes (or EOF) arrive on a
connection, and that thread serves its frames until it is idle again (``FrameServer.serve`` returns), then parks it
again. No thread hands a chunk to another on its way in (the thread the kernel wakes serves it), and the threads of a
decode worker grow with the frames landing at once, not with the prefill workers connected to it (16 senders with two
streams each held 32 serve threads).

While the connections are no more than the serve threads (one prefill worker's streams, say), a thread does not
park the connection it served: it waits for its next frame in the native loop, woken by its bytes with no epoll round
and no Python between, as a thread of its own would be (a single request costs what it cost before the pool). The
moment one connection more arrives the pool is *crowded*: ``crowd_fd`` becomes readable, which ends each such wait
between frames (``FRAME_IDLE``, csrc/kvframes.cpp), and every idle connection is parked; it stops being crowded once
connections leave.

No connection waits for a serve thread for long: when every serve thread has been inside a turn for
``serve_wait_s`` and a parked connection has bytes waiting, a watcher takes that connection and starts one more
thread for it, up to ``max_connections``; a thread beyond ``serve_threads`` ends once it has had nothing to do for
``SPARE_IDLE_S``. A peer that trickles its frames thus costs a thread while it does, as it did before, and cannot
hold the other peers' frames back.

OpenSSL's decrypted bytes are invisible to epoll, so the frame loop parks a TLS connection only when it holds none
(``Conn.readable`` looks at both).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from pdkv.channels.tcp.options import Agent

log = logging.getLogger(__name__)

SPARE_IDLE_S = 5.0  # a serve thread beyond serve_threads ends after this long without a connection to serve
CLOSE_WAIT_S = 10.0  # how long the watcher waits for the serve threads to end before it closes the epoll set
_ARMED = select.EPOLLIN | select.EPOLLONESHOT | select.EPOLLRDHUP


class Parkable(Protocol):
    """What the pool parks: a connection, by the socket it waits on; ``hang_up`` wakes whoever serves it to its end
    (a pool that is closing parks nothing more)."""

    def fileno(self) -> int: ...

    def hang_up(self) -> None: ...


P = TypeVar("P", bound=Parkable)


class ServePool(Generic[P]):
    """Parks idle connections in one epoll set, which the idle serve threads wait in; see the module docstring.

    ``turn(item)`` serves one connection until it is idle (True: park it again) or over (False: it finished it, and
    ``forget`` was called for its fd). It runs on a serve thread and must not raise.
    """

    def __init__(self, agent: Agent, turn: Callable[[P], bool]) -> None:
        opts = agent.opts
        self._name = agent.name
        self._count = agent.count
        self._turn = turn
        self._core = min(opts.serve_threads, opts.max_connections)
        self._wait_s = opts.serve_wait_s
        self._max = opts.max_connections
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()  # readable once closing: every waiting thread wakes (level-triggered)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a thread became busy or ended, or closing
        self._parked: dict[int, P] = {}  # fd -> connection, armed in the epoll set
        self._registered: set[int] = set()  # fds in the epoll set, armed or not
        self._threads: list[threading.Thread] = []
        self._busy = 0  # serve threads inside a turn
        self._members = 0  # connections handed to the pool and not over
        # readable while the connections outnumber the serve threads (or the pool closes): a thread may keep its
        # connection, blocked natively until bytes come (as a thread per connection did), only while it is not
        self.crowd_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.crowded = False
        self._closing = False
        self._watcher = threading.Thread(target=self._watch, name=f"tcp-{self._name}-watch", daemon=True)
        with self._lock:
            for _ in range(self._core):
                self._spawn(None)
        self._watcher.start()

    # -- called by the target -------------------------------------------------------
    def park(self, item: P) -> bool:
        """Hand ``item`` to the pool until bytes arrive on it; False once the pool is closing (the caller keeps it)."""
        fd = item.fileno()
        with self._lock:
            if self._closing:
                return False
            self._parked[fd] = item
            if fd in self._registered:
                self._epoll.modify(fd, _ARMED)
            else:
                self._epoll.register(fd, _ARMED)
                self._registered.add(fd)
                self._members += 1
                self._recount()
            if self._busy == len(self._threads):
                self._changed.notify_all()  # every thread busy and one more connection parked: the watcher looks
        return True

    def forget(self, fd: int) -> None:
        """The connection on ``fd`` is over: out of the epoll set before its socket closes (the number may come
        back)."""
        with self._lock:
            self._parked.pop(fd, None)
            if fd in self._registered and not self._closing:  # closing: the watcher closes the whole set
                self._registered.discard(fd)
                self._members -= 1
                self._recount()
                try:
                    self._epoll.unregister(fd)
                except OSError:
                    pass

    def _recount(self) -> None:
        """Crowded or not, as the members and serve threads now stand (under the lock)."""
        crowded = self._closing or self._members > self._core
        if crowded == self.crowded:
            return
        if crowded:
            os.eventfd_write(self.crowd_fd, 1)
        else:
            os.eventfd_read(self.crowd_fd)
        self.crowded = crowded

    def run(self, item: P, turn: Callable[[P], bool]) -> None:
        """Turn ``item`` until it is over or parked; one the pool will not take back (closing, or an epoll error) is
        hung up, so that the next turn meets its end and finishes it."""
        while turn(item):
            try:
                if self.park(item):
                    return
            except OSError:
                log.exception("tcp %s: cannot park a connection; hanging it up", self._name)
            item.hang_up()

    def parked(self) -> list[P]:
        """The connections parked now (the others are being served)."""
        with self._lock:
            return list(self._parked.values())

    def close(self) -> list[threading.Thread]:
        """Stop: every serve thread ends after its turn (the target hung the connections up first, so turns end);
        what is parked stays parked, for the target to finish. Returns the threads to join."""
        with self._lock:
            if self._closing:
                return []
            self._closing = True
            self._recount()  # threads keeping a connection let it go
            self._changed.notify_all()
            os.write(self._wake_w, b"x")  # under the lock: the watcher closes the pipe only once it saw closing
            return [self._watcher, *self._threads]

    # -- a serve thread ------------------------------------------------------------------
    def _spawn(self, first: P | None) -> None:
        """One more serve thread, serving ``first`` before it waits (under the lock, which the thread needs before
        it counts itself: nothing is counted for a thread that could not start)."""
        t = threading.Thread(target=self._serve, args=(first,), name=f"tcp-{self._name}-serve", daemon=True)
        t.start()
        self._threads.append(t)
        if first is not None:
            self._busy += 1

    def _serve(self, item: P | None) -> None:
        me = threading.current_thread()
        if item is not None:  # started by the watcher for it: counted before its frames land, so whoever sees them
            self._count("serve_threads_added")  # landed sees the thread counted
        try:
            while True:
                if item is not None:
                    self.run(item, self._turn)
                    with self._lock:
                        self._busy -= 1
                item = self._next(me)
                if item is None:
                    return
        finally:
            with self._lock:
                self._threads.remove(me)
                self._changed.notify_all()

    def _next(self, me: threading.Thread) -> P | None:
        """Wait in the epoll set for a connection with bytes, and take it (busy from here); None: this thread ends
        (closing, or a spare thread that had nothing to do for SPARE_IDLE_S)."""
        while True:
            with self._lock:
                if self._closing:
                    return None
                spare = self._threads.index(me) >= self._core
            events = self._epoll.poll(SPARE_IDLE_S if spare else -1, 1)
            with self._lock:
                if self._closing or (spare and not events):
                    return None
                item = self._parked.pop(events[0][0], None) if events else None
                if item is not None:
                    self._busy += 1
                    if self._busy == len(self._threads):
                        self._changed.notify_all()  # every thread busy: the watcher looks for connections waiting
                    return item

    # -- the watcher ---------------------------------------------------------------------
    def _watch(self) -> None:
        """While every serve thread is busy, every ``wait_s``: a connection with bytes waiting gets a thread of its
        own. Once closing, closes the epoll set after the serve threads ended."""
        try:
            while True:
                with self._lock:
                    while not self._closing and (self._busy < len(self._threads) or not self._parked):
                        self._changed.wait()
                    if self._closing:
                        break
                    deadline = time.monotonic() + self._wait_s  # every thread busy this long, or not
                    while not self._closing and self._busy == len(self._threads):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._changed.wait(left)
                    if self._closing:
                        break
                    if self._busy < len(self._threads) or len(self._threads) >= self._max:
                        continue
                events = self._epoll.poll(0, 1)  # one-shot: a connection found here is this watcher's to hand on
                with self._lock:
                    if self._closing:  # what is parked stays parked: the target finishes it
                        break
                    item = self._parked.pop(events[0][0], None) if events else None
                    if item is None:
                        continue
                    log.info(
                        "tcp %s: every serve thread busy for %.0f ms with a connection waiting: starting serve "
                        "thread %d",
                        self._name,
                        self._wait_s * 1e3,
                        len(self._threads) + 1,
                    )
                    try:
                        self._spawn(item)
                    except RuntimeError as exc:  # no thread to be had (a pid or memory limit): it waits parked
                        log.error("tcp %s: cannot start a serve thread: %s", self._name, exc)
                        self._parked[item.fileno()] = item
                        self._epoll.modify(item.fileno(), _ARMED)
                        continue
        except Exception:
            log.exception("tcp %s: the serve pool's watcher failed; the pool closes", self._name)
        finally:
            self._close_set()

    def _close_set(self) -> None:
        """Closes the epoll set and the wake pipe once no serve thread waits in it (or CLOSE_WAIT_S passed)."""
        with self._lock:
            self._closing = True
            self._recount()
            os.write(self._wake_w, b"x")
            ended = self._changed.wait_for(lambda: not self._threads, CLOSE_WAIT_S)
            if not ended:
                log.error(
                    "tcp %s: %d serve threads did not end; their epoll set stays open", self._name, len(self._threads)
                )
                return
            self._epoll.close()
            for fd in (self._wake_r, self._wake_w, self.crowd_fd):
                os.close(fd)
