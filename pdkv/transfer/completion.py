"""What comes back for one transfer's writes on the prefill side: each write's completion (its send credit back),
the receiver's word on each chunk (a ``ChunkVerdict`` read with the write's completion, or a ``Landed`` on the
control plane: the chunk counted, or the transfer failed, saying why), and what those times measure
(``wire_times``).

``Completions`` keeps the transfer's state where it is (``outgoing.OutgoingTransfer``, the state machine), which it
reaches through ``Completing``. See README.md, "verified".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from pdkv.channels.handle import TransferHandle, XferState
from pdkv.errors import ChecksumError, NoticeForged, ProtocolError, ReservationError, TransferError
from pdkv.transfer import protocol
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer
from pdkv.transfer.posting import ChunkPoster, SendCredit
from pdkv.transfer.protocol import Landed
from pdkv.transfer.stall import PostedWrite, StallBound


class Completing(Protocol):
    """What the answers to a transfer's writes read and change of it (``outgoing.OutgoingTransfer``), under the
    sender's condition: its writes in flight, the chunks sent and landed, failing and settling it."""

    transfer_id: str
    peer: ReceiverPeer
    cond: threading.Condition
    poster: ChunkPoster  # the receiver's staging slots, freed as their chunks land
    error: TransferError | None
    posted: dict[TransferHandle, PostedWrite]
    writes_may_land: bool  # a write was given up on that may still land: the Cancel says so
    sent: set[int]
    landed: set[int]
    started: float
    post_times: dict[int, tuple[int, float]]

    @property
    def complete(self) -> bool: ...

    def fail(self, err: TransferError) -> None: ...

    def settle_if_over(self) -> None: ...


