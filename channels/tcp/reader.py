"""Reading an initiator link's answers (ACK, ANSWER, READ_DATA, NACK, ERROR), on whichever thread holds ``rx_lock``.

That is a thread in ``drive`` (so the answer wakes the waiter itself, not a
reader thread that then wakes it: one context switch less per transfer), a
``poll`` call or the posting thread (``drain``: what is already there), or
the initiator's link watcher (``watching.LinkWatcher``), which reads an answer
nobody waits for the moment it arrives (so done callbacks fire without delay).
"""

from __future__ import annotations

import logging
import math
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

from pdkv.channels.handle import TransferHandle, XferState
from pdkv.channels.tcp.conn import IO_ERRORS, PeerClosed
from pdkv.channels.tcp.streams import Stream
from pdkv.channels.tcp.wire import (
    ACK,
    ANSWER,
    ERROR,
    FRAME_NAMES,
    MAX_ACK_BATCH,
    MAX_ERROR_BYTES,
    NACK,
    READ_DATA,
    no_extras,
)
from pdkv.errors import ChannelError, ProtocolError

if TYPE_CHECKING:
    from pdkv.channels.tcp.link import Link

log = logging.getLogger(__name__)

FOLLOW_S = 0.002  # how often a waiter re-checks its handle while another thread reads the link


class LinkReader:
    """Reads ``link``'s answers into its pending transfers (``Link.finish``, ``Link.landed``, ``Link.refused``); a
    bad or lost stream fails the link, whose sockets the initiator's link watcher then closes."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.rx_lock = threading.Lock()
        self.waiters = 0  # threads in ``drive``
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = select.poll()
        self._by_fd: dict[int, Stream] = {}
        for st in link.streams:
            self._poller.register(st.conn.sock, select.POLLIN)
            self._by_fd[st.conn.sock.fileno()] = st
        self._poller.register(self._wake_r, select.POLLIN)

    def drain(self) -> bool:
        """Read the answers already there, unless another thread is reading (then False)."""
        if not self.rx_lock.acquire(blocking=False):
            return False
        try:
            while self.progress(0):
                pass
        finally:
            self.rx_lock.release()
        return True

    def drive(self, handle: TransferHandle, deadline: float) -> None:
        """Read the link's answers on the calling thread until ``handle`` finishes or ``deadline`` passes."""
        link = self.link
        with link.lock:
            self.waiters += 1
            if self.waiters == 1:
                link.watcher.pause(link)
        try:
            while handle.state is XferState.PENDING and link.dead is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                # another thread reading may finish this handle too: check again at least every FOLLOW_S
                if not self.rx_lock.acquire(timeout=min(remaining, FOLLOW_S)):
                    continue
                try:
                    while handle.state is XferState.PENDING and link.dead is None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return
                        self.progress(min(remaining, link.opts.io_timeout))
                finally:
                    self.rx_lock.release()
        finally:
            with link.lock:
                self.waiters -= 1
                if not self.waiters:
                    link.watcher.resume(link)

    def wake(self) -> None:
        """Wake a waiter polling the sockets: a READ completed elsewhere."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # the wake socket is full (a wake-up is pending anyway) or the link is gone

    def progress(self, timeout: float) -> int:
        """Read one frame from each stream that has one, waiting up to ``timeout`` s; the caller holds ``rx_lock``.

        Returns how many frames were read; a bad or lost stream fails the link.
        """
        link = self.link
        if link.dead is not None:
            return 0
        frames = 0
        try:
            for fd, _ in self._ready(math.ceil(timeout * 1000)):
                if link.dead is not None:
                    break
                st = self._by_fd.get(fd)
                if st is None:
                    self._wake_r.recv(4096)  # a READ completed elsewhere: the caller re-checks its handle
                    continue
                self._read_frame(st)
                frames += 1
        except ProtocolError as exc:
            log.error("%s; closing the link", exc)
            link.fail(str(exc))
        except IO_ERRORS as exc:
            if link.dead is None and not link.initiator.closed:
                # a peer hanging up an idle link is a normal shutdown; losing transfers is not
                level = logging.INFO if isinstance(exc, PeerClosed) and not link.pending else logging.WARNING
                log.log(level, "tcp %s: link to %s failed: %s", link.initiator.agent.name, link.where, exc)
            link.fail(str(exc))
        return frames

    def _ready(self, timeout_ms: int) -> list[tuple[int, int]]:
        """``poll`` on the streams and the wake socket, plus (TLS) the streams OpenSSL holds decrypted bytes of."""
        if not self.link.initiator.agent.tls:
            return self._poller.poll(timeout_ms)
        held = {st.conn.sock.fileno() for st in self.link.streams if st.conn.pending()}
        return [
            *((fd, select.POLLIN) for fd in held),
            *(r for r in self._poller.poll(0 if held else timeout_ms) if r[0] not in held),
        ]

    def _read_frame(self, st: Stream) -> None:
        link, conn = self.link, st.conn
        ftype, flags, shares, aux, nlen, xfer, _, length = conn.recv_header()
        no_extras(conn.label, ftype, flags, shares, nlen)
        if ftype == ACK:
            if not 1 <= aux <= MAX_ACK_BATCH or length != 8 * (aux - 1):
                raise ProtocolError(f"tcp: {link.where} sent an ACK of {aux} ids in {length} bytes")
            xfers = (
                (xfer,)
                if aux == 1
                else (xfer, *struct.unpack(f"<{aux - 1}Q", conn.recv_payload(length, length, "ACK ids")))
            )
            if why := link.misanswered(xfers, answered=False):
                raise ProtocolError(f"tcp: {link.where} {why}")
            if not link.finish(xfers):
                raise ProtocolError(f"tcp: {link.where} acknowledged a transfer that is not pending")
        elif ftype == ANSWER:
            answer = conn.recv_payload(length, link.opts.max_notif_bytes, "answer")
            if why := link.misanswered((xfer,), answered=True):
                raise ProtocolError(f"tcp: {link.where} {why}")
            if not link.finish((xfer,), answer):
                raise ProtocolError(f"tcp: {link.where} answered a transfer that is not pending")
        elif ftype == READ_DATA:
            if not st.expect:
                raise ProtocolError(f"tcp: {link.where} sent READ data nobody asked for")
            want_xfer, view = st.expect.popleft()
            if xfer != want_xfer or length != view.nbytes:
                raise ProtocolError(
                    f"tcp: {link.where} answered READ of transfer {want_xfer} ({view.nbytes} bytes) with transfer "
                    f"{xfer} ({length} bytes)"
                )
            conn.recv_exact(view)
            link.landed(st, xfer, length)
        elif ftype == NACK:
            why = conn.recv_payload(length, MAX_ERROR_BYTES, "refusal").decode(errors="replace")
            if st.expect and st.expect[0][0] == xfer:  # a READ_REQ answered with a refusal instead of its data
                st.expect.popleft()
            link.refused(xfer, why)
        elif ftype == ERROR:
            msg = conn.recv_payload(length, MAX_ERROR_BYTES, "error message").decode(errors="replace")
            raise ChannelError(f"the peer rejected a frame: {msg}")
        else:
            raise ProtocolError(f"tcp: unexpected {FRAME_NAMES.get(ftype, ftype)} frame from {link.where}")

    def close(self) -> None:
        """Close the wake socket pair (the link watcher does, once the link failed and nobody reads it)."""
        self._wake_r.close()
        self._wake_w.close()
