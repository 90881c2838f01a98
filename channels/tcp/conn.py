"""One TCP connection of the tcp channel, either side's: exact receives, vectored zero-copy sends, timeouts.

Sockets are blocking with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) so a
receive is one syscall, yet no wait is unbounded: ``io_timeout`` without
progress inside a frame fails the connection, while an idle socket between
frames is normal and only ticks ``on_idle``. The sender hands header and
payload views to one ``sendmsg`` (no join, no copy); the receiver
``recv_into``s a payload straight into the memory it names, or
``recvmsg_into``s a frame of many runs into all of their views at once.

With TLS (``start_tls``, the channel's ``tls`` option) the same calls go
through OpenSSL, which takes neither ``MSG_WAITALL`` nor ``sendmsg``: a
receive is one record (16 KiB at most) per call, still decrypted straight
into the region, and small buffers are joined before they are sent (one
record, not one per 40-byte header). A kernel timeout then surfaces as
``SSLWantReadError``/``SSLWantWriteError``, handled like the clear path's
``BlockingIOError``. Bytes OpenSSL already decrypted are invisible to
``poll``: ``pending`` says whether a connection holds some, and whoever
polls for readable connections looks at it too. The clear path is unchanged.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pdkv.channels.landing import Snapshot
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.options import TcpOptions
from pdkv.channels.tcp.patience import Patience
from pdkv.channels.tcp.wire import HDR_SIZE, RUN, Header, pack, unpack_header
from pdkv.errors import ChannelError, ProtocolError, TransferTimeout

_DRAIN_BYTES = 1 << 20  # a refused frame's payload is read away in pieces this big
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
SHUTDOWN_JOIN_S = 2.0  # how long closing waits for each of the channel's threads
_TLS_JOIN_BYTES = (
    64 << 10
)  # with TLS, buffers up to this size are joined into one write (one record instead of several)
# A kernel timeout (SO_RCVTIMEO/SO_SNDTIMEO) with nothing moved: BlockingIOError in clear, SSLWant*Error through
# OpenSSL.
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class PeerClosed(ChannelError):
    """The peer closed the connection between frames."""


# What a dead or stuck connection raises; each fails the link (or session) it belongs to.
IO_ERRORS = (OSError, ChannelError, TransferTimeout)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def set_buffers(sock: socket.socket, opts: TcpOptions) -> None:
    """Socket buffer sizes; set before connect/listen (accepted sockets inherit them) so the window scale fits."""
    if opts.sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, opts.sndbuf)
    if opts.rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, opts.rcvbuf)


def shutdown(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock``; its owner closes it once nobody can be using it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Conn:
    """One TCP stream: exact receives that tolerate idle ticks, zero-copy vectored sends."""

    def __init__(self, sock: socket.socket, opts: TcpOptions, label: str) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.patience = Patience(opts, label)  # its timeouts, and the errors that end its waits
        self.last_progress = time.monotonic()  # last time a send or receive call moved a byte
        self._hdr = bytearray(HDR_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self.tls = False
        self._recv_flags = socket.MSG_WAITALL  # OpenSSL takes no flags: 0 once TLS is on
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.patience.tick))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(opts.io_timeout))

    @property
    def label(self) -> str:
        """What logs and errors call this connection; the peer's name joins it after the handshake. Kept by
        ``patience``, whose errors say it too."""
        return self.patience.label

    @label.setter
    def label(self, value: str) -> None:
        self.patience.label = value

    def start_tls(
        self, context: ssl.SSLContext, server_side: bool, server_hostname: str | None, timeout: float
    ) -> None:
        """Wrap the connection in TLS and complete the handshake within ``timeout``, however its bytes trickle in (a
        ``TransferTimeout`` past it, an ``ssl.SSLError`` if it fails).

        The socket keeps its file descriptor (pollers registered on it stay valid) and its kernel timeouts. Those
        cannot bound the handshake: on a blocking socket OpenSSL's would-block is retried inside ``do_handshake``,
        so a peer that sends nothing would hold it for ever. A socket timeout bounds the whole call instead, and is
        taken off again once it returns.
        """
        self.sock = context.wrap_socket(
            self.sock, server_side=server_side, server_hostname=server_hostname, do_handshake_on_connect=False
        )
        self.tls = True  # from here on every byte goes through OpenSSL, even an ERROR after a failed handshake
        self._recv_flags = 0
        self.sock.settimeout(max(timeout, 1e-3))
        try:
            self.sock.do_handshake()
        except TimeoutError:
            raise TransferTimeout(
                f"tcp {self.label}: TLS handshake not complete within {timeout:.3g}s (raise connect_timeout if the "
                "network is slow)"
            ) from None
        finally:
            self.sock.settimeout(None)

    def pending(self) -> bool:
        """Whether OpenSSL holds decrypted bytes ``poll`` cannot see (never, in clear)."""
        return self.tls and self.sock.pending() > 0  # type: ignore[attr-defined]

    def readable(self) -> bool:
        """Whether bytes (or EOF) are waiting, without blocking."""
        return self.pending() or bool(self._poller.poll(0))

    def recv_exact(self, view: memoryview, on_idle: Callable[[], None] | None = None, boundary: bool = False) -> None:
        """Fill ``view`` from the socket, in place.

        At a frame boundary an idle socket is normal: ``on_idle`` runs every
        tick (and may raise). Inside a frame, ``io_timeout`` without a byte is
        a dead peer, and EOF is a truncated frame. Past ``deadline`` any wait
        fails, bytes arriving or not.
        """
        n = view.nbytes
        got = idle = 0
        while got < n:
            if got and time.monotonic() > self.patience.deadline:  # a receive came back short: checked before the next
                raise self.patience.late()
            try:
                r = self.sock.recv_into(view[got:] if got else view, n - got, self._recv_flags)
            except _WOULD_BLOCK:
                if time.monotonic() > self.patience.deadline:
                    raise self.patience.late() from None
                if boundary and got == 0:
                    if on_idle is not None:
                        on_idle()
                    continue
                idle = self.patience.stalled(idle, got, n)
                continue
            if r == 0:
                if boundary and got == 0:
                    raise PeerClosed(f"tcp {self.label}: connection closed by the peer")
                raise self.patience.cut(got, n)
            got += r
            idle = 0
        self.last_progress = time.monotonic()

    def recv_views(self, views: list[memoryview], nbytes: int) -> None:
        """Fill every view in order (``nbytes`` in all) inside a frame: one ``recvmsg_into`` for up to IOV_MAX of them.

        A DATA frame's runs land with as few system calls as the kernel allows
        (``MSG_WAITALL``: usually one per IOV_MAX runs), not one per run.
        ``views`` is consumed. Through TLS, which has no ``recvmsg_into``,
        each view is filled in turn.
        """
        if self.tls:
            for view in views:
                self.recv_exact(view)
            return
        i, n, got, idle = 0, len(views), 0, 0
        while i < n:
            try:
                r = self.sock.recvmsg_into(views[i : i + _IOV_MAX], 0, self._recv_flags)[0]
            except _WOULD_BLOCK:
                idle = self.patience.stalled(idle, got, nbytes)
                continue
            if r == 0:
                raise self.patience.truncated(got, nbytes)
            got += r
            idle = 0
            while r:
                size = views[i].nbytes
                if r >= size:
                    r -= size
                    i += 1
                else:
                    views[i] = views[i][r:]
                    r = 0
        self.last_progress = time.monotonic()

    def recv_runs(self, runs: bytes, nruns: int, landing: Snapshot, nbytes: int, piece: int) -> None:
        """``recv_views`` for a clear connection, in native code: a DATA frame's checked ``runs`` (the wire's run
        table) filled in pieces of at most ``piece`` bytes, each hashed into its region's landing table while it is
        in cache (channels/landing.py); the same timeouts and errors as ``recv_views``."""
        code, got, os_error = tcp_native.recv_runs(
            self.sock.fileno(), runs, nruns, landing.address, landing.count, piece, self.patience.max_idle_ticks
        )
        if code == tcp_native.LAND_EOF:
            raise self.patience.truncated(got, nbytes)
        if code == tcp_native.LAND_STALLED:
            raise self.patience.stall(got, nbytes)
        if code == tcp_native.LAND_EOS:
            raise OSError(os_error, f"tcp {self.label}: {os.strerror(os_error)}")
        self.last_progress = time.monotonic()

    def frames_served(self, loop: tcp_native.FrameLoop, code: int) -> tuple[Header | None, bytes | None]:
        """What a native frame loop's ``serve`` (csrc/kvframes.cpp) on this connection came back with: the header of
        the frame handed back (None: only completions to drain) and its run table where that was read too; a frame
        cut short or a closed connection raises what ``recv_header``, ``recv_payload`` and ``recv_runs`` raise."""
        landed, part, got, wanted, os_error = loop.io
        if landed:
            self.last_progress = time.monotonic()
        if code == tcp_native.FRAME_CLOSED:
            raise PeerClosed(f"tcp {self.label}: connection closed by the peer")
        if code == tcp_native.LAND_EOF:
            raise self.patience.truncated(got, wanted) if part == 2 else self.patience.cut(got, wanted)
        if code == tcp_native.LAND_STALLED:
            raise self.patience.stall(got, wanted)
        if code == tcp_native.LAND_EOS:
            raise OSError(os_error, f"tcp {self.label}: {os.strerror(os_error)}")
        if code in (tcp_native.FRAME_DRAIN, tcp_native.FRAME_IDLE):
            return None, None
        header = unpack_header(bytearray(loop.header.raw), self.label)
        return header, loop.table.raw[: header[3] * RUN.size] if code == tcp_native.FRAME_TABLE else None

    def recv_header(self, on_idle: Callable[[], None] | None = None) -> Header:
        """Next header as (type, flags, shares, aux, notif, xfer, offset, length); magic and version checked."""
        self.recv_exact(self._hdr_view, on_idle, boundary=True)
        return unpack_header(self._hdr, self.label)

    def recv_payload(self, length: int, limit: int, what: str) -> bytes:
        """A small payload (name, notification, message), bounded before anything is allocated."""
        if length > limit:
            raise ProtocolError(f"tcp {self.label}: {what} of {length} bytes exceeds the limit of {limit}")
        buf = bytearray(length)
        if length:
            self.recv_exact(memoryview(buf))
        return bytes(buf)

    def drain(self, length: int) -> None:
        """Read ``length`` payload bytes away (a refused frame's): the stream stays in step, nothing lands."""
        scratch = memoryview(bytearray(min(length, _DRAIN_BYTES)))
        while length:
            n = min(length, scratch.nbytes)
            self.recv_exact(scratch[:n])
            length -= n

    def send(self, bufs: list[Any]) -> None:
        """Send every buffer in order with ``sendmsg`` (no join, no copy), resuming partial sends."""
        if self.tls:
            self._send_tls(bufs)
            return
        i, n = 0, len(bufs)
        try:
            while i < n:
                sent = self.sock.sendmsg(bufs[i : i + _IOV_MAX])
                self.last_progress = time.monotonic()
                while sent:
                    size = len(bufs[i])
                    if sent >= size:
                        sent -= size
                        i += 1
                    else:
                        bufs[i] = memoryview(bufs[i])[sent:]
                        sent = 0
        except BlockingIOError:
            raise self.patience.send_stall() from None

    def send_iov(self, iov: np.ndarray) -> None:
        """Send the (address, length) rows in order natively (csrc/kvsend.cpp, the GIL released), as ``send`` sends
        views; for a clear connection, whose caller keeps the memory alive."""
        self.sent_natively(*tcp_native.send_iov(self.sock.fileno(), iov))

    def sent_natively(self, code: int, os_error: int) -> None:
        """A native send's outcome (``send_iov``, a sealed write's ``send_summed``): progress noted, or why not."""
        self.last_progress = time.monotonic()
        if code == tcp_native.LAND_STALLED:
            raise self.patience.send_stall()
        if code == tcp_native.LAND_EARG:  # nothing was sent
            raise ChannelError(f"tcp {self.label}: a native send's rows are not whole checksum words (a bug)")
        if code != tcp_native.OK:
            raise OSError(os_error, f"tcp {self.label}: {os.strerror(os_error)}")

    def _send_tls(self, bufs: list[Any]) -> None:
        """Send every buffer in order through OpenSSL: small ones joined into one write, large ones as they are."""
        joined = bytearray()
        try:
            for buf in bufs:
                view = memoryview(buf).cast("B")
                if view.nbytes <= _TLS_JOIN_BYTES and len(joined) + view.nbytes <= _TLS_JOIN_BYTES:
                    joined += view
                    continue
                if joined:
                    self.sock.sendall(joined)
                    joined.clear()
                self.sock.sendall(view)
                self.last_progress = time.monotonic()
            if joined:
                self.sock.sendall(joined)
            self.last_progress = time.monotonic()
        except _WOULD_BLOCK:
            raise self.patience.send_stall() from None

    def send_frame(
        self, ftype: int, xfer: int = 0, payload: bytes = b"", aux: int = 0, flags: int = 0, shares: int = 0
    ) -> None:
        """Send one control frame (handshake, NACK, ERROR) between other threads' batches."""
        hdr = pack(ftype, xfer, len(payload), aux, flags, shares)
        with self.send_lock:
            self.send([hdr, payload] if payload else [hdr])
