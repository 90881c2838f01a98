"""``IncomingBook``: a decode worker's reservations through their life: book, renew, fail, revoke, free, fence,
reap. Their chunks land through ``arrivals.ChunkArrivals``, under the same lock.

The rules (README.md, "freed" and the late-write rule): blocks and slots are freed exactly once; a failed
reservation's memory waits until its sender said it writes no more (Done/Cancel) or drain_timeout_s passed;
a sender that went silent is fenced off the data plane before its blocks go to anyone else.
"""

from __future__ import annotations

import collections
import logging
import time

from pdkv.errors import PromptMismatchError, TransferCancelled, TransferError
from pdkv.transfer.admission import Admission, ReceiverView
from pdkv.transfer.incoming import IncomingTransfer, ReceivedKV, State
from pdkv.transfer.parts import ReceiverParts
from pdkv.transfer.peers import SenderPeer
from pdkv.transfer.plan import TransferPlan, whole_blocks
from pdkv.transfer.pool import ReceiverPools
from pdkv.transfer.protocol import Cancel, Done, Heartbeat, Reserve

log = logging.getLogger(__name__)


class IncomingBook:
    """Every reservation a receiver holds, its senders' pools, and the transfer ids it already used; all under one
    lock (``parts.lock``)."""

    def __init__(self, parts: ReceiverParts) -> None:
        self.parts, self.channel, self.memory, self.config = parts, parts.channel, parts.memory, parts.config
        self.counters, self.lock = parts.counters, parts.lock
        self.pools = ReceiverPools(parts, self)
        self.res: dict[str, IncomingTransfer] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.free_slots = list(range(parts.config.staging_slots))

    def view(self, identity: bytes, peer: SenderPeer, transfer_id: str, held_tokens: int = 0) -> ReceiverView:
        """What admission reads (caller holds the lock); ``held_tokens``: what we hold of the transfer already."""
        memory = self.memory
        return ReceiverView(
            config=self.config,
            layout=memory.layout,
            num_blocks=memory.num_blocks,
            codecs=memory.codecs,
            free_slots=len(self.free_slots),
            reservations=len(self.res),
            id_used=transfer_id in self.res or transfer_id in self.gone,
            peer_layout=peer.layout,
            peer_blocks=tuple(len(r.blocks) for r in self.res.values() if r.identity == identity),
            kv_in_reach=peer.kv_reached and bool(memory.kv_regions),
            held_tokens=held_tokens,
        )

    def open(
        self,
        *,
        identity: bytes,
        peer: SenderPeer,
        req: Reserve,
        admission: Admission,
        blocks: list[int],
        slots: list[int],
    ) -> IncomingTransfer:
        """Book an admitted reservation (caller holds the lock)."""
        now = time.monotonic()
        r = self.res[req.transfer_id] = IncomingTransfer(
            transfer_id=req.transfer_id,
            identity=identity,
            peer_agent=peer.agent,
            num_tokens=req.num_tokens,
            blocks=blocks,
            slots=slots,
            mode=admission.mode,
            num_chunks=admission.chunks,
            created=now,
            lease_deadline=now + self.config.lease_s,
            token=peer.token,
            plan=TransferPlan.build(
                req.transfer_id,
                num_tokens=req.num_tokens,
                chunk_size=self.memory.chunk_size,
                block_size=self.memory.layout.block_size,
                ours=blocks,
                num_blocks=self.memory.num_blocks,
                held=admission.held,
            ),
            prompt_key=req.prompt_key,
            codec=req.codec,
            heads=req.heads,
            whole_blocks=whole_blocks(self.memory.layout, admission.mode, window=req.heads is not None),
        )
        self.counters["reserved"] += 1
        self.lock.notify_all()
        return r

    def claim(self, r: IncomingTransfer, prompt_key: bytes | None) -> ReceivedKV:
        """Hand a ready reservation's blocks to the caller (caller holds the lock); KV of another prompt is
        freed instead."""
        del self.res[r.transfer_id]
        self.revoke(r)  # from now on its blocks are the caller's: the sender may not touch them
        if prompt_key is not None and r.prompt_key != prompt_key:
            self.free(r)
            self.remember_gone(r.transfer_id, "its KV was computed for another prompt")
            self.counters["prompt_mismatches"] += 1
            raise PromptMismatchError(
                f"KV transfer {r.transfer_id!r} carries the KV of another prompt than the one to decode "
                "(the prompt differs from the one prefilled); computing it instead"
            )
        self.remember_gone(r.transfer_id, "claimed")
        self.counters["claimed"] += 1
        return ReceivedKV(
            transfer_id=r.transfer_id,
            blocks=r.blocks,
            num_tokens=r.num_tokens,
            prompt_key=r.prompt_key,
            held_tokens=r.plan.table_start,
        )

    def cancel(self, transfer_id: str, reason: str) -> None:
        """Abandon a transfer from the decode side (client gone, timeout); frees what it holds."""
        with self.lock:
            r = self.res.get(transfer_id)
            if r is None:
                self.remember_gone(transfer_id, f"cancelled: {reason}")
                return
            if r.state is State.READY:
                del self.res[transfer_id]
                self.free(r)
                self.remember_gone(transfer_id, f"cancelled: {reason}")
            elif r.state is State.RECEIVING:
                self.fail(r, TransferCancelled(f"cancelled: {reason}"), notify_sender=True)
            self.lock.notify_all()

    def beat(self, identity: bytes, msg: Heartbeat) -> None:
        """A heartbeat of an admitted sender: renew the leases it names (and its pool's), and hear the transfers it
        says completed (their ``Done``)."""
        deadline = time.monotonic() + self.config.lease_s
        with self.lock:
            self.pools.renew(identity, deadline)
            for rid in msg.transfer_ids:
                r = self.res.get(rid)
                if r is not None and r.identity == identity:
                    r.lease_deadline = deadline
            for rid in msg.done:
                self.sender_finished(identity, Done(rid, True))

    def sender_finished(self, identity: bytes, msg: Cancel | Done) -> None:
        with self.lock:
            r = self.res.get(msg.transfer_id)
            if r is None and isinstance(msg, Cancel) and msg.writes_may_land and msg.transfer_id not in self.gone:
                # A request we never heard of was written into the sender's pool (its notice never came), and the
                # sender gave up on that write: it may still land there, so the pool's blocks wait out the hold.
                self.pools.lapse(
                    identity, time.monotonic(), f"a write of transfer {msg.transfer_id!r} into it may still land"
                )
            if r is None or r.identity != identity:
                return
            # Its word frees the memory early, unless it gave up on a write that may still land.
            r.sender_done = not (isinstance(msg, Cancel) and msg.writes_may_land)
            if r.state is State.RECEIVING and (isinstance(msg, Cancel) or not msg.ok):
                reason = msg.reason if isinstance(msg, Cancel) else "sender reported failure"
                self.fail(r, TransferCancelled(f"sender cancelled: {reason}"), notify_sender=False)
            self.lock.notify_all()

    def receiving(self, peer: str, transfer_id: str) -> IncomingTransfer | None:
        """The reservation ``transfer_id`` if ``peer`` sends it and it still receives chunks (caller holds the
        lock), else None."""
        r = self.res.get(transfer_id)
        return r if r is not None and r.peer_agent == peer and r.state is State.RECEIVING else None

    def fail(self, r: IncomingTransfer, exc: TransferError, notify_sender: bool) -> None:
        """Mark failed (caller holds the lock); memory is freed once the sender can no longer write into it."""
        r.state, r.error = State.FAILED, str(exc)
        # Where fencing cannot stop the sender's writes, only its own word (or a long quarantine) frees the memory.
        r.free_deadline = time.monotonic() + self.config.late_write_hold(self.channel.enforces_grants)
        self.counters["transfers_failed"] += 1
        log.warning("transfer %s: %s", r.transfer_id, exc)
        if notify_sender:
            identity, msg = r.identity, Cancel(r.transfer_id, str(exc))
            self.parts.loop.call_soon(
                lambda: self.parts.outbox.reply(identity, msg)
            )  # _fail also runs on API threads (cancel)

    def revoke(self, r: IncomingTransfer) -> None:
        """Take back what ``r`` granted, once (caller holds the lock); a frame still landing there is waited
        out, or its peer fenced."""
        if r.revoked:
            return
        r.revoked = True
        if not r.revoke_grant(self.channel, self.memory, self.config.drain_timeout_s):
            self.counters["fences"] += 1
            log.error(
                "transfer %s: a write was still landing in its memory after drain_timeout_s; cutting its sender's data "
                "connections",
                r.transfer_id,
            )
            self.fence(r.identity)

    def free(self, r: IncomingTransfer) -> None:
        """Give ``r``'s blocks and slots back, exactly once (caller holds the lock)."""
        self.revoke(r)
        self.parts.allocator.free(r.blocks)
        self.free_slots.extend(r.slots)
        r.blocks, r.slots = [], []

    def fence(self, identity: bytes) -> None:
        """Cut a sender that went silent off the data plane before its memory is reused (caller holds the lock).

        The channel drops its data connections, so nothing it queued before can
        land later (a frozen process's writes die with its sockets); its other
        reservations fail (their data path is gone), and it must send Hello
        again: its next Reserve is refused with ``hello-required``.
        """
        peer = self.parts.peers.pop(identity, None)
        if peer is None:
            return
        self.channel.fence(peer.agent, peer.token)
        self.pools.give_back(identity)
        for other in self.res.values():
            if other.identity == identity and other.state is State.RECEIVING:
                self.fail(
                    other,
                    TransferError("the sender was cut off the data plane after it went silent"),
                    notify_sender=True,
                )

    def remember_gone(self, transfer_id: str, why: str) -> None:
        self.gone[transfer_id] = why
        while len(self.gone) > self.config.max_reservations:
            self.gone.popitem(last=False)

    def close(self) -> None:
        """Free every reservation still held, and the pools (``KVReceiver.close``)."""
        with self.lock:
            for r in list(self.res.values()):
                self.free(r)
            self.res.clear()
            self.pools.close()
            self.lock.notify_all()

    def reap(self) -> None:
        """Scan every reservation (no early exit) for expired leases and timeouts."""
        now = time.monotonic()
        cfg = self.config
        with self.lock:
            self.pools.reap(now)
            for r in list(self.res.values()):
                if (overdue := r.overdue(now, cfg)) is not None:  # failed, not freed: its memory waits (``fail``)
                    counter, err = overdue
                    self.counters[counter] += 1
                    self.fail(r, err, notify_sender=True)
                if r.state is State.FAILED and (r.sender_done or now > r.free_deadline):
                    if not r.sender_done:  # it never said it stopped writing: it may be frozen with writes queued
                        self.counters["fences"] += 1
                        self.fence(r.identity)
                    del self.res[r.transfer_id]
                    self.free(r)
                    self.remember_gone(r.transfer_id, f"failed: {r.error}")
                elif r.state is State.READY and now > r.ready_at + cfg.claim_timeout_s:
                    del self.res[r.transfer_id]
                    self.free(r)
                    self.counters["unclaimed"] += 1
                    self.remember_gone(r.transfer_id, "never claimed by the decode side")
            self.lock.notify_all()
