"""One link of the initiator side: its streams to one peer, their sender threads and its watcher, its pending transfers.

Threads, per link: one sender per stream, and a watcher. A transfer's first
share goes out on the caller's thread when its stream is free and it is at
most ``inline_max_bytes`` (a thread hand-off costs more than sending 256 KiB
on loopback, and on a busy machine the woken sender often waits for a core);
its other shares go to their streams' senders first, so they move side by
side. Answers are read by
the thread that waits for them (``wait``: reading on the waiting thread
saves waking it from another, one context switch per transfer), by ``poll``
and by the posting thread when they are already there, and otherwise by the
watcher, which sleeps in ``poll`` on the streams, reads an answer the moment
it arrives (so done callbacks fire without delay), and fails a link whose
peer went silent: ``io_timeout`` without progress fails the link.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdkv.auth import NONCE_BYTES, PROOF_BYTES, new_nonce
from pdkv.channels.handle import TransferHandle, XferState
from pdkv.channels.tcp.conn import IO_ERRORS, SHUTDOWN_JOIN_S, Conn, PeerClosed, idle_deadline, set_buffers, shutdown
from pdkv.channels.tcp.options import TcpOptions
from pdkv.channels.tcp.wire import (
    ACK,
    ANSWER,
    AUTH,
    ERROR,
    FRAME_NAMES,
    HELLO,
    HELLO_OK,
    INITIATOR_ROLE,
    MAX_ACK_BATCH,
    MAX_ERROR_BYTES,
    MAX_NAME_BYTES,
    NACK,
    NOTIF,
    READ_DATA,
    SECRET,
    TARGET_ROLE,
    HandshakeTranscript,
    Meta,
    no_extras,
    pack,
)
from pdkv.errors import ChannelError, ProtocolError, TransferTimeout

if TYPE_CHECKING:
    from pdkv.channels.tcp.initiator import Initiator

log = logging.getLogger(__name__)

_IDLE_TICK = 0.05  # how often the watcher wakes with nothing to read (to look for a link whose peer went silent)
_FOLLOW_S = 0.002  # how often a waiter re-checks its handle while another thread reads the link


@dataclass(slots=True)
class Batch:
    """Buffers one stream sends uninterrupted; READ expectations are recorded as it goes out."""

    bufs: list[Any]
    nbytes: int
    expect: list[tuple[int, memoryview]] = field(default_factory=list)
    on_sent: Callable[[], None] | None = None
    # or the buffers as (address, length) rows, sent natively (``Initiator.post_blocks``), and what keeps them alive
    iov: np.ndarray | None = None
    keep: object = None


@dataclass(slots=True)
class Pending:
    handle: TransferHandle
    remaining: int  # READ: bytes still to land
    notif: bytes | None  # READ: sent to the target once everything landed


class Stream:
    """One initiator-side connection of a link, its sender thread and its READ answers to expect."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self.expect: collections.deque[tuple[int, memoryview]] = collections.deque()
        self.sent_bytes = 0

    def send(self, batch: Batch) -> None:
        """Send ``batch``; the caller holds ``conn.send_lock`` so batches never interleave."""
        self.expect.extend(batch.expect)
        self.sent_bytes += batch.nbytes  # counted first: the ACK may overtake this thread's return from send
        if batch.iov is not None:
            self.conn.send_iov(batch.iov)
        else:
            self.conn.send(batch.bufs)


