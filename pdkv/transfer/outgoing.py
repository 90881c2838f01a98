"""One request's push on the prefill side: the state machine that ties its rooms together.

``OutgoingTransfer`` holds one transfer's state (its reservation, the chunks sent and landed, its writes in flight,
its failure) and settles it; its rooms do the work on that state: ``posting.ChunkPoster`` posts each chunk's bytes,
``completion.Completions`` applies what comes back for them, ``stall.StallWatch`` bounds them in time. It is handed a
``SendContext`` (what every transfer of one sender shares: the sender's parts, its memory and credit) instead of the
sender itself, so the state machine can be read and tested on its own; it tells the sender it settled through a
named hook (``SettleListener``). See README.md, "sent".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdkv.channels.handle import TransferHandle, XferState
from pdkv.codec import Codec
from pdkv.errors import ChannelError, ReservationError, TransferCancelled, TransferError, TransferTimeout
from pdkv.transfer import protocol
from pdkv.transfer.completion import Completions
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer, lease_margin
from pdkv.transfer.plan import TransferPlan
from pdkv.transfer.pool import PoolClaim
from pdkv.transfer.posting import ChunkPoster, SendCredit, SendSource, sender_plan
from pdkv.transfer.protocol import Reserved
from pdkv.transfer.stall import PostedWrite, StallBound, StallWatch

log = logging.getLogger(__name__)


class SettleListener(Protocol):
    """Told once a transfer settled, on the thread that settled it (the I/O thread, or the channel's thread that read
    its last verdict): ``KVSender.transfer_settled`` tells its receiver and forgets it."""

    def transfer_settled(self, xfer: OutgoingTransfer) -> None: ...


@dataclass(kw_only=True)
class SendContext:
    """What every transfer of one sender shares: the sender's parts (lock, counters, channel, I/O thread), our
    memory, the send credit, who hears that a transfer settled, and where a pool offered on the way is held."""

    parts: SenderParts
    source: SendSource
    credit: SendCredit
    listener: SettleListener
    hold_pool: Callable[[ReceiverPeer, protocol.Pool], None]  # the next pool a chunk's verdict carried (SenderPools)
    stall: StallBound = field(init=False)  # when a posted write counts as stalled (stall.py), from the config

    def __post_init__(self) -> None:
        self.stall = StallBound(self.parts.config)


class OutgoingTransfer:
    """One request's push to one receiver. Made by ``KVSender.open``.

    Its state changes under the sender's condition; the I/O thread applies
    what the channel and the receiver report (writes done, chunks landed,
    cancel) and settles it: once it failed or completed and no write of ours
    is in flight, the ``on_settled`` callbacks run and the receiver is told (a
    ``Cancel`` at once; a complete transfer's ``Done`` on the next heartbeat).
    """

    def __init__(
        self,
        ctx: SendContext,
        *,
        peer: ReceiverPeer,
        transfer_id: str,
        num_tokens: int,
        block_table: Sequence[int],
        plan: TransferPlan,
        opened_ns: int,
        reserved: Reserved,
        codec: Codec,
        claim: PoolClaim | None = None,
        source: SendSource | None = None,
    ) -> None:
        """``plan``: its chunks over ``block_table`` (``sender_plan``), made again past what the receiver holds
        already when it says so, and paired here with the receiver's blocks in direct mode. ``opened_ns``: when
        ``open`` began (``time.perf_counter_ns``), the start of our fixed host cost (``hosttime.py``). ``claim``: the
        transfer was written into the receiver's pool, not reserved: its one chunk's notice carries the Reserve
        (README.md here, "Pools"). ``source``: what its chunks are read from, when not all of ``ctx.source`` (a head
        window of it: ``SendSource.for_heads``)."""
        self.ctx = ctx
        source = ctx.source if source is None else source
        self.claim = claim
        self.cond = ctx.parts.cond
        self.peer = peer
        self.transfer_id = transfer_id
        self.mode = reserved.mode
        self.remote_blocks = reserved.block_ids
        if reserved.held_tokens:  # the receiver holds the prompt's first tokens already: our chunks start past them
            chunk_size = ctx.parts.config.chunk_size
            plan = sender_plan(source, chunk_size, transfer_id, num_tokens, block_table, held=reserved.held_tokens)
        self.plan = plan.with_peer(reserved.block_ids) if self.mode == "direct" else plan
        self.spans = plan.spans
        self.sent: set[int] = set()
        self.landed: set[int] = set()
        self.posted: dict[TransferHandle, PostedWrite] = {}  # writes not finished, watched for stalls (``StallWatch``)
        self.posting = 0  # chunks between taking credit and their write being tracked
        self.error: TransferError | None = None
        self.settled = False  # over, no write of ours in flight: no more writes from us
        self.writes_may_land = False  # a write was given up on that may still land: the Cancel says so
        self.bytes_sent = 0
        self.started = 0.0  # first chunk posted: transfer time excludes the wait for compute before it
        self.opened = time.monotonic()  # reservation granted: transfer_timeout_s counts from here, as on the receiver
        # last heartbeat posted for it: the receiver's lease runs from about here (a pool's, from its last one)
        self.renewed = claim.renewed if claim is not None else self.opened
        # Past this long without a heartbeat the receiver may have reaped the reservation; its lease_s, not ours,
        # is what counts.
        self.lease_s = reserved.lease_s
        self.lease_margin = lease_margin(self.lease_s, ctx.parts.config.heartbeat_s)
        self.post_times: dict[int, tuple[int, float]] = {}  # when each chunk was posted (``Completions.wire_times``)
        self._on_settled: list[Callable[[OutgoingTransfer], None]] = []
        # the rooms: what comes back for our writes, our chunks' bytes (``codec``: how staged chunks go on the wire;
        # ``none``: as they are), and the time bounds on both
        self.completion = Completions(
            self, parts=ctx.parts, credit=ctx.credit, bound=ctx.stall, hold_pool=ctx.hold_pool
        )
        self.poster = ChunkPoster(
            self,
            parts=ctx.parts,
            credit=ctx.credit,
            bound=ctx.stall,
            source=source,
            window=source is not ctx.source,
            codec=codec,
            reserved=reserved,
            plan=self.plan,
            block_table=list(block_table),
            on_done=self.completion.finished,
        )
        self.stalls = StallWatch(self, ctx.parts, ctx.stall)
        # the request's fixed host time (hosttime.py): open to here, then its last Landed to settled
        self.fixed_ns = time.perf_counter_ns() - opened_ns

    @property
    def num_chunks(self) -> int:
        return len(self.spans)

    @property
    def complete(self) -> bool:
        return len(self.landed) == self.num_chunks

    # -- the caller's side -----------------------------------------------------
    def send_chunk(self, index: int, timeout: float | None = None) -> None:
        """Post chunk ``index`` (its KV must already be in our blocks); waits only for credit."""
        self.poster.post(index, timeout)

    def send_all(self) -> None:
        """Post every chunk not sent yet (the whole KV is in our blocks), their checksums read in one go where that
        saves read-backs (``ChunkPoster.post_all``)."""
        self.poster.post_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the receiver verified every chunk, or raise why it did not.

        While one write of ours is in flight over a channel whose ``wait`` sleeps in the kernel until it completes
        (``Channel.wakes_waiter``: tcp), this thread reads it there: its verdict wakes this thread itself, as raw's
        ``recv`` of an ack does, not a reader thread that then wakes it."""
        timeout = self.ctx.parts.config.transfer_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        channel = self.ctx.parts.channel
        while True:
            with self.cond:
                if self.error is None and not self.complete:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.fail(
                            TransferTimeout(
                                f"transfer {self.transfer_id!r}: receiver did not confirm all {self.num_chunks} chunks "
                                f"within {timeout:.3g}s"
                            )
                        )
                if self.error is not None:
                    raise self.error
                if self.complete:
                    return
                alone = next(iter(self.posted)) if channel.wakes_waiter and len(self.posted) == 1 else None
                if alone is None or alone.state is not XferState.PENDING:
                    self.cond.wait(remaining)
                    continue
            with contextlib.suppress(TransferError, ChannelError):  # its done callback has failed us, or will
                channel.wait(alone, remaining)

    def cancel(self, reason: str) -> None:
        """Stop sending; the receiver is told once our in-flight writes settle."""
        with self.cond:
            self.fail(TransferCancelled(f"cancelled by the prefill side: {reason}"))

    def cancel_by_receiver(self, reason: str) -> None:
        with self.cond:
            self.fail(TransferCancelled(f"receiver cancelled: {reason}"))

    def refused(self, reason: str) -> None:
        """The receiver refused the Reserve this transfer's chunk carried (a pooled transfer): it failed."""
        with self.cond:
            self.fail(ReservationError(f"receiver {self.peer.address} refused transfer {self.transfer_id!r}: {reason}"))

    def on_settled(self, fn: Callable[[OutgoingTransfer], None]) -> None:
        """Call ``fn(self)`` once no write of ours can touch the source blocks any more.

        The prefill worker frees the request's blocks here, not earlier: a
        block freed while a write still reads from it could ship another
        request's KV. Runs on the sender's I/O thread, on the thread that read
        a complete transfer's last verdict, or at once if settled.
        """
        with self.cond:
            if not self.settled:
                self._on_settled.append(fn)
                return
        fn(self)

    def fail(self, err: TransferError) -> None:
        """First failure wins (caller holds the condition); the I/O thread tells the receiver once writes settle."""
        if self.error is None and not self.complete:
            self.error = err
            self.ctx.parts.counters["transfers_failed"] += 1
            log.warning("transfer %s: %s", self.transfer_id, err)
            self.ctx.parts.loop.call_soon(self.settle_if_over)
        self.cond.notify_all()

    def settle_if_over(self) -> None:
        """Once failed or complete with no write of ours in flight: tell the receiver, run the callbacks (the I/O
        thread, or for a complete transfer the thread that read its last verdict)."""
        began = time.perf_counter_ns()
        with self.cond:
            over = self.error is not None or self.complete
            if not over or self.posted or self.posting or self.settled:
                return
            self.settled = True
            callbacks, self._on_settled = self._on_settled, []
        self.ctx.listener.transfer_settled(self)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("on_settled callback for %s failed", self.transfer_id)
        landed_ns = self.completion.landed_ns
        if landed_ns and self.error is None:  # from the last chunk counted, less a wait for this thread
            self.ctx.parts.host.add("request", self.fixed_ns + time.perf_counter_ns() - max(landed_ns, began))
