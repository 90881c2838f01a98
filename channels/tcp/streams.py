"""An initiator link's streams: the connections it sends on, and what each sends (``Batch``) uninterrupted."""

from __future__ import annotations

import collections
import ctypes
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.conn import Conn
from pdkv.channels.tcp.wire import LAST, NOTIF_FOLLOWS, data_frame
from pdkv.checksum import finish
from pdkv.errors import ChannelError


@dataclass(slots=True, frozen=True)
class Sealed:
    """A write whose notification vouches for its bytes' checksum, computed as they are sent
    (``Initiator.post_blocks_sealed``): its frames, all but the held-back tail (``BlockFrames.tail``), are hashed
    and sent first; ``seal(checksum)`` then makes the notification that the LAST frame, carrying the tail, ends the
    share with."""

    frames: tcp_native.BlockFrames
    unit: int  # the checksum's unit: the write's block bytes
    total: int  # payload bytes, tail included
    xfer: int
    seal: Callable[[int], bytes]
    max_notif: int
    window: int  # payload bytes hashed, then sent, at a time (``sum_window_bytes``)

    def send(self, conn: Conn) -> None:
        code, os_error, acc = tcp_native.send_summed(conn.sock.fileno(), self.frames, self.unit, self.window)
        conn.sent_natively(code, os_error)
        try:
            notif = self.seal(finish(acc, self.total))
        except Exception as exc:  # the share is on the wire without its end: only the link's end can follow
            raise ChannelError(f"tcp: sealing the notification of transfer {self.xfer} failed: {exc!r}") from exc
        if len(notif) > self.max_notif:
            raise ChannelError(
                f"tcp: the sealed notification of transfer {self.xfer} is {len(notif)} bytes, over max_notif_bytes="
                f"{self.max_notif}: its bytes went without it, so the link ends"
            )
        assert self.frames.tail is not None
        region, offset, length = self.frames.tail
        first, rows, _ = self.frames.shares[0]
        tail = (ctypes.c_char * length).from_address(int(self.frames.iov[first + rows][0]))
        hdr = data_frame(self.xfer, [(region, offset, length)], length, LAST | NOTIF_FOLLOWS, 1, len(notif))
        conn.send([hdr, tail, notif])


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
        if batch.sealed is not None:
            batch.sealed.send(self.conn)
        elif batch.iov is not None:
            self.conn.send_iov(batch.iov)
        else:
            self.conn.send(batch.bufs)
