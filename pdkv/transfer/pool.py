"""Blocks granted ahead to each sender, on the decode side: offer, take for one request, take back.

A pool (``transfer.pool_tokens``) lets a one-chunk request skip the Reserve round trip: the sender writes
the chunk into blocks already granted to its capability token and sends its Reserve in the chunk's notice;
the receiver admits it then (README.md here, "Pools"). The rules that hold for reservations hold here:

- every frame is still checked against a grant: the pool's blocks are granted to the sender's token, and a
  request's frames land only in them;
- a pool's blocks belong to one reservation or to the pool, never both, and go back to the allocator once;
- its lease is the sender's heartbeat, like a reservation's; a pool whose lease lapsed is taken back (its grant
  revoked) and its blocks wait ``TransferConfig.late_write_hold`` (the late-write fence: ``drain_timeout_s`` where
  the channel enforces grants, the longer of that and ``unfenced_quarantine_s`` where it cannot, as on nixl) before
  the sender is fenced and they are freed, or less, if the sender returns the pool first: its word frees it.

Everything here runs under the receiver's lock.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdkv.blocks import BlockAllocator
from pdkv.channels.base import Channel
from pdkv.config import TransferConfig
from pdkv.errors import OutOfBlocksError
from pdkv.transfer.incoming import ReceiveTarget
from pdkv.transfer.protocol import Pool

log = logging.getLogger(__name__)


@dataclass
class PeerPool:
    """One sender's pool: blocks granted to its token, held on a lease its heartbeats renew."""

    generation: int
    identity: bytes
    token: bytes
    blocks: list[int]
    lease_deadline: float
    free_deadline: float = 0.0  # set once taken back without word from the sender: late writes are waited out


class Pools:
    """Every sender's pool, and the pools taken back that still wait out late writes."""

    def __init__(
        self,
        channel: Channel,
        target: ReceiveTarget,
        allocator: BlockAllocator,
        config: TransferConfig,
        counters: collections.Counter[str],
        fence: Callable[[bytes], None],
    ) -> None:
        """``fence(identity)``: cut a sender off the data plane (``IncomingBook.fence``), before its pool's
        blocks are freed when a write of it may still land there."""
        self.channel, self.target, self.allocator, self.config, self.counters, self._fence = (
            channel,
            target,
            allocator,
            config,
            counters,
            fence,
        )
        # One chunk's blocks at most: a pooled request is one chunk, so its notice is the only one it sends; and
        # all pools together within pool_blocks_share of the blocks, so a small receiver keeps room for Reserves.
        # A receiver whose share cannot hold one pool grants none: its blocks are for Reserves.
        self.budget = int(config.pool_blocks_share * target.num_blocks)
        size = target.layout.blocks_for(min(config.pool_tokens, config.chunk_size)) if config.pool_tokens else 0
        self.size = size if size <= self.budget else 0
        self.by_peer: dict[bytes, PeerPool] = {}
        self.lapsed: list[PeerPool] = []
        self._generations = itertools.count(1)

    @property
    def blocks_held(self) -> int:
        return sum(len(p.blocks) for p in (*self.by_peer.values(), *self.lapsed))

    def owner(self, generation: int) -> PeerPool | None:
        return next((p for p in self.by_peer.values() if p.generation == generation), None)

    def offer(self, identity: bytes, token: bytes, keep: list[int]) -> Pool | None:
        """A new pool for ``identity`` (``keep``: blocks of its previous one it still holds, granted), or None
        when the allocator has no room for it (then ``keep`` goes back too)."""
        self.give_back(identity)
        if not self.size:
            self.discard(identity, token, keep)
            return None
        try:
            if self.blocks_held + self.size > self.budget:  # the others' pools (and lapsed ones) hold the share
                raise OutOfBlocksError(f"pools hold {self.blocks_held} of their {self.budget} blocks")
            fresh = self.allocator.allocate(self.size - len(keep)) if self.size > len(keep) else []
        except OutOfBlocksError:
            self.counters["pools_unavailable"] += 1
            self.discard(identity, token, keep)
            return None
        self.channel.grant(token, "write", self.target.block_ranges(fresh))
        # in order: a request takes the first blocks, and adjacent ones are one descriptor (and frame) per tensor
        blocks = sorted(keep + fresh)
        pool = PeerPool(next(self._generations), identity, token, blocks, time.monotonic() + self.config.lease_s)
        self.by_peer[identity] = pool
        self.counters["pools_granted"] += 1
        return Pool(pool.generation, pool.blocks, self.config.lease_s)

    def take(self, pool: PeerPool, n: int) -> tuple[list[int], list[int]]:
        """Hand the first ``n`` blocks to a request; (its blocks, the rest, still granted to the same token)."""
        del self.by_peer[pool.identity]
        return pool.blocks[:n], pool.blocks[n:]

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
            self.allocator.free(pool.blocks)  # its grant was revoked when it lapsed
        if lapsed:
            return
        pool = self.by_peer.get(identity)
        if pool is None or (generation and pool.generation != generation):
            return
        del self.by_peer[identity]
        self.discard(identity, pool.token, pool.blocks)

    def lapse(self, identity: bytes, now: float, why: str) -> None:
        """Take ``identity``'s pool back now, its blocks held for the late-write hold (a write into it may still
        land), after which ``reap`` fences its sender and frees them; its word (``give_back``) frees them early."""
        pool = self.by_peer.pop(identity, None)
        if pool is None:
            return
        self.channel.revoke(pool.token, "write", self.target.block_ranges(pool.blocks), 0)
        pool.free_deadline = now + self.config.late_write_hold(self.channel.enforces_grants)
        self.lapsed.append(pool)
        self.counters["pools_lapsed"] += 1
        log.warning("taking a sender's pool back, its blocks held against late writes: %s", why)

    def reap(self, now: float) -> None:
        """Take back pools whose lease lapsed; free those that waited out late writes, fencing their senders
        first (they never said they stopped writing)."""
        for pool in [p for p in self.by_peer.values() if now > p.lease_deadline]:
            self.lapse(pool.identity, now, f"its lease lapsed (no heartbeat for {self.config.lease_s:.3g}s)")
        over = [p for p in self.lapsed if now > p.free_deadline]
        self.lapsed = [p for p in self.lapsed if now <= p.free_deadline]
        for pool in over:
            self.counters["fences"] += 1
            self._fence(pool.identity)
            self.allocator.free(pool.blocks)

    def close(self) -> None:
        for identity in list(self.by_peer):
            self.give_back(identity)
        for pool in self.lapsed:
            self.allocator.free(pool.blocks)
        self.lapsed = []

    def discard(self, identity: bytes, token: bytes, blocks: list[int]) -> None:
        """Blocks of a pool no one holds any more: revoke, then free; a frame still landing after
        ``drain_timeout_s`` gets its sender fenced first."""
        if blocks and not self.channel.revoke(
            token, "write", self.target.block_ranges(blocks), self.config.drain_timeout_s
        ):
            self.counters["fences"] += 1
            self._fence(identity)
        self.allocator.free(blocks)
