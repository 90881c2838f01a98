"""TCP channel: one-sided WRITE and READ over plain sockets, bytes landing in place.

Many clusters have no RDMA, and the general stacks lose much of what plain TCP
can do to intermediate buffers and per-message overhead. This channel keeps
the raw-socket cost model: a frame is a fixed 40-byte header followed by its
payload; the sender hands header and payload views to one ``sendmsg`` (no
join, no copy) and the receiver ``recv_into``s the payload straight into the
registered region. One kernel copy on each side, as between two programs
using ``sendall``/``recv_into``.

Wire format: every frame starts with ``HEADER`` (little endian, 40 bytes)::

    magic "PK" | version u8 | type u8 | flags u8 | pad u8 | shares u16 | aux u32 | notif u32
    | xfer u64 | offset u64 | length u64

    type       dir   fields (unlisted ones are zero)                       payload
    HELLO      I->T  xfer=session id, aux=stream index, length,            [nonce if SECRET] token agent name
                     shares=token length, flags SECRET: the initiator
                     holds a shared secret
    HELLO_OK   T->I  xfer=instance id, length, flags SECRET as in HELLO    [nonce, proof if SECRET] agent name
    AUTH       I->T  length                                                the initiator's proof (after a SECRET HELLO_OK)
    DATA       I->T  aux=region, offset, length, flags, shares, notif      bytes for region[offset:+length],
                     flags LAST: this frame ends the stream's share          then ``notif`` bytes of
                     of the transfer, which has ``shares`` shares;           notification if NOTIF
                     flags NOTIF (with LAST): a notification follows
    ACK        T->I  aux=count, xfer=first id, length=8*(count-1)          the other ids, u64 each
    NACK       T->I  xfer, length                                          why: the transfer (or, for a READ,
                                                                           this READ_REQ) was refused; the link lives
    READ_REQ   I->T  aux=region, offset, length                            -
    READ_DATA  T->I  xfer, length                                          answer to the stream's oldest READ_REQ
    NOTIF      I->T  xfer, length                                          notification of a READ that landed
    ERROR      T->I  length                                                message; the target then hangs up

I is the initiator (the side calling write/read), T the target. An initiator
opens a *link* of ``streams`` connections to each peer, all with one random
session id so the target can group them. A transfer is cut into shares, one
per stream, each sent as one uninterrupted batch of DATA frames ending in
LAST. TCP is in order and the stream's reader lands each payload before
reading on, so once the LAST frame of every share has been read, every byte of
the transfer is in the region: only then is the notification delivered and
the transfer acknowledged. The initiator's handle is DONE on ACK, so DONE
means the bytes are in the target's memory and the source may be reused (NIXL
semantics). ACKs that pile up while more frames are already waiting go out
together in one frame when the socket runs dry, so pipelined small transfers
cost one ACK per batch, not per transfer. READ: the target answers each
READ_REQ in order on the same stream; the initiator lands the answer where it
recorded for that request (the target never picks an address), and sends
NOTIF once the whole transfer landed.

Capabilities. A region the target ``guard``s takes a frame only within what
it granted (``Grants``) to the token the initiator presented in HELLO, which
a ``KVReceiver`` learns from the sender's Hello and grants exactly the blocks
of that sender's reservations. A DATA frame outside its grants lands nothing:
the target reads its payload into a scratch buffer and answers the transfer
with NACK instead of ACK (no notification is delivered); a READ_REQ outside
them is answered with NACK instead of READ_DATA. Only that transfer fails: the
link and the peer's other transfers go on. A frame is marked landing while its
bytes go into the region, so ``revoke`` can wait it out before the blocks are
reused (the fence against late writes).

With a shared secret (``options.secret``, the worker's top-level ``secret``)
every connection proves it before the target reads a single frame of it into
a region, once per connection and never per frame: each side sends a fresh
nonce (``pdkv.auth``), the target proves the secret over both in HELLO_OK and
the initiator answers with its own proof in AUTH. The initiator checks the
target's proof first, so it never sends KV to an agent without the secret; the
target reads nothing but AUTH until the proof checks out, and only then adds
the connection to its session, so a failed one hangs up no other. A HELLO
without SECRET to a target with a secret (or the reverse), a wrong proof, any
other frame where AUTH is due, or a peer that leaves before proving it is
refused with ERROR, logged and counted (``stats()["auth_failures"]``).
Without a secret the handshake is HELLO and HELLO_OK alone, as before.

Every header field from the wire is checked before use (magic, version, type,
flags, region, range, lengths against ``max_frame_bytes``/``max_notif_bytes``
and fixed caps). A frame that fails a check makes the target log an error,
answer ERROR and hang up every connection of that session, so its transfer
fails on the initiator and nothing lands outside the range the frame named.
Nothing is allocated from a length the peer sent before that length is bounded.

Threads. Target side: an acceptor and one reader per accepted connection
(lands DATA, answers READ_REQ, sends ACKs). Initiator side, per link: one
sender per stream for large batches (small ones go out on the caller's thread
when its stream is free: a thread hand-off costs more than sending 256 KiB on
loopback), and a watcher: answers are read by the thread that waits for them
(``wait``: reading on the waiting thread saves waking it from another, one
context switch per transfer), by ``poll`` and by the posting thread when they
are already there, and otherwise by the watcher, which sleeps in ``poll`` on
the streams, reads an answer the moment it arrives (so done callbacks fire
without delay), and fails a link whose peer went silent. Sockets are
blocking with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) so a receive is one
syscall, yet no wait is unbounded: ``io_timeout`` without progress fails the link.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgspec

from pdkv.auth import NONCE_BYTES, PROOF_BYTES, new_nonce, proof, verify
from pdkv.channels.base import Channel, ChannelOptions, TransferHandle, TransferOp, XferState, merge_ops
from pdkv.errors import AuthError, ChannelError, ConfigError, ProtocolError, TransferTimeout
from pdkv.memory import byte_view
from pdkv.netaddr import is_wildcard

log = logging.getLogger(__name__)

MAGIC = b"PK"
VERSION = 2
HEADER = struct.Struct("<2sBBBxHIIQQQ")
HDR_SIZE = HEADER.size

HELLO, HELLO_OK, DATA, ACK, READ_REQ, READ_DATA, NOTIF, ERROR, AUTH, NACK = range(1, 11)
FRAME_NAMES = {
    HELLO: "HELLO", HELLO_OK: "HELLO_OK", DATA: "DATA", ACK: "ACK",
    READ_REQ: "READ_REQ", READ_DATA: "READ_DATA", NOTIF: "NOTIF", ERROR: "ERROR", AUTH: "AUTH", NACK: "NACK",
}  # fmt: skip
LAST, NOTIF_FOLLOWS = 1, 2  # DATA flags
SECRET = 1  # HELLO/HELLO_OK flag: the sender holds a shared secret, and nonce (and proof) lead the payload
# proof roles: a target's proof is never an initiator's, and neither is ever a control-plane one
TARGET_ROLE, INITIATOR_ROLE = "tcp-target", "tcp-initiator"

MAX_NAME_BYTES = 255
MAX_TOKEN_BYTES = 64
MAX_ERROR_BYTES = 1024
_DRAIN_BYTES = 1 << 20  # a refused frame's payload is read away in pieces this big
MAX_STREAMS = 64
MAX_ACK_BATCH = 256  # ids per ACK frame; a full batch is sent even if more frames wait
_ACK_FLUSH_BYTES = 64 << 10  # send pending ACKs before landing a payload this big, not after
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_SHUTDOWN_JOIN_S = 2.0
_IDLE_TICK = 0.05  # how often the watcher wakes with nothing to read (to look for a link whose peer went silent)
_FOLLOW_S = 0.002  # how often a waiter re-checks its handle while another thread reads the link


class TcpOptions(ChannelOptions):
    """Options of the tcp channel; both peers should use the same limits."""

    # host (ChannelOptions): where to listen; the worker's host unless set here
    port: int = 0  # 0: an ephemeral port, published through metadata()
    advertise_host: str | None = None  # host peers dial: needed when ``host`` is a wildcard like 0.0.0.0, or behind a NAT
    advertise_port: int = 0  # port peers dial, when a port forward, NAT or proxy sits in front of ``port``; 0: ``port``
    streams: int = 4  # connections per peer
    stream_min_bytes: int = 4 << 20  # a transfer is split only into shares at least this big
    inline_max_bytes: int = 1 << 20  # writes up to this size go out on the caller's thread when possible
    sndbuf: int = 0  # SO_SNDBUF in bytes; 0 leaves the kernel's autotuning
    rcvbuf: int = 0  # SO_RCVBUF in bytes; 0 leaves the kernel's autotuning
    connect_timeout: float = 5.0  # seconds for connect + handshake
    io_timeout: float = 10.0  # seconds without progress before a stream (and its link) is failed
    max_frame_bytes: int = 64 << 20  # largest DATA/READ frame sent or accepted
    max_notif_bytes: int = 64 << 10  # largest notification sent or accepted
    max_inflight: int = 1024  # transfers in flight per peer (initiator waits, target refuses beyond)
    max_connections: int = 256  # accepted connections, all peers together

    def streams_for(self, nbytes: int) -> int:
        """How many streams a transfer of ``nbytes`` is split over: shares of at least ``stream_min_bytes``."""
        return min(self.streams, max(1, nbytes // self.stream_min_bytes))

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("port", 0 <= self.port <= 65535, "0..65535"),
            ("advertise_port", 0 <= self.advertise_port <= 65535, "0..65535 (0: the listening port)"),
            ("advertise_host", not is_wildcard(self.advertise_host or self.host), f"an address peers can dial when host is {self.host!r}, which listens everywhere"),
            ("streams", 1 <= self.streams <= MAX_STREAMS, f"1..{MAX_STREAMS}"),
            ("stream_min_bytes", self.stream_min_bytes >= 1, ">= 1"),
            ("inline_max_bytes", self.inline_max_bytes >= 0, ">= 0"),
            ("sndbuf", self.sndbuf >= 0, ">= 0 (0: kernel default)"),
            ("rcvbuf", self.rcvbuf >= 0, ">= 0 (0: kernel default)"),
            ("connect_timeout", self.connect_timeout > 0, "> 0 seconds"),
            ("io_timeout", self.io_timeout > 0, "> 0 seconds"),
            ("max_frame_bytes", 1 <= self.max_frame_bytes <= 1 << 40, "1..2**40"),
            ("max_notif_bytes", 0 <= self.max_notif_bytes <= 1 << 24, "0..16 MiB"),
            ("max_inflight", self.max_inflight >= 1, ">= 1"),
            ("max_connections", self.max_connections >= 1, ">= 1"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"tcp channel option {name}={getattr(self, name)!r}: expected {expected}")


class _Meta(msgspec.Struct, forbid_unknown_fields=True):
    """What a peer needs to reach this agent; ``instance`` tells a restarted agent from the old one."""

    name: str
    host: str
    port: int
    instance: int
    regions: dict[int, int]
    version: int = VERSION


class _PeerClosed(ChannelError):
    """The peer closed the connection between frames."""


# What a dead or stuck connection raises; each fails the link (or session) it belongs to.
_IO_ERRORS = (OSError, ChannelError, TransferTimeout)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _set_buffers(sock: socket.socket, opts: TcpOptions) -> None:
    """Socket buffer sizes; set before connect/listen (accepted sockets inherit them) so the window scale fits."""
    if opts.sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, opts.sndbuf)
    if opts.rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, opts.rcvbuf)


def _shutdown(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock``; its owner closes it once nobody can be using it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _deadline(timeout: float, what: str) -> Callable[[], None]:
    """An idle callback that raises once ``timeout`` seconds have passed."""
    end = time.monotonic() + timeout

    def check() -> None:
        if time.monotonic() > end:
            raise TransferTimeout(f"tcp: no {what} within {timeout:.3g}s (raise connect_timeout if the network is slow)")

    return check


def _pack(ftype: int, xfer: int = 0, length: int = 0, aux: int = 0, flags: int = 0, shares: int = 0) -> bytes:
    """A header for the frame types that use only these fields."""
    return HEADER.pack(MAGIC, VERSION, ftype, flags, shares, aux, 0, xfer, 0, length)


class _Conn:
    """One TCP stream: exact receives that tolerate idle ticks, zero-copy vectored sends."""

    def __init__(self, sock: socket.socket, opts: TcpOptions, label: str) -> None:
        self.sock = sock
        self.label = label
        self.send_lock = threading.Lock()
        self.io_timeout = opts.io_timeout
        self.tick = min(0.5, opts.io_timeout / 4)
        self.max_idle_ticks = max(1, round(opts.io_timeout / self.tick))
        self.last_progress = time.monotonic()  # last time a send or receive call moved a byte
        self._hdr = bytearray(HDR_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.tick))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(opts.io_timeout))

    def readable(self) -> bool:
        """Whether bytes (or EOF) are waiting, without blocking."""
        return bool(self._poller.poll(0))

    def recv_exact(self, view: memoryview, on_idle: Callable[[], None] | None = None, boundary: bool = False) -> None:
        """Fill ``view`` from the socket, in place.

        At a frame boundary an idle socket is normal: ``on_idle`` runs every
        tick (and may raise). Inside a frame, ``io_timeout`` without a byte is
        a dead peer, and EOF is a truncated frame.
        """
        n = view.nbytes
        got = idle = 0
        while got < n:
            try:
                r = self.sock.recv_into(view[got:] if got else view, n - got, socket.MSG_WAITALL)
            except BlockingIOError:
                if boundary and got == 0:
                    if on_idle is not None:
                        on_idle()
                    continue
                idle += 1
                if idle >= self.max_idle_ticks:
                    raise TransferTimeout(
                        f"tcp {self.label}: peer sent {got} of {n} bytes of a frame, then nothing for {self.io_timeout:.3g}s"
                    ) from None
                continue
            if r == 0:
                if boundary and got == 0:
                    raise _PeerClosed(f"tcp {self.label}: connection closed by the peer")
                raise ProtocolError(f"tcp {self.label}: truncated frame, connection closed after {got} of {n} bytes")
            got += r
            idle = 0
        self.last_progress = time.monotonic()

    def recv_header(self, on_idle: Callable[[], None] | None = None) -> tuple[int, int, int, int, int, int, int, int]:
        """Next header as (type, flags, shares, aux, notif, xfer, offset, length); magic and version checked."""
        self.recv_exact(self._hdr_view, on_idle, boundary=True)
        magic, version, ftype, flags, shares, aux, notif, xfer, offset, length = HEADER.unpack_from(self._hdr)
        if magic != MAGIC:
            raise ProtocolError(f"tcp {self.label}: bad magic {bytes(magic)!r}; the peer does not speak pdkv tcp")
        if version != VERSION:
            raise ProtocolError(f"tcp {self.label}: protocol version {version}, this agent speaks {VERSION}; upgrade both")
        return ftype, flags, shares, aux, notif, xfer, offset, length

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
            raise TransferTimeout(f"tcp {self.label}: peer accepted no data for {self.io_timeout:.3g}s") from None

    def send_frame(self, ftype: int, xfer: int = 0, payload: bytes = b"", aux: int = 0, flags: int = 0, shares: int = 0) -> None:
        """Send one control frame (handshake, NACK, ERROR) between other threads' batches."""
        hdr = _pack(ftype, xfer, len(payload), aux, flags, shares)
        with self.send_lock:
            self.send([hdr, payload] if payload else [hdr])


