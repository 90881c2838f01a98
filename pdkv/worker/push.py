"""Pushes computed chunks to the decode side off the engine thread.

``send_chunk`` may wait for send credit (backpressure from a slow decode
worker); doing that on the engine thread would stall every other request's
prefill and decode. The engine thread only enqueues ``(transfer, chunk)``;
this thread posts them in order. The queue is bounded by the chunks of
admitted requests, whose blocks the engine already holds.
"""

from __future__ import annotations

import logging
import queue
import threading

from pdkv.errors import PdkvError
from pdkv.transfer.outgoing import OutgoingTransfer

log = logging.getLogger(__name__)


class ChunkPusher:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[OutgoingTransfer, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdkv-push", daemon=True)
        self._thread.start()

    def push(self, xfer: OutgoingTransfer, chunk_index: int) -> None:
        self._queue.put((xfer, chunk_index))

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            xfer, index = item
            if xfer.error is not None:
                continue  # already failed: the decode side falls back
            try:
                xfer.send_chunk(index)
            except PdkvError as exc:
                log.warning("transfer %s: chunk %d not sent: %s", xfer.transfer_id, index, exc)
