"""A chunk's bytes on the prefill side: the memory they are read from (``SendSource``), the credit they draw
(``SendCredit``), and posting one (``ChunkPoster``): its credit taken, its bytes (a direct write of whole blocks, or
a staged frame gathered and encoded), their checksum, its notice and its write.

``ChunkPoster`` keeps no transfer state of its own beyond the bytes' (their writes worked out once, the receiver's
staging slots): what it posted is counted on its transfer (``outgoing.OutgoingTransfer``, the state machine), which
it reaches through ``Postable``. See README.md, "sent".
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdkv.channels.base import Channel, SummedWrites
from pdkv.channels.handle import TransferHandle, TransferOp
from pdkv.checksum import BlockSums, chunk_checksum, flat_bytes, frame_checksum, read_back_shared
from pdkv.codec import Codec
from pdkv.errors import LayoutError, ReservationError, TransferError, TransferTimeout
from pdkv.layout import HeadWindow, KVLayout
from pdkv.memory import in_reach, memory_kind
from pdkv.native import PagedBuffer
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer
from pdkv.transfer.plan import TransferPlan, whole_blocks
from pdkv.transfer.pool import PoolClaim
from pdkv.transfer.protocol import ChunkNotice, Reserved
from pdkv.transfer.stall import PostedWrite, StallBound
from pdkv.transfer.windows import Windows


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

    @functools.cached_property
    def paged(self) -> PagedBuffer:
        """The KV buffer as every staged chunk is gathered from it (``PagedBuffer.gather_summed``)."""
        return PagedBuffer(self.layout, self.kv)

    @functools.cached_property
    def sums(self) -> BlockSums:
        """The KV tensors' blocks as a direct chunk's checksum reads them where the channel does not hash what it
        sends (``blocks_checksums``)."""
        return BlockSums(self.kv_bytes, self.layout.block_bytes)

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
        """Our KV (registered where the channel reaches its memory) and a pinned staging area of ``slots`` slots,
        each region sealed (``Channel.guard``): a prefill worker only pushes, so no peer has a reason to read or
        write its memory, and over nixl its peers get no key to it. Left open (a plain registration), any peer that
        reached its channel could read every request's KV out of it, or overwrite KV this side then checksums and
        sends as its own; and over nixl its watcher polled for such a peer's notifications forever (~850 passes a
        second at rest)."""
        num_blocks = layout.validate_buffer(kv)
        staging = pinned_empty(slots * slot_bytes)
        reached = all(in_reach(t, channel.memory) for t in kv)
        kv_regions = [channel.register(t, layout.block_bytes) for t in kv] if reached else []
        staging_region = channel.register(staging)
        for region in (*kv_regions, staging_region):
            channel.guard(region, sealed=True)
        return cls(
            layout=layout,
            kv=kv,
            kv_bytes=[flat_bytes(t) for t in kv],
            kv_regions=kv_regions,
            num_blocks=num_blocks,
            staging=staging,
            staging_region=staging_region,
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


class Postable(Protocol):
    """What posting a chunk reads and counts of its transfer (``outgoing.OutgoingTransfer``), under the sender's
    condition: whether it failed (and failing it), its lease, and what is sent and in flight."""

    transfer_id: str
    peer: ReceiverPeer
    cond: threading.Condition
    claim: PoolClaim | None  # written into the receiver's pool: its one chunk's notice carries the Reserve
    error: TransferError | None
    renewed: float  # when an answered heartbeat last renewed its reservation
    lease_s: float
    lease_margin: float
    sent: set[int]
    posting: int  # chunks between taking credit and their write being tracked
    posted: dict[TransferHandle, PostedWrite]
    started: float
    bytes_sent: int
    post_times: dict[int, tuple[int, float]]

    def fail(self, err: TransferError) -> None: ...


class Seal(Protocol):
    """Makes a chunk's sealed notice from its checksum and (staged) the bytes written into its slot."""

    def __call__(self, digest: int, wire: int = 0) -> bytes: ...


