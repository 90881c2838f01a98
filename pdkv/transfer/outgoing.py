"""One request's push on the prefill side: its reservation, chunks, in-flight writes and settling.

``OutgoingTransfer`` is handed a ``SendContext`` (what every transfer of one sender shares: the sender's parts, its
memory and credit) instead of the sender itself, so the state machine can be read and tested on its own; it tells
the sender it settled through a named hook (``SettleListener``). See README.md, "sent".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdkv.channels.base import Channel
from pdkv.channels.handle import BlockWrite, TransferHandle, TransferOp, XferState
from pdkv.checksum import blocks_checksums, chunk_checksum, flat_bytes, frame_checksum, read_back_shared
from pdkv.codec import Codec
from pdkv.errors import (
    ChannelError,
    ChecksumError,
    LayoutError,
    NoticeForged,
    ProtocolError,
    ReservationError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from pdkv.layout import HeadWindow, KVLayout
from pdkv.memory import in_reach, memory_kind
from pdkv.native import gather, gather_summed
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.admission import whole_blocks
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer, lease_margin
from pdkv.transfer.plan import TransferPlan
from pdkv.transfer.pool import PoolClaim
from pdkv.transfer.protocol import ChunkNotice, Landed, Reserved
from pdkv.transfer.stall import StallBound
from pdkv.transfer.windows import Windows

log = logging.getLogger(__name__)


class SendCredit:
    """What every transfer of one sender draws from: bytes in flight and local staging slots.

    Guarded by the sender's condition. One chunk may always go when nothing is
    in flight, so a chunk bigger than the budget still moves, alone.
    """

    def __init__(self, max_bytes: int, slots: int) -> None:
        self.max_bytes = max_bytes
        self.inflight = 0
        self.free_slots = list(range(slots))

    def available(self, nbytes: int, need_slot: bool) -> bool:
        room = self.inflight == 0 or self.inflight + nbytes <= self.max_bytes
        return room and (not need_slot or bool(self.free_slots))

    def take(self, nbytes: int, need_slot: bool) -> int:
        self.inflight += nbytes
        return self.free_slots.pop() if need_slot else -1

    def give(self, nbytes: int, slot: int) -> None:
        self.inflight -= nbytes
        if slot >= 0:
            self.free_slots.append(slot)


@dataclass(kw_only=True)
class SendSource:
    """Our side's memory as every transfer reads it: the KV buffer and the staging area, registered.

    ``kv_regions`` is empty when the channel cannot reach the KV's memory (a
    tcp channel and KV in VRAM): our Hello then says so and receivers admit us
    in staging mode only. ``stager`` (KV in device memory) gathers each staged
    chunk on the KV's device and copies it into its pinned slot on pdkv's
    stream.
    """

    layout: KVLayout
    kv: list[torch.Tensor]
    kv_bytes: list[torch.Tensor]  # each KV tensor's bytes, flat, on its own device
    kv_regions: list[int]
    num_blocks: int
    staging: torch.Tensor
    staging_region: int
    slot_bytes: int
    stager: DeviceStager | None
    windows: Windows = field(default_factory=Windows, repr=False)

    def for_heads(
        self, transfer_id: str, heads: tuple[HeadWindow, HeadWindow] | None, codec: str, chunk_size: int
    ) -> tuple[SendSource, HeadWindow | None]:
        """This memory as a transfer of our heads ``heads[0]`` into the receiver's ``heads[1]`` reads it
        (``pdkv.transfer.windows``), and the receiver's window; (itself, None) for None. Raises ``ReservationError``
        for windows that are not as wide as each other, do not fit our heads, or go through a codec (a window moves
        raw)."""
        if heads is None:
            return self, None
        ours, into = heads
        if ours.count != into.count or codec != "none":
            raise ReservationError(
                f"transfer {transfer_id!r}: heads {ours} into {into} with codec {codec!r}: a head window moves as "
                "many heads as it lands in, raw (codec 'none')"
            )
        try:
            return self.windows.of(self, ours, chunk_size), into
        except LayoutError as exc:
            raise ReservationError(f"transfer {transfer_id!r}: {exc}") from None

    @classmethod
    def register(
        cls, channel: Channel, layout: KVLayout, kv: list[torch.Tensor], *, chunk_size: int, slot_bytes: int, slots: int
    ) -> SendSource:
        """Our KV (registered where the channel reaches its memory) and a pinned staging area of ``slots`` slots."""
        num_blocks = layout.validate_buffer(kv)
        staging = pinned_empty(slots * slot_bytes)
        reached = all(in_reach(t, channel.memory) for t in kv)
        return cls(
            layout=layout,
            kv=kv,
            kv_bytes=[flat_bytes(t) for t in kv],
            kv_regions=[channel.register(t, layout.block_bytes) for t in kv] if reached else [],
            num_blocks=num_blocks,
            staging=staging,
            staging_region=channel.register(staging),
            slot_bytes=slot_bytes,
            stager=DeviceStager(layout, kv, chunk_size) if kv and memory_kind(kv[0]) != "host" else None,
        )


def sender_plan(
    source: SendSource, chunk_size: int, transfer_id: str, num_tokens: int, block_table: Sequence[int], held: int = 0
) -> TransferPlan:
    """Our plan of a transfer over its request's whole ``block_table``: its chunks past the ``held`` tokens the
    receiver holds already (``Reserved.held_tokens``; 0 until it answered), over our blocks from the one holding
    token ``held``. Raises ``ReservationError`` for a request with no tokens or too short a block table, and
    ``TransferError`` unless those blocks are ours: checked before anything is reserved."""
    layout = source.layout
    if num_tokens <= 0:
        raise ReservationError(f"transfer {transfer_id!r}: nothing to transfer (num_tokens={num_tokens})")
    if len(block_table) < layout.blocks_for(num_tokens):
        raise ReservationError(
            f"transfer {transfer_id!r}: block table has {len(block_table)} blocks, {num_tokens} tokens need "
            f"{layout.blocks_for(num_tokens)}"
        )
    block_size = layout.block_size
    return TransferPlan.build(
        transfer_id,
        num_tokens=num_tokens,
        chunk_size=chunk_size,
        block_size=block_size,
        ours=block_table[held // block_size :],
        num_blocks=source.num_blocks,
        held=held,
    )


class SettleListener(Protocol):
    """Told once a transfer settled (on the I/O thread if it failed): ``KVSender.transfer_settled`` tells its
    receiver and forgets it."""

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


@dataclass(kw_only=True)
class PostedWrite:
    """A write of ours the channel has not finished: what it needs and by when it must finish (``stall.py``)."""

    nbytes: int
    need: int  # bytes in flight when it was posted, itself included: what has to move before it is done
    limit: float  # seconds it may stay pending


class OutgoingTransfer:
    """One request's push to one receiver. Made by ``KVSender.open``.

    Its state changes under the sender's condition; the I/O thread applies
    what the channel and the receiver report (writes done, chunks landed,
    cancel) and settles it: once it failed or completed and no write of ours
    is in flight, the receiver is told (``Done``/``Cancel``) and the
    ``on_settled`` callbacks run.
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
        self.source = ctx.source if source is None else source
        self.claim = claim
        self.codec = codec  # how staged chunks go on the wire (``none``: as they are)
        self.cond = ctx.parts.cond
        self.peer = peer
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.block_table = list(block_table)
        self.mode = reserved.mode
        self.remote_blocks = reserved.block_ids
        self.remote_slots = reserved.staging_slots
        # each staged chunk moves up to the end of its last block (a head window's, a packed layout's)
        self.whole_blocks = whole_blocks(self.source.layout, self.mode, window=self.source is not ctx.source)
        if reserved.held_tokens:  # the receiver holds the prompt's first tokens already: our chunks start past them
            chunk_size = ctx.parts.config.chunk_size
            plan = sender_plan(self.source, chunk_size, transfer_id, num_tokens, block_table, held=reserved.held_tokens)
        self.plan = plan.with_peer(reserved.block_ids) if self.mode == "direct" else plan
        self.spans = plan.spans
        # every chunk's direct write, worked out once: send_chunk takes its chunk's (none in staging mode)
        assert peer.hello is not None
        src = self.source
        self.direct_writes = self.plan.writes(src.kv_regions, peer.hello.kv_regions, src.layout.block_bytes)
        self.free_remote_slots = collections.deque(range(len(reserved.staging_slots)))
        self.slot_of_chunk: dict[int, int] = {}
        self.sent: set[int] = set()
        self.landed: set[int] = set()
        self.writes = 0  # posted writes whose handles have not finished
        self.posted: dict[TransferHandle, PostedWrite] = {}  # those writes, watched for stalls by check_timeout
        self.posting = 0  # chunks between taking credit and their write being tracked
        self.error: TransferError | None = None
        self.settled = False  # Done or Cancel sent: no more writes from us
        self.writes_may_land = False  # a write was given up on that may still land: the Cancel says so
        self.bytes_sent = 0
        self.wire_bytes = 0  # what the channel carried: less than bytes_sent with a compressing codec
        self.started = 0.0  # first chunk posted: transfer time excludes the wait for compute before it
        self.opened = time.monotonic()  # reservation granted: transfer_timeout_s counts from here, as on the receiver
        # last heartbeat posted for it: the receiver's lease runs from about here (a pool's, from its last one)
        self.renewed = claim.renewed if claim is not None else self.opened
        # Past this long without a heartbeat the receiver may have reaped the reservation; its lease_s, not ours,
        # is what counts.
        self.lease_s = reserved.lease_s
        self.lease_margin = lease_margin(self.lease_s, ctx.parts.config.heartbeat_s)
        self.finished_at = 0.0
        # when each chunk was posted, and each verified chunk's (bytes, seconds from its post to its verdict): what
        # the wire and the receiver's check took, apart from the prefill computing the chunks (``wire_times``)
        self.post_times: dict[int, tuple[int, float]] = {}
        self.chunk_times: list[tuple[int, float]] = []
        self._on_settled: list[Callable[[OutgoingTransfer], None]] = []
        # the request's fixed host time (hosttime.py): open to here, then its last Landed to settled
        self.landed_ns = 0
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
        self._post(index, timeout)

    def send_all(self) -> None:
        """Post every chunk not sent yet (the whole KV is in our blocks). In direct mode with the KV on a GPU their
        digests are computed first, all in one ``blocks_checksums`` call (one read-back, not one a chunk): the bytes
        they hash are the ones posted, as nothing writes these blocks any more. On CPU each is hashed as it is
        posted (``read_back_shared``)."""
        todo = [i for i in range(self.num_chunks) if i not in self.sent]
        try:
            digests, hashed_ns = self._direct_digests(todo if read_back_shared(self.source.kv_bytes) else [])
        except Exception as exc:
            with self.cond:
                err = self._posting_failed(exc, f"hashing chunks {todo}")
            raise err from exc
        for i in todo:
            if i not in self.sent:
                self._post(i, digest=digests.get(i), hashed_ns=hashed_ns)

    def _post(self, index: int, timeout: float | None = None, *, digest: int | None = None, hashed_ns: int = 0) -> None:
        """``send_chunk``; ``digest``: the chunk's direct-mode checksum when ``send_all`` computed it already, and
        ``hashed_ns`` this chunk's share of that host time (hosttime.py counts it in the chunk's)."""
        if not 0 <= index < self.num_chunks:
            raise TransferError(
                f"chunk {index} out of range: transfer {self.transfer_id!r} has {self.num_chunks} chunks"
            )
        ctx = self.ctx
        timeout = ctx.parts.config.chunk_timeout_s if timeout is None else timeout
        start, n = self.spans[index]
        if self.whole_blocks:
            n = self.source.layout.whole_blocks(start, n)
        nbytes = self.source.layout.chunk_bytes(n)
        staging = self.mode == "staging"
        local_slot, remote_slot = self._take_credit(index, nbytes, staging, timeout)
        posting = time.perf_counter_ns()  # this chunk's host time (hosttime.py): credit waits left out
        try:
            if staging:
                ops, digest = self._staged_ops(local_slot, remote_slot, start, n)
                wire = sum(op.length for op in ops)
            else:
                blocks, digest = self._direct_write(index, digest)
                wire = blocks.nbytes
            notice = ChunkNotice(self.transfer_id, index, digest, remote_slot, wire if staging else 0)
            if self.claim is not None:  # one chunk: the receiver admits the transfer as this notice arrives
                notice.reserve, notice.pool = self.claim.reserve, self.claim.generation
            notice_bytes = protocol.seal_notice(notice, self.peer.session_key)
            channel, to, token = ctx.parts.channel, self.peer.agent, self.peer.token
            handle = (
                channel.write(to, ops, notice_bytes, token=token)
                if staging
                else channel.write_blocks(to, blocks, notice_bytes, token=token, inline=self.claim is not None)
            )
        except Exception as exc:
            with self.cond:
                self.posting -= 1
                ctx.credit.give(nbytes, local_slot)
                err = self._posting_failed(exc, f"posting chunk {index}")
            raise err from exc
        with self.cond:
            self.posting -= 1
            self.writes += 1
            self.bytes_sent += nbytes
            self.wire_bytes += wire
            ctx.parts.counters["bytes_raw"] += nbytes
            ctx.parts.counters["bytes_wire"] += wire
            need = ctx.credit.inflight
            self.posted[handle] = PostedWrite(nbytes=nbytes, need=need, limit=ctx.stall.limit(need))
            self.post_times[index] = (nbytes, handle.posted_at)
        handle.add_done_callback(lambda h: self._finished(h, local_slot, index))
        ctx.parts.host.since("chunk", posting - hashed_ns)

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

    # -- posting ---------------------------------------------------------------
    def _take_credit(self, index: int, nbytes: int, staging: bool, timeout: float) -> tuple[int, int]:
        credit = self.ctx.credit
        deadline = time.monotonic() + timeout
        with self.cond:
            if index in self.sent:
                raise TransferError(f"chunk {index} of {self.transfer_id!r} was already sent")
            while True:
                if self.error is None and time.monotonic() - self.renewed > self.lease_margin:
                    # We were stalled (SIGSTOP, a long GC, a frozen VM) past the point where the receiver may have
                    # reaped the reservation and handed its blocks to another request: writing now could land in them.
                    self.fail(
                        TransferTimeout(
                            f"transfer {self.transfer_id!r}: no heartbeat reached receiver {self.peer.address} for "
                            f"{time.monotonic() - self.renewed:.3g}s (its lease is {self.lease_s:.3g}s); not writing "
                            "into a reservation that may be gone"
                        )
                    )
                if self.error is not None:
                    raise self.error
                if credit.available(nbytes, staging) and (not staging or self.free_remote_slots):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    err = TransferTimeout(
                        f"chunk {index} of {self.transfer_id!r}: no send credit within chunk_timeout_s={timeout:.3g}s "
                        "(receiver slow or gone)"
                    )
                    self.fail(err)
                    raise err
                self.cond.wait(remaining)
            local_slot = credit.take(nbytes, staging)
            remote_slot = self.free_remote_slots.popleft() if staging else -1
            self.sent.add(index)
            self.posting += 1  # keeps the transfer from settling before its write is tracked
            if not self.started:
                self.started = time.monotonic()
            if staging:
                self.slot_of_chunk[index] = remote_slot
        return local_slot, remote_slot

    def _direct_write(self, index: int, digest: int | None) -> tuple[BlockWrite, int]:
        """Chunk ``index``'s write from the plan (its blocks of every buffer tensor, as arrays); the checksum over
        the same bytes in wire order (``digest``, when ``send_all`` computed it already)."""
        if digest is None:
            (digest,) = self._direct_digests([index])[0].values()
        return self.direct_writes[index], digest

    def _direct_digests(self, indices: list[int]) -> tuple[dict[int, int], int]:
        """Direct chunks ``indices``' checksums, in one ``blocks_checksums`` call, and each one's share of its host
        time in ns; none in staging mode (a staged chunk is hashed as it is gathered)."""
        if self.mode != "direct" or not indices:
            return {}, 0
        src, began = self.source, time.perf_counter_ns()
        # On a GPU the checksums run on pdkv's stream after the caller's (the forward step that wrote these blocks)
        # and their values are read before a write is posted: a chunk goes only once that step finished (that
        # stream's work queued before this call, not the device's, nor work queued after it).
        values = blocks_checksums(src.kv_bytes, [self.plan.blocks[i] for i in indices], src.layout.block_bytes)
        return dict(zip(indices, values, strict=True)), (time.perf_counter_ns() - began) // len(indices)

    def _posting_failed(self, exc: Exception, what: str) -> TransferError:
        """Fail the transfer with ``exc``, as a ``TransferError`` saying ``what`` failed (caller holds the
        condition); returns it, to raise."""
        err = exc if isinstance(exc, TransferError) else TransferError(f"{what} of {self.transfer_id!r} failed: {exc}")
        self.fail(err)
        return err

    def _staged_ops(self, local_slot: int, remote_slot: int, start: int, n: int) -> tuple[list[TransferOp], int]:
        """Gather the chunk into our slot (through the codec, when one encodes it); the checksum covers the wire
        bytes."""
        src = self.source
        layout = src.layout
        base = local_slot * src.slot_bytes
        digest: int | None = None
        if self.codec.passthrough:
            nbytes = layout.chunk_bytes(n)
            if src.stager is not None:  # device KV: gathered and hashed on its device, copied into the pinned slot
                digest = src.stager.stage_out(self.block_table, start, n, src.staging[base : base + nbytes])
            else:
                frame = src.staging[base : base + nbytes]
                out = frame.view(layout.torch_dtype).view(layout.chunk_shape(n))
                digest = frame_checksum(
                    frame, gather_summed(layout, src.kv, self.block_table, start, n, out=out, checksum=True)[1]
                )
        else:
            raw = self.codec.scratch("raw", layout.chunk_shape(n), layout.torch_dtype)
            if src.stager is not None:
                src.stager.stage_out(self.block_table, start, n, flat_bytes(raw), digest=False)
            else:
                gather(layout, src.kv, self.block_table, start, n, out=raw)
            nbytes = self.codec.encode(raw, src.staging[base : base + src.slot_bytes])
        if digest is None:
            digest = chunk_checksum([src.staging[base : base + nbytes]])
        assert self.peer.hello is not None
        op = TransferOp(
            src.staging_region, base, self.peer.hello.staging_region, self.remote_slots[remote_slot], nbytes
        )
        return [op], digest

    # -- what the channel and the receiver report (I/O thread) ----------------
    def _finished(self, handle: TransferHandle, local_slot: int, index: int) -> None:
        """The handle's done callback (the channel's thread): a write the receiver answered (``ChunkVerdict``) is
        applied here, on the thread that read the answer; else note when, and hand the rest to the I/O thread,
        where the chunk's ``Landed`` will come. ``index``: the chunk this write carried."""
        at = time.monotonic()
        if handle.answer:
            self._on_verdict(handle, local_slot, at, index)
        else:
            self.ctx.parts.loop.call_soon(lambda: self._written(handle, local_slot, at))

    def _written(self, handle: TransferHandle, local_slot: int, at: float) -> None:
        self.ctx.parts.channel.release(handle)
        with self.cond:
            self._write_over(handle, local_slot, at)
        self._settle_if_over()

    def _write_over(self, handle: TransferHandle, local_slot: int, at: float) -> None:
        """A write of ours finished (caller holds the condition): its send credit back; a failed one fails us."""
        ctx = self.ctx
        write = self.posted.pop(handle)
        nbytes = write.nbytes
        self.writes -= 1
        ctx.credit.give(nbytes, local_slot)
        if handle.state is XferState.DONE:
            ctx.stall.observe(write.need, at - handle.posted_at)
        if handle.state is XferState.ERROR:
            self.writes_may_land |= handle.may_still_land
            self.fail(TransferError(f"channel write failed: {handle.error}"))
        else:
            ctx.parts.counters["chunks_sent"] += 1
            ctx.parts.counters["bytes_sent"] += nbytes
        self.cond.notify_all()

    def _on_verdict(self, handle: TransferHandle, local_slot: int, at: float, index: int) -> None:
        """The receiver's word on chunk ``index``, which this write carried, read with its completion: the credit
        back, the chunk counted (or the transfer failed, saying why), the next pool held, the waiter woken, all on
        this thread; only a failed transfer's settling (its Cancel) goes to the I/O thread. A verdict counts only for
        the chunk its write carried: one moved to another write's answer is refused."""
        ctx = self.ctx
        try:
            verdict = protocol.open_verdict(handle.answer, self.peer.session_key if ctx.parts.secret else None)
            if verdict.transfer_id != self.transfer_id or verdict.chunk_index != index:
                raise ProtocolError(
                    f"a verdict on chunk {verdict.chunk_index} of {verdict.transfer_id!r} answered the write of chunk "
                    f"{index} of {self.transfer_id!r}"
                )
        except ProtocolError as exc:
            ctx.parts.counters["forged_verdicts" if isinstance(exc, NoticeForged) else "malformed_verdicts"] += 1
            verdict, why = None, str(exc)
        ctx.parts.channel.release(handle)
        if verdict is not None and verdict.pool is not None:  # held before the caller hears its request is done
            ctx.hold_pool(self.peer, verdict.pool)
        with self.cond:
            self._write_over(handle, local_slot, at)
            if verdict is None:
                self.fail(TransferError(f"transfer {self.transfer_id!r}: the receiver's answer was refused: {why}"))
            elif verdict.outcome == "landed":
                self._count_landed([verdict.chunk_index])
            elif verdict.outcome == "refused":
                self.fail(
                    ReservationError(
                        f"receiver {self.peer.address} refused transfer {self.transfer_id!r}: {verdict.reason}"
                    )
                )
            else:
                error = ChecksumError if verdict.outcome == "mismatch" else TransferError
                self.fail(error(f"receiver {self.peer.address}: {verdict.reason}"))
            failed = self.error is not None
        if not failed:  # complete, or more chunks to come: a complete transfer settles here, telling nobody now
            self._settle_if_over()
        else:  # its Cancel goes over the control plane, from the I/O thread
            ctx.parts.loop.call_soon(self._settle_if_over)

    def on_landed(self, msg: Landed) -> None:
        with self.cond:
            self._count_landed(msg.chunk_indices)
        self._settle_if_over()

    def _count_landed(self, indices: list[int]) -> None:
        """Chunks the receiver verified (caller holds the condition): their staging slots free, a waiter woken."""
        now = time.monotonic()
        for index in indices:
            if index not in self.sent or index in self.landed:
                continue  # a stray or repeated acknowledgement: nothing of ours to free twice
            self.landed.add(index)
            if index in self.post_times:
                nbytes, posted = self.post_times[index]
                self.chunk_times.append((nbytes, now - posted))
            self.ctx.parts.counters["chunks_landed"] += 1
            slot = self.slot_of_chunk.pop(index, None)
            if slot is not None:
                self.free_remote_slots.append(slot)
        if self.complete and not self.finished_at:
            self.finished_at, self.landed_ns = time.monotonic(), time.perf_counter_ns()
        self.cond.notify_all()

    def wire_times(self) -> list[tuple[str, float]]:
        """A complete transfer's measurements, as (histogram series, value) (pdkv/worker/metrics.py): from its first
        post to its last verdict (``pdkv_transfer_seconds``, the prefill's computing of the chunks included); the
        exposed tail, from its last chunk's post (that KV computed) to its verdict (``pdkv_transfer_tail_seconds``);
        and each chunk's time from post to verdict and its throughput (``pdkv_chunk_seconds``,
        ``pdkv_transfer_gbps``): what the wire did, not what the prefill did."""
        if not self.complete or not self.finished_at:
            return []
        last_post = max((posted for _, posted in self.post_times.values()), default=self.started)
        out = [
            ("pdkv_transfer_seconds", max(self.finished_at - self.started, 1e-9)),
            ("pdkv_transfer_tail_seconds", max(self.finished_at - last_post, 0.0)),
        ]
        for nbytes, seconds in self.chunk_times:
            out += [("pdkv_chunk_seconds", seconds), ("pdkv_transfer_gbps", nbytes / max(seconds, 1e-9) / 1e9)]
        return out

    def check_timeout(self, now: float) -> None:
        """Nobody may be waiting on this transfer (the worker never calls wait): if its receiver died after
        our writes completed, neither Landed nor Cancel ever comes, so bound it here or it stays open forever.
        A write of ours that neither completed nor failed within its stall bound is given up on here too."""
        self._abandon_stalled(now)
        with self.cond:
            if (
                self.error is None
                and not self.complete
                and now > self.opened + self.ctx.parts.config.transfer_timeout_s
            ):
                self.fail(
                    TransferTimeout(
                        f"transfer {self.transfer_id!r}: receiver {self.peer.address} did not confirm all "
                        f"{self.num_chunks} chunks "
                        f"within transfer_timeout_s={self.ctx.parts.config.transfer_timeout_s:.3g}s"
                    )
                )
        self._settle_if_over()

    def _abandon_stalled(self, now: float) -> None:
        """Fail the transfer for each write past its stall bound and abandon the write (stall.py): its handle fails
        as one whose bytes may still land, so the Cancel says so and the receiver quarantines its blocks as it does
        a late write; settling no longer waits for it, and its credit comes back."""
        with self.cond:
            overdue = [(h, w) for h, w in self.posted.items() if now > h.posted_at + w.limit]
        for handle, write in overdue:
            # One last look: a write that finished just now is not a stall (nixl learns of completions by polling).
            if self.ctx.parts.channel.poll(handle) is not XferState.PENDING:
                continue
            err = TransferTimeout(
                f"transfer {self.transfer_id!r}: a {self.ctx.parts.channel.name} write of {write.nbytes} bytes to "
                f"{handle.peer!r} neither completed nor failed within {write.limit:.3g}s "
                f"({self.ctx.stall.describe()}); given up on, its blocks at the receiver held as a write that may "
                "still land"
            )
            with self.cond:
                self.fail(err)
            if handle.abandon(str(err)):
                with self.cond:
                    self.ctx.parts.counters["stalled_writes"] += 1

    def fail(self, err: TransferError) -> None:
        """First failure wins (caller holds the condition); the I/O thread tells the receiver once writes settle."""
        if self.error is None and not self.complete:
            self.error = err
            self.ctx.parts.counters["transfers_failed"] += 1
            log.warning("transfer %s: %s", self.transfer_id, err)
            self.ctx.parts.loop.call_soon(self._settle_if_over)
        self.cond.notify_all()

    def _settle_if_over(self) -> None:
        """Once failed or complete with no write of ours in flight: tell the receiver, run the callbacks (the I/O
        thread, or for a complete transfer the thread that read its last verdict)."""
        began = time.perf_counter_ns()
        with self.cond:
            over = self.error is not None or self.complete
            if not over or self.writes or self.posting or self.settled:
                return
            self.settled = True
            callbacks, self._on_settled = self._on_settled, []
        self.ctx.listener.transfer_settled(self)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("on_settled callback for %s failed", self.transfer_id)
        if self.landed_ns and self.error is None:  # from the last chunk counted, less a wait for this thread
            self.ctx.parts.host.add("request", self.fixed_ns + time.perf_counter_ns() - max(self.landed_ns, began))
