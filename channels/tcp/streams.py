"""An initiator link's streams: the connections it sends on, and what each sends (``Batch``) uninterrupted."""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.conn import Conn
from pdkv.channels.tcp.wire import LAST, NOTIF_FOLLOWS, data_frame
from pdkv.checksum import finish
from pdkv.errors import ChannelError


class SealedEnd:
    """Where a sealed write's shares meet: each adds its part of the checksum once its frames are hashed and sent,
    and the last to do so has the notification sealed over their sum, so no share waits for another (two
    transfers' shares, queued in opposite orders on two streams, would otherwise wait for each other)."""

    def __init__(self, shares: int, total: int, xfer: int, seal: Callable[[int], bytes], max_notif: int) -> None:
        self.total, self.xfer, self._seal, self._max_notif = total, xfer, seal, max_notif
        self._lock = threading.Lock()
        self._left, self._acc = shares, 0

    def add(self, acc: int) -> bytes | None:
        """Count one share's part ``acc``; the sealed notification if it was the last, else None."""
        with self._lock:
            self._acc += acc  # finish() takes it modulo 2**64
            self._left -= 1
            if self._left:
                return None
        try:
            notif = self._seal(finish(self._acc, self.total))
        except Exception as exc:  # the shares are on the wire without their end: only the link's end can follow
            raise ChannelError(f"tcp: sealing the notification of transfer {self.xfer} failed: {exc!r}") from exc
        if len(notif) > self._max_notif:
            raise ChannelError(
                f"tcp: the sealed notification of transfer {self.xfer} is {len(notif)} bytes, over max_notif_bytes="
                f"{self._max_notif}: its bytes went without it, so the link ends"
            )
        return notif


@dataclass(slots=True, frozen=True)
class Sealed:
    """One share of a write whose notification vouches for its bytes' checksum, computed as they are sent
    (``Initiator.post_blocks_sealed``): the share's frames, all but its held-back tail (``BlockFrames.tails``), are
    hashed and sent first; its LAST frame then carries the tail, and the notification where ``end`` says this
    share was the last hashed."""

    frames: tcp_native.BlockFrames
    share: int
    unit: int  # the checksum's unit: the write's block bytes
    window: int  # payload bytes hashed, then sent, at a time (``sum_window_bytes``)
    end: SealedEnd

    def send(self, conn: Conn) -> None:
        frames, share = self.frames, self.share
        code, os_error, acc = tcp_native.send_summed(conn.sock.fileno(), frames, share, self.unit, self.window)
        conn.sent_natively(code, os_error)
        notif = self.end.add(acc)
        region, offset, length = frames.tails[share]
        first, rows, _ = frames.shares[share]
        tail = (ctypes.c_char * length).from_address(int(frames.iov[first + rows][0]))
        flags, nlen = (LAST, 0) if notif is None else (LAST | NOTIF_FOLLOWS, len(notif))
        hdr = data_frame(self.end.xfer, [(region, offset, length)], length, flags, len(frames.shares), nlen)
        conn.send([hdr, tail] if notif is None else [hdr, tail, notif])


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
    sealed: Sealed | None = None  # or a sealed write, which sends itself (``iov`` unused)


class Stream:
    """One initiator-side connection of a link, the shares queued on it (sent by the initiator's ``LinkWorkers``) and
    its READ answers to expect; ``fail`` fails its link."""

    def __init__(self, conn: Conn, fail: Callable[[str], None]) -> None:
        self.conn = conn
        self.fail = fail
        self.queue: collections.deque[Batch] = collections.deque()  # under the workers' lock
        self.scheduled = False  # in the workers' ready queue, or being sent by one of them
        self.expect: collections.deque[tuple[int, memoryview]] = collections.deque()
        self.sent_bytes = 0

    def send(self, batch: Batch) -> None:
        """Send ``batch``; the caller holds ``conn.send_lock`` so batches never interleave."""
        self.expect.extend(batch.expect)
        self.sent_bytes += batch.nbytes  # counted first: the ACK may overtake this thread's return from send
        if batch.sealed is not None:
            batch.sealed.send(self.conn)
        elif batch.iov is not None:
            self.conn.send_iov(batch.iov)
        else:
            self.conn.send(batch.bufs)
