"""Pools, both halves: blocks a receiver grants each sender ahead, so a one-chunk request skips the Reserve's round
trip (``transfer.pool_tokens``; README.md here, "Pools").

A *pool* is one thing on both sides: one chunk's worth of a receiver's blocks at most, granted ahead to one sender's
capability token, held on that sender's lease and used by one request. Where the sender's chunks cannot land in
place (another block size or order, KV its channel cannot reach: staging mode), the pool is those blocks and one
staging slot, and the slot is what is granted: the request's chunk is written into it and scattered on landing.
The receiver offers it (after a Hello, or in the ``Landed`` of the request that used the last one:
``ReceiverPools``); the sender holds it, claims it for a request that fits and writes that request's chunk into it
at once, its Reserve riding on the chunk's notice (``SenderPools``); the receiver admits that Reserve as the notice
arrives, hands the pool's blocks (and slot) to the request and offers the next pool, or refuses it and offers the
same blocks again. The rules that hold for reservations hold here:

- every frame is still checked against a grant: the pool's blocks are granted to the sender's token, and a
  request's frames land only in them;
- a pool's blocks belong to one reservation or to the pool, never both, and go back to the allocator once;
- its lease is the sender's heartbeat, like a reservation's: the sender stops writing into a pool it could not renew
  within the lease's margin and returns it; the receiver takes back a pool whose lease lapsed (its grant revoked) and
  keeps its blocks ``TransferConfig.late_write_hold`` (the late-write fence: ``drain_timeout_s`` where the channel
  enforces grants, the longer of that and ``unfenced_quarantine_s`` where it cannot, as on nixl) before the sender is
  fenced and they are freed, or less, if the sender returns the pool first: its word frees it.

Each side's half runs under that side's one lock.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pdkv.config import TransferConfig
from pdkv.errors import OutOfBlocksError
from pdkv.layout import KVLayout
from pdkv.transfer.admission import Admission, ReceiverView, admit_pooled, pool_mode
from pdkv.transfer.handshake import SenderHandshake, reserving_peer, signed_reserve
from pdkv.transfer.incoming import IncomingTransfer
from pdkv.transfer.parts import ReceiverParts, SenderParts
from pdkv.transfer.peers import ReceiverPeer, SenderPeer, SentBeat, lease_margin
from pdkv.transfer.protocol import ChunkNotice, Pool, Refused, Reserve, Reserved, ReturnPool

log = logging.getLogger(__name__)


# -- the sender's half: hold, claim, renew, return --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PoolClaim:
    """A transfer written into the receiver's pool instead of reserved first: the Reserve its chunk's notice
    carries, the pool's generation, and when an answered heartbeat last renewed the pool (its lease counts from
    there)."""

    reserve: Reserve
    generation: int
    renewed: float


class SenderPools:
    """The pool each receiver granted this sender (kept on its ``ReceiverPeer``), under the sender's lock."""

    def __init__(self, parts: SenderParts, handshake: SenderHandshake) -> None:
        self.parts, self.handshake = parts, handshake

    def hold(self, peer: ReceiverPeer, pool: Pool) -> None:
        """A pool the receiver granted us (a ``Pool`` message, or the one a ``Landed`` or a verdict carries)."""
        with self.parts.cond:
            if not peer.dropped:
                peer.pool, peer.pool_renewed = pool, time.monotonic()

    def claim(
        self, address: str, *, transfer_id: str, num_tokens: int, prompt_key: bytes, codec: str
    ) -> tuple[ReceiverPeer, Reserved, PoolClaim] | None:
        """Claim the pool the receiver at ``address`` granted us, when this transfer fits it: one chunk, no codec,
        its lease surely still ours. (peer, the reservation the pool stands for: its blocks, or its staging slot,
        the claim), or None: reserve the usual way (reserves.py)."""
        parts = self.parts
        if codec != "none" or num_tokens > parts.config.chunk_size:
            return None
        peer = self.handshake.connect(address)  # cheap once connected; the data path proven before any write
        assert peer.hello is not None  # connected
        with parts.cond:
            pool = peer.pool if not peer.dropped else None
            needed = peer.hello.layout.blocks_for(num_tokens)  # the receiver's blocks (staged: of its block size)
            if (
                pool is None
                or len(pool.block_ids) < needed
                or time.monotonic() - peer.pool_renewed > lease_margin(pool.lease_s, parts.config.heartbeat_s)
                or transfer_id in parts.asking
                or transfer_id in parts.transfers
            ):
                return None
            peer.pool = None  # one request per pool: the receiver grants the next once it took this one
            renewed = peer.pool_renewed
        parts.counters["reserved_from_pool"] += 1
        slots = [] if pool.staging_slot is None else [pool.staging_slot]
        reserved = Reserved(transfer_id, "staging" if slots else "direct", pool.block_ids[:needed], slots, pool.lease_s)
        reserve = signed_reserve(
            peer, parts.secret, transfer_id=transfer_id, num_tokens=num_tokens, prompt_key=prompt_key, codec=codec
        )
        return peer, reserved, PoolClaim(reserve=reserve, generation=pool.generation, renewed=renewed)

    def lapse_stale(self, now: float) -> list[tuple[ReceiverPeer, Pool]]:
        """Drop every pool not renewed within its lease's margin (caller holds the lock): we were stalled, and the
        receiver may have taken it back, so we never write into it. The caller returns them (``give_back``)."""
        stale = []
        for peer in self.parts.peers.values():
            if peer.pool is not None and now - peer.pool_renewed > lease_margin(
                peer.pool.lease_s, self.parts.config.heartbeat_s
            ):
                stale.append((peer, peer.pool))
                peer.pool = None
        return stale

    def renewed(self, peer: ReceiverPeer, beat: SentBeat) -> None:
        """An answered heartbeat renews the pool it named, from when it was sent (caller holds the lock)."""
        if peer.pool is not None and peer.pool.generation == beat.pool:
            peer.pool_renewed = max(peer.pool_renewed, beat.sent)

    def give_back(self, peer: ReceiverPeer, pool: Pool) -> None:
        """Tell the receiver we write into ``pool`` no more: its blocks need not wait out the late-write hold."""
        self.parts.outbox.send(peer, ReturnPool(pool.generation))

    def close(self) -> None:
        """Return every pool we hold (the sender is closing)."""
        with self.parts.cond:
            held = [(peer, peer.pool) for peer in self.parts.peers.values() if peer.pool is not None]
            for peer, _ in held:
                peer.pool = None
        for peer, pool in held:
            self.give_back(peer, pool)


