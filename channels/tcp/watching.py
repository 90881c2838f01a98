"""The initiator's link watcher: one thread watches every link's streams, instead of one thread a link.

It waits in one epoll set holding every live link's streams, armed one-shot, and reads the answers nobody waits
for the moment they arrive (``LinkReader.drain``: done callbacks fire without delay). The streams of a link that a
waiter reads on its own thread (``LinkReader.drive``: the caller wakes on its own answer) are taken out of the set
while it does (``pause``, ``resume``), so that an answer wakes the waiter alone, not this thread too. On each tick
it fails a link whose peer went silent (``io_timeout`` without progress while transfers are pending), lets the
send pool grow (``SendPool.grow``), and closes the sockets of the links that failed, once nobody polls or sends on
them: a reused fd number must never be read. OpenSSL's decrypted bytes are invisible to epoll, so a TLS stream
holding some is drained on each tick.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING

from pdkv.channels.tcp.conn import SHUTDOWN_JOIN_S
from pdkv.channels.tcp.options import TcpOptions
from pdkv.channels.tcp.reader import FOLLOW_S
from pdkv.channels.tcp.sending import SendPool

if TYPE_CHECKING:
    from pdkv.channels.tcp.link import Link

log = logging.getLogger(__name__)

IDLE_TICK_S = 0.05  # how often the watcher wakes with nothing to read (a silent peer, a stream waiting to be sent)
_ARMED = select.EPOLLIN | select.EPOLLONESHOT


class LinkWatcher:
    """Watches every link of one initiator, and holds the send pool they share; see the module docstring."""

    def __init__(self, name: str, opts: TcpOptions) -> None:
        self._name = name
        self.sends = SendPool(name, opts.streams, opts.send_wait_s)  # a thread a stream to begin with
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # a link failed, or closing
        self._epoll.register(self._wake, select.EPOLLIN)
        self._lock = threading.Lock()
        self._by_fd: dict[int, Link] = {}  # every live link's streams
        self._links: set[Link] = set()
        self._failed: list[Link] = []  # failed links whose sockets are still to close
        self._held: set[int] = set()  # streams left to a waiter (or a reader busy elsewhere): to arm again
        self._closing = False
        self._ended = False  # the thread ended, and closed the epoll set and eventfd
        self.thread = threading.Thread(target=self._run, name=f"tcp-{name}-links", daemon=True)
        self.thread.start()

    def add(self, link: Link) -> None:
        """Watch ``link``'s streams from now on."""
        with self._lock:
            if self._closing:
                raise RuntimeError("the link watcher is closed")
            for st in link.streams:
                fd = st.conn.sock.fileno()
                self._epoll.register(fd, _ARMED)
                self._by_fd[fd] = link
            self._links.add(link)

    def pause(self, link: Link) -> None:
        """A waiter reads ``link`` on its own thread from now on (``LinkReader.drive``): its answers wake it alone."""
        self._set(link, 0)

    def resume(self, link: Link) -> None:
        """Nobody reads ``link`` on their own thread any more: watch it again (what arrived meanwhile wakes us now)."""
        self._set(link, _ARMED)

    def _set(self, link: Link, events: int) -> None:
        with self._lock:
            if self._ended:
                return
            for st in link.streams:
                fd = st.conn.sock.fileno()
                if self._by_fd.get(fd) is link:
                    self._held.discard(fd)
                    self._epoll.modify(fd, events)

    def failed(self, link: Link) -> None:
        """``link`` failed (its sockets are shut down): close them once nobody polls or sends on them."""
        with self._lock:
            self._failed.append(link)
            self._poke()

    def close(self) -> threading.Thread:
        """Stop once the failed links' sockets are closed (the initiator failed every link first); returns the
        thread, to join."""
        with self._lock:
            self._closing = True
            self._poke()
        return self.thread

    def _poke(self) -> None:
        """Wake the thread (under the lock, which it closes the eventfd under once it ended)."""
        if not self._ended:
            os.eventfd_write(self._wake, 1)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing and not self._failed:
                        break
                    timeout = FOLLOW_S if self._held else IDLE_TICK_S
                for fd, _ in self._epoll.poll(timeout):
                    if fd == self._wake:
                        os.eventfd_read(self._wake)
                    else:
                        self._read(fd)
                self._tick(time.monotonic())
        except Exception:
            log.exception("tcp %s: the link watcher failed; links fail on their own timeouts", self._name)
        finally:
            with self._lock:
                self._ended = True
                self._epoll.close()
                os.close(self._wake)

    def _read(self, fd: int) -> None:
        """Answers arrived on ``fd``: read them here, unless a waiter reads its link (it arms the stream again when
        it leaves: ``resume``) or another thread does (then it is armed on the next tick)."""
        with self._lock:
            link = self._by_fd.get(fd)
        if link is None or link.dead is not None or link.reader.waiters:
            return
        if not link.reader.drain():
            with self._lock:
                self._held.add(fd)
            return
        self._arm(fd)

    def _arm(self, fd: int) -> None:
        with self._lock:
            link = self._by_fd.get(fd)
            if link is not None and link.dead is None and not link.reader.waiters:
                self._epoll.modify(fd, _ARMED)  # already readable: reported at the next poll

    def _tick(self, now: float) -> None:
        """What the watcher does each time it wakes: arm the streams another reader held, drain TLS streams holding
        decrypted bytes, fail silent links, let the send pool grow, close failed links' sockets."""
        with self._lock:
            held, self._held = self._held, set()
            links = list(self._links)
            failed, self._failed = self._failed, []
        for fd in held:
            self._arm(fd)
        for link in links:
            if link.dead is not None:
                continue
            if any(st.conn.pending() for st in link.streams):
                link.reader.drain()
            latest = max(link.last_post, *(st.conn.last_progress for st in link.streams))
            if link.pending and now - latest > link.opts.io_timeout:
                link.fail(
                    f"{len(link.pending)} transfers pending and no byte moved either way for "
                    f"{link.opts.io_timeout:.3g}s (peer hung or unreachable?)"
                )
        self.sends.grow(now)
        for link in failed:
            self._release(link)

    def _release(self, link: Link) -> None:
        """Close a failed link's sockets once nobody polls or sends on them (the shutdown made both end soon)."""
        with self._lock:
            self._links.discard(link)
            for st in link.streams:
                fd = st.conn.sock.fileno()
                if self._by_fd.pop(fd, None) is not None:
                    self._held.discard(fd)
                    try:
                        self._epoll.unregister(fd)
                    except OSError:
                        pass
        reader = link.reader
        if not reader.rx_lock.acquire(timeout=SHUTDOWN_JOIN_S):
            log.error("tcp %s: a reader of the link to %s did not stop; its sockets stay open", self._name, link.where)
            return
        try:
            for st in link.streams:
                if not st.conn.send_lock.acquire(timeout=SHUTDOWN_JOIN_S):
                    log.error("tcp %s: a send to %s did not stop; its socket stays open", self._name, link.where)
                    continue
                try:
                    st.conn.sock.close()
                finally:
                    st.conn.send_lock.release()
            reader.close()
        finally:
            reader.rx_lock.release()