class Completions:
    """Applies what the channel and the receiver report of one transfer's writes, on the thread that learns it: the
    channel's (a write answered), or the I/O thread (a write done, a ``Landed``)."""

    def __init__(
        self,
        xfer: Completing,
        *,
        parts: SenderParts,
        credit: SendCredit,
        bound: StallBound,
        hold_pool: Callable[[ReceiverPeer, protocol.Pool], None],
    ) -> None:
        """``hold_pool``: where the next pool a chunk's verdict carried is held (``SenderPools.hold``)."""
        self.xfer, self.parts, self.credit, self.bound, self.hold_pool = xfer, parts, credit, bound, hold_pool
        # each verified chunk's (bytes, seconds from its post to its verdict): what the wire and the receiver's check
        # took, apart from the prefill computing the chunks (``wire_times``)
        self.chunk_times: list[tuple[int, float]] = []
        self.finished_at = 0.0
        self.landed_ns = 0  # its last chunk counted (perf_counter_ns): the request's fixed host time runs on from here

    def finished(self, handle: TransferHandle, local_slot: int, index: int) -> None:
        """The handle's done callback (the channel's thread): a write the receiver answered (``ChunkVerdict``) is
        applied here, on the thread that read the answer; else note when, and hand the rest to the I/O thread,
        where the chunk's ``Landed`` will come. ``index``: the chunk this write carried."""
        at = time.monotonic()
        if handle.answer:
            self._on_verdict(handle, local_slot, at, index)
        else:
            self.parts.loop.call_soon(lambda: self.written(handle, local_slot, at))

    def written(self, handle: TransferHandle, local_slot: int, at: float) -> None:
        """An unanswered write finished (I/O thread): its credit back, and the transfer settled if it is over."""
        self.parts.channel.release(handle)
        with self.xfer.cond:
            self._write_over(handle, local_slot, at)
        self.xfer.settle_if_over()

    def _write_over(self, handle: TransferHandle, local_slot: int, at: float) -> None:
        """A write of ours finished (caller holds the condition): its send credit back; a failed one fails us."""
        xfer, parts = self.xfer, self.parts
        write = xfer.posted.pop(handle)
        nbytes = write.nbytes
        self.credit.give(nbytes, local_slot)
        if handle.state is XferState.DONE:
            self.bound.observe(write.need, at - handle.posted_at)
        if handle.state is XferState.ERROR:
            xfer.writes_may_land |= handle.may_still_land
            xfer.fail(TransferError(f"channel write failed: {handle.error}"))
        else:
            parts.counters["chunks_sent"] += 1
            parts.counters["bytes_sent"] += nbytes
        xfer.cond.notify_all()

    def _on_verdict(self, handle: TransferHandle, local_slot: int, at: float, index: int) -> None:
        """The receiver's word on chunk ``index``, which this write carried, read with its completion: the credit
        back, the chunk counted (or the transfer failed, saying why), the next pool held, the waiter woken, all on
        this thread; only a failed transfer's settling (its Cancel) goes to the I/O thread. A verdict counts only for
        the chunk its write carried: one moved to another write's answer is refused."""
        xfer, parts = self.xfer, self.parts
        try:
            verdict = protocol.open_verdict(handle.answer, xfer.peer.session_key if parts.secret else None)
            if verdict.transfer_id != xfer.transfer_id or verdict.chunk_index != index:
                raise ProtocolError(
                    f"a verdict on chunk {verdict.chunk_index} of {verdict.transfer_id!r} answered the write of chunk "
                    f"{index} of {xfer.transfer_id!r}"
                )
        except ProtocolError as exc:
            parts.counters["forged_verdicts" if isinstance(exc, NoticeForged) else "malformed_verdicts"] += 1
            verdict, why = None, str(exc)
        parts.channel.release(handle)
        if verdict is not None and verdict.pool is not None:  # held before the caller hears its request is done
            self.hold_pool(xfer.peer, verdict.pool)
        with xfer.cond:
            self._write_over(handle, local_slot, at)
            if verdict is None:
                xfer.fail(TransferError(f"transfer {xfer.transfer_id!r}: the receiver's answer was refused: {why}"))
            elif verdict.outcome == "landed":
                self._count_landed([verdict.chunk_index])
            elif verdict.outcome == "refused":
                xfer.fail(
                    ReservationError(
                        f"receiver {xfer.peer.address} refused transfer {xfer.transfer_id!r}: {verdict.reason}"
                    )
                )
            else:
                error = ChecksumError if verdict.outcome == "mismatch" else TransferError
                xfer.fail(error(f"receiver {xfer.peer.address}: {verdict.reason}"))
            failed = xfer.error is not None
        if not failed:  # complete, or more chunks to come: a complete transfer settles here, telling nobody now
            xfer.settle_if_over()
        else:  # its Cancel goes over the control plane, from the I/O thread
            parts.loop.call_soon(xfer.settle_if_over)

    def on_landed(self, msg: Landed) -> None:
        """The receiver's ``Landed`` (I/O thread; a channel without verdicts): the chunks it names counted."""
        with self.xfer.cond:
            self._count_landed(msg.chunk_indices)
        self.xfer.settle_if_over()

    def _count_landed(self, indices: list[int]) -> None:
        """Chunks the receiver verified (caller holds the condition): their staging slots free, a waiter woken."""
        xfer, now = self.xfer, time.monotonic()
        for index in indices:
            if index not in xfer.sent or index in xfer.landed:
                continue  # a stray or repeated acknowledgement: nothing of ours to free twice
            xfer.landed.add(index)
            if index in xfer.post_times:
                nbytes, posted = xfer.post_times[index]
                self.chunk_times.append((nbytes, now - posted))
            self.parts.counters["chunks_landed"] += 1
            xfer.poster.slot_back(index)
        if xfer.complete and not self.finished_at:
            self.finished_at, self.landed_ns = time.monotonic(), time.perf_counter_ns()
        xfer.cond.notify_all()

    def wire_times(self) -> list[tuple[str, float]]:
        """A complete transfer's measurements, as (histogram series, value) (pdkv/worker/metrics.py): from its first
        post to its last verdict (``pdkv_transfer_seconds``, the prefill's computing of the chunks included); the
        exposed tail, from its last chunk's post (that KV computed) to its verdict (``pdkv_transfer_tail_seconds``);
        and each chunk's time from post to verdict and its throughput (``pdkv_chunk_seconds``,
        ``pdkv_transfer_gbps``): what the wire did, not what the prefill did."""
        xfer = self.xfer
        if not xfer.complete or not self.finished_at:
            return []
        last_post = max((posted for _, posted in xfer.post_times.values()), default=xfer.started)
        out = [
            ("pdkv_transfer_seconds", max(self.finished_at - xfer.started, 1e-9)),
            ("pdkv_transfer_tail_seconds", max(self.finished_at - last_post, 0.0)),
        ]
        for nbytes, seconds in self.chunk_times:
            out += [("pdkv_chunk_seconds", seconds), ("pdkv_transfer_gbps", nbytes / max(seconds, 1e-9) / 1e9)]
        return out