def _no_extras(conn: _Conn, ftype: int, flags: int, shares: int, notif: int, allowed_flags: int = 0) -> None:
    """Fields only DATA may set must be zero in every other frame (but for the flags the handshake allows)."""
    if flags & ~allowed_flags or shares or notif:
        raise ProtocolError(f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame sets flags/shares/notif fields")


def _split(ops: Sequence[TransferOp], parts: int, max_frame: int) -> list[list[TransferOp]]:
    """Cut the ops' bytes into ``parts`` near-equal shares of frames no bigger than ``max_frame``.

    The shares go to different streams, so one large op still uses them all.
    """
    total = sum(op.length for op in ops)
    share = -(-total // parts)  # the last share is the smallest, so ``room`` never runs out early
    out: list[list[TransferOp]] = [[] for _ in range(parts)]
    s, room = 0, share
    for op in ops:
        lo, ro, left = op.local_offset, op.remote_offset, op.length
        while left:
            n = min(left, room, max_frame)
            out[s].append(TransferOp(op.local_region, lo, op.remote_region, ro, n))
            lo, ro, left, room = lo + n, ro + n, left - n, room - n
            if room == 0 and s < parts - 1:
                s, room = s + 1, share
    return [p for p in out if p]


@dataclass(slots=True)
class _Batch:
    """Buffers one stream sends uninterrupted; READ expectations are recorded as it goes out."""

    bufs: list[Any]
    nbytes: int
    expect: list[tuple[int, memoryview]] = field(default_factory=list)
    on_sent: Callable[[], None] | None = None


@dataclass(slots=True)
class _Pending:
    handle: TransferHandle
    remaining: int  # READ: bytes still to land
    notif: bytes | None  # READ: sent to the target once everything landed


class _Stream:
    """One initiator-side connection of a link, its sender thread and its READ answers to expect."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self.expect: collections.deque[tuple[int, memoryview]] = collections.deque()
        self.sent_bytes = 0

    def send(self, batch: _Batch) -> None:
        """Send ``batch``; the caller holds ``conn.send_lock`` so batches never interleave."""
        self.expect.extend(batch.expect)
        self.sent_bytes += batch.nbytes  # counted first: the ACK may overtake this thread's return from send
        self.conn.send(batch.bufs)


class _TcpHandle(TransferHandle):
    """A handle that knows its link, so ``wait`` can read the link's answers on the waiting thread."""

    def __init__(self, peer: str, op: str, nbytes: int, link: _Link) -> None:
        super().__init__(peer, op, nbytes)
        self.link = link


class _Link:
    """This agent's connections to one peer: streams, pending transfers, the in-flight bound.

    Answers (ACK, READ_DATA, ERROR) are read by whoever holds ``rx_lock``: a
    thread in ``wait`` (so the answer wakes the waiter itself, not a reader
    thread that then wakes it: one context switch less per transfer), a
    ``poll`` call, the posting thread (what is already there), or the
    watcher, which reads them as they arrive while nobody waits, and notices
    stalls and hang-ups.

    A link lives until its first failure; the next transfer opens a new one
    (new session id), so the target never mixes state of the two.
    """

    def __init__(self, channel: TcpChannel, peer: str, meta: _Meta, token: bytes) -> None:
        self.channel = channel
        self.token = token  # presented in every stream's HELLO: the target checks our frames against its grants to it
        self.opts: TcpOptions = channel.options  # type: ignore[assignment]
        self.peer = peer
        self.meta = meta
        self.where = f"peer {peer!r} at {meta.host}:{meta.port}"
        self.session = secrets.randbits(64)
        self.pending: dict[int, _Pending] = {}  # its size is the in-flight count
        self.nacked: collections.deque[int] = collections.deque(maxlen=1024)  # transfers the target refused, latest
        self.lock = threading.Lock()
        self.waiters = 0  # threads in ``drive``
        self.rx_lock = threading.Lock()
        self.dead: str | None = None
        self.last_post = time.monotonic()
        self.streams: list[_Stream] = []
        try:
            for i in range(self.opts.streams):
                self.streams.append(_Stream(self._connect(i)))
        except BaseException:
            for st in self.streams:
                st.conn.sock.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = select.poll()
        self._by_fd: dict[int, _Stream] = {}
        for st in self.streams:
            self._poller.register(st.conn.sock, select.POLLIN)
            self._by_fd[st.conn.sock.fileno()] = st
        self._poller.register(self._wake_r, select.POLLIN)
        self._watch_poller = select.poll()  # the watcher's own: one poll object must never be polled by two threads
        for st in self.streams:
            self._watch_poller.register(st.conn.sock, select.POLLIN)
        self._stopped = threading.Event()
        name = f"tcp-{channel.agent_name}->{peer}"
        self.senders = [threading.Thread(target=self._send_loop, args=(st,), name=f"{name}-tx{i}", daemon=True) for i, st in enumerate(self.streams)]
        self.threads = [*self.senders, threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)]
        for t in self.threads:
            t.start()

    def _connect(self, index: int) -> _Conn:
        """Open stream ``index`` and check, through the handshake, that it reached the agent the metadata names.

        With a secret, that agent proves it before we prove ours: KV never goes
        to an agent without the secret, and our proof never to one that lacks it.
        """
        opts, meta = self.opts, self.meta
        try:
            family, stype, proto, _, addr = socket.getaddrinfo(meta.host, meta.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, stype, proto)
        except OSError as exc:
            raise ChannelError(f"tcp: cannot resolve {self.where}: {exc}") from None
        try:
            _set_buffers(sock, opts)
            sock.settimeout(opts.connect_timeout)
            sock.connect(addr)
            conn = _Conn(sock, opts, f"{self.channel.agent_name}->{self.peer}#{index}")
            secret = self.channel._secret
            nonce = new_nonce() if secret else b""
            hello = nonce + self.token + self.channel.agent_name.encode()
            conn.send_frame(HELLO, self.session, hello, aux=index, flags=SECRET if secret else 0, shares=len(self.token))
            ftype, flags, shares, _, nlen, instance, _, length = conn.recv_header(
                _deadline(opts.connect_timeout, f"handshake answer from {self.where}")
            )
            _no_extras(conn, ftype, flags, shares, nlen, SECRET if ftype == HELLO_OK else 0)
            if ftype == ERROR:
                msg = conn.recv_payload(length, MAX_ERROR_BYTES, "error message").decode(errors="replace")
                raise ChannelError(f"tcp: {self.where} refused the connection: {msg}")
            if ftype != HELLO_OK:
                raise ProtocolError(f"tcp: {self.where} answered the handshake with frame type {ftype}")
            challenge = NONCE_BYTES + PROOF_BYTES if flags & SECRET else 0
            payload = conn.recv_payload(length, challenge + MAX_NAME_BYTES, "HELLO_OK")
            if secret:
                theirs, given = payload[:NONCE_BYTES], payload[NONCE_BYTES:challenge]
                if not challenge or not verify(secret, TARGET_ROLE, nonce, theirs, given):
                    self.channel._count("auth_failures")
                    raise ChannelError(f"tcp: {self.where} did not prove the shared secret (it has another `secret`, or none); nothing is sent to it")
                conn.send_frame(AUTH, payload=proof(secret, INITIATOR_ROLE, theirs, nonce))
            elif challenge:
                raise ProtocolError(f"tcp: {self.where} proved a shared secret nobody asked for (this agent has none)")
            name = payload[challenge:].decode(errors="replace")
            if name != self.peer or instance != meta.instance:
                raise ChannelError(
                    f"tcp: {self.where} is now agent {name!r} (instance {instance:x}), not the one its metadata describes "
                    f"(instance {meta.instance:x}); the peer restarted: call add_peer with its current metadata"
                )
            return conn
        except (*_IO_ERRORS, ProtocolError) as exc:
            sock.close()
            if isinstance(exc, ChannelError):
                raise
            raise ChannelError(f"tcp: cannot connect to {self.where}: {exc} (is it running? did it restart on a new port?)") from None

    # -- posting ---------------------------------------------------------------
    def post(self, handle: TransferHandle, xfer: int, batches: list[tuple[int, _Batch]], notif: bytes | None, inline: bool) -> None:
        """Register the transfer (reading answers while at ``max_inflight``), send it, then drain ready answers.

        Draining on the posting thread keeps pipelined small writes from
        piling unread ACKs up until the target blocks on sending them.
        """
        limit = self.opts.max_inflight
        deadline = time.monotonic() + self.opts.io_timeout
        while len(self.pending) >= limit and self.dead is None:
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"tcp: {limit} transfers in flight to {self.where} and none finished in "
                    f"{self.opts.io_timeout:.3g}s; wait on handles before posting more or raise max_inflight"
                )
            if self.rx_lock.acquire(timeout=_FOLLOW_S):
                try:
                    self.progress(_FOLLOW_S)
                finally:
                    self.rx_lock.release()
        with self.lock:
            if self.dead is not None:
                handle.fail(self.dead)
                return
            self.pending[xfer] = _Pending(handle, handle.nbytes, notif)
            self.last_post = time.monotonic()
        self._send(batches, inline)
        # answers to earlier transfers may be waiting (ours cannot be yet): skip the syscall when there are none
        if len(self.pending) > 1 and self.rx_lock.acquire(blocking=False):
            try:
                while self.progress(0):
                    pass
            finally:
                self.rx_lock.release()

    def _send(self, batches: list[tuple[int, _Batch]], inline: bool) -> None:
        """Each batch on its stream: on this thread if allowed and the stream is free, else by its sender."""
        for index, batch in batches:
            st = self.streams[index]
            if inline and st.conn.send_lock.acquire(blocking=False):
                try:
                    st.send(batch)
                except _IO_ERRORS as exc:
                    self.fail(f"sending failed: {exc}")
                    return
                finally:
                    st.conn.send_lock.release()
            else:
                st.queue.put(batch)

    def _send_loop(self, st: _Stream) -> None:
        while (batch := st.queue.get()) is not None:
            try:
                with st.conn.send_lock:
                    st.send(batch)
                if batch.on_sent is not None:
                    batch.on_sent()
            except _IO_ERRORS as exc:
                self.fail(f"sending failed: {exc}")
                return

    # -- completion ----------------------------------------------------------------
    def finish(self, xfers: Sequence[int]) -> bool:
        """Complete pending transfers; False if one is not pending (already failed with the link)."""
        with self.lock:
            done = [self.pending.pop(x, None) for x in xfers]
        for p in done:
            if p is not None:
                p.handle.complete()
        return None not in done

    def _finish_read(self, xfer: int) -> None:
        """A READ's notification went out: complete it, and wake a waiter polling the sockets for it."""
        self.finish((xfer,))
        if self.waiters:
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass  # the wake socket is full (a wake-up is pending anyway) or the link is gone

    def refused(self, xfer: int, why: str) -> None:
        """The target refused the transfer (NACK): fail its handle alone; the link goes on."""
        with self.lock:
            p = self.pending.pop(xfer, None)
            self.nacked.append(xfer)  # other answers of a refused READ may follow: they are expected, not an error
        if p is not None:
            p.handle.fail(f"tcp: {self.where} refused transfer {xfer}: {why}")

    def landed(self, st: _Stream, xfer: int, nbytes: int) -> None:
        """READ bytes landed; once all have, notify the target (if asked) then complete."""
        with self.lock:
            p = self.pending.get(xfer)
            if p is None and xfer in self.nacked:
                return  # a READ partly refused: its other answers land in our own buffer, and it failed already
            if p is None:
                raise ProtocolError(f"tcp: {self.where} sent READ data for transfer {xfer}, which is not pending")
            p.remaining -= nbytes
            if p.remaining:
                return
        if p.notif is None:
            self.finish((xfer,))
            return
        # sent by the stream's sender: the reader must never block on a send (the target may be blocked sending to us)
        hdr = _pack(NOTIF, xfer, len(p.notif))
        st.queue.put(_Batch([hdr, p.notif] if p.notif else [hdr], 0, on_sent=lambda: self._finish_read(xfer)))

    def fail(self, reason: str) -> None:
        """Fail every pending handle with ``reason`` and tear the link down; the first reason wins."""
        with self.lock:
            if self.dead is not None:
                return
            why = f"tcp: link to {self.where} failed: {reason}"
            for p in self.pending.values():
                p.handle.fail(why)
            self.pending = {}
            self.dead = why  # last: whoever sees the link dead finds its handles already failed
        for st in self.streams:
            _shutdown(st.conn.sock)  # wakes whoever polls or sends on it
            st.queue.put(None)
        self._stopped.set()

    # -- reading answers -------------------------------------------------------------
    def drive(self, handle: TransferHandle, deadline: float) -> None:
        """Read the link's answers on the calling thread until ``handle`` finishes or ``deadline`` passes."""
        with self.lock:
            self.waiters += 1
        try:
            while handle.state is XferState.PENDING and self.dead is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                # another thread reading may finish this handle too: check again at least every _FOLLOW_S
                if not self.rx_lock.acquire(timeout=min(remaining, _FOLLOW_S)):
                    continue
                try:
                    while handle.state is XferState.PENDING and self.dead is None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return
                        self.progress(min(remaining, self.opts.io_timeout))
                finally:
                    self.rx_lock.release()
        finally:
            with self.lock:
                self.waiters -= 1

    def progress(self, timeout: float) -> int:
        """Read one frame from each stream that has one, waiting up to ``timeout`` s; the caller holds ``rx_lock``.

        Returns how many frames were read; a bad or lost stream fails the link.
        """
        if self.dead is not None:
            return 0
        frames = 0
        try:
            for fd, _ in self._poller.poll(math.ceil(timeout * 1000)):
                if self.dead is not None:
                    break
                st = self._by_fd.get(fd)
                if st is None:
                    self._wake_r.recv(4096)  # a READ completed elsewhere: the caller re-checks its handle
                    continue
                self._read_frame(st)
                frames += 1
        except ProtocolError as exc:
            log.error("%s; closing the link", exc)
            self.fail(str(exc))
        except _IO_ERRORS as exc:
            if self.dead is None and not self.channel.closed:
                # a peer hanging up an idle link is a normal shutdown; losing transfers is not
                level = logging.INFO if isinstance(exc, _PeerClosed) and not self.pending else logging.WARNING
                log.log(level, "tcp %s: link to %s failed: %s", self.channel.agent_name, self.where, exc)
            self.fail(str(exc))
        return frames

    def _read_frame(self, st: _Stream) -> None:
        conn = st.conn
        ftype, flags, shares, aux, nlen, xfer, _, length = conn.recv_header()
        _no_extras(conn, ftype, flags, shares, nlen)
        if ftype == ACK:
            if not 1 <= aux <= MAX_ACK_BATCH or length != 8 * (aux - 1):
                raise ProtocolError(f"tcp: {self.where} sent an ACK of {aux} ids in {length} bytes")
            xfers = (xfer,) if aux == 1 else (xfer, *struct.unpack(f"<{aux - 1}Q", conn.recv_payload(length, length, "ACK ids")))
            if not self.finish(xfers):
                raise ProtocolError(f"tcp: {self.where} acknowledged a transfer that is not pending")
        elif ftype == READ_DATA:
            if not st.expect:
                raise ProtocolError(f"tcp: {self.where} sent READ data nobody asked for")
            want_xfer, view = st.expect.popleft()
            if xfer != want_xfer or length != view.nbytes:
                raise ProtocolError(
                    f"tcp: {self.where} answered READ of transfer {want_xfer} ({view.nbytes} bytes) with transfer {xfer} ({length} bytes)"
                )
            conn.recv_exact(view)
            self.landed(st, xfer, length)
        elif ftype == NACK:
            why = conn.recv_payload(length, MAX_ERROR_BYTES, "refusal").decode(errors="replace")
            if st.expect and st.expect[0][0] == xfer:  # a READ_REQ answered with a refusal instead of its data
                st.expect.popleft()
            self.refused(xfer, why)
        elif ftype == ERROR:
            msg = conn.recv_payload(length, MAX_ERROR_BYTES, "error message").decode(errors="replace")
            raise ChannelError(f"the peer rejected a frame: {msg}")
        else:
            raise ProtocolError(f"tcp: unexpected {FRAME_NAMES.get(ftype, ftype)} frame from {self.where}")

    def _watch(self) -> None:
        """Read answers nobody waits for as they arrive, fail a link whose peer went silent, release the sockets at the end.

        It sleeps in ``poll`` on the streams, so an ACK completes its handle (and
        fires its done callbacks) the moment it arrives. While a waiter reads the
        link on its own thread (``drive``) the watcher leaves the reading to it.
        """
        while not self._stopped.is_set():
            latest = max(self.last_post, *(st.conn.last_progress for st in self.streams))
            if self.pending and time.monotonic() - latest > self.opts.io_timeout:
                self.fail(
                    f"{len(self.pending)} transfers pending and no byte moved either way for {self.opts.io_timeout:.3g}s "
                    "(peer hung or unreachable?)"
                )
                break
            if self.waiters:
                self._stopped.wait(_FOLLOW_S)
                continue
            try:
                ready = self._watch_poller.poll(_IDLE_TICK * 1000)
            except OSError:
                ready = []
            if not ready:
                continue
            if self.rx_lock.acquire(blocking=False):
                try:
                    while self.progress(0):
                        pass
                finally:
                    self.rx_lock.release()
            else:  # another thread is reading: let it, instead of spinning on what it is about to read
                self._stopped.wait(_FOLLOW_S)
        for t in self.senders:
            t.join(_SHUTDOWN_JOIN_S)
        # close only once nobody can be polling or sending on the sockets: a reused fd number must never be read
        if self.rx_lock.acquire(timeout=_SHUTDOWN_JOIN_S):
            for st in self.streams:
                with st.conn.send_lock:
                    st.conn.sock.close()
            self._wake_r.close()
            self._wake_w.close()
            self.rx_lock.release()

    def bytes_per_stream(self) -> list[int]:
        return [st.sent_bytes for st in self.streams]


