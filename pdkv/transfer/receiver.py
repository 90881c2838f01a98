"""``KVReceiver``: the decode side's one object per worker (README.md here walks one transfer through it).

It owns the paged KV buffer as the channel sees it (guarded regions: a peer writes only what a reservation
granted it), binds the control plane's ROUTER, routes what arrives on it and answers Reserves; the handshake,
the admission rules, the pools, each reservation's landing and its life until freed are their own rooms, wired
once through ``parts.ReceiverParts``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

import torch

from pdkv import native
from pdkv.blocks import BlockAllocator
from pdkv.channels.base import Channel
from pdkv.checksum import flat_bytes
from pdkv.codec import available_codecs, make_codec
from pdkv.codec import slot_bytes as codec_slot_bytes
from pdkv.config import TransferConfig
from pdkv.errors import OutOfBlocksError, TransferError
from pdkv.layout import KVLayout
from pdkv.memory import adopt_kv, in_reach, memory_kind
from pdkv.netaddr import zmq_address
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.admission import admit
from pdkv.transfer.arrivals import ChunkArrivals
from pdkv.transfer.book import IncomingBook
from pdkv.transfer.claims import BookLock, Claims
from pdkv.transfer.control import ControlLoop, RouterSocket
from pdkv.transfer.handshake import ReceiverHandshake, reserving_peer
from pdkv.transfer.incoming import ReceivedKV, ReceiveMemory, landed_checksum
from pdkv.transfer.parts import ReceiverParts
from pdkv.transfer.protocol import Auth, BeatAck, Cancel, Done, Heartbeat, Hello, Refused, Reserve, ReturnPool

log = logging.getLogger(__name__)

_REAP_TICK_S = 0.05  # how often leases, timeouts and quarantines are checked


class KVReceiver:
    """Lands pushed KV chunks in a paged buffer: ``wait`` for a transfer, then decode from its blocks."""

    def __init__(
        self,
        channel: Channel,
        layout: KVLayout,
        kv_tensors: Sequence[torch.Tensor],
        allocator: BlockAllocator,
        fingerprint: str,
        config: TransferConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes = b"",
        advertise_host: str = "",
    ) -> None:
        self.channel, self.layout = channel, layout
        kv = adopt_kv(list(kv_tensors))
        num_blocks = layout.validate_buffer(kv)
        if allocator.num_blocks != num_blocks:
            raise TransferError(f"allocator manages {allocator.num_blocks} blocks but the KV buffer has {num_blocks}")
        self.allocator, self.fingerprint = allocator, fingerprint
        self.config = config = config or TransferConfig()
        codecs = {name: make_codec(name, layout) for name in available_codecs(layout)}
        # any offered codec's frame fits
        slot_bytes = codec_slot_bytes(layout, config.chunk_size, list(codecs.values()))
        staging = pinned_empty(config.staging_slots * slot_bytes)
        reached = all(in_reach(t, channel.memory) for t in kv)
        kv_regions = [channel.register(t, layout.block_bytes) for t in kv] if reached else []
        staging_region = channel.register(staging)
        for region in (*kv_regions, staging_region):
            channel.guard(region)  # peers write only into what a reservation of theirs granted them
        if not channel.enforces_grants:
            log.warning(
                "%s channel: one-sided writes never pass through this receiver, so it cannot check them against "
                "its reservations; with peers you do not trust, use the tcp channel or a shared secret",
                channel.name,
            )
        self.memory = ReceiveMemory(
            layout=layout,
            kv=kv,
            kv_bytes=[flat_bytes(t) for t in kv],
            num_blocks=num_blocks,
            staging=staging,
            slot_bytes=slot_bytes,
            chunk_size=config.chunk_size,
            kv_regions=kv_regions,
            staging_region=staging_region,
            codecs=codecs,
            stager=DeviceStager(layout, kv, config.chunk_size) if kv and memory_kind(kv[0]) != "host" else None,
            landed_checksum=landed_checksum(channel, kv_regions, layout.block_bytes),
        )
        native.available()  # load the kernel library now, not inside the first transfer
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False
        self.loop = ControlLoop("pdkv-receiver", min(_REAP_TICK_S, config.lease_s / 4), lambda: self.book.reap())
        self.parts = ReceiverParts(
            channel=channel,
            config=config,
            secret=secret.encode() if isinstance(secret, str) else secret,
            greeting=self,
            outbox=self,
            loop=self.loop,
            lock=BookLock(),
            counters=self.counters,
            memory=self.memory,
            allocator=allocator,
            peers={},
            unproven={},
        )
        self.book = IncomingBook(self.parts)
        self.claims = Claims(self.book, self.parts.lock, config, self.counters, self.cancel)
        self.arrivals = ChunkArrivals(self.parts, self.book)
        self.handshake = ReceiverHandshake(self.parts, admitted=self.book.pools)
        self._router = RouterSocket(
            self.loop,
            host=host,
            port=port,
            on_message=self._on_message,
            counters=self.counters,
            keys=self.handshake,
            handshake_s=config.handshake_timeout_s,
        )
        self.address = self._router.address
        if advertise_host:  # what senders dial: not a wildcard bind address
            self.address = zmq_address(advertise_host, self.address.rsplit(":", 1)[1])
        self.loop.watch(channel.notification_fd(), self.arrivals.on_notifications)
        self.loop.start()

    def hello(self) -> Hello:
        """``parts.Greeting``: our Hello, the same construction as the sender's."""
        memory = self.memory
        return protocol.make_hello(
            agent=self.channel.agent_name,
            channel=self.channel.name,
            channel_metadata=self.channel.metadata(),
            fingerprint=self.fingerprint,
            layout=self.layout,
            chunk_size=self.config.chunk_size,
            kv_regions=memory.kv_regions,
            staging_region=memory.staging_region,
            codecs=list(memory.codecs),
        )

    def wait(self, transfer_id: str, timeout: float | None = None, prompt_key: bytes | None = None) -> ReceivedKV:
        """Block until the transfer's KV has landed and verified, then hand it over.

        ``prompt_key``: the key of the prompt the caller will decode. When given, the KV is handed over only
        if the sender computed it for that prompt (the key in its Reserve); otherwise its blocks are freed and
        ``PromptMismatchError`` raised: a mismatch is a recompute, never a decode.

        Raises ``TransferError`` if it failed (its memory is already on its way back to the allocator) and
        ``TransferTimeout`` after ``timeout`` seconds (default ``transfer_timeout_s``), or ``NotAnnouncedError``
        after ``announce_timeout_s`` if no sender ever reserved it, cancelling it so nothing leaks: the caller
        falls back to computing the prefix itself.
        """
        return self.claims.wait(transfer_id, timeout, prompt_key)

    async def claim(
        self, transfer_id: str, timeout: float | None = None, prompt_key: bytes | None = None
    ) -> ReceivedKV:
        """``wait`` on the running asyncio loop, with no thread (``claims.py``); a cancelled claim cancels the
        transfer."""
        return await self.claims.claim(transfer_id, timeout, prompt_key)

    def cancel(self, transfer_id: str, reason: str) -> None:
        """Abandon a transfer from the decode side (client gone, timeout); frees what it holds."""
        self.book.cancel(transfer_id, reason)

    def stats(self) -> dict[str, int]:
        """Counters plus the gauges the leak checks read (free blocks, reservations)."""
        with self.book.lock:
            out = dict(self.counters)
            out["free_blocks"] = self.allocator.num_free
            out["free_staging_slots"] = len(self.book.free_slots)
            out["reservations"] = len(self.book.res)
            out["reserved_blocks"] = sum(len(r.blocks) for r in self.book.res.values())
            out["pooled_blocks"] = self.book.pools.blocks_held
            out["pooled_slots"] = self.book.pools.slots_held
        if self.memory.stager is not None:  # device KV: staged chunks copied to the device and scattered there
            out["chunks_staged_to_device"] = self.memory.stager.chunks_in
        return out

    def close(self) -> None:
        """Stop the loop, free every reservation still held and close the socket; once (a loop that already
        stopped leaves the rest to do all the same)."""
        if self._closed:
            return
        self._closed = True
        self.loop.stop()
        self.book.close()
        self._router.close()

    # -- control messages (I/O thread) ------------------------------------------
    def reply(self, identity: bytes, msg: protocol.Message) -> None:
        """``parts.ReceiverOutbox``: send from the I/O thread; other threads go through ``loop.call_soon``."""
        self._router.send(identity, msg)

    def _on_message(self, identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self.handshake.on_hello(identity, msg)
        elif isinstance(msg, Auth):
            self.handshake.on_auth(identity, msg)
        elif isinstance(msg, Reserve):
            self.reply(identity, self._on_reserve(identity, msg))
        elif isinstance(msg, Heartbeat):
            if identity in self.handshake.peers:  # answered: the sender renews on our word, not on its own
                self.book.beat(identity, msg)
                self.reply(identity, BeatAck(msg.seq))
        elif isinstance(msg, (Cancel, Done)):
            self.book.sender_finished(identity, msg)
        elif isinstance(msg, ReturnPool):
            with self.book.lock:
                self.book.pools.give_back(identity, msg.generation)
        else:
            self.reply(identity, protocol.Error(f"unexpected {type(msg).__name__} at the receiver"))

    def _on_reserve(self, identity: bytes, req: Reserve) -> protocol.Message:
        """Authenticated peers only; then the admission rules (``admission.admit``), then the blocks."""
        book, began = self.book, time.perf_counter_ns()  # D's fixed host time per request (hosttime.py)
        with book.lock:
            peer = reserving_peer(self.parts, identity, req)
            if isinstance(peer, Refused):
                return peer
            held = self.allocator.held_for(req.transfer_id)  # our prefix hit: P pushes only the tokens past it
            admitted = admit(req, book.view(identity, peer, req.transfer_id, held))
            if isinstance(admitted, Refused):
                self.counters["refused"] += 1
                return admitted
            try:
                blocks = self.allocator.allocate_for(req.transfer_id, admitted.blocks, held)
            except OutOfBlocksError as exc:
                self.counters["refused"] += 1
                return Refused(
                    req.transfer_id,
                    f"cannot hold {req.num_tokens} tokens: {exc}",
                    retryable=admitted.blocks <= self.memory.num_blocks,
                )
            slots = [book.free_slots.pop() for _ in range(admitted.slots)]
            r = book.open(identity=identity, peer=peer, req=req, admission=admitted, blocks=blocks, slots=slots)
            r.grant(self.channel, self.memory)
            answer = r.reserved(held, self.memory.slot_bytes, self.config.lease_s)
        self.parts.host.since("request", began)
        return answer
