"""What each side knows of the other: a receiver as the sender knows it, a sender as the receiver knows it.

Kept below every room of the wing (the handshake makes them, the Reserves, pools, heartbeats and transfers read
them), so no room imports another to name a peer. A receiver's record also keeps the heartbeats it has not answered
(``Beats``; heartbeat.py says why a beat counts only once answered).
"""

from __future__ import annotations

import collections
import itertools
import os
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdkv.auth import new_nonce
from pdkv.layout import KVLayout
from pdkv.transfer.protocol import MAX_DONE_PER_BEAT, BeatAck, Heartbeat, Hello, Pool


def lease_margin(lease_s: float, heartbeat_s: float) -> float:
    """How long after its last answered heartbeat a lease is still surely ours: less two beats of slack for a
    renewal that was queued but not yet on the wire."""
    return max(lease_s - 2 * heartbeat_s, lease_s / 2)


@dataclass(frozen=True, kw_only=True)
class SentBeat:
    """What one heartbeat renewed, once answered: the transfers it named and the pool generation it held."""

    sent: float
    transfer_ids: tuple[str, ...]
    pool: int  # the pool's generation, 0 if none


@dataclass(kw_only=True)
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


def new_beat(beats: Beats, now: float, transfer_ids: list[str], pool: int, done: list[str]) -> Heartbeat:
    """The next heartbeat to a receiver, remembered in ``beats`` until it is answered; ``done``: transfers that
    completed since the last one (their ``Done``)."""
    seq = next(_seqs)
    beats.unanswered[seq] = SentBeat(sent=now, transfer_ids=tuple(transfer_ids), pool=pool)
    return Heartbeat(transfer_ids, seq, done)


@dataclass(eq=False, kw_only=True)  # hashable by identity: it keys its DEALER socket
class ReceiverPeer:
    """A receiver as the sender knows it, one per address and run."""

    address: str
    identity: bytes
    sent: Hello | None = None  # the Hello we sent it: half of the transcript the handshake's proofs cover
    hello: Hello | None = None
    agent: str = ""
    dropped: str = ""  # why it was forgotten; once set, its socket is closed for good and messages to it discarded
    nonce: bytes = field(default_factory=new_nonce)
    token: bytes = field(default_factory=lambda: os.urandom(16))  # our data connections' capability at this receiver
    hello_future: Future[Hello] = field(default_factory=Future)
    pool: Pool | None = None  # blocks it granted us ahead, unused yet (pool.py, README.md here, "Pools")
    pool_renewed: float = 0.0  # when an answered heartbeat last renewed the pool's lease (or it arrived)
    session: bytes = b""  # with a secret, once its Hello proved it: the handshake's transcript (Reserve proofs bind it)
    session_key: bytes = b""  # with a secret, once its Hello proved it: what our messages and notices are tagged with
    beats: Beats = field(default_factory=Beats)  # heartbeats it has not answered yet
    # transfers to it that completed, for the next heartbeat to say; bounded, the oldest dropped (MAX_DONE_PER_BEAT)
    done: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=MAX_DONE_PER_BEAT))


@dataclass(kw_only=True)
class SenderPeer:
    """A sender as the receiver knows it, once admitted."""

    agent: str
    layout: KVLayout
    token: bytes  # its data connections' capability: its reservations are granted to it
    session: bytes = b""  # the handshake's transcript (with a secret): what its Reserves' proofs are bound to
    session_key: bytes = b""  # with a secret: what its control messages and chunk notices are tagged with
    kv_reached: bool = True  # its channel registered its KV (an empty kv_regions in its Hello: not, so staging only)
