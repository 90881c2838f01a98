"""An initiator link's streams: the connections it sends on, and what each sends (``Batch``) uninterrupted."""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdkv.channels.tcp.conn import Conn


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
