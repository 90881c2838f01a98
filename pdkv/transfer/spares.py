"""Spares: the blocks of each sender's next pool, granted before the request that needs them (``Spares``).

A pooled request takes the first blocks of its sender's pool, and the verdict that answers it offers the next pool:
the rest of this one and as many blocks again. Granting those blocks (the channel's capability table, the landing
tables it keeps per unit) took ~50 of the verdict's ~230 us on the 2-core VM, on the request's path (the answer
waited for it). So each pool keeps a *spare*: up to
a pool's worth of blocks granted to its sender's token but not offered. An offer takes what it lacks from its spare,
granted already, and the spare is granted again once the verdict is on the wire, on the thread that sent it, outside
the book's lock (which a decode request claiming its KV then wants).

Where that thread exists: a channel that runs an answer pass's ``after`` work (tcp's connection thread,
``Channel.runs_after_answers``). nixl's watcher sends its answers by polling, and work there measured slower, so its
offers grant in place as before. The rules of pools hold for spares: a spare's blocks are the pool's (counted in
``blocks_held``, revoked and freed with it, taken back with it when its lease lapses); spares only take the pools'
share where it has room beside a pool for every admitted sender, and an offer takes another sender's spare back
rather than go without.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from pdkv.errors import OutOfBlocksError
from pdkv.transfer.parts import ReceiverParts


class SparePool(Protocol):
    """What a spare belongs to: one sender's pool on the receiver (``pool.PeerPool``)."""

    identity: bytes
    token: bytes
    spare: list[int]


class Pools(Protocol):
    """What spares ask of the receiver's pools (``pool.ReceiverPools``), under its lock."""

    parts: ReceiverParts
    size: int  # blocks in a pool
    budget: int  # blocks all pools may hold together, spares included

    @property
    def by_peer(self) -> Mapping[bytes, SparePool]: ...

    @property
    def blocks_held(self) -> int: ...

    def discard(self, identity: bytes, token: bytes, blocks: list[int]) -> None: ...


class Spares:
    """The receiver's spares, beside its pools (``ReceiverPools.spares``); under the receiver's lock but for the
    grants ``top_up`` makes."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.on = False  # whether offers leave a spare to grant (set by ``arrivals.ChunkArrivals``)
        self._short: set[bytes] = set()  # senders offered a pool whose spare is short of a pool's worth
        self.granting = 0  # blocks ``top_up`` took from the allocator and grants outside the lock

    def owed(self, identity: bytes, held: int) -> None:
        """``identity`` was just offered a pool whose spare holds ``held`` blocks: top it up after the offer went."""
        if self.on and held < self.pools.size:
            self._short.add(identity)

    def top_up(self) -> None:
        """Grant each sender just offered a pool its spare again, up to a pool's worth, where the share has room."""
        pools, parts = self.pools, self.pools.parts
        with parts.lock:
            short, self._short = self._short, set()
            fills: list[tuple[SparePool, list[int]]] = []
            for identity in short:
                pool = pools.by_peer.get(identity)
                poolless = sum(1 for i in parts.peers if i not in pools.by_peer)
                room = pools.budget - pools.blocks_held - pools.size * poolless
                want = min(pools.size - len(pool.spare), room) if pool is not None else 0
                if pool is None or want <= 0:
                    continue
                try:
                    fresh = parts.allocator.allocate(want)
                except OutOfBlocksError:
                    break
                self.granting += len(fresh)
                fills.append((pool, fresh))
        for pool, fresh in fills:
            parts.channel.grant(pool.token, "write", parts.memory.block_ranges(fresh))
        with parts.lock:
            for pool, fresh in fills:
                self.granting -= len(fresh)
                if pools.by_peer.get(pool.identity) is pool:
                    pool.spare = pool.spare + fresh
                else:  # its pool was taken or given back meanwhile: these blocks were never told to anyone
                    pools.discard(pool.identity, pool.token, fresh)

    def reclaim(self, need: int) -> bool:
        """Take spares back until the pools' share has room for ``need`` more blocks (caller holds the lock): an
        offer comes before another sender's spare. Whether it has that room now."""
        pools = self.pools
        return self._take_back(lambda: pools.blocks_held + need <= pools.budget)

    def yield_to(self, blocks: int) -> bool:
        """Take spares back until the allocator has ``blocks`` free (caller holds the lock): a Reserve comes before
        every spare. Whether any was taken back (then the Reserve's blocks are worth asking for again)."""
        allocator = self.pools.parts.allocator
        before = allocator.num_free
        self._take_back(lambda: allocator.num_free >= blocks)
        return allocator.num_free > before

    def _take_back(self, enough: Callable[[], bool]) -> bool:
        """Revoke and free spares, one sender's at a time, until ``enough()``; its value then."""
        parts = self.pools.parts
        for pool in list(self.pools.by_peer.values()):
            if enough():
                break
            if pool.spare and parts.channel.revoke(
                pool.token, "write", parts.memory.block_ranges(pool.spare), 0
            ):  # nothing lands there unless its sender wrote where it was never told to: then it stays
                parts.allocator.free(pool.spare)
                parts.counters["spare_blocks_taken_back"] += len(pool.spare)
                pool.spare = []
        return enough()
