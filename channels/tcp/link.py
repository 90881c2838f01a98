"""One link of the initiator side: its streams to one peer, its pending transfers.

A link has no threads of its own: the initiator's workers (``workers.LinkWorkers``) send the shares queued on its
streams and read the answers nobody waits for, which its link watcher (``watching.LinkWatcher``) hands them, and
the watcher closes the sockets of a failed link. A transfer's first share goes out on the caller's thread when its
stream is free and it is at most ``inline_max_bytes``, or whatever its size when the caller has nothing else to do
until it is answered (``write_blocks(..., inline=True)``: a thread hand-off costs more than sending 256 KiB on
loopback, and on a busy machine the woken sender often waits for a core); its other shares are queued first, so
they move side by side. Each stream is opened and proven by ``handshake.dial``; answers are read by the
``LinkReader``.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdkv.channels.handle import TransferHandle
from pdkv.channels.tcp.conn import IO_ERRORS, shutdown
from pdkv.channels.tcp.handshake import dial
from pdkv.channels.tcp.options import TcpOptions
from pdkv.channels.tcp.reader import FOLLOW_S, LinkReader
from pdkv.channels.tcp.streams import Batch, Stream
from pdkv.channels.tcp.wire import NOTIF, Meta, pack
from pdkv.errors import ProtocolError, TransferTimeout

if TYPE_CHECKING:
    from pdkv.channels.tcp.initiator import Initiator


@dataclass(slots=True)
class Pending:
    handle: TransferHandle
    remaining: int  # READ: bytes still to land
    notif: bytes | None  # a READ's is sent once everything landed; a write's went with its data (and may be answered)


class Link:
    """This agent's connections to one peer: streams, pending transfers, the in-flight bound.

    Answers (ACK, ANSWER, READ_DATA, NACK, ERROR) are read by its ``reader``,
    on whichever thread holds ``reader.rx_lock`` (``LinkReader``).

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
        self.max_shares = self.opts.shares_to(meta.host)  # fewer than the streams to a peer on this host
        self.session = secrets.randbits(64)
        self.pending: dict[int, Pending] = {}  # its size is the in-flight count
        self.nacked: collections.deque[int] = collections.deque(maxlen=1024)  # transfers the target refused, latest
        self.lock = threading.Lock()
        self.dead: str | None = None
        self.last_post = time.monotonic()
        self.streams: list[Stream] = []
        self.watcher = initiator.watcher()
        self.workers = self.watcher.workers
        try:
            for i in range(self.opts.streams):
                conn = dial(initiator.agent, peer, meta, self.where, self.session, i, token)
                self.streams.append(Stream(conn, self.fail))
            self.reader = LinkReader(self)
            try:
                self.watcher.add(self)
            except BaseException:
                self.reader.close()
                raise
        except BaseException:
            for st in self.streams:
                st.conn.sock.close()
            raise

    # -- posting ---------------------------------------------------------------
    def shares_for(self, nbytes: int) -> int:
        """How many shares a transfer of ``nbytes`` to this peer is cut into (``TcpOptions.streams_for``, at most
        ``max_shares``)."""
        return min(self.max_shares, self.opts.streams_for(nbytes))

    def post(
        self, handle: TransferHandle, xfer: int, batches: list[tuple[int, Batch]], notif: bytes | None, inline: bool
    ) -> None:
        """Register the transfer (reading answers while at ``max_inflight``), send it, then drain ready answers.

        Draining on the posting thread keeps pipelined small writes from
        piling unread ACKs up until the target blocks on sending them.
        """
        limit = self.opts.max_inflight
        deadline = time.monotonic() + self.opts.io_timeout
        reader = self.reader
        while len(self.pending) >= limit and self.dead is None:
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"tcp: {limit} transfers in flight to {self.where} and none finished in "
                    f"{self.opts.io_timeout:.3g}s; wait on handles before posting more or raise max_inflight"
                )
            if reader.rx_lock.acquire(timeout=FOLLOW_S):
                try:
                    reader.progress(FOLLOW_S)
                finally:
                    reader.rx_lock.release()
        with self.lock:
            if self.dead is not None:
                handle.fail(self.dead)
                return
            self.pending[xfer] = Pending(handle, handle.nbytes, notif)
            self.last_post = time.monotonic()
        self._send(batches, inline)
        # answers to earlier transfers may be waiting (ours cannot be yet): skip the syscall when there are none
        if len(self.pending) > 1:
            reader.drain()

    def _send(self, batches: list[tuple[int, Batch]], inline: bool) -> None:
        """The first batch on this thread if allowed and its stream is free, the others (and it, if not) by the
        workers, handed over first so that the shares go out side by side."""
        index, batch = batches[0]
        st = self.streams[index]
        for later, later_batch in batches[1:]:
            self.workers.put(self.streams[later], later_batch)
        if inline and st.conn.send_lock.acquire(blocking=False):
            try:
                st.send(batch)
            except IO_ERRORS as exc:
                self.fail(f"sending failed: {exc}")
            finally:
                st.conn.send_lock.release()
        else:
            self.workers.put(st, batch)

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

    def misanswered(self, xfers: Sequence[int], answered: bool) -> str:
        """Why the peer's ACK (or ANSWER) may not complete these pending transfers, "" if it may: a READ completes
        when its data has landed, and only a write that carried a notification has an answer."""
        with self.lock:
            for x in xfers:
                p = self.pending.get(x)
                if p is not None and p.handle.op != "write":
                    return f"acknowledged READ {x}, which completes when its data has landed"
                if p is not None and answered and not p.notif:
                    return f"answered transfer {x}, which carried no notification to answer"
        return ""

    def _finish_read(self, xfer: int) -> None:
        """A READ's notification went out: complete it, and wake a waiter polling the sockets for it."""
        self.finish((xfer,))
        if self.reader.waiters:
            self.reader.wake()

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
        # sent by a worker: the reader must never block on a send (the target may be blocked sending to us)
        hdr = pack(NOTIF, xfer, len(p.notif))
        self.workers.put(st, Batch([hdr, p.notif] if p.notif else [hdr], 0, on_sent=lambda: self._finish_read(xfer)))

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
            self.workers.drop(st)
        self.watcher.failed(self)  # which closes the sockets once nobody polls or sends on them

    def bytes_per_stream(self) -> list[int]:
        return [st.sent_bytes for st in self.streams]
