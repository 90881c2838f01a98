"""The initiator's link watcher: one thread watches every link's streams, instead of one thread a link.

It waits in one epoll set holding every live link's streams, armed one-shot. When answers arrive that nobody waits
for, it hands the link to a worker (``workers.LinkWorkers``), which reads them (``LinkReader.drain``: done callbacks
fire without delay) and arms the stream again; it never reads a frame itself, so a peer that trickles an answer
holds one worker, not the watcher and every other link. The streams of a link that a waiter reads on its own thread
(``LinkReader.drive``: the caller wakes on its own answer) are taken out of the set while it does (``pause``,
``resume``), so that an answer wakes the waiter alone. A stream whose link another thread was reading is armed again
``FOLLOW_S`` later. Every ``IDLE_TICK_S`` it fails a link whose peer went silent (``io_timeout`` without progress
while transfers are pending), hands a TLS link whose OpenSSL holds decrypted bytes (which epoll cannot see) to a
worker, and lets the workers grow (``LinkWorkers.grow``). A worker closes the sockets of a link that failed once
nobody polls or sends on them (a reused fd number must never be read), which may wait for a reader or a send to stop:
not on the watcher, which every other link needs.
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
from pdkv.channels.tcp.workers import LinkWorkers
from pdkv.errors import ChannelError

if TYPE_CHECKING:
    from pdkv.channels.tcp.link import Link

log = logging.getLogger(__name__)

IDLE_TICK_S = 0.05  # how often the watcher looks for silent peers, TLS bytes and workers to add
_ARMED = select.EPOLLIN | select.EPOLLONESHOT
_PAUSED = select.EPOLLONESHOT  # nothing asked; an error or hang-up is reported once


class LinkWatcher:
    """Watches every link of one initiator, and holds the workers they share; see the module docstring."""

    def __init__(self, name: str, opts: TcpOptions) -> None:
        self._name = name
        self.workers = LinkWorkers(name, opts.streams, opts.send_wait_s)  # a thread a stream to begin with
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # a link failed, a stream held, or closing
        self._epoll.register(self._wake, select.EPOLLIN)
        self._lock = threading.Lock()
        self._by_fd: dict[int, Link] = {}  # every live link's streams
        self._links: set[Link] = set()
        self._failed: list[Link] = []  # failed links whose sockets are still to close
        self._held: dict[int, float] = {}  # streams another thread was reading: since when, to arm again
        self._next_scan = 0.0
        self._closing = False
        self._ended = False  # the thread ended: closing
        self.thread = threading.Thread(target=self._run, name=f"tcp-{name}-links", daemon=True)
        self.thread.start()

    def add(self, link: Link) -> None:
        """Watch ``link``'s streams from now on."""
        with self._lock:
            if self._closing or self._ended:
                raise ChannelError("tcp: the channel is closed")
            for st in link.streams:
                fd = st.conn.sock.fileno()
                self._epoll.register(fd, _ARMED)
                self._by_fd[fd] = link
            self._links.add(link)

    def pause(self, link: Link) -> None:
        """A waiter reads ``link`` on its own thread from now on (``LinkReader.drive``): its answers wake it alone."""
        self._set(link, _PAUSED)

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
                    self._held.pop(fd, None)
                    self._epoll.modify(fd, events)

    def failed(self, link: Link) -> None:
        """``link`` failed (its sockets are shut down): close them once nobody polls or sends on them."""
        with self._lock:
            if not self._ended:
                self._failed.append(link)
                os.eventfd_write(self._wake, 1)
                return
        # nobody left to do it later, and the caller may hold the link's reader (a failing read): not on its thread
        threading.Thread(target=self._release, args=(link,), name=f"tcp-{self._name}-release", daemon=True).start()

    def close(self) -> threading.Thread:
        """Stop once the failed links' sockets are closed (the initiator failed every link first); returns the
        thread, to join."""
        with self._lock:
            self._closing = True
            if not self._ended:
                os.eventfd_write(self._wake, 1)
        return self.thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing and not self._failed:
                        break
                    timeout = FOLLOW_S if self._held else IDLE_TICK_S
                try:
                    for fd, _ in self._epoll.poll(timeout):
                        if fd == self._wake:
                            os.eventfd_read(self._wake)
                        else:
                            self._ready(fd)
                    self._tick(time.monotonic())
                except Exception:  # a bug of ours: every link must go on being watched, so the thread goes on
                    log.exception("tcp %s: the link watcher's pass failed; it goes on", self._name)
                    time.sleep(IDLE_TICK_S)
        finally:
            with self._lock:
                self._ended = True
                self._epoll.close()
                os.close(self._wake)
                failed, self._failed = self._failed, []
            for link in failed:
                self._release(link)

    def _ready(self, fd: int) -> None:
        """Answers arrived on ``fd``: a worker reads them, unless a waiter reads its link (it arms the stream again
        when it leaves: ``resume``)."""
        with self._lock:
            link = self._by_fd.get(fd)
        if link is not None and link.dead is None and not link.reader.waiters:
            self.workers.run(lambda: self._drain(link, fd))

    def _drain(self, link: Link, fd: int) -> None:
        """On a worker: read what ``link`` has, then arm ``fd`` again; if another thread is reading the link, arm it
        ``FOLLOW_S`` later (that thread reads what is there)."""
        if link.reader.drain():
            self._arm(fd)
            return
        with self._lock:
            if not self._ended and fd in self._by_fd:
                self._held[fd] = time.monotonic()
                os.eventfd_write(self._wake, 1)  # to sleep FOLLOW_S, not IDLE_TICK_S

    def _arm(self, fd: int) -> None:
        with self._lock:
            link = self._by_fd.get(fd)
            if not self._ended and link is not None and link.dead is None and not link.reader.waiters:
                self._epoll.modify(fd, _ARMED)  # already readable: reported at the next poll

    def _tick(self, now: float) -> None:
        """After every wake: arm the streams held long enough, hand failed links to a worker to close their sockets;
        every IDLE_TICK_S: fail silent links, hand TLS links holding decrypted bytes to a worker, let the workers
        grow."""
        with self._lock:
            due = [fd for fd, since in self._held.items() if now - since >= FOLLOW_S]
            for fd in due:
                del self._held[fd]
            failed, self._failed = self._failed, []
            links = list(self._links) if now >= self._next_scan else []
        for fd in due:
            self._arm(fd)
        for link in failed:  # on a worker: it may wait for a reader or a send to stop, and other links go on
            if not self.workers.run(lambda link=link: self._release(link)):
                self._release(link)  # the workers are closing (so is the channel): here, before the watcher ends
        if not links:
            return
        self._next_scan = now + IDLE_TICK_S
        for link in links:
            if link.dead is not None:
                continue
            if any(st.conn.pending() for st in link.streams):
                self.workers.run(link.reader.drain)
            latest = max(link.last_post, *(st.conn.last_progress for st in link.streams))
            if link.pending and now - latest > link.opts.io_timeout:
                link.fail(
                    f"{len(link.pending)} transfers pending and no byte moved either way for "
                    f"{link.opts.io_timeout:.3g}s (peer hung or unreachable?)"
                )
        self.workers.grow(now)

    def _release(self, link: Link) -> None:
        """Close a failed link's sockets once nobody polls or sends on them (the shutdown made both end soon)."""
        with self._lock:
            self._links.discard(link)
            for st in link.streams:
                fd = st.conn.sock.fileno()
                if self._by_fd.pop(fd, None) is not None:
                    self._held.pop(fd, None)
                    if not self._ended:
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
