"""``KVSender``: the prefill side's one object per worker (README.md here walks one transfer through it).

It registers the paged KV buffer and a bounded staging area with the channel, owns the send credit
every transfer draws from, and runs the control plane's I/O thread; the handshake, the reservations
and each transfer's state machine are their own modules.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from pdkv import native
from pdkv.channels.base import Channel
from pdkv.checksum import flat_bytes
from pdkv.codec import Codec, make_codec
from pdkv.codec import slot_bytes as codec_slot_bytes
from pdkv.config import TransferConfig
from pdkv.errors import ReservationError, TransferCancelled, TransferError
from pdkv.layout import KVLayout
from pdkv.memory import adopt_kv, in_reach, memory_kind
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.control import ControlLoop, DealerSockets
from pdkv.transfer.handshake import ReceiverPeer, SenderHandshake
from pdkv.transfer.heartbeat import new_beat
from pdkv.transfer.outgoing import OutgoingTransfer, SendContext, SendCredit, SendSource
from pdkv.transfer.protocol import BeatAck, Cancel, Done, Hello, Landed, Pool, Refused, Reserved, ReturnPool
from pdkv.transfer.reservation import Reservations, lease_margin

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
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.fingerprint = fingerprint
        self.config = config or TransferConfig()
        kv = adopt_kv(list(kv_tensors))
        num_blocks = layout.validate_buffer(kv)
        native.available()  # load the kernel library now, not inside the first transfer
        # ``none`` and the configured codec: a transfer uses one of the two (``open(codec=...)``)
        self.codecs: dict[str, Codec] = {
            name: make_codec(name, layout) for name in dict.fromkeys(("none", self.config.codec))
        }
        slot_bytes = codec_slot_bytes(layout, self.config.chunk_size, list(self.codecs.values()))
        n_slots = max(1, self.config.max_inflight_bytes // slot_bytes)
        staging = pinned_empty(n_slots * slot_bytes)
        reached = all(in_reach(t, channel.memory) for t in kv)
        self.source = SendSource(
            layout,
            kv,
            [flat_bytes(t) for t in kv],
            [channel.register(t) for t in kv] if reached else [],
            num_blocks,
            staging,
            channel.register(staging),
            slot_bytes,
            DeviceStager(layout, kv, self.config.chunk_size) if kv and memory_kind(kv[0]) != "host" else None,
        )
        self.kv_memory = memory_kind(kv[0]) if kv else "host"  # where the KV lives, for benchmarks and logs
        self.credit = SendCredit(self.config.max_inflight_bytes, n_slots)
        self.counters: collections.Counter[str] = collections.Counter()
        self.cond = (
            threading.Condition()
        )  # guards the sender's state and every transfer's: one lock, no ordering to get wrong
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._last_beat = time.monotonic()
        self.loop = ControlLoop("pdkv-sender", min(self.config.heartbeat_s, 0.25), self._tick)
        self._dealers = DealerSockets(self.loop, self._on_message, self._on_lost, self.counters)
        self.handshake = SenderHandshake(
            channel,
            self.config,
            self.secret,
            self.cond,
            self.counters,
            self.hello,
            self._send,
            lambda: list(self._transfers.values()),
            self._on_drop,
            self._dealers.close_peer,
        )
        self.reservations = Reservations(
            self.handshake, layout.block_size, self.config, self.secret, self.cond, self.counters, self._send
        )
        self._ctx = SendContext(
            channel, self.config, self.source, self.credit, self.cond, self.counters, self.loop, self._settled
        )
        self.loop.start()

    @property
    def layout(self) -> KVLayout:
        return self.source.layout

    def hello(self) -> Hello:
        src = self.source
        return protocol.make_hello(
            self.channel.agent_name,
            self.channel.name,
            self.channel.metadata(),
            self.fingerprint,
            src.layout,
            self.config.chunk_size,
            src.kv_regions,
            src.staging_region,
            list(self.codecs),
        )

    def open(
        self,
        transfer_id: str,
        address: str,
        num_tokens: int,
        block_table: Sequence[int],
        prompt_key: bytes = b"",
        codec: str | None = None,
    ) -> OutgoingTransfer:
        """Handshake (once per receiver) and reserve room for the whole transfer there.

        ``prompt_key``: the chained key of the prompt whose KV this is (``pdkv.keys.chunk_keys(...)[-1]``);
        it travels in the Reserve, so the decode side adopts this KV only for that prompt.
        ``codec``: ``none`` or the configured ``transfer.codec`` (the default) for this transfer's chunks;
        any codec but ``none`` makes the receiver grant staging mode (direct writes stay raw).
        """
        codec = self.config.codec if codec is None else codec
        if codec not in self.codecs:
            raise ReservationError(
                f"transfer {transfer_id!r}: codec {codec!r} is not this sender's; it runs {' or '.join(self.codecs)} "
                "(transfer.codec)"
            )
        if num_tokens <= 0:
            raise ReservationError(f"transfer {transfer_id!r}: nothing to transfer (num_tokens={num_tokens})")
        if len(block_table) < self.layout.blocks_for(num_tokens):
            raise ReservationError(
                f"transfer {transfer_id!r}: block table has {len(block_table)} blocks, {num_tokens} tokens need "
                f"{self.layout.blocks_for(num_tokens)}"
            )
        pooled = self.reservations.from_pool(
            address, transfer_id, num_tokens, prompt_key, codec, self._transfers.__contains__
        )
        if pooled is not None:  # no round trip: the Reserve rides on the chunk's notice
            peer, reply, claim = pooled
        else:
            peer, reply = self.reservations.reserve(
                address, transfer_id, num_tokens, prompt_key, codec, self._transfers.__contains__
            )
            claim = None
        xfer = OutgoingTransfer(self._ctx, peer, transfer_id, num_tokens, block_table, reply, self.codecs[codec], claim)
        with self.cond:
            self._transfers[transfer_id] = xfer
        return xfer

    def stats(self) -> dict[str, int]:
        with self.cond:
            out = dict(self.counters)
            out["inflight_bytes"] = self.credit.inflight
            out["open_transfers"] = len(self._transfers)
        if self.source.stager is not None:  # device KV: chunks gathered on the device and copied into host slots
            out["chunks_staged_to_host"] = self.source.stager.chunks_out
        return out

    def close(self) -> None:
        if not self.loop.thread.is_alive():
            return
        with self.cond:
            for xfer in list(self._transfers.values()):
                xfer.fail(TransferCancelled("sender closing"))
            deadline = time.monotonic() + self.config.drain_timeout_s
            while self._transfers and time.monotonic() < deadline:  # settling tells each receiver
                self.cond.wait(deadline - time.monotonic())
            pools = [(peer, peer.pool) for peer in self.handshake.peers.values() if peer.pool is not None]
            for peer, _ in pools:
                peer.pool = None
        for peer, pool in pools:  # we write into none of them any more: the receivers take their blocks back now
            self._send(peer, ReturnPool(pool.generation))
        self.loop.stop()
        self._dealers.close_all()

    def _settled(self, xfer: OutgoingTransfer) -> None:
        """A transfer settled (I/O thread): tell its receiver and forget it."""
        msg: protocol.Message = (
            Done(xfer.transfer_id, True)
            if xfer.error is None
            else Cancel(xfer.transfer_id, str(xfer.error), writes_may_land=xfer.writes_may_land)
        )
        self._send(xfer.peer, msg)
        with self.cond:
            if self._transfers.get(xfer.transfer_id) is xfer:
                del self._transfers[xfer.transfer_id]
            self.counters["transfers_ok" if xfer.error is None else "transfers_settled_failed"] += 1
            self.cond.notify_all()

    def _on_drop(self, peer: ReceiverPeer, err: TransferError) -> list[Future[Any]]:
        """A receiver is forgotten (caller holds the lock): its transfers fail; its unanswered Reserves are
        returned to fail."""
        for xfer in self._transfers.values():
            if xfer.peer is peer:
                xfer.fail(err)
        return list(self.reservations.waiting_on(peer))

    # -- control plane (I/O thread) ------------------------------------------------
    def _send(self, peer: ReceiverPeer, msg: protocol.Message) -> None:
        self._dealers.send(peer, peer.address, peer.identity, msg)

    def _on_lost(self, peer: ReceiverPeer, why: str) -> None:
        """A receiver's control connection dropped or never came up: nothing open with it can finish, so fail it now.

        ZeroMQ would reconnect on its own; we drop the peer instead so that a receiver that comes back is met
        with a fresh Hello.
        """
        if not peer.dropped:
            self.counters["peers_lost"] += 1
            log.warning("%s: failing what is open with it; the next transfer to it handshakes again", why)
            self.handshake.drop(peer, why)

    def _on_message(self, peer: ReceiverPeer, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self.handshake.on_hello(peer, msg)
        elif isinstance(msg, protocol.Error):
            self.handshake.on_error(peer, msg)
        elif isinstance(msg, Pool):
            self._take_pool(peer, msg)
        elif isinstance(msg, BeatAck):
            self._renewed(peer, msg)
        elif isinstance(msg, (Reserved, Refused)):
            with self.cond:
                xfer = self._transfers.get(msg.transfer_id)
            if isinstance(msg, Refused) and xfer is not None and xfer.peer is peer and xfer.claim is not None:
                xfer.refused(msg.reason)  # the Reserve its chunk carried
            else:
                self.reservations.on_reply(peer, msg)
        elif isinstance(msg, (Landed, Cancel)):
            if isinstance(msg, Landed) and msg.pool is not None:  # the next pool: held before the caller hears
                self._take_pool(peer, msg.pool)  # its request is done (and even if nobody waits for it any more)
            with self.cond:
                xfer = self._transfers.get(msg.transfer_id)
            if xfer is None or xfer.peer is not peer:
                return
            if isinstance(msg, Landed):
                xfer.on_landed(msg)
            else:
                xfer.cancel_by_receiver(msg.reason)

    def _take_pool(self, peer: ReceiverPeer, pool: Pool) -> None:
        with self.cond:
            if not peer.dropped:
                peer.pool, peer.pool_renewed = pool, time.monotonic()

    def _tick(self) -> None:
        """Heartbeats every heartbeat_s, transfers nobody waits for bounded by transfer_timeout_s, and receivers
        that stopped answering heartbeats given up."""
        now = time.monotonic()
        with self.cond:
            transfers = list(self._transfers.values())
        for xfer in transfers:
            xfer.check_timeout(now)
        self._give_up_deaf(now)
        if now - self._last_beat >= self.config.heartbeat_s:
            self._last_beat = now
            self._heartbeat(transfers, now)

    def _heartbeat(self, transfers: list[OutgoingTransfer], now: float) -> None:
        """Send each live peer a heartbeat naming what it renews, over its own socket (by peer, not address: after
        a restart the address has a new one). Nothing counts as renewed until the beat is answered
        (``_renewed``)."""
        by_peer: dict[bytes, tuple[ReceiverPeer, list[str]]] = {}
        stale: list[tuple[ReceiverPeer, Pool]] = []
        beats = []
        with self.cond:
            for xfer in transfers:
                if not xfer.peer.dropped and not xfer.settled:
                    by_peer.setdefault(xfer.peer.identity, (xfer.peer, []))[1].append(xfer.transfer_id)
            for peer in self.handshake.peers.values():  # a pool is held on the same lease
                if peer.pool is None:
                    continue
                if now - peer.pool_renewed > lease_margin(peer.pool.lease_s, self.config.heartbeat_s):
                    stale.append((peer, peer.pool))  # we were stalled: the receiver may have taken it back
                    peer.pool = None  # never write into it
                    continue
                by_peer.setdefault(peer.identity, (peer, []))
            for peer, ids in by_peer.values():
                beats.append((peer, new_beat(peer.beats, now, ids, peer.pool.generation if peer.pool else 0)))
        for peer, beat in beats:
            self._send(peer, beat)
        for peer, pool in stale:  # and say so: its blocks need not wait out the late-write quarantine
            self._send(peer, ReturnPool(pool.generation))

    def _renewed(self, peer: ReceiverPeer, ack: BeatAck) -> None:
        """The receiver answered a heartbeat: what it named is renewed from when it was sent (I/O thread)."""
        with self.cond:
            beat = peer.beats.answered(ack)
            if beat is None:
                return
            for transfer_id in beat.transfer_ids:
                xfer = self._transfers.get(transfer_id)
                if xfer is not None and xfer.peer is peer:
                    xfer.renewed = max(xfer.renewed, beat.sent)
            if peer.pool is not None and peer.pool.generation == beat.pool:
                peer.pool_renewed = max(peer.pool_renewed, beat.sent)

    def _give_up_deaf(self, now: float) -> None:
        """Give up receivers that left a heartbeat unanswered past the lease's margin (I/O thread).

        Its answers do not reach us (a one-way partition, or it is stalled): whatever we hold there may lapse
        without our hearing, so our transfers to it fail and our pool there is dropped. It is told over the
        way that may still work, before its socket closes: a Cancel per transfer (our writes may still land, so
        it quarantines what it cannot fence) and the pool back, so it sees the partition when we do.
        """
        margin = lease_margin(self.config.lease_s, self.config.heartbeat_s)
        with self.cond:
            deaf = [
                (
                    peer,
                    waited,
                    [x.transfer_id for x in self._transfers.values() if x.peer is peer and not x.settled],
                    peer.pool,
                )
                for peer in self.handshake.peers.values()
                if (waited := peer.beats.overdue(now, margin))
            ]
        for peer, waited, transfer_ids, pool in deaf:
            why = (
                f"receiver {peer.address} answered no heartbeat for {waited:.3g}s (lease_s={self.config.lease_s:.3g}s):"
                " its messages do not reach us (a one-way partition?) or it is stalled"
            )
            self.counters["peers_deaf"] += 1
            for transfer_id in transfer_ids:
                self._send(peer, Cancel(transfer_id, why, writes_may_land=True))
            if pool is not None:
                self._send(peer, ReturnPool(pool.generation))
            self._on_lost(peer, why)