class Link:
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

    def __init__(self, initiator: Initiator, peer: str, meta: Meta, token: bytes) -> None:
        self.initiator = initiator
        self.token = token  # presented in every stream's HELLO: the target checks our frames against its grants to it
        self.opts: TcpOptions = initiator.agent.opts
        self.peer = peer
        self.meta = meta
        self.where = f"peer {peer!r} at {meta.host}:{meta.port}"
        self.session = secrets.randbits(64)
        self.pending: dict[int, Pending] = {}  # its size is the in-flight count
        self.nacked: collections.deque[int] = collections.deque(maxlen=1024)  # transfers the target refused, latest
        self.lock = threading.Lock()
        self.waiters = 0  # threads in ``drive``
        self.rx_lock = threading.Lock()
        self.dead: str | None = None
        self.last_post = time.monotonic()
        self.streams: list[Stream] = []
        try:
            for i in range(self.opts.streams):
                self.streams.append(Stream(self._connect(i)))
        except BaseException:
            for st in self.streams:
                st.conn.sock.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = select.poll()
        self._by_fd: dict[int, Stream] = {}
        for st in self.streams:
            self._poller.register(st.conn.sock, select.POLLIN)
            self._by_fd[st.conn.sock.fileno()] = st
        self._poller.register(self._wake_r, select.POLLIN)
        self._watch_poller = select.poll()  # the watcher's own: one poll object must never be polled by two threads
        for st in self.streams:
            self._watch_poller.register(st.conn.sock, select.POLLIN)
        self._stopped = threading.Event()
        name = f"tcp-{initiator.agent.name}->{peer}"
        self.senders = [
            threading.Thread(target=self._send_loop, args=(st,), name=f"{name}-tx{i}", daemon=True)
            for i, st in enumerate(self.streams)
        ]
        self.threads = [*self.senders, threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)]
        for t in self.threads:
            t.start()

    def _connect(self, index: int) -> Conn:
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
            set_buffers(sock, opts)
            sock.settimeout(opts.connect_timeout)
            sock.connect(addr)
            conn = Conn(sock, opts, f"{self.initiator.agent.name}->{self.peer}#{index}")
            # the whole answer, however a listener trickles it (as the listener bounds ours): io_timeout is per byte
            conn.limit(opts.connect_timeout, f"the handshake answer from {self.where} (connect_timeout)")
            tls = self.initiator.agent.tls
            if tls is not None:
                conn.start_tls(tls.client, False, meta.host, opts.connect_timeout)
            secret = self.initiator.agent.secret
            nonce = new_nonce() if secret else b""
            hello = nonce + self.token + self.initiator.agent.name.encode()
            conn.send_frame(
                HELLO, self.session, hello, aux=index, flags=SECRET if secret else 0, shares=len(self.token)
            )
            ftype, flags, shares, _, nlen, instance, _, length = conn.recv_header(
                idle_deadline(opts.connect_timeout, f"handshake answer from {self.where}")
            )
            no_extras(conn.label, ftype, flags, shares, nlen, SECRET if ftype == HELLO_OK else 0)
            if ftype == ERROR:
                msg = conn.recv_payload(length, MAX_ERROR_BYTES, "error message").decode(errors="replace")
                raise ChannelError(f"tcp: {self.where} refused the connection: {msg}")
            if ftype != HELLO_OK:
                raise ProtocolError(f"tcp: {self.where} answered the handshake with frame type {ftype}")
            challenge = NONCE_BYTES + PROOF_BYTES if flags & SECRET else 0
            payload = conn.recv_payload(length, challenge + MAX_NAME_BYTES, "HELLO_OK")
            if secret:
                said = HandshakeTranscript(
                    session=self.session,
                    stream=index,
                    token=self.token,
                    initiator=self.initiator.agent.name.encode(),
                    initiator_nonce=nonce,
                    target=payload[challenge:],
                    instance=instance,
                    target_nonce=payload[:NONCE_BYTES],
                )
                if not challenge or not said.verify(secret, TARGET_ROLE, payload[NONCE_BYTES:challenge]):
                    self.initiator.agent.count("auth_failures")
                    raise ChannelError(
                        f"tcp: {self.where} did not prove the shared secret over this handshake (it has another "
                        "`secret`, or none, or something on the path changed what either side said); nothing is sent "
                        "to it"
                    )
                conn.send_frame(AUTH, payload=said.proof(secret, INITIATOR_ROLE))
            elif challenge:
                raise ProtocolError(f"tcp: {self.where} proved a shared secret nobody asked for (this agent has none)")
            name = payload[challenge:].decode(errors="replace")
            if name != self.peer or instance != meta.instance:
                raise ChannelError(
                    f"tcp: {self.where} is now agent {name!r} (instance {instance:x}), not the one its metadata "
                    "describes "
                    f"(instance {meta.instance:x}); the peer restarted: call add_peer with its current metadata"
                )
            conn.limit(None)
            return conn
        except ssl.SSLError as exc:  # the handshake, or (TLS 1.3) the target refusing our certificate at the first read
            sock.close()
            self.initiator.agent.count("tls_failures")
            raise ChannelError(
                f"tcp: TLS with {self.where} failed: {exc.reason or exc}; both agents need `tls` channel options "
                "with a certificate signed by the CA the other trusts"
            ) from None
        except (*IO_ERRORS, ProtocolError) as exc:
            sock.close()
            if isinstance(exc, ChannelError):
                raise
            raise ChannelError(
                f"tcp: cannot connect to {self.where}: {exc} (is it running? did it restart on a new port?)"
            ) from None

    # -- posting ---------------------------------------------------------------
    def post(
        self, handle: TransferHandle, xfer: int, batches: list[tuple[int, Batch]], notif: bytes | None, inline: bool
    ) -> None:
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
            self.pending[xfer] = Pending(handle, handle.nbytes, notif)
            self.last_post = time.monotonic()
        self._send(batches, inline)
        # answers to earlier transfers may be waiting (ours cannot be yet): skip the syscall when there are none
        if len(self.pending) > 1 and self.rx_lock.acquire(blocking=False):
            try:
                while self.progress(0):
                    pass
            finally:
                self.rx_lock.release()

    def _send(self, batches: list[tuple[int, Batch]], inline: bool) -> None:
        """The first batch on this thread if allowed and its stream is free, the others (and it, if not) by their
        streams' senders, handed over first so that the shares go out side by side."""
        index, batch = batches[0]
        st = self.streams[index]
        for later, later_batch in batches[1:]:
            self.streams[later].queue.put(later_batch)
        if inline and st.conn.send_lock.acquire(blocking=False):
            try:
                st.send(batch)
            except IO_ERRORS as exc:
                self.fail(f"sending failed: {exc}")
            finally:
                st.conn.send_lock.release()
        else:
            st.queue.put(batch)

    def _send_loop(self, st: Stream) -> None:
        while (batch := st.queue.get()) is not None:
            try:
                with st.conn.send_lock:
                    st.send(batch)
                if batch.on_sent is not None:
                    batch.on_sent()
            except IO_ERRORS as exc:
                self.fail(f"sending failed: {exc}")
                return

    # -- completion ----------------------------------------------------------------
    def finish(self, xfers: Sequence[int], answer: bytes = b"") -> bool:
        """Complete pending transfers (``answer``: the target's answer to the one transfer's notification); False if
        one is not pending (already failed with the link)."""
        with self.lock:
            done = [self.pending.pop(x, None) for x in xfers]
        for p in done:
            if p is not None:
                p.handle.answer = answer
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

    def landed(self, st: Stream, xfer: int, nbytes: int) -> None:
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
        hdr = pack(NOTIF, xfer, len(p.notif))
        st.queue.put(Batch([hdr, p.notif] if p.notif else [hdr], 0, on_sent=lambda: self._finish_read(xfer)))

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
            shutdown(st.conn.sock)  # wakes whoever polls or sends on it
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
            for fd, _ in self._ready(math.ceil(timeout * 1000)):
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
        except IO_ERRORS as exc:
            if self.dead is None and not self.initiator.closed:
                # a peer hanging up an idle link is a normal shutdown; losing transfers is not
                level = logging.INFO if isinstance(exc, PeerClosed) and not self.pending else logging.WARNING
                log.log(level, "tcp %s: link to %s failed: %s", self.initiator.agent.name, self.where, exc)
            self.fail(str(exc))
        return frames

    def _ready(self, timeout_ms: int) -> list[tuple[int, int]]:
        """``poll`` on the streams and the wake socket, plus (TLS) the streams OpenSSL holds decrypted bytes of."""
        if not self.initiator.agent.tls:
            return self._poller.poll(timeout_ms)
        held = {st.conn.sock.fileno() for st in self.streams if st.conn.pending()}
        return [
            *((fd, select.POLLIN) for fd in held),
            *(r for r in self._poller.poll(0 if held else timeout_ms) if r[0] not in held),
        ]

    def _read_frame(self, st: Stream) -> None:
        conn = st.conn
        ftype, flags, shares, aux, nlen, xfer, _, length = conn.recv_header()
        no_extras(conn.label, ftype, flags, shares, nlen)
        if ftype == ACK:
            if not 1 <= aux <= MAX_ACK_BATCH or length != 8 * (aux - 1):
                raise ProtocolError(f"tcp: {self.where} sent an ACK of {aux} ids in {length} bytes")
            xfers = (
                (xfer,)
                if aux == 1
                else (xfer, *struct.unpack(f"<{aux - 1}Q", conn.recv_payload(length, length, "ACK ids")))
            )
            if not self.finish(xfers):
                raise ProtocolError(f"tcp: {self.where} acknowledged a transfer that is not pending")
        elif ftype == ANSWER:
            answer = conn.recv_payload(length, self.opts.max_notif_bytes, "answer")
            if not self.finish((xfer,), answer):
                raise ProtocolError(f"tcp: {self.where} answered a transfer that is not pending")
        elif ftype == READ_DATA:
            if not st.expect:
                raise ProtocolError(f"tcp: {self.where} sent READ data nobody asked for")
            want_xfer, view = st.expect.popleft()
            if xfer != want_xfer or length != view.nbytes:
                raise ProtocolError(
                    f"tcp: {self.where} answered READ of transfer {want_xfer} ({view.nbytes} bytes) with transfer "
                    f"{xfer} ({length} bytes)"
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
        """Read answers nobody waits for as they arrive, fail a link whose peer went silent, release the sockets
        at the end.

        It sleeps in ``poll`` on the streams, so an ACK completes its handle (and
        fires its done callbacks) the moment it arrives. While a waiter reads the
        link on its own thread (``drive``) the watcher leaves the reading to it.
        """
        while not self._stopped.is_set():
            latest = max(self.last_post, *(st.conn.last_progress for st in self.streams))
            if self.pending and time.monotonic() - latest > self.opts.io_timeout:
                self.fail(
                    f"{len(self.pending)} transfers pending and no byte moved either way for "
                    f"{self.opts.io_timeout:.3g}s "
                    "(peer hung or unreachable?)"
                )
                break
            if self.waiters:
                self._stopped.wait(_FOLLOW_S)
                continue
            try:
                ready = any(st.conn.pending() for st in self.streams) or self._watch_poller.poll(_IDLE_TICK * 1000)
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
            t.join(SHUTDOWN_JOIN_S)
        # close only once nobody can be polling or sending on the sockets: a reused fd number must never be read
        if self.rx_lock.acquire(timeout=SHUTDOWN_JOIN_S):
            for st in self.streams:
                with st.conn.send_lock:
                    st.conn.sock.close()
            self._wake_r.close()
            self._wake_w.close()
            self.rx_lock.release()

    def bytes_per_stream(self) -> list[int]:
        return [st.sent_bytes for st in self.streams]