# -- the receiver's half: offer, admit, take, refill, return, take back ----------------------------------------------
@dataclass(kw_only=True)
class PeerPool:
    """One sender's pool on the receiver: blocks granted to its token (or, staged, blocks and a staging slot
    granted to it), held on a lease its heartbeats renew."""

    generation: int
    identity: bytes
    token: bytes
    blocks: list[int]
    lease_deadline: float
    slot: int | None = None  # a staged pool's staging slot (its index), the part granted
    free_deadline: float = 0.0  # set once taken back without word from the sender: late writes are waited out


class Rest(NamedTuple):
    """What a pool a request took (or a refused request gave back) leaves until its sender's next pool is offered:
    its blocks not taken, still granted where written in place, and a refused staged request's slot, still
    granted (None once a request took it)."""

    token: bytes
    blocks: list[int]
    slot: int | None


class Bookings(Protocol):
    """What the receiver's pools ask of its reservations (``book.IncomingBook``), under its lock."""

    def view(self, identity: bytes, peer: SenderPeer, transfer_id: str) -> ReceiverView: ...

    def open(
        self,
        *,
        identity: bytes,
        peer: SenderPeer,
        req: Reserve,
        admission: Admission,
        blocks: list[int],
        slots: list[int],
    ) -> IncomingTransfer: ...

    def fence(self, identity: bytes) -> None: ...

    @property
    def free_slots(self) -> list[int]: ...


def pool_size(layout: KVLayout, config: TransferConfig) -> int:
    """The blocks of one pool on a receiver of ``layout``: one chunk's (0: pools off). The receiver grants pools only
    where ``pool_blocks_share`` of its blocks hold one."""
    return layout.blocks_for(min(config.pool_tokens, config.chunk_size)) if config.pool_tokens else 0


