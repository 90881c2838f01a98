"""One reservation on the decode side: the memory it holds, how far its chunks got, and landing a chunk.

See README.md, "landed" and "verified": a chunk counts only after its checksum matched, and a staged chunk
is scattered into the blocks (through its codec) only then.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdkv.channels.base import Channel
from pdkv.channels.grants import BlockGrid, GridSpans, Range, Span
from pdkv.checksum import BlockSums, chunk_checksum, frame_checksum
from pdkv.codec import Codec
from pdkv.config import TransferConfig
from pdkv.errors import ChecksumError, TransferError, TransferTimeout
from pdkv.layout import HeadWindow, KVLayout
from pdkv.native import PagedBuffer
from pdkv.staging import DeviceStager
from pdkv.transfer.plan import TransferPlan
from pdkv.transfer.protocol import ChunkNotice, Reserved
from pdkv.transfer.windows import Windows


class State(enum.Enum):
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class ReceivedKV:
    """A request's landed KV: ``blocks`` now belong to the caller, who frees them.

    ``prompt_key`` is the key of the prompt the sender computed this KV from (its Reserve). ``held_tokens``: the
    leading tokens we held already (``Reserved.held_tokens``): ``blocks`` hold tokens ``[held_tokens, num_tokens)``.
    """

    transfer_id: str
    blocks: list[int]
    num_tokens: int
    prompt_key: bytes = b""
    held_tokens: int = 0


@dataclass(kw_only=True)
class ReceiveMemory:
    """Our side's memory as every transfer lands in it, and its regions in the channel.

    ``kv_regions`` is empty when the channel cannot reach the KV's memory:
    every reservation is then staged. ``stager`` (KV in device memory) copies
    each staged chunk from its pinned slot to the KV's device and scatters it
    there.
    """

    layout: KVLayout
    kv: list[torch.Tensor]
    kv_bytes: list[torch.Tensor]  # each KV tensor's bytes, flat, on its own device
    num_blocks: int
    staging: torch.Tensor
    slot_bytes: int
    chunk_size: int
    kv_regions: list[int]
    staging_region: int
    codecs: dict[str, Codec]  # what this side decodes (offered in its Hello)
    stager: DeviceStager | None
    # The channel's checksum of blocks (of every KV tensor) from what it hashed as they landed
    # (``Channel.landed_checksum``), or None: a direct chunk is verified by reading its blocks.
    landed_checksum: Callable[[list[int]], int] | None = None
    windows: Windows = field(default_factory=Windows, repr=False)

    def window(self, heads: HeadWindow | None) -> ReceiveMemory:
        """This memory as a transfer landing in ``heads`` of ours sees it (``pdkv.transfer.windows``)."""
        return self.windows.of(self, heads, self.chunk_size)

    def blocks_checksums(self, chunks: list[list[int]]) -> list[int]:
        """Each chunk's checksum of its ``blocks`` of every KV tensor as they sit in memory: direct chunks' landed
        values, all read in one go (one read-back on a GPU), or the channel's from what it hashed as they landed."""
        if self.landed_checksum is not None:
            return [self.landed_checksum(blocks) for blocks in chunks]
        return self.sums(chunks)

    @functools.cached_property
    def paged(self) -> PagedBuffer:
        """The KV buffer as every staged chunk is scattered into it (``PagedBuffer.scatter_summed``)."""
        return PagedBuffer(self.layout, self.kv)

    @functools.cached_property
    def sums(self) -> BlockSums:
        """The KV tensors' blocks as every direct chunk's verification reads them (``blocks_checksums``)."""
        return BlockSums(self.kv_bytes, self.layout.block_bytes)

    @functools.cached_property
    def grid(self) -> BlockGrid:
        """The KV tensors as one grid of blocks: a reservation's blocks are granted and revoked over all of them at
        once (``GridSpans``)."""
        return BlockGrid(tuple(self.kv_regions), self.layout.block_bytes)

    def grant_blocks(self, channel: Channel, token: bytes, blocks: list[int]) -> None:
        """Let ``token`` write ``blocks`` of every KV tensor."""
        channel.grant(token, "write", GridSpans(self.grid, self._spans(blocks)))

    def revoke_blocks(self, channel: Channel, token: bytes, blocks: list[int], timeout: float) -> bool:
        """Take ``grant_blocks`` back, waiting up to ``timeout`` s for a frame still landing: False if one still is."""
        return not blocks or channel.revoke(token, "write", GridSpans(self.grid, self._spans(blocks)), timeout)

    def _spans(self, blocks: list[int]) -> list[Span]:
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise TransferError(f"block ids {blocks} outside the buffer's {self.num_blocks} blocks")
        return self.grid.spans(blocks)

    def slot_ranges(self, slots: list[int]) -> list[Range]:
        return [(self.staging_region, s * self.slot_bytes, self.slot_bytes) for s in slots]


