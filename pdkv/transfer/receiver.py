"""``KVReceiver``: the decode side's one object per worker (README.md here walks one transfer through it).

It owns the paged KV buffer as the channel sees it (guarded regions: a peer writes only what a reservation
granted it), binds the control plane's ROUTER, and answers Reserves; the handshake, the admission rules,
each reservation's landing and its life until freed are their own modules.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

import torch

from pdkv import native
from pdkv.auth import verify_bound
from pdkv.blocks import BlockAllocator
from pdkv.channels.base import Channel
from pdkv.checksum import flat_bytes
from pdkv.codec import available_codecs, make_codec
from pdkv.codec import slot_bytes as codec_slot_bytes
from pdkv.config import TransferConfig
from pdkv.errors import NotAnnouncedError, OutOfBlocksError, TransferError, TransferTimeout
from pdkv.layout import KVLayout
from pdkv.memory import adopt_kv, in_reach, memory_kind
from pdkv.netaddr import zmq_address
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.admission import Grant, ReceiverView, admit, admit_pooled, writes_in_place
from pdkv.transfer.control import ControlLoop, RouterSocket
from pdkv.transfer.handshake import ReceiverHandshake, SenderPeer
from pdkv.transfer.incoming import IncomingTransfer, ReceivedKV, ReceiveTarget, State, landed_checksum
from pdkv.transfer.lifecycle import IncomingBook
from pdkv.transfer.pool import PeerPool
from pdkv.transfer.protocol import (
    HELLO_REQUIRED,
    Auth,
    BeatAck,
    Cancel,
    ChunkNotice,
    Done,
    Heartbeat,
    Hello,
    Refused,
    Reserve,
    Reserved,
    ReturnPool,
    reserve_fields,
)

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
        self.channel = channel
        self.layout = layout
        kv = adopt_kv(list(kv_tensors))
        num_blocks = layout.validate_buffer(kv)
        if allocator.num_blocks != num_blocks:
            raise TransferError(f"allocator manages {allocator.num_blocks} blocks but the KV buffer has {num_blocks}")
        self.allocator = allocator
        self.fingerprint = fingerprint
        self.config = config or TransferConfig()
        self.secret = secret.encode() if isinstance(secret, str) else secret
        codecs = {name: make_codec(name, layout) for name in available_codecs(layout)}
        slot_bytes = codec_slot_bytes(
            layout, self.config.chunk_size, list(codecs.values())
        )  # any offered codec's frame fits
        staging = pinned_empty(self.config.staging_slots * slot_bytes)
        reached = all(in_reach(t, channel.memory) for t in kv)
        self.kv_regions = [channel.register(t) for t in kv] if reached else []
        self.staging_region = channel.register(staging)
        for region in (*self.kv_regions, self.staging_region):
            channel.guard(region)  # peers write only into what a reservation of theirs granted them
        if not channel.enforces_grants:
            log.warning(
                "%s channel: one-sided writes never pass through this receiver, so it cannot check them against "
                "its reservations; with peers you do not trust, use the tcp channel or a shared secret",
                channel.name,
            )
        self.target = ReceiveTarget(
            layout,
            kv,
            [flat_bytes(t) for t in kv],
            num_blocks,
            staging,
            slot_bytes,
            self.config.chunk_size,
            self.kv_regions,
            self.staging_region,
            codecs,
            DeviceStager(layout, kv, self.config.chunk_size) if kv and memory_kind(kv[0]) != "host" else None,
            landed_checksum(channel, self.kv_regions, layout.block_bytes),
        )
        native.available()  # load the kernel library now, not inside the first transfer
        self.counters: collections.Counter[str] = collections.Counter()
        lock = threading.Condition()
        self.loop = ControlLoop("pdkv-receiver", min(_REAP_TICK_S, self.config.lease_s / 4), lambda: self.book.reap())
        self.handshake = ReceiverHandshake(
            channel,
            self.config,
            self.secret,
            lock,
            self.counters,
            self.hello,
            self._reply,
            lambda identity, token: self._send_pool(identity, token, []),
        )
        self.book = IncomingBook(
            channel,
            self.target,
            allocator,
            self.config,
            self.counters,
            self.loop,
            lock,
            self.handshake.peers,
            self._reply,
            self._open_pooled,
        )
        self._router = RouterSocket(self.loop, host, port, self._on_message, self.counters, self.handshake)
        self.address = self._router.address
        if advertise_host:  # what senders dial: not a wildcard bind address
            self.address = zmq_address(advertise_host, self.address.rsplit(":", 1)[1])
        # pooled requests taken this pass: identity -> (token, the rest of its pool), to grant the next pool
        self._refills: dict[bytes, tuple[bytes, list[int]]] = {}
        self.loop.watch(channel.notification_fd(), self._on_notifications)
        self.loop.start()

    def hello(self) -> Hello:
        return protocol.make_hello(
            self.channel.agent_name,
            self.channel.name,
            self.channel.metadata(),
            self.fingerprint,
            self.layout,
            self.config.chunk_size,
            self.kv_regions,
            self.staging_region,
            list(self.target.codecs),
        )

    def wait(self, transfer_id: str, timeout: float | None = None, prompt_key: bytes | None = None) -> ReceivedKV:
        """Block until the transfer's KV has landed and verified, then hand it over.

        ``prompt_key``: the key of the prompt the caller will decode. When given, the KV is handed over only
        if the sender computed it for that prompt (the key in its Reserve); otherwise its blocks are freed and
        ``PromptMismatchError`` raised: a mismatch is a recompute, never a decode.

        Raises ``TransferError`` if it failed (its memory is already on its way back to the pool) and
        ``TransferTimeout`` after ``timeout`` seconds (default ``transfer_timeout_s``), or ``NotAnnouncedError``
        after ``announce_timeout_s`` if no sender ever reserved it, cancelling it so nothing leaks: the caller
        falls back to computing the prefix itself.
        """
        timeout = self.config.transfer_timeout_s if timeout is None else timeout
        now = time.monotonic()
        deadline, unannounced = now + timeout, now + self.config.announce_timeout_s
        why, error = f"KV of transfer {transfer_id!r} did not arrive within {timeout:.3g}s", TransferTimeout
        book = self.book
        with book.lock:
            while True:
                got = self._claim_settled(transfer_id, prompt_key)
                if got is not None:
                    return got
                r = book.res.get(transfer_id)
                now = time.monotonic()
                if r is None and now >= unannounced:
                    self.counters["unannounced"] += 1
                    why = (
                        f"no sender announced transfer {transfer_id!r} within "
                        f"announce_timeout_s={self.config.announce_timeout_s:.3g}s"
                    )
                    error = NotAnnouncedError
                    break
                if now >= deadline:
                    break
                book.lock.wait(min(deadline, unannounced if r is None else deadline) - now)
        self.cancel(transfer_id, f"decode side stopped waiting: {why}")
        raise error(why)

    def try_claim(self, transfer_id: str, prompt_key: bytes | None = None) -> ReceivedKV | None:
        """``wait`` without the wait: the KV if it has landed and verified, None if not yet (or if the book is
        busy this instant); raises as ``wait`` does for a failed or finished transfer.

        Never blocks, so the decode worker's event loop can claim KV that is already there without the hop
        to a waiting thread and back; None sends it to ``wait`` on a thread.
        """
        if not self.book.lock.acquire(blocking=False):
            return None
        try:
            return self._claim_settled(transfer_id, prompt_key)
        finally:
            self.book.lock.release()

    def _claim_settled(self, transfer_id: str, prompt_key: bytes | None) -> ReceivedKV | None:
        """The KV of a landed transfer, claimed; None while it is still coming (the caller holds the book's lock)."""
        book = self.book
        r = book.res.get(transfer_id)
        if r is not None and r.state is State.READY:
            return book.claim(r, prompt_key)
        if r is not None and r.state is State.FAILED:
            raise TransferError(f"KV transfer {transfer_id!r} failed: {r.error}")
        if r is None and transfer_id in book.gone:
            raise TransferError(f"KV transfer {transfer_id!r} is over: {book.gone[transfer_id]}")
        return None

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
        if self.target.stager is not None:  # device KV: staged chunks copied to the device and scattered there
            out["chunks_staged_to_device"] = self.target.stager.chunks_in
        return out

    def close(self) -> None:
        """Stop the loop and free every reservation still held."""
        if not self.loop.thread.is_alive():
            return
        self.loop.stop()
        with self.book.lock:
            for r in list(self.book.res.values()):
                self.book.free(r)
            self.book.res.clear()
            self.book.pools.close()
            self.book.lock.notify_all()
        self._router.close()

    # -- control messages (I/O thread) ------------------------------------------
    def _reply(self, identity: bytes, msg: protocol.Message) -> None:
        """Send from the I/O thread; other threads go through ``loop.call_soon``."""
        self._router.send(identity, msg)

    def _on_message(self, identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self.handshake.on_hello(identity, msg)
        elif isinstance(msg, Auth):
            self.handshake.on_auth(identity, msg)
        elif isinstance(msg, Reserve):
            self._reply(identity, self._on_reserve(identity, msg))
        elif isinstance(msg, Heartbeat):
            if identity in self.handshake.peers:  # answered: the sender renews on our word, not on its own
                self.book.renew(identity, msg.transfer_ids)
                self._reply(identity, BeatAck(msg.seq))
        elif isinstance(msg, (Cancel, Done)):
            self.book.sender_finished(identity, msg)
        elif isinstance(msg, ReturnPool):
            with self.book.lock:
                self.book.pools.give_back(identity, msg.generation)
        else:
            self._reply(identity, protocol.Error(f"unexpected {type(msg).__name__} at the receiver"))

    def _on_reserve(self, identity: bytes, req: Reserve) -> protocol.Message:
        """Authenticated peers only; then the admission rules (``admission.admit``), then the blocks."""
        peer = self._reserving_peer(identity, req)
        if isinstance(peer, Refused):
            return peer
        book = self.book
        with book.lock:
            grant = admit(req, self._view(identity, peer, req.transfer_id))
            if isinstance(grant, Refused):
                self.counters["refused"] += 1
                return grant
            try:
                blocks = self.allocator.allocate_for(req.transfer_id, grant.blocks)
            except OutOfBlocksError as exc:
                self.counters["refused"] += 1
                return Refused(
                    req.transfer_id,
                    f"cannot hold {req.num_tokens} tokens: {exc}",
                    retryable=grant.blocks <= self.target.num_blocks,
                )
            slots = [book.free_slots.pop() for _ in range(grant.slots)]
            r = self._open(identity, peer, req, grant, blocks, slots)
            self.channel.grant(peer.token, "write", book.granted(r))
        return Reserved(
            req.transfer_id, grant.mode, blocks, [s * self.target.slot_bytes for s in slots], self.config.lease_s
        )

    def _open_pooled(self, agent: str, notice: ChunkNotice) -> bool:
        """A chunk written into a sender's pool, with its Reserve (I/O thread, holding the lock): the rules of
        a Reserve (``admission.admit_pooled``), then the pool's blocks become the reservation's. Refused, its
        bytes are discarded (counted) and the sender's pool is offered again."""
        assert notice.reserve is not None
        req, book = notice.reserve, self.book
        pool = book.pools.owner(notice.pool)
        sender = self.handshake.peers.get(pool.identity) if pool is not None else None
        grant: Grant | Refused
        peer: SenderPeer | Refused | None = None
        if pool is None or sender is None or sender.agent != agent:  # not this sender's pool: leave it alone
            pool, grant = None, Refused(req.transfer_id, f"pooled request names no pool of yours ({notice.pool})")
        else:
            peer = self._reserving_peer(pool.identity, req)  # with a secret: the Reserve's proof
            grant = (
                peer
                if isinstance(peer, Refused)
                else admit_pooled(req, self._view(pool.identity, peer, req.transfer_id), len(pool.blocks))
            )
        self.counters["pooled_requests"] += 1
        if isinstance(grant, Refused):
            self.counters["pooled_refused"] += 1
            self.counters["pooled_bytes_discarded"] += self.layout.chunk_bytes(
                min(req.num_tokens, self.config.chunk_size)
            )
            log.warning("transfer %s: %s", req.transfer_id, grant.reason)
            owner = (
                pool.identity
                if pool is not None
                else next((i for i, p in self.handshake.peers.items() if p.agent == agent), None)
            )
            if owner is not None:
                self._reply(owner, grant)
            if pool is not None:  # the same blocks again, under a new generation
                self._refill(pool, 0)
            return False
        assert pool is not None and isinstance(peer, SenderPeer)
        blocks = self._refill(pool, grant.blocks)
        self._open(pool.identity, peer, req, grant, blocks, [])
        return True

    def _refill(self, pool: PeerPool, n: int) -> list[int]:
        """Take the pool's first ``n`` blocks for a request; its sender's next pool (the rest, topped up) is
        granted in the request's ``Landed`` (``_on_notifications``), or on its own if no Landed goes out."""
        blocks, rest = self.book.pools.take(pool, n)
        self._refills[pool.identity] = (pool.token, rest)  # one per sender: it held one pool, now taken
        return blocks

    def _on_notifications(self) -> None:
        """Land what arrived (I/O thread); then grant the pools of pooled requests that sent no Landed (refused,
        or failed their checksum) in a message of their own."""
        self.book.on_notifications(self._next_pool)
        while self._refills:
            identity, (token, rest) = self._refills.popitem()
            self._send_pool(identity, token, rest)

    def _next_pool(self, identity: bytes) -> protocol.Pool | None:
        """The next pool of ``identity``, for the Landed of the request that took its last one (I/O thread)."""
        refill = self._refills.pop(identity, None)
        return None if refill is None else self._offer_pool(identity, *refill)

    def _reserving_peer(self, identity: bytes, req: Reserve) -> SenderPeer | Refused:
        """The peer a Reserve comes from, authenticated (its proof checked with a secret), or why not."""
        peer = self.handshake.peers.get(identity)
        if peer is None and identity in self.handshake.unproven:
            self.counters["auth_failures"] += 1
            return Refused(
                req.transfer_id,
                "not authenticated: this receiver requires the shared secret (set the same `secret` on both sides)",
            )
        if peer is None:
            return Refused(req.transfer_id, f"{HELLO_REQUIRED}: this receiver has no Hello from you (did it restart?)")
        if self.secret and not verify_bound(self.secret, "reserve", peer.session, req.proof, *reserve_fields(req)):
            self.counters["auth_failures"] += 1
            return Refused(
                req.transfer_id,
                "the Reserve's proof does not check out: it was not made by the peer that proved the shared secret",
            )
        return peer

    def _view(self, identity: bytes, peer: SenderPeer, transfer_id: str) -> ReceiverView:
        """What admission reads (caller holds the lock)."""
        book = self.book
        return ReceiverView(
            self.config,
            self.layout,
            self.target.num_blocks,
            self.target.codecs,
            len(book.free_slots),
            len(book.res),
            transfer_id in book.res or transfer_id in book.gone,
            peer.layout,
            tuple(len(r.blocks) for r in book.res.values() if r.identity == identity),
            peer.kv_reached and bool(self.kv_regions),
        )

    def _open(
        self, identity: bytes, peer: SenderPeer, req: Reserve, grant: Grant, blocks: list[int], slots: list[int]
    ) -> IncomingTransfer:
        """Book an admitted reservation (caller holds the lock)."""
        now = time.monotonic()
        r = self.book.res[req.transfer_id] = IncomingTransfer(
            req.transfer_id,
            identity,
            peer.agent,
            req.num_tokens,
            blocks,
            slots,
            grant.mode,
            grant.chunks,
            now,
            now + self.config.lease_s,
            peer.token,
            req.prompt_key,
            req.codec,
        )
        self.counters["reserved"] += 1
        self.book.lock.notify_all()
        return r

    # -- pools (README.md here, "Pools") ------------------------------------------
    def _offer_pool(self, identity: bytes, token: bytes, keep: list[int]) -> protocol.Pool | None:
        """Grant ``identity`` a pool, if pools are on and its chunks can land in place (I/O thread): the
        message that tells it, or None. ``keep``: blocks of its previous pool, still granted to ``token``."""
        book = self.book
        with book.lock:
            peer = self.handshake.peers.get(identity)
            if peer is None or peer.token != token or not writes_in_place(self._view(identity, peer, "")):
                book.pools.discard(identity, token, keep)  # cut off (or fenced) since: nothing to offer
                return None
            return book.pools.offer(identity, token, keep)

    def _send_pool(self, identity: bytes, token: bytes, keep: list[int]) -> None:
        """``_offer_pool``, told in a ``Pool`` message of its own (after a Hello, or with no Landed to carry it)."""
        msg = self._offer_pool(identity, token, keep)
        if msg is not None:
            self._reply(identity, msg)
