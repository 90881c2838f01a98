"""``Heartbeats``: the sender's heartbeats, numbered and acknowledged: a lease counts as renewed when the
receiver says it was.

A heartbeat that went out is not one that arrived: in a one-way partition (sender -> receiver open, the way back
cut) every beat arrives and every answer is lost, and a sender that renewed on what it sent would keep writing
into reservations it cannot hear about. So each beat is remembered until its ``BeatAck`` comes back (each
receiver's ``peers.Beats``), and what it named is renewed from the moment it was sent (the receiver renewed on
arrival, later). A beat left unanswered past the lease's margin means the receiver cannot reach us (or is
stalled): the sender gives it up, telling it so over the way that still works, so both sides see the partition
within ``lease_s``.
"""

from __future__ import annotations

import time

from pdkv.transfer.handshake import SenderHandshake
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer, lease_margin, new_beat
from pdkv.transfer.pool import SenderPools
from pdkv.transfer.protocol import BeatAck, Cancel, Pool


class Heartbeats:
    """What the sender's tick does for leases: beat, renew on the receiver's answer, give up a receiver that is deaf.

    Its pools are on the same lease: the pools room (``pool.SenderPools``) renews them and drops a stale one.
    """

    def __init__(self, parts: SenderParts, handshake: SenderHandshake, pools: SenderPools) -> None:
        self.parts, self.handshake, self.pools = parts, handshake, pools
        self._last_beat = self._last_tick = time.monotonic()

    def tick(self, now: float) -> None:
        """Each tick of the sender's loop: give up receivers that stopped answering, and beat every heartbeat_s.

        Not on the first tick after we ourselves were stalled (a long GC, SIGSTOP, a starved core): the answers
        that came meanwhile wait unread in the sockets, and the loop reads them before its next tick."""
        stalled = now - self._last_tick > 2 * self.parts.config.heartbeat_s
        self._last_tick = now
        if not stalled:
            self.give_up_deaf(now)
        if now - self._last_beat >= self.parts.config.heartbeat_s:
            self._last_beat = now
            self.beat(now)

    def beat(self, now: float) -> None:
        """Send each live peer a heartbeat naming what it renews, and the transfers to it that completed since the
        last one (their ``Done``), over its own socket (by peer, not address: after a restart the address has a new
        one). Nothing counts as renewed until the beat is answered (``renewed``)."""
        parts = self.parts
        by_peer: dict[bytes, tuple[ReceiverPeer, list[str]]] = {}
        with parts.cond:
            for xfer in parts.transfers.values():
                if not xfer.peer.dropped and not xfer.settled:
                    by_peer.setdefault(xfer.peer.identity, (xfer.peer, []))[1].append(xfer.transfer_id)
            stale = self.pools.lapse_stale(now)  # we were stalled: the receiver may have taken them back
            for peer in parts.peers.values():  # a pool is held on the same lease; completed transfers ride along
                if peer.pool is not None or peer.done:
                    by_peer.setdefault(peer.identity, (peer, []))
            beats = []
            for peer, ids in by_peer.values():
                done = list(peer.done)
                peer.done.clear()
                beats.append((peer, new_beat(peer.beats, now, ids, peer.pool.generation if peer.pool else 0, done)))
        for peer, beat in beats:
            parts.outbox.send(peer, beat)
        for peer, pool in stale:  # and say so: its blocks need not wait out the late-write quarantine
            self.pools.give_back(peer, pool)

    def renewed(self, peer: ReceiverPeer, ack: BeatAck) -> None:
        """The receiver answered a heartbeat: what it named is renewed from when it was sent (I/O thread)."""
        with self.parts.cond:
            beat = peer.beats.answered(ack)
            if beat is None:
                return
            for transfer_id in beat.transfer_ids:
                xfer = self.parts.transfers.get(transfer_id)
                if xfer is not None and xfer.peer is peer:
                    xfer.renewed = max(xfer.renewed, beat.sent)
            self.pools.renewed(peer, beat)

    def give_up_deaf(self, now: float) -> None:
        """Give up receivers that left a heartbeat unanswered past the lease's margin (I/O thread).

        Its answers do not reach us (a one-way partition, or it is stalled): whatever we hold there may lapse
        without our hearing, so our transfers to it fail and our pool there is dropped. It is told over the
        way that may still work, before its socket closes: a Cancel per transfer (our writes may still land, so
        it quarantines what it cannot fence) and the pool back, so it sees the partition when we do.
        """
        parts = self.parts
        config = parts.config
        margin = lease_margin(config.lease_s, config.heartbeat_s)
        with parts.cond:
            deaf: list[tuple[ReceiverPeer, float, list[str], Pool | None]] = [
                (
                    peer,
                    waited,
                    [x.transfer_id for x in parts.transfers.values() if x.peer is peer and not x.settled],
                    peer.pool,
                )
                for peer in parts.peers.values()
                if (waited := peer.beats.overdue(now, margin))
            ]
        for peer, waited, transfer_ids, pool in deaf:
            why = (
                f"receiver {peer.address} answered no heartbeat for {waited:.3g}s (lease_s={config.lease_s:.3g}s):"
                " its messages do not reach us (a one-way partition?) or it is stalled"
            )
            parts.counters["peers_deaf"] += 1
            for transfer_id in transfer_ids:
                parts.outbox.send(peer, Cancel(transfer_id, why, writes_may_land=True))
            if pool is not None:
                self.pools.give_back(peer, pool)
            self.handshake.lost(peer, why)