class ReceiverPools:
    """Every sender's pool on the receiver, and the pools taken back that still wait out late writes."""

    def __init__(self, parts: ReceiverParts, book: Bookings) -> None:
        self.parts, self.book = parts, book
        config, memory = parts.config, parts.memory
        # One chunk's blocks at most: a pooled request is one chunk, so its notice is the only one it sends; and
        # all pools together within pool_blocks_share of the blocks, so a small receiver keeps room for Reserves.
        # A receiver whose share cannot hold one pool grants none: its blocks are for Reserves.
        self.budget = int(config.pool_blocks_share * memory.num_blocks)
        size = pool_size(memory.layout, config)
        self.size = size if size <= self.budget else 0
        # staged pools hold a slot each, all of them within the same share of the slots (a Reserve needs one too)
        self.slot_budget = int(config.pool_blocks_share * config.staging_slots)
        self.by_peer: dict[bytes, PeerPool] = {}
        self.lapsed: list[PeerPool] = []
        self._generations = itertools.count(1)
        # pooled requests taken this pass: identity -> what its pool left, to offer the next pool
        self._refills: dict[bytes, Rest] = {}

    @property
    def blocks_held(self) -> int:
        """Blocks in senders' pools: those granted, those lapsed (held against late writes), and the rest of a pool a
        request just took (all of it, where the request was refused) until it is offered again (``_refills``)."""
        pooled = sum(len(p.blocks) for p in (*self.by_peer.values(), *self.lapsed))
        return pooled + sum(len(rest.blocks) for rest in self._refills.values())

    @property
    def slots_held(self) -> int:
        """Staging slots in senders' staged pools, counted as ``blocks_held`` counts blocks."""
        pools = (*self.by_peer.values(), *self.lapsed, *self._refills.values())
        return sum(p.slot is not None for p in pools)

    # -- offering -------------------------------------------------------------------------------------------------
    def admitted(self, identity: bytes, token: bytes) -> None:
        """``handshake.Admitted``: a sender just admitted is offered its first pool, in a ``Pool`` message."""
        self._send_offer(identity, Rest(token, [], None))

    def next_pool(self, identity: bytes) -> Pool | None:
        """The next pool of ``identity``, for the Landed (or the verdict) of the request that took its last one."""
        with self.parts.lock:
            refill = self._refills.pop(identity, None)
            return None if refill is None else self._offer(identity, refill)

    def send_refills(self) -> None:
        """Offer the pools of pooled requests that sent no Landed (refused, or failed their checksum) in a message
        of their own (I/O thread, after a pass of landing)."""
        while True:
            with self.parts.lock:  # taken and offered as one (serving threads take pools too): never out of a pool
                if not self._refills:
                    return
                identity, rest = self._refills.popitem()
                msg = self._offer(identity, rest)
            if msg is not None:
                self.parts.outbox.reply(identity, msg)

    def _send_offer(self, identity: bytes, keep: Rest) -> None:
        """``_offer``, told in a ``Pool`` message of its own (after a Hello, or with no Landed to carry it)."""
        msg = self._offer(identity, keep)
        if msg is not None:
            self.parts.outbox.reply(identity, msg)

    def _offer(self, identity: bytes, keep: Rest) -> Pool | None:
        """Grant ``identity`` a pool, if pools are on and a one-chunk request of its would be admitted (I/O thread):
        the message that tells it, or None. ``keep``: what its previous pool left (``Rest``), still granted to
        ``keep.token``; it goes back too when no pool is offered."""
        parts, token = self.parts, keep.token
        with parts.lock:
            peer = parts.peers.get(identity)
            mode = None if peer is None or peer.token != token else pool_mode(self.book.view(identity, peer, ""))
            if mode is None:
                self.discard(identity, keep)  # cut off (or fenced) since, or its chunks never land here: no pool
                return None
            self.give_back(identity)
            if not self.size:
                self.discard(identity, keep)
                return None
            slot, staged = keep.slot, mode == "staging"
            try:
                if self.blocks_held + self.size > self.budget:  # the others' pools (and lapsed ones) hold the share
                    raise OutOfBlocksError(f"pools hold {self.blocks_held} of their {self.budget} blocks")
                if staged and slot is None and (self.slots_held >= self.slot_budget or not self.book.free_slots):
                    raise OutOfBlocksError(
                        f"no staging slot for a pool: pools hold {self.slots_held} of their {self.slot_budget}, "
                        f"{len(self.book.free_slots)} free"
                    )
                fresh = parts.allocator.allocate(self.size - len(keep.blocks)) if self.size > len(keep.blocks) else []
            except OutOfBlocksError:
                parts.counters["pools_unavailable"] += 1
                self.discard(identity, keep)
                return None
            if not staged:
                parts.memory.grant_blocks(parts.channel, token, fresh)
            elif slot is None:  # a staged pool's slot is what its sender writes: granted, its blocks are not
                slot = self.book.free_slots.pop()
                parts.channel.grant(token, "write", parts.memory.slot_ranges([slot]))
            # in order: a request takes the first blocks, and adjacent ones are one descriptor (and frame) per tensor
            pool = PeerPool(
                generation=next(self._generations),
                identity=identity,
                token=token,
                blocks=sorted(keep.blocks + fresh),
                lease_deadline=time.monotonic() + parts.config.lease_s,
                slot=slot,
            )
            self.by_peer[identity] = pool
            parts.counters["pools_granted"] += 1
            offset = None if slot is None else slot * parts.memory.slot_bytes
            return Pool(pool.generation, pool.blocks, parts.config.lease_s, staging_slot=offset)

    # -- a request written into a pool ----------------------------------------------------------------------------
    def open_pooled(
        self, agent: str, notice: ChunkNotice, session: bytes | None = None
    ) -> tuple[bytes | None, Refused] | None:
        """A chunk written into a sender's pool, with its Reserve (holding the lock; ``session``: the sender session
        whose key tagged the notice, whose pool it must be, where a secret tells sessions apart): the rules of a Reserve
        (``admission.admit_pooled``), then the pool's blocks become the reservation's: None. Refused, its bytes
        are discarded (counted) and its pool is offered again: (whom to tell, if anyone, and the refusal), which
        the caller sends (a ``Refused``, or the chunk's verdict)."""
        assert notice.reserve is not None
        parts, req = self.parts, notice.reserve
        pool = next((p for p in self.by_peer.values() if p.generation == notice.pool), None)
        sender = parts.peers.get(pool.identity) if pool is not None else None
        admitted: Admission | Refused
        peer: SenderPeer | Refused | None = None
        if (
            pool is None or sender is None or sender.agent != agent or session not in (None, pool.identity)
        ):  # not this sender's pool: leave it alone
            pool, admitted = None, Refused(req.transfer_id, f"pooled request names no pool of yours ({notice.pool})")
        else:
            peer = reserving_peer(parts, pool.identity, req)  # with a secret: the Reserve's proof
            admitted = peer if isinstance(peer, Refused) else self._admit(pool, peer, req)
        parts.counters["pooled_requests"] += 1
        if isinstance(admitted, Refused):
            parts.counters["pooled_refused"] += 1
            parts.counters["pooled_bytes_discarded"] += parts.memory.layout.chunk_bytes(
                min(req.num_tokens, parts.config.chunk_size)
            )
            log.warning("transfer %s: %s", req.transfer_id, admitted.reason)
            owner = (
                pool.identity
                if pool is not None
                else next((i for i, p in parts.peers.items() if p.agent == agent), None)
            )
            if pool is not None:  # the same blocks (and slot) again, under a new generation
                self._take(pool, 0)
            return owner, admitted
        assert pool is not None and isinstance(peer, SenderPeer)
        slots = [] if pool.slot is None else [pool.slot]
        blocks = self._take(pool, admitted.blocks)
        self.book.open(identity=pool.identity, peer=peer, req=req, admission=admitted, blocks=blocks, slots=slots)
        return None

    def _admit(self, pool: PeerPool, peer: SenderPeer, req: Reserve) -> Admission | Refused:
        """``admit_pooled`` for a request written into ``pool``: a staged pool's slot is the request's own."""
        view = self.book.view(pool.identity, peer, req.transfer_id)
        if pool.slot is None:
            return admit_pooled(req, view, len(pool.blocks), "direct")
        return admit_pooled(req, dataclasses.replace(view, free_slots=view.free_slots + 1), len(pool.blocks), "staging")

    def _take(self, pool: PeerPool, n: int) -> list[int]:
        """Hand the pool's first ``n`` blocks (and its slot, if any: ``n`` > 0) to a request; its sender's next pool
        (the rest, topped up) is offered in the request's ``Landed`` (``next_pool``), or on its own if no Landed
        goes out (``send_refills``)."""
        del self.by_peer[pool.identity]
        # one per sender: it held one pool, now taken
        self._refills[pool.identity] = Rest(pool.token, pool.blocks[n:], None if n else pool.slot)
        return pool.blocks[:n]

    # -- lease, return, take back ---------------------------------------------------------------------------------
    def renew(self, identity: bytes, deadline: float) -> None:
        pool = self.by_peer.get(identity)
        if pool is not None:
            pool.lease_deadline = deadline

    def give_back(self, identity: bytes, generation: int = 0) -> None:
        """The sender returned its pool (or was cut off): take the grant back, free the blocks (``generation``:
        only that pool's). A pool taken back after its lease lapsed is freed at once on its sender's word (it
        writes into it no more), as a quarantined reservation is on its Cancel."""
        lapsed = [p for p in self.lapsed if generation and p.identity == identity and p.generation == generation]
        for pool in lapsed:  # (one at most: generations are unique)
            self.lapsed.remove(pool)
            self._free(pool)  # its grant was revoked when it lapsed
        if lapsed:
            return
        pool = self.by_peer.get(identity)
        if pool is None or (generation and pool.generation != generation):
            return
        del self.by_peer[identity]
        self.discard(identity, pool)

    def lapse(self, identity: bytes, now: float, why: str) -> None:
        """Take ``identity``'s pool back now, its blocks held for the late-write hold (a write into it may still
        land), after which ``reap`` fences its sender and frees them; its word (``give_back``) frees them early."""
        parts = self.parts
        pool = self.by_peer.pop(identity, None)
        if pool is None:
            return
        self._revoke(pool, 0)
        pool.free_deadline = now + parts.config.late_write_hold(parts.channel.enforces_grants)
        self.lapsed.append(pool)
        parts.counters["pools_lapsed"] += 1
        log.warning("taking a sender's pool back, its blocks held against late writes: %s", why)

    def reap(self, now: float) -> None:
        """Take back pools whose lease lapsed; free those that waited out late writes, fencing their senders
        first (they never said they stopped writing)."""
        for pool in [p for p in self.by_peer.values() if now > p.lease_deadline]:
            self.lapse(pool.identity, now, f"its lease lapsed (no heartbeat for {self.parts.config.lease_s:.3g}s)")
        over = [p for p in self.lapsed if now > p.free_deadline]
        self.lapsed = [p for p in self.lapsed if now <= p.free_deadline]
        for pool in over:
            self.parts.counters["fences"] += 1
            self.book.fence(pool.identity)
            self._free(pool)

    def close(self) -> None:
        for identity in list(self.by_peer):
            self.give_back(identity)
        while self._refills:  # taken back, not offered again yet
            identity, rest = self._refills.popitem()
            self.discard(identity, rest)
        for pool in self.lapsed:
            self._free(pool)
        self.lapsed = []

    def discard(self, identity: bytes, rest: Rest | PeerPool) -> None:
        """A pool's memory no one holds any more: revoke, then free; a frame still landing after
        ``drain_timeout_s`` gets its sender fenced first."""
        if not self._revoke(rest, self.parts.config.drain_timeout_s):
            self.parts.counters["fences"] += 1
            self.book.fence(identity)
        self._free(rest)

    def _revoke(self, rest: Rest | PeerPool, timeout: float) -> bool:
        """Take a pool's grant back (its blocks', or a staged pool's slot's), waiting up to ``timeout`` s for a
        frame still landing: False if one still is."""
        parts = self.parts
        if rest.slot is not None:
            return parts.channel.revoke(rest.token, "write", parts.memory.slot_ranges([rest.slot]), timeout)
        return parts.memory.revoke_blocks(parts.channel, rest.token, rest.blocks, timeout)

    def _free(self, rest: Rest | PeerPool) -> None:
        """A pool's blocks back to the allocator, its slot (staged) back to the free slots; its grant is gone."""
        self.parts.allocator.free(rest.blocks)
        if rest.slot is not None:
            self.book.free_slots.append(rest.slot)