class ChunkPoster:
    """Posts one transfer's chunks: waits for credit, reads the chunk's bytes and their checksum, sends its notice
    with its write. Made by ``OutgoingTransfer``; ``on_done(handle, local_slot, index)`` is each write's done
    callback (``completion.Completions.finished``)."""

    def __init__(
        self,
        xfer: Postable,
        *,
        parts: SenderParts,
        credit: SendCredit,
        bound: StallBound,
        source: SendSource,
        window: bool,
        codec: Codec,
        reserved: Reserved,
        plan: TransferPlan,
        block_table: list[int],
        on_done: Callable[[TransferHandle, int, int], None],
    ) -> None:
        """``window``: ``source`` is a head window of the sender's memory (``SendSource.for_heads``)."""
        self.xfer, self.parts, self.credit, self.bound, self.on_done = xfer, parts, credit, bound, on_done
        self.source, self.codec, self.plan, self.block_table = source, codec, plan, block_table
        self.mode = reserved.mode
        self.remote_slots = reserved.staging_slots
        # each staged chunk moves up to the end of its last block (a head window's, a packed layout's)
        self.whole_blocks = whole_blocks(source.layout, self.mode, window=window)
        # every chunk's direct write, worked out once: post takes its chunk's (none in staging mode)
        assert xfer.peer.hello is not None
        self.direct_writes = plan.writes(source.kv_regions, xfer.peer.hello.kv_regions, source.layout.block_bytes)
        self.free_remote_slots = collections.deque(range(len(reserved.staging_slots)))
        self.slot_of_chunk: dict[int, int] = {}

    def post_all(self) -> None:
        """Post every chunk not sent yet (``OutgoingTransfer.send_all``). In direct mode with the KV on a GPU their
        digests are computed first, all in one ``blocks_checksums`` call (one read-back, not one a chunk): the bytes
        they hash are the ones posted, as nothing writes these blocks any more. On CPU each is hashed as it is
        posted (``read_back_shared``)."""
        xfer = self.xfer
        todo = [i for i in range(self.plan.num_chunks) if i not in xfer.sent]
        try:
            digests, hashed_ns = self._direct_digests(todo if read_back_shared(self.source.kv_bytes) else [])
        except Exception as exc:
            with xfer.cond:
                err = self._posting_failed(exc, f"hashing chunks {todo}")
            raise err from exc
        for i in todo:
            if i not in xfer.sent:
                self.post(i, digest=digests.get(i), hashed_ns=hashed_ns)

    def post(self, index: int, timeout: float | None = None, *, digest: int | None = None, hashed_ns: int = 0) -> None:
        """Post chunk ``index`` (``OutgoingTransfer.send_chunk``); ``digest``: the chunk's direct-mode checksum when
        ``post_all`` computed it already, and ``hashed_ns`` this chunk's share of that host time (hosttime.py counts
        it in the chunk's)."""
        xfer, num_chunks = self.xfer, self.plan.num_chunks
        if not 0 <= index < num_chunks:
            raise TransferError(f"chunk {index} out of range: transfer {xfer.transfer_id!r} has {num_chunks} chunks")
        parts = self.parts
        timeout = parts.config.chunk_timeout_s if timeout is None else timeout
        start, n = self.plan.spans[index]
        if self.whole_blocks:
            n = self.source.layout.whole_blocks(start, n)
        nbytes = self.source.layout.chunk_bytes(n)
        staging = self.mode == "staging"
        local_slot, remote_slot = self._take_credit(index, nbytes, staging, timeout)
        posting = time.perf_counter_ns()  # this chunk's host time (hosttime.py): credit waits left out
        try:
            channel, to, token = parts.channel, xfer.peer.agent, xfer.peer.token
            seal = self._sealer(index, remote_slot)
            if staging:
                ops, digest = self._staged_ops(local_slot, remote_slot, start, n)
                wire = sum(op.length for op in ops)
                handle = channel.write(to, ops, seal(digest, wire), token=token)
            else:
                blocks = self.direct_writes[index]
                # a one-chunk request's (pooled or reserved) goes out on this thread: it has nothing else to post
                wire, inline = blocks.nbytes, num_chunks == 1
                # Hashed as the channel sends it where it can (tcp): each piece right after the kernel copied it,
                # from cache, not in a pass of its own over the whole chunk first. Otherwise hashed here first (or by
                # post_all, on a GPU).
                found = None
                if digest is None and isinstance(channel, SummedWrites):
                    found = channel.write_blocks_summed(to, blocks, seal, token, inline=inline)
                if found is None:
                    if digest is None:
                        (digest,) = self._direct_digests([index])[0].values()
                    found = channel.write_blocks(to, blocks, seal(digest), token=token, inline=inline)
                handle = found
        except Exception as exc:
            with xfer.cond:
                xfer.posting -= 1
                self.credit.give(nbytes, local_slot)
                err = self._posting_failed(exc, f"posting chunk {index}")
            raise err from exc
        with xfer.cond:
            xfer.posting -= 1
            xfer.bytes_sent += nbytes
            parts.counters["bytes_raw"] += nbytes
            parts.counters["bytes_wire"] += wire
            need = self.credit.inflight
            xfer.posted[handle] = PostedWrite(nbytes=nbytes, need=need, limit=self.bound.limit(need))
            xfer.post_times[index] = (nbytes, handle.posted_at)
        handle.add_done_callback(lambda h: self.on_done(h, local_slot, index))
        parts.host.since("chunk", posting - hashed_ns)

    def slot_back(self, index: int) -> None:
        """Chunk ``index`` landed (caller holds the condition): its staging slot at the receiver is free again."""
        slot = self.slot_of_chunk.pop(index, None)
        if slot is not None:
            self.free_remote_slots.append(slot)

    def _take_credit(self, index: int, nbytes: int, staging: bool, timeout: float) -> tuple[int, int]:
        xfer, credit = self.xfer, self.credit
        deadline = time.monotonic() + timeout
        with xfer.cond:
            if index in xfer.sent:
                raise TransferError(f"chunk {index} of {xfer.transfer_id!r} was already sent")
            while True:
                if xfer.error is None and time.monotonic() - xfer.renewed > xfer.lease_margin:
                    # We were stalled (SIGSTOP, a long GC, a frozen VM) past the point where the receiver may have
                    # reaped the reservation and handed its blocks to another request: writing now could land in them.
                    xfer.fail(
                        TransferTimeout(
                            f"transfer {xfer.transfer_id!r}: no heartbeat reached receiver {xfer.peer.address} for "
                            f"{time.monotonic() - xfer.renewed:.3g}s (its lease is {xfer.lease_s:.3g}s); not writing "
                            "into a reservation that may be gone"
                        )
                    )
                if xfer.error is not None:
                    raise xfer.error
                if credit.available(nbytes, staging) and (not staging or self.free_remote_slots):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    err = TransferTimeout(
                        f"chunk {index} of {xfer.transfer_id!r}: no send credit within chunk_timeout_s={timeout:.3g}s "
                        "(receiver slow or gone)"
                    )
                    xfer.fail(err)
                    raise err
                xfer.cond.wait(remaining)
            local_slot = credit.take(nbytes, staging)
            remote_slot = self.free_remote_slots.popleft() if staging else -1
            xfer.sent.add(index)
            xfer.posting += 1  # keeps the transfer from settling before its write is tracked
            if not xfer.started:
                xfer.started = time.monotonic()
            if staging:
                self.slot_of_chunk[index] = remote_slot
        return local_slot, remote_slot

    def _sealer(self, index: int, remote_slot: int) -> Seal:
        """What makes chunk ``index``'s notification from its checksum (and, staged, the bytes written into the
        slot), sealed under the session key: called here, or by the channel once it hashed the bytes it sent."""
        xfer = self.xfer
        transfer_id, claim, key = xfer.transfer_id, xfer.claim, xfer.peer.session_key

        def seal(digest: int, wire: int = 0) -> bytes:
            notice = ChunkNotice(transfer_id, index, digest, remote_slot, wire)
            if claim is not None:  # one chunk: the receiver admits the transfer as this notice arrives
                notice.reserve, notice.pool = claim.reserve, claim.generation
            return protocol.seal_notice(notice, key)

        return seal

    def _direct_digests(self, indices: list[int]) -> tuple[dict[int, int], int]:
        """Direct chunks ``indices``' checksums, in one ``blocks_checksums`` call, and each one's share of its host
        time in ns; none in staging mode (a staged chunk is hashed as it is gathered)."""
        if self.mode != "direct" or not indices:
            return {}, 0
        src, began = self.source, time.perf_counter_ns()
        # On a GPU the checksums run on pdkv's stream after the caller's (the forward step that wrote these blocks)
        # and their values are read before a write is posted: a chunk goes only once that step finished (that
        # stream's work queued before this call, not the device's, nor work queued after it).
        values = src.sums([self.plan.blocks[i] for i in indices])
        return dict(zip(indices, values, strict=True)), (time.perf_counter_ns() - began) // len(indices)

    def _posting_failed(self, exc: Exception, what: str) -> TransferError:
        """Fail the transfer with ``exc``, as a ``TransferError`` saying ``what`` failed (caller holds the
        condition); returns it, to raise."""
        xfer = self.xfer
        err = exc if isinstance(exc, TransferError) else TransferError(f"{what} of {xfer.transfer_id!r} failed: {exc}")
        xfer.fail(err)
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
                    frame, src.paged.gather_summed(self.block_table, start, n, out=out, checksum=True)[1]
                )
        else:
            raw = self.codec.scratch("raw", layout.chunk_shape(n), layout.torch_dtype)
            if src.stager is not None:
                src.stager.stage_out(self.block_table, start, n, flat_bytes(raw), digest=False)
            else:
                src.paged.gather_summed(self.block_table, start, n, out=raw)
            nbytes = self.codec.encode(raw, src.staging[base : base + src.slot_bytes])
        if digest is None:
            digest = chunk_checksum([src.staging[base : base + nbytes]])
        peer = self.xfer.peer
        assert peer.hello is not None
        op = TransferOp(src.staging_region, base, peer.hello.staging_region, self.remote_slots[remote_slot], nbytes)
        return [op], digest
