"""The sender's heartbeats, numbered and acknowledged: a lease counts as renewed when the receiver says it was.

A heartbeat that went out is not one that arrived: in a one-way partition (sender -> receiver open, the way back
cut) every beat arrives and every answer is lost, and a sender that renewed on what it sent would keep writing
into reservations it cannot hear about. So each beat is remembered until its ``BeatAck`` comes back, and what it
named is renewed from the moment it was sent (the receiver renewed on arrival, later). A beat left unanswered
past the lease's margin means the receiver cannot reach us (or is stalled): the sender gives it up, telling it
so over the way that still works, so both sides see the partition within ``lease_s``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdkv.transfer.protocol import BeatAck, Heartbeat


@dataclass(frozen=True)
class SentBeat:
    """What one heartbeat renewed, once answered: the transfers it named and the pool generation it held."""

    sent: float
    transfer_ids: tuple[str, ...]
    pool: int  # the pool's generation, 0 if none


@dataclass
class Beats:
    """One receiver's unanswered heartbeats (kept on its ``ReceiverPeer``)."""

    unanswered: dict[int, SentBeat] = field(default_factory=dict)

    def overdue(self, now: float, margin: float) -> float:
        """How long the oldest unanswered beat has waited, when that is past ``margin``; else 0."""
        if not self.unanswered:
            return 0.0
        waited = now - next(iter(self.unanswered.values())).sent
        return waited if waited > margin else 0.0

    def answered(self, ack: BeatAck) -> SentBeat | None:
        """The beat ``ack`` answers (None: not ours, or already answered); older ones still open are forgotten:
        the receiver answers in order, so they were lost and this one renews past them."""
        beat = self.unanswered.get(ack.seq)
        if beat is None:
            return None
        for seq in [s for s in self.unanswered if s <= ack.seq]:
            del self.unanswered[seq]
        return beat


_seqs = itertools.count(1)  # one numbering for the process: a seq never repeats across peers or restarts of a peer


def new_beat(beats: Beats, now: float, transfer_ids: list[str], pool: int) -> Heartbeat:
    """The next heartbeat to a receiver, remembered in ``beats`` until it is answered."""
    seq = next(_seqs)
    beats.unanswered[seq] = SentBeat(now, tuple(transfer_ids), pool)
    return Heartbeat(transfer_ids, seq)