class _Ending:
    """Target-side state of one WRITE whose shares have not all arrived yet."""

    __slots__ = ("conns", "notif", "refused", "shares")

    def __init__(self, shares: int) -> None:
        self.conns: set[int] = set()
        self.shares = shares
        self.notif: bytes | None = None
        self.refused = ""  # why a share of it was refused: the whole transfer is answered with NACK


class _Session:
    """The target side of one initiator link: its connections, its capability token, its partly arrived transfers."""

    def __init__(self, sid: int, peer: str, token: bytes) -> None:
        self.sid = sid
        self.peer = peer
        self.token = token
        self.conns: set[_Conn] = set()
        self.ending: dict[int, _Ending] = {}
        self.lock = threading.Lock()

    def end(self, conn: _Conn, xfer: int, shares: int, notif: bytes | None, refused: str, max_inflight: int) -> tuple[bool, bytes | None, str]:
        """Record that one share of a multi-stream transfer ended; returns (all ended, its notification, why refused)."""
        with self.lock:
            st = self.ending.get(xfer)
            if st is None:
                if len(self.ending) >= max_inflight:
                    raise ProtocolError(f"tcp {conn.label}: more than max_inflight={max_inflight} transfers partly arrived")
                st = self.ending[xfer] = _Ending(shares)
            if st.shares != shares or id(conn) in st.conns:
                raise ProtocolError(f"tcp {conn.label}: inconsistent shares for transfer {xfer}")
            if notif is not None:
                if st.notif is not None:
                    raise ProtocolError(f"tcp {conn.label}: transfer {xfer} carries two notifications")
                st.notif = notif
            st.refused = st.refused or refused
            st.conns.add(id(conn))
            if len(st.conns) < shares:
                return False, None, ""
            del self.ending[xfer]
            return True, st.notif, st.refused