def landed_checksum(channel: Channel, kv_regions: list[int], block_bytes: int) -> Callable[[list[int]], int] | None:
    """``ReceiveMemory.landed_checksum``: the channel's, where it hashes every KV region as it lands
    (``Channel.hash_landing``), else None."""
    if not kv_regions or not all(channel.hash_landing(region, block_bytes) for region in kv_regions):
        return None
    return functools.partial(channel.landed_checksum, list(kv_regions), unit=block_bytes)


@dataclass(kw_only=True)
class IncomingTransfer:
    """One reservation: the memory it holds and how far its chunks got. Changed under the receiver's lock."""

    transfer_id: str
    identity: bytes
    peer_agent: str
    num_tokens: int
    blocks: list[int]
    slots: list[int]
    mode: str
    num_chunks: int
    created: float
    lease_deadline: float
    token: bytes  # the sender's capability: what its blocks and slots are granted to
    plan: TransferPlan  # each chunk's tokens and blocks, worked out at admission
    prompt_key: bytes = b""
    codec: str = "none"  # how its staged chunks arrive
    heads: HeadWindow | None = None  # the heads of ours its chunks carry (None: all); staged
    whole_blocks: bool = False  # each staged chunk lands up to the end of its last block (plan.whole_blocks)
    revoked: bool = False  # its grants were taken back: the sender can no longer write into it
    state: State = State.RECEIVING
    landed: set[int] = field(default_factory=set)
    error: str = ""
    sender_done: bool = False
    free_deadline: float = 0.0
    ready_at: float = 0.0

    def reserved(self, held: int, slot_bytes: int, lease_s: float) -> Reserved:
        """The answer to the Reserve that booked it: where its chunks land (its slots, of ``slot_bytes``), for how
        long (``lease_s``), and the prompt's leading tokens we hold already (``held``: P pushes only the rest)."""
        return Reserved(
            transfer_id=self.transfer_id,
            mode=self.mode,
            block_ids=list(self.blocks),
            staging_slots=[s * slot_bytes for s in self.slots],
            lease_s=lease_s,
            held_tokens=held,
        )

    def grant(self, channel: Channel, memory: ReceiveMemory) -> None:
        """Let its sender write its slots (staging) or its blocks (direct)."""
        if self.mode == "staging":
            channel.grant(self.token, "write", memory.slot_ranges(self.slots))
        else:
            memory.grant_blocks(channel, self.token, self.blocks)

    def revoke_grant(self, channel: Channel, memory: ReceiveMemory, timeout: float) -> bool:
        """Take ``grant`` back, waiting up to ``timeout`` s for a frame still landing: False if one still is."""
        if self.mode == "staging":
            return not self.slots or channel.revoke(self.token, "write", memory.slot_ranges(self.slots), timeout)
        return memory.revoke_blocks(channel, self.token, self.blocks, timeout)

    def overdue(self, now: float, config: TransferConfig) -> tuple[str, TransferTimeout] | None:
        """Why it fails at ``now``, still receiving: the counter that counts it and the error; None if it is not due.
        Its lease expired, or it is not complete after ``transfer_timeout_s``."""
        if self.state is not State.RECEIVING:
            return None
        if now > self.lease_deadline:
            # Not presumed dead: a stalled sender may still have writes queued. Its blocks stay quarantined until it
            # answers the Cancel or drain_timeout_s passes (and the sender itself stops writing once it sees its
            # heartbeats lapsed), so no late write lands in blocks handed to another request.
            return "leases_expired", TransferTimeout(
                f"lease expired: no word from the sender for {config.lease_s:.3g}s (the prefill side died, hung or "
                "lost its connection)"
            )
        if now > self.created + config.transfer_timeout_s:
            return "timeouts", TransferTimeout(
                f"not complete after transfer_timeout_s={config.transfer_timeout_s:.3g}s"
            )
        return None

    def direct_blocks(self, notice: ChunkNotice) -> list[int] | None:
        """The blocks a direct chunk's notice names, to hash ahead of ``land`` with the pass's other chunks; None
        where ``land`` refuses it before any checksum (out of range, duplicated) or the chunk is staged."""
        idx = notice.chunk_index
        return self.plan.blocks[idx] if self.mode == "direct" and self._awaited(idx) else None

    def _awaited(self, idx: int) -> bool:
        """Whether chunk ``idx`` is one of ours that has not landed yet."""
        return idx < self.num_chunks and idx not in self.landed

    def land(self, memory: ReceiveMemory, notice: ChunkNotice, got: int | None = None) -> int:
        """Verify one chunk that arrived (and scatter it, when staged); returns its bytes. Raises ``TransferError``.

        ``got``: a direct chunk's checksum as it sits in memory, computed already (``direct_blocks``, hashed with
        the other chunks of the notifications' pass); None: hashed here."""
        idx = notice.chunk_index
        if not self._awaited(idx):
            raise TransferError(f"chunk {idx} is out of range or duplicated (request has {self.num_chunks} chunks)")
        start, n = self.plan.spans[idx]
        start -= self.plan.table_start  # our blocks start at the first token we did not hold
        if self.whole_blocks:
            n = memory.layout.whole_blocks(start, n)
        nbytes = memory.layout.chunk_bytes(n)
        scattered = False  # landed in the blocks by the pass that hashed it
        if self.mode == "direct":
            if got is None:
                (got,) = memory.blocks_checksums([self.plan.blocks[idx]])
        else:
            if not 0 <= notice.slot < len(self.slots):
                raise TransferError(f"chunk {idx} names staging slot {notice.slot}, request has {len(self.slots)}")
            codec = memory.codecs[self.codec]
            wire = notice.nbytes
            if not (
                wire == nbytes if codec.passthrough else 0 < wire <= memory.slot_bytes
            ):  # checked before the slot is read
                raise TransferError(
                    f"chunk {idx} claims {wire} bytes in its slot ({self.codec!r} chunk of {n} tokens, slots of "
                    f"{memory.slot_bytes})"
                )
            base = self.slots[notice.slot] * memory.slot_bytes
            frame = memory.staging[base : base + wire]
            scattered = codec.passthrough
            if scattered:
                # landed in the blocks and hashed in the pass that does it (on the KV's device): a chunk that fails
                # lands too, in blocks of this request only, which the failed transfer never hands to the engine
                chunk = frame.view(memory.layout.torch_dtype).view(memory.layout.chunk_shape(n))
                if memory.stager is not None:
                    got = memory.stager.stage_in(self.blocks, start, chunk, digest=True)
                else:
                    got = frame_checksum(frame, memory.paged.scatter_summed(self.blocks, start, chunk, checksum=True))
            else:
                got = chunk_checksum([frame])
        if got != notice.checksum:
            raise ChecksumError(
                f"chunk {idx} of transfer {self.transfer_id!r} failed its checksum (sent {notice.checksum:#x}, landed "
                f"{got:#x})"
            )
        if self.mode == "staging" and not scattered:  # an encoded frame, verified as sent: decoded, then landed
            # a frame that does not decode to exactly this chunk raises CodecError (a TransferError)
            chunk = codec.decode(
                memory.staging[base : base + wire],
                codec.scratch("raw", memory.layout.chunk_shape(n), memory.layout.torch_dtype),
            )
            if memory.stager is not None:  # to the KV's device on pdkv's stream; back once the chunk is there
                memory.stager.stage_in(self.blocks, start, chunk)
            else:
                memory.paged.scatter_summed(self.blocks, start, chunk)
        self.landed.add(idx)
        return nbytes

    @property
    def all_landed(self) -> bool:
        return len(self.landed) == self.num_chunks
