"""``KVSender``: the prefill side's one object per worker (README.md here walks one transfer through it).

It registers the paged KV buffer and a bounded staging area with the channel, owns the send credit
every transfer draws from, runs the control plane's I/O thread and routes what arrives on it; the handshake,
the Reserves, the pools, the heartbeats and each transfer's state machine are their own rooms, wired once
through ``parts.SenderParts``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

import torch

from pdkv import native
from pdkv.channels.base import Channel
from pdkv.codec import Codec, make_codec
from pdkv.codec import slot_bytes as codec_slot_bytes
from pdkv.config import TransferConfig
from pdkv.errors import ReservationError, TransferCancelled
from pdkv.layout import HeadWindow, KVLayout
from pdkv.memory import adopt_kv, memory_kind
from pdkv.transfer import protocol
from pdkv.transfer.control import ControlLoop, DealerSockets
from pdkv.transfer.handshake import SenderHandshake
from pdkv.transfer.heartbeat import Heartbeats
from pdkv.transfer.outgoing import OutgoingTransfer, SendContext
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer
from pdkv.transfer.pool import SenderPools
from pdkv.transfer.posting import SendCredit, SendSource, sender_plan
from pdkv.transfer.protocol import BeatAck, Cancel, Hello, Landed, Pool, Refused, Reserved
from pdkv.transfer.reserves import Reserves

log = logging.getLogger(__name__)


class KVSender:
    """Pushes KV chunks to decode receivers: ``open`` a transfer, then ``send_chunk`` as its KV is computed."""

    def __init__(
        self,
        channel: Channel,
        layout: KVLayout,
        kv_tensors: Sequence[torch.Tensor],
        fingerprint: str,
        config: TransferConfig | None = None,
        secret: str | bytes = b"",
    ) -> None:
        self.channel = channel
        self.fingerprint, self.config = fingerprint, (config := config or TransferConfig())
        kv = adopt_kv(list(kv_tensors))
        native.available()  # load the kernel library now, not inside the first transfer
        codecs = dict.fromkeys(("none", config.codec))  # a transfer uses one of the two (``open(codec=...)``)
        self.codecs: dict[str, Codec] = {n: make_codec(n, layout) for n in codecs}
        slot_bytes = codec_slot_bytes(layout, config.chunk_size, list(self.codecs.values()))
        n_slots = max(1, config.max_inflight_bytes // slot_bytes)
        self.source = SendSource.register(
            channel, layout, kv, chunk_size=config.chunk_size, slot_bytes=slot_bytes, slots=n_slots
        )
        self.kv_memory = memory_kind(kv[0]) if kv else "host"  # where the KV lives, for benchmarks and logs
        self.credit, self.counters = SendCredit(config.max_inflight_bytes, n_slots), collections.Counter[str]()
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._closed = False
        self.loop = ControlLoop("pdkv-sender", min(config.heartbeat_s, 0.25), self._tick)
        self._dealers = DealerSockets(self.loop, self._on_message, self._on_lost, self.counters)
        self.parts = SenderParts(
            channel=channel,
            config=config,
            secret=secret.encode() if isinstance(secret, str) else secret,
            greeting=self,
            outbox=self._dealers,
            loop=self.loop,
            cond=threading.Condition(),
            counters=self.counters,
            peers={},
            transfers=self._transfers,
            asking={},
        )
        self.cond = self.parts.cond
        self.handshake = SenderHandshake(self.parts)
        self.reserves = Reserves(self.parts, self.handshake, layout.block_size)
        self.pools = SenderPools(self.parts, self.handshake)
        self.heartbeats = Heartbeats(self.parts, self.handshake, self.pools)
        self._ctx = SendContext(
            parts=self.parts, source=self.source, credit=self.credit, listener=self, hold_pool=self.pools.hold
        )
        self.loop.start()

    @property
    def layout(self) -> KVLayout:
        return self.source.layout

    def hello(self) -> Hello:
        """``parts.Greeting``: our Hello, the same construction as the receiver's."""
        return protocol.make_hello(
            agent=self.channel.agent_name,
            channel=self.channel.name,
            channel_metadata=self.channel.metadata(),
            fingerprint=self.fingerprint,
            layout=self.source.layout,
            chunk_size=self.config.chunk_size,
            kv_regions=self.source.kv_regions,
            staging_region=self.source.staging_region,
            codecs=list(self.codecs),
        )

    def open(
        self,
        transfer_id: str,
        address: str,
        num_tokens: int,
        block_table: Sequence[int],
        prompt_key: bytes = b"",
        codec: str | None = None,
        heads: tuple[HeadWindow, HeadWindow] | None = None,
    ) -> OutgoingTransfer:
        """Handshake (once per receiver) and reserve room for the whole transfer there.

        ``prompt_key``: the chained key of the prompt whose KV this is (``pdkv.keys.chunk_keys(...)[-1]``);
        it travels in the Reserve, so the decode side adopts this KV only for that prompt.
        ``codec``: ``none`` or the configured ``transfer.codec`` (the default) for this transfer's chunks;
        any codec but ``none`` makes the receiver grant staging mode (direct writes stay raw).
        ``heads``: (ours, theirs), our window of heads into the receiver's (``SendSource.for_heads``); None: all.
        """
        codec = self.config.codec if codec is None else codec
        source, into = self.source.for_heads(transfer_id, heads, codec, self.config.chunk_size)
        if codec not in self.codecs:
            raise ReservationError(
                f"transfer {transfer_id!r}: codec {codec!r} is not this sender's; it runs {' or '.join(self.codecs)} "
                "(transfer.codec)"
            )
        began = time.perf_counter_ns()  # the request's fixed host cost (hosttime.py) runs from here
        # every chunk's blocks, checked against ours once and before anything is reserved
        plan = sender_plan(source, self.config.chunk_size, transfer_id, num_tokens, block_table)
        request = {"transfer_id": transfer_id, "num_tokens": num_tokens, "prompt_key": prompt_key, "codec": codec}
        pooled = self.pools.claim(address, **request) if into is None else None  # a pool is written in place
        if pooled is not None:  # no round trip: the Reserve rides on the chunk's notice
            peer, reserved, claim = pooled
        else:
            (peer, reserved), claim = self.reserves.reserve(address, **request, heads=into), None
        xfer = OutgoingTransfer(
            self._ctx,
            peer=peer,
            transfer_id=transfer_id,
            num_tokens=num_tokens,
            block_table=block_table,
            plan=plan,
            opened_ns=began,
            reserved=reserved,
            codec=self.codecs[codec],
            claim=claim,
            source=source,
        )
        with self.cond:
            self._transfers[transfer_id] = xfer
        return xfer

    def stats(self) -> dict[str, int]:
        with self.cond:
            out = dict(self.counters, inflight_bytes=self.credit.inflight, open_transfers=len(self._transfers))
        if self.source.stager is not None:  # device KV: chunks gathered on the device and copied into host slots
            out["chunks_staged_to_host"] = self.source.stager.chunks_out
        return out

    def close(self) -> None:
        """Fail what is open, give pools back, stop the loop, close every socket (once; sockets even if it died)."""
        if self._closed:
            return
        self._closed = True
        if self.loop.thread.is_alive():
            with self.cond:
                for xfer in list(self._transfers.values()):
                    xfer.fail(TransferCancelled("sender closing"))
                deadline = time.monotonic() + self.config.drain_timeout_s
                while self._transfers and time.monotonic() < deadline:  # settling tells each receiver
                    self.cond.wait(deadline - time.monotonic())
            self.pools.close()  # we write into none of them any more: the receivers take their blocks back now
        self.loop.stop()
        self._dealers.close_all()

    def transfer_settled(self, xfer: OutgoingTransfer) -> None:
        """``outgoing.SettleListener``: a transfer settled: tell its receiver and forget it. A failed one (on the
        I/O thread) is told at once, its ``Cancel`` freeing what the receiver holds; a complete one's ``Done`` rides
        the next heartbeat (the receiver's memory is its own already), so it may settle on any thread."""
        if (error := xfer.error) is not None:
            self._dealers.send(xfer.peer, Cancel(xfer.transfer_id, str(error), writes_may_land=xfer.writes_may_land))
        with self.cond:
            if xfer.error is None and not xfer.peer.dropped:  # for the next beat (bounded: the oldest go unsaid)
                xfer.peer.done.append(xfer.transfer_id)
            if self._transfers.get(xfer.transfer_id) is xfer:
                del self._transfers[xfer.transfer_id]
            self.counters["transfers_ok" if xfer.error is None else "transfers_settled_failed"] += 1
            self.cond.notify_all()

    # -- control plane (I/O thread) ------------------------------------------------
    def _on_lost(self, peer: ReceiverPeer, why: str) -> None:
        """``DealerSockets``' loss callback: a receiver's control connection dropped or never came up."""
        self.handshake.lost(peer, why)

    def _on_message(self, peer: ReceiverPeer, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self.handshake.on_hello(peer, msg)
        elif isinstance(msg, protocol.Error):
            self.handshake.on_error(peer, msg)
        elif isinstance(msg, Pool):
            self.pools.hold(peer, msg)
        elif isinstance(msg, BeatAck):
            self.heartbeats.renewed(peer, msg)
        elif isinstance(msg, (Reserved, Refused)):
            with self.cond:
                xfer = self._transfers.get(msg.transfer_id)
            if isinstance(msg, Refused) and xfer is not None and xfer.peer is peer and xfer.claim is not None:
                xfer.refused(msg.reason)  # the Reserve its chunk carried
            else:
                self.reserves.on_reply(peer, msg)
        elif isinstance(msg, (Landed, Cancel)):
            if isinstance(msg, Landed) and msg.pool is not None:  # the next pool: held before the caller hears
                self.pools.hold(peer, msg.pool)  # its request is done (and even if nobody waits for it any more)
            with self.cond:
                xfer = self._transfers.get(msg.transfer_id)
            if xfer is None or xfer.peer is not peer:
                return
            if isinstance(msg, Landed):
                xfer.completion.on_landed(msg)
            else:
                xfer.cancel_by_receiver(msg.reason)

    def _tick(self) -> None:
        """Transfers nobody waits for bounded by transfer_timeout_s; then the heartbeats' turn (``Heartbeats.tick``)."""
        now = time.monotonic()
        with self.cond:
            transfers = list(self._transfers.values())
        for xfer in transfers:
            xfer.stalls.check_timeout(now)
        self.heartbeats.tick(now)