class TcpChannel(Channel):
    """The tcp channel; see the module docstring for the protocol and its guarantees."""

    name: ClassVar[str] = "tcp"
    Options = TcpOptions
    authenticates_data: ClassVar[bool] = True

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        super().__init__(agent_name, options)
        opts = self.options
        if not isinstance(opts, TcpOptions):
            raise ConfigError(f"tcp channel needs TcpOptions, got {type(opts).__name__}")
        if len(agent_name.encode()) > MAX_NAME_BYTES:
            raise ConfigError(f"tcp channel agent name {agent_name!r}: expected at most {MAX_NAME_BYTES} UTF-8 bytes")
        self._opts = opts
        self._secret = opts.secret.encode()
        self._instance = secrets.randbits(63)
        self._xfer_ids = itertools.count(1)
        self._rr = itertools.count()
        self._caller = threading.local()
        self._peers: dict[str, _Meta] = {}
        self._links: dict[tuple[str, bytes], _Link] = {}  # (peer, token) -> its live link
        self._link_locks: dict[tuple[str, bytes], threading.Lock] = collections.defaultdict(threading.Lock)
        self._sessions: dict[int, _Session] = {}
        self._accepted: dict[_Conn, threading.Thread] = {}
        self._lock = threading.Lock()
        self.closed = False
        try:
            family, stype, proto, _, addr = socket.getaddrinfo(opts.host, opts.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            self._listener = socket.socket(family, stype, proto)
        except OSError as exc:
            raise ConfigError(f"tcp channel cannot listen on {opts.host}:{opts.port}: {exc}") from None
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _set_buffers(self._listener, opts)
            self._listener.bind(addr)
            self._listener.listen(min(socket.SOMAXCONN, opts.max_connections))
        except OSError as exc:
            self._listener.close()
            raise ConfigError(f"tcp channel cannot listen on {opts.host}:{opts.port}: {exc}") from None
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-{agent_name}-accept", daemon=True)
        self._acceptor.start()

    # -- memory ----------------------------------------------------------------
    def register(self, buf: Any) -> int:
        view = byte_view(buf)
        if view.readonly:
            raise ChannelError("tcp: cannot register read-only memory; transfers land bytes in registered regions")
        return self.regions.add(view, view.nbytes)

    def deregister(self, region: int) -> None:
        self.regions.remove(region)

    def metadata(self) -> bytes:
        host = self._opts.advertise_host or self._opts.host
        port = self._opts.advertise_port or self.port
        return msgspec.msgpack.encode(_Meta(self.agent_name, host, port, self._instance, self.regions.sizes()))

    # -- peers -------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = msgspec.msgpack.decode(metadata, type=_Meta)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ChannelError(f"tcp: malformed peer metadata ({exc}); pass the bytes of the peer's metadata() unchanged") from None
        if meta.version != VERSION:
            raise ChannelError(f"tcp: peer {meta.name!r} speaks protocol {meta.version}, this agent {VERSION}; upgrade both")
        if is_wildcard(meta.host):
            raise ChannelError(f"tcp: peer {meta.name!r} advertises {meta.host!r}, which is no address to dial; it must set advertise_host")
        with self._lock:
            old = self._peers.get(meta.name)
            self._peers[meta.name] = meta
            self.regions.add_peer(meta.name, meta.regions)
            links = self._pop_links(meta.name) if old != meta else []
        if old != meta:
            self.forget_unreachable(meta.name)  # new address: worth trying at once
        for link in links:
            link.fail(f"peer {meta.name!r} re-added with new metadata")
        return meta.name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)
            self.regions.remove_peer(peer)
            links = self._pop_links(peer)
        for link in links:
            link.fail(f"peer {peer!r} removed")

    def _probe(self, peer: str, timeout: float, token: bytes) -> None:
        """Open the link that transfers presenting ``token`` will use, if it is not up: every stream connected and,
        with a secret, both sides proven.

        Bounded by ``connect_timeout`` per stream (``timeout`` is not used).
        """
        try:
            self._link(peer, token)
        except ChannelError as exc:
            meta = self._peers.get(peer)
            where = f"{meta.host}:{meta.port}" if meta is not None else "the address in its metadata"
            raise ChannelError(
                f"{exc}. The peer advertises {where}: on another host it must advertise an address this host can reach "
                "(its host / --host, or advertise_host and advertise_port behind a NAT or proxy)"
            ) from None

    def _pop_links(self, peer: str) -> list[_Link]:
        """Forget every link to ``peer``, whatever its token (caller holds the lock)."""
        return [self._links.pop(key) for key in [k for k in self._links if k[0] == peer]]

    def _link(self, peer: str, token: bytes) -> _Link:
        """The live link to ``peer`` presenting ``token``, connecting (again) if there is none: reconnection is lazy.

        One link per (peer, token): a transfer always travels with the capability it was posted with.
        """
        key = (peer, token)
        link = self._links.get(key)
        if link is not None and link.dead is None:
            return link
        with self._link_locks[key]:
            link = self._links.get(key)
            if link is not None and link.dead is None:
                return link
            meta = self._peers.get(peer)
            if meta is None:
                raise ChannelError(f"tcp: unknown peer {peer!r}; call add_peer with its metadata first")
            link = _Link(self, peer, meta, token)
            with self._lock:
                current = not self.closed and self._peers.get(peer) is meta
                if current:
                    self._links[key] = link
            if not current:
                link.fail("the channel closed or the peer was re-added while connecting")
                raise ChannelError(f"tcp: peer {peer!r} was removed or re-added, or the channel closed, while connecting")
            return link

    # -- transfers ---------------------------------------------------------------
    def _post(self, kind: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes) -> TransferHandle:
        if self.closed:
            raise ChannelError("tcp channel is closed")
        total = self.regions.check_ops(peer, ops)
        if notif is not None and len(notif) > self._opts.max_notif_bytes:
            raise ChannelError(f"tcp: notification of {len(notif)} bytes exceeds max_notif_bytes={self._opts.max_notif_bytes}")
        link = self._link(peer, token)
        nstreams = len(link.streams)
        parts = min(nstreams, self._opts.streams_for(total))
        if parts == 1 and len(ops) == 1 and total <= self._opts.max_frame_bytes:
            shares = [list(ops)]  # the common small case: nothing to merge or cut
        else:
            shares = _split(merge_ops(ops), parts, self._opts.max_frame_bytes)
        xfer = next(self._xfer_ids)
        home = self._home_stream()
        if kind == "write":
            batches = [((home + i) % nstreams, self._write_batch(xfer, share, len(shares), notif if i == 0 else None)) for i, share in enumerate(shares)]
        else:
            batches = [((home + i) % nstreams, self._read_batch(xfer, share)) for i, share in enumerate(shares)]
        handle = _TcpHandle(peer, kind, total, link)
        link.post(handle, xfer, batches, notif if kind == "read" else None, kind == "read" or total <= self._opts.inline_max_bytes)
        return handle

    def _home_stream(self) -> int:
        """The calling thread's stream: where its unsplit transfers go and its split ones start.

        One busy stream beats several idle ones for small transfers: an idle
        stream's reader sleeps, and waking it on both sides costs more than
        sending 16 KiB. Different threads still spread over the streams.
        """
        home: int | None = getattr(self._caller, "stream", None)
        if home is None:
            home = self._caller.stream = next(self._rr)
        return home

    def _write_batch(self, xfer: int, share: list[TransferOp], nshares: int, notif: bytes | None) -> _Batch:
        """DATA frames of one share, the last flagged LAST (and NOTIF); headers in one buffer, payloads as views."""
        hdrs = memoryview(bytearray(HDR_SIZE * len(share)))
        bufs: list[Any] = []
        nbytes = 0
        last = len(share) - 1
        for i, op in enumerate(share):
            if i < last:
                flags = shares = nlen = 0
            else:
                flags, shares, nlen = (LAST, nshares, 0) if notif is None else (LAST | NOTIF_FOLLOWS, nshares, len(notif))
            at = i * HDR_SIZE
            HEADER.pack_into(hdrs, at, MAGIC, VERSION, DATA, flags, shares, op.remote_region, nlen, xfer, op.remote_offset, op.length)
            bufs.append(hdrs[at : at + HDR_SIZE])
            bufs.append(self.regions[op.local_region][op.local_offset : op.local_offset + op.length])
            nbytes += op.length
        if notif:
            bufs.append(notif)
        return _Batch(bufs, nbytes)

    def _read_batch(self, xfer: int, share: list[TransferOp]) -> _Batch:
        """READ_REQ frames; where each answer lands is decided here, never by the target."""
        hdrs = bytearray(HDR_SIZE * len(share))
        expect = []
        for i, op in enumerate(share):
            HEADER.pack_into(hdrs, i * HDR_SIZE, MAGIC, VERSION, READ_REQ, 0, 0, op.remote_region, 0, xfer, op.remote_offset, op.length)
            expect.append((xfer, self.regions[op.local_region][op.local_offset : op.local_offset + op.length]))
        return _Batch([hdrs], 0, expect)

    def poll(self, handle: TransferHandle) -> XferState:
        """The handle's state, after landing whatever answers are already there (never blocks)."""
        if isinstance(handle, _TcpHandle) and handle.state is XferState.PENDING and handle.link.rx_lock.acquire(blocking=False):
            try:
                while handle.link.progress(0):
                    pass
            finally:
                handle.link.rx_lock.release()
        return handle.state

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """Block until the handle finishes, reading its link's answers on this thread (see ``_Link``)."""
        if isinstance(handle, _TcpHandle) and handle.state is XferState.PENDING:
            handle.link.drive(handle, time.monotonic() + timeout)
            if handle.state is XferState.PENDING:
                raise TransferTimeout(
                    f"tcp {handle.op} of {handle.nbytes} bytes to {handle.peer!r} still pending after {timeout:.3g}s "
                    "while its link is up (peer slow or overloaded?)"
                )
        super().wait(handle, timeout)  # finished: returns, or raises the handle's error

    def stream_bytes(self, peer: str, token: bytes = b"") -> list[int]:
        """Bytes written to ``peer`` per stream of the current link (for metrics, and to see the split)."""
        link = self._links.get((peer, token))
        return link.bytes_per_stream() if link is not None else []

    def _count(self, event: str) -> None:
        with self._lock:
            self.counters[event] += 1

    # -- target side ---------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                log.warning("tcp %s: accept failed: %s", self.agent_name, exc)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            label = f"{self.agent_name}<-{addr[0]}:{addr[1]}"
            with self._lock:
                full = self.closed or len(self._accepted) >= self._opts.max_connections
            if full:
                if not self.closed:
                    log.warning("tcp %s: refusing %s: max_connections=%d reached", self.agent_name, label, self._opts.max_connections)
                sock.close()
                continue
            try:
                conn = _Conn(sock, self._opts, label)
            except OSError as exc:
                log.warning("tcp %s: cannot set up connection %s: %s", self.agent_name, label, exc)
                sock.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name=f"tcp-{self.agent_name}-serve", daemon=True)
            with self._lock:
                self._accepted[conn] = t
            t.start()

    def _serve(self, conn: _Conn) -> None:
        """Reader of one accepted connection: handshake, then frames until EOF or a bad frame."""
        session: _Session | None = None
        try:
            session = self._handshake(conn)
            self._serve_frames(conn, session)
        except ProtocolError as exc:
            if isinstance(exc, AuthError):
                self._count("auth_failures")
            peer = session.peer if session else "?"
            log.error("tcp %s: rejecting connection %s (peer %r): %s", self.agent_name, conn.label, peer, exc)
            self._hang_up(conn, session, str(exc))
        except _IO_ERRORS as exc:
            if not self.closed and not isinstance(exc, _PeerClosed):
                log.warning("tcp %s: connection %s failed: %s", self.agent_name, conn.label, exc)
            elif session is not None and session.ending:
                log.warning("tcp %s: %s closed with %d transfers partly arrived", self.agent_name, conn.label, len(session.ending))
            self._hang_up(conn, session, None)
        finally:
            with self._lock:
                self._accepted.pop(conn, None)
                if session is not None:
                    session.conns.discard(conn)
                    if not session.conns and self._sessions.get(session.sid) is session:
                        del self._sessions[session.sid]
            with conn.send_lock:  # another session member may be telling this one why it hangs up
                conn.sock.close()

    def _handshake(self, conn: _Conn) -> _Session:
        """HELLO, HELLO_OK and, with a secret, the peer's proof; only then does the connection join its session.

        Until it has joined, a failure hangs up this connection alone, and no
        frame of it but AUTH has been read.
        """
        deadline = _deadline(self._opts.connect_timeout, f"handshake on {conn.label}")
        ftype, flags, shares, _, nlen, sid, _, length = conn.recv_header(deadline)
        if ftype != HELLO:
            raise ProtocolError(f"tcp {conn.label}: expected HELLO first, got frame type {FRAME_NAMES.get(ftype, ftype)}")
        token_len = shares  # HELLO's one use of the field
        if token_len > MAX_TOKEN_BYTES:
            raise ProtocolError(f"tcp {conn.label}: HELLO with a {token_len} byte token (at most {MAX_TOKEN_BYTES})")
        _no_extras(conn, ftype, flags, 0, nlen, SECRET)
        nonce_len = NONCE_BYTES if flags & SECRET else 0
        payload = conn.recv_payload(length, nonce_len + token_len + MAX_NAME_BYTES, "HELLO")
        if len(payload) < nonce_len + token_len:
            raise ProtocolError(f"tcp {conn.label}: HELLO of {len(payload)} bytes cannot hold its {nonce_len} byte nonce and {token_len} byte token")
        theirs, token, name = payload[:nonce_len], payload[nonce_len : nonce_len + token_len], payload[nonce_len + token_len :]
        peer = name.decode(errors="replace")
        conn.label += f" ({peer!r})"
        if self._secret and not nonce_len:
            raise AuthError(f"tcp {conn.label}: this agent requires the shared secret and the peer has none (set the same `secret` on both sides)")
        if nonce_len and not self._secret:
            raise AuthError(f"tcp {conn.label}: the peer holds a shared secret and this agent none (set the same `secret` on both sides)")
        if self._secret:
            self._check_proof(conn, theirs, deadline)
        else:
            conn.send_frame(HELLO_OK, self._instance, self.agent_name.encode())
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                session = self._sessions[sid] = _Session(sid, peer, token)
            elif session.peer != peer or session.token != token:
                raise ProtocolError(f"tcp {conn.label}: session {sid:x} belongs to {session.peer!r} with another token")
            session.conns.add(conn)
        return session

    def _check_proof(self, conn: _Conn, theirs: bytes, deadline: Callable[[], None]) -> None:
        """Prove the secret over both nonces, then read the peer's proof: the one frame read before it checks out."""
        ours = new_nonce()
        conn.send_frame(HELLO_OK, self._instance, ours + proof(self._secret, TARGET_ROLE, theirs, ours) + self.agent_name.encode(), flags=SECRET)
        try:
            ftype, flags, shares, _, nlen, _, _, length = conn.recv_header(deadline)
        except (*_IO_ERRORS, ProtocolError) as exc:  # leaving is what a peer with another secret does: it refuses our proof
            if self.closed:
                raise  # we hung up, at close: no failure of the peer's
            raise AuthError(f"tcp {conn.label}: no proof of the shared secret from the peer ({exc})") from None
        if ftype != AUTH or length != PROOF_BYTES:
            raise AuthError(f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame of {length} bytes where the proof of the shared secret was due")
        _no_extras(conn, ftype, flags, shares, nlen)
        if not verify(self._secret, INITIATOR_ROLE, ours, theirs, conn.recv_payload(length, PROOF_BYTES, "proof")):
            raise AuthError(f"tcp {conn.label}: the peer failed to prove the shared secret (set the same `secret` on both sides)")

    def _region_slice(self, conn: _Conn, region: int, offset: int, length: int) -> memoryview:
        """The view a DATA/READ_REQ frame names, or ProtocolError: nothing outside a region, ever."""
        view = self.regions.get(region)
        if view is None:
            raise ProtocolError(f"tcp {conn.label}: frame names region {region}, which is not registered here")
        if length == 0 or length > self._opts.max_frame_bytes or offset + length > view.nbytes:
            raise ProtocolError(
                f"tcp {conn.label}: frame range offset={offset} length={length} does not fit region {region} "
                f"of {view.nbytes} bytes (max_frame_bytes={self._opts.max_frame_bytes})"
            )
        return view[offset : offset + length]

    def _serve_frames(self, conn: _Conn, session: _Session) -> None:
        """The hot loop: land DATA in place; when a transfer has fully landed, notify, then ACK.

        ACKs wait in ``acks`` only while more frames are already readable (or
        until a batch is full), and go out before any large payload is landed
        or anything else is sent, so holding them never delays a transfer by
        more than the frames that were queued behind it anyway.
        """
        opts = self._opts
        cur_xfer = -1  # the transfer whose share this stream is in the middle of
        refused = ""  # why a frame of that share was refused: it lands nothing, the transfer gets NACK
        acks: list[int] = []
        while True:
            if acks and (len(acks) >= MAX_ACK_BATCH or not conn.readable()):
                self._send_acks(conn, acks)
            ftype, flags, shares, region, nlen, xfer, offset, length = conn.recv_header()
            if ftype == DATA:
                if xfer != cur_xfer:
                    if cur_xfer != -1:
                        raise ProtocolError(f"tcp {conn.label}: DATA of transfer {xfer} inside the share of transfer {cur_xfer}")
                    cur_xfer = xfer
                # everything checked before a byte lands: flags, the share count, the notification size
                bad = flags & ~(LAST | NOTIF_FOLLOWS) or nlen > opts.max_notif_bytes or (nlen and not flags & NOTIF_FOLLOWS)
                if bad or (not 1 <= shares <= MAX_STREAMS if flags & LAST else flags or shares):
                    raise ProtocolError(
                        f"tcp {conn.label}: DATA with flags={flags} shares={shares} notif={nlen} "
                        f"(max {MAX_STREAMS} shares, max_notif_bytes={opts.max_notif_bytes})"
                    )
                view = self._region_slice(conn, region, offset, length)
                if acks and length >= _ACK_FLUSH_BYTES:
                    self._send_acks(conn, acks)
                refused = self._land(conn, session, view, region, offset, length) or refused
                if flags & LAST:
                    notif = conn.recv_payload(nlen, opts.max_notif_bytes, "notification") if flags & NOTIF_FOLLOWS else None
                    cur_xfer = -1
                    # a one-stream transfer has fully landed now: no shared state to consult
                    done, notif, why = (True, notif, refused) if shares == 1 else session.end(conn, xfer, shares, notif, refused, opts.max_inflight)
                    refused = ""
                    if done and why:
                        self._send_acks(conn, acks)
                        self._nack(conn, xfer, why)
                    elif done:
                        if notif is not None:
                            self.inbox.deliver(session.peer, notif)
                        acks.append(xfer)
                continue
            if cur_xfer != -1:
                raise ProtocolError(f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame inside the share of transfer {cur_xfer}")
            _no_extras(conn, ftype, flags, shares, nlen)
            if acks:
                self._send_acks(conn, acks)
            if ftype == READ_REQ:
                view = self._region_slice(conn, region, offset, length)
                try:
                    ticket = self.grants.begin(session.token, "read", region, offset, length)
                except ChannelError as exc:
                    self._count("refused_frames")
                    self._nack(conn, xfer, str(exc))
                    continue
                try:
                    with conn.send_lock:
                        conn.send([_pack(READ_DATA, xfer, length), view])
                finally:
                    self.grants.end(ticket)
            elif ftype == NOTIF:
                self.inbox.deliver(session.peer, conn.recv_payload(length, opts.max_notif_bytes, "notification"))
            else:
                raise ProtocolError(f"tcp {conn.label}: unexpected frame type {FRAME_NAMES.get(ftype, ftype)}")

    def _land(self, conn: _Conn, session: _Session, view: memoryview, region: int, offset: int, length: int) -> str:
        """Receive one DATA payload into ``view`` if the session's grants allow it, else read it away; why refused, or ""."""
        try:
            ticket = self.grants.begin(session.token, "write", region, offset, length)
        except ChannelError as exc:
            self._count("refused_frames")
            log.warning("tcp %s: refusing a write from %r: %s", self.agent_name, session.peer, exc)
            conn.drain(length)
            return str(exc)
        try:
            conn.recv_exact(view)
        finally:
            self.grants.end(ticket)
        return ""

    @staticmethod
    def _nack(conn: _Conn, xfer: int, why: str) -> None:
        conn.send_frame(NACK, xfer, why.encode()[:MAX_ERROR_BYTES])

    @staticmethod
    def _send_acks(conn: _Conn, acks: list[int]) -> None:
        if not acks:
            return
        n = len(acks)
        hdr = _pack(ACK, acks[0], 8 * (n - 1), aux=n)
        with conn.send_lock:
            conn.send([hdr, struct.pack(f"<{n - 1}Q", *acks[1:])] if n > 1 else [hdr])
        acks.clear()

    def _hang_up(self, conn: _Conn, session: _Session | None, reason: str | None) -> None:
        """Hang up every connection of the session (its transfers span them all), telling each ``reason`` first.

        Each initiator stream then fails with the reason rather than with a bare
        EOF. Every ERROR goes out before the first hang-up, since each hang-up
        makes that connection's own thread hang up the rest of the session.
        """
        with self._lock:
            conns = list(session.conns) if session is not None else [conn]
        if reason is not None:
            for c in conns:
                try:
                    c.send_frame(ERROR, payload=reason.encode()[:MAX_ERROR_BYTES])
                except _IO_ERRORS:
                    pass
        for c in conns:
            _shutdown(c.sock)

    def fence(self, peer: str, token: bytes) -> None:
        """Hang up every session that presented ``token`` and wait for their readers: nothing queued behind them lands."""
        with self._lock:
            sessions = [sess for sess in self._sessions.values() if sess.token == token]
            threads = [self._accepted[c] for sess in sessions for c in sess.conns if c in self._accepted]
        for sess in sessions:
            conns = list(sess.conns)
            if conns:
                self._hang_up(conns[0], sess, f"fenced by {self.agent_name!r}: it went silent mid-transfer; handshake again")
        deadline = time.monotonic() + self._opts.io_timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        log.warning("tcp %s: fenced peer %r: cut %d data connection(s)", self.agent_name, peer, len(threads))

    # -- shutdown ------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            links = list(self._links.values())
            self._links.clear()
            accepted = dict(self._accepted)
        _shutdown(self._listener)
        self._listener.close()
        for link in links:
            link.fail("tcp channel closed")
        for conn in accepted:
            _shutdown(conn.sock)
        me = threading.current_thread()
        deadline = time.monotonic() + _SHUTDOWN_JOIN_S
        for t in [self._acceptor, *accepted.values(), *(t for link in links for t in link.threads)]:
            if t is not me and t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        self.regions.clear()
        self.regions.clear_peers()
        self._peers.clear()
        super().close()
