"""Prepared descriptor lists, what every NIXL transfer is made from: the block lists of gridded regions, prepared
once per side as vLLM's NixlConnector does, and lists of exactly a transfer's ranges kept in a small LRU
(channels/README.md, "nixl")."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from pdkv.channels.handle import BlockWrite, TransferOp
from pdkv.channels.nixl.agent import Region
from pdkv.channels.nixl.lib import NIXL_ERRORS, describe_nixl_error, nixl_agent, nixl_prepped_dlist_handle
from pdkv.channels.nixl.meta import RegionMeta
from pdkv.channels.regions import RegionTable
from pdkv.errors import ChannelError

Desc = tuple[int, int, int]  # NIXL transfer descriptor: (address, length, device id)
ListKey = tuple[str, str, tuple[Desc, ...]]  # (agent, "" for local; memory type; descriptors)
# what make_prepped_xfer takes for a transfer: the local list and indices into it, the remote list and indices
Prepped = tuple[nixl_prepped_dlist_handle, np.ndarray, nixl_prepped_dlist_handle, np.ndarray]
ROUTES_KEPT = 64  # sets of regions whose block writes' routes are kept (a sender's chunks name one set per KV buffer)


class BlockRoute(NamedTuple):
    """How a write of whole blocks between one set of regions goes (``Lists.route``): each side's memory type and,
    for each region of the write on each side, the index of its first block in that side's block list."""

    mems: tuple[str, str]
    mine: np.ndarray
    theirs: np.ndarray


class BlockLists:
    """One side's block-gridded regions as prepared descriptor lists, one descriptor per block, one list per memory
    type: what vLLM's NixlConnector prepares once per peer, so that a write of whole blocks is only index arrays
    into lists made long before it (``make_prepped_xfer`` merges runs of adjacent blocks back into one descriptor).
    """

    def __init__(self, agent: nixl_agent, name: str, regions: Mapping[int, RegionMeta]) -> None:
        """Prepare the lists over ``regions``' gridded ones, local (``name`` "") or the peer ``name``'s."""
        self.lists: dict[str, nixl_prepped_dlist_handle] = {}
        self.first: dict[int, int] = {}  # region -> the index of its first block in its memory type's list
        descs: dict[str, list[np.ndarray]] = {}
        for region, meta in regions.items():
            if meta.block:
                rows = descs.setdefault(meta.mem, [])
                self.first[region] = sum(len(r) for r in rows)
                count = meta.size // meta.block
                addrs = meta.addr + meta.block * np.arange(count, dtype=np.uint64)
                rows.append(
                    np.column_stack([addrs, np.full(count, meta.block, np.uint64), np.full(count, meta.dev, np.uint64)])
                )
        try:
            for mem, rows in descs.items():
                self.lists[mem] = agent.prep_xfer_dlist(name, np.concatenate(rows), mem)
        except BaseException:
            self.release()
            raise

    def indices(self, regions: np.ndarray, offsets: np.ndarray, blocks: np.ndarray, block: int) -> np.ndarray:
        """The list indices of ``blocks[i]`` blocks from byte ``offsets[i]`` of ``regions[i]``, op after op."""
        ids, where = np.unique(regions, return_inverse=True)
        starts = np.array([self.first[int(r)] for r in ids], dtype=np.int64)[where] + offsets // block
        within = np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
        return np.repeat(starts, blocks) + within

    def firsts(self, regions: Sequence[int]) -> np.ndarray:
        """The list index of each of ``regions``' first block (all in one memory type's list)."""
        return np.fromiter((self.first[r] for r in regions), dtype=np.int64, count=len(regions))

    def release(self) -> None:
        for handle in self.lists.values():
            handle.release()
        self.lists.clear()


class PrepCache:
    """LRU of prepared descriptor lists keyed by (agent, memory type, descriptors).

    Releasing a prepared list does not disturb transfers already made from
    it (NIXL copies what it needs into the request), so eviction is safe at
    any time.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lists: OrderedDict[ListKey, nixl_prepped_dlist_handle] = OrderedDict()

    def get(self, key: ListKey, make: Callable[[], nixl_prepped_dlist_handle]) -> nixl_prepped_dlist_handle:
        handle = self._lists.get(key)
        if handle is not None:
            self._lists.move_to_end(key)
            return handle
        handle = self._lists[key] = make()
        while len(self._lists) > self.capacity:
            self._lists.popitem(last=False)[1].release()
        return handle

    def drop(self, agent: str | None = None) -> None:
        """Release the lists prepared for ``agent`` (all of them when None)."""
        for key in [k for k in self._lists if agent is None or k[0] == agent]:
            self._lists.pop(key).release()


def one_mem(mems: set[str], whose: str) -> str:
    """The one memory type of ``whose`` ranges in a transfer."""
    if len(mems) != 1:
        raise ChannelError(
            f"nixl: one transfer must use one memory type per side; {whose} ranges mix {sorted(mems)}: split it"
        )
    return mems.pop()


def mems_of(peer: str, local: Iterable[RegionMeta], theirs: Iterable[RegionMeta]) -> tuple[str, str]:
    """The one memory type of each side's regions in a transfer."""
    return one_mem({m.mem for m in local}, "local"), one_mem({m.mem for m in theirs}, f"peer {peer!r}")


def _indices(firsts: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """The list indices of ``blocks`` of each region in turn, whose first blocks sit at ``firsts`` in the list."""
    return (firsts[:, None] + blocks.astype(np.int64, copy=False)[None, :]).ravel()


def _desc(region: RegionMeta, offset: int, length: int) -> Desc:
    return (region.addr + offset, length, region.dev)


class Lists:
    """Every descriptor list this side prepared, local and per peer, over the regions of ``local`` (this side's
    table) and ``peers`` (each peer's regions, as its metadata gave them). Called holding the agent's lock."""

    def __init__(
        self,
        agent: nixl_agent,
        capacity: int,
        local: RegionTable[Region],
        peers: Mapping[str, Mapping[int, RegionMeta]],
    ) -> None:
        self._agent = agent
        self._local_lists = PrepCache(capacity)
        self._remote_lists = PrepCache(capacity)
        self._local = local
        self._peers = peers
        self._local_blocks: BlockLists | None = None  # made on first use after a gridded region came or went
        self._remote_blocks: dict[str, BlockLists] = {}  # per peer written to, made by connect or the first write
        # kept until the block lists they index change (``drop_local_blocks``, ``forget``)
        self._routes: dict[tuple[str, tuple[int, ...], tuple[int, ...], int], BlockRoute | None] = {}

    def check_peer(self, peer: str, regions: Mapping[int, RegionMeta]) -> None:
        """Stage 2 of ``add_peer``: prepare one list per region of the peer's, which makes NIXL check each against
        the registrations of stage 1; ``ChannelError`` on a mismatch."""
        for region in regions.values():
            try:
                self.prepared(peer, region.mem, ((region.addr, region.size, region.dev),))
            except NIXL_ERRORS as exc:
                raise ChannelError(
                    f"nixl: peer {peer!r} region of {region.size} bytes at {region.addr:#x} does not match "
                    f"its registrations ({describe_nixl_error(exc)}); its metadata is stale or malformed"
                ) from exc

    def for_ops(
        self,
        peer: str,
        ops: Sequence[TransferOp],
        local: Mapping[int, RegionMeta],
        theirs: Mapping[int, RegionMeta],
        mems: tuple[str, str],
    ) -> Prepped:
        """The lists and indices of ``ops``: both sides' block lists where every op moves whole blocks between
        regions gridded in one block size on both sides, else lists of exactly their ranges."""
        sizes = {m.block for m in local.values()} | {m.block for m in theirs.values()}
        if len(sizes) == 1 and 0 not in sizes:
            block = sizes.pop()
            spans = np.array(ops, dtype=np.int64)  # TransferOp's fields as columns; check_ops bounded every one
            if not (spans[:, [1, 3, 4]] % block).any():
                return self._block_lists(peer, spans, block, mems)
        local_descs = tuple(_desc(local[o.local_region], o.local_offset, o.length) for o in ops)
        remote_descs = tuple(_desc(theirs[o.remote_region], o.remote_offset, o.length) for o in ops)
        return self._range_lists(peer, local_descs, remote_descs, mems)

    def _block_lists(self, peer: str, spans: np.ndarray, block: int, mems: tuple[str, str]) -> Prepped:
        """Both sides' block lists and the indices of the blocks of ``spans`` (ops as rows) in them."""
        mine, peers = self.local_blocks(), self.peer_blocks(peer)
        blocks = spans[:, 4] // block
        return (
            mine.lists[mems[0]],
            mine.indices(spans[:, 0], spans[:, 1], blocks, block),
            peers.lists[mems[1]],
            peers.indices(spans[:, 2], spans[:, 3], blocks, block),
        )

    def route(self, peer: str, blocks: BlockWrite) -> BlockRoute | None:
        """How ``blocks`` goes as index arrays into both sides' block lists, worked out once per set of regions (a
        sender's every chunk names the same ones: reading 30-80 regions' descriptions each chunk cost a 40-token
        write more than its own indices); None where a region is not gridded in ``blocks.block_bytes`` on both sides
        (the write goes as ops). Kept until either side's block lists are made again (a gridded region here came or
        went, or the peer's metadata was added again)."""
        key = (peer, blocks.local_regions, blocks.remote_regions, blocks.block_bytes)
        if key in self._routes:
            return self._routes[key]
        remote = self._peers[peer]
        local = [self._local[r].meta for r in blocks.local_regions]
        theirs = [remote[r] for r in blocks.remote_regions]
        route = None
        if all(m.block == blocks.block_bytes for m in (*local, *theirs)):
            mems = mems_of(peer, local, theirs)
            mine, peers = self.local_blocks(), self.peer_blocks(peer)
            route = BlockRoute(mems, mine.firsts(blocks.local_regions), peers.firsts(blocks.remote_regions))
        if len(self._routes) >= ROUTES_KEPT:
            self._routes.clear()
        self._routes[key] = route
        return route

    def for_blocks(self, peer: str, blocks: BlockWrite, route: BlockRoute) -> Prepped:
        """Both sides' block lists and the indices of ``blocks``' blocks in them, tensor by tensor (``route``:
        ``Lists.route`` of these blocks)."""
        mine, peers = self.local_blocks(), self.peer_blocks(peer)
        return (
            mine.lists[route.mems[0]],
            _indices(route.mine, blocks.local_blocks),
            peers.lists[route.mems[1]],
            _indices(route.theirs, blocks.remote_blocks),
        )

    def _range_lists(
        self, peer: str, local_descs: tuple[Desc, ...], remote_descs: tuple[Desc, ...], mems: tuple[str, str]
    ) -> Prepped:
        """Lists of exactly these ranges (a staging slot, a partial block), from the caches or made now, and every
        index of each."""
        indices = np.arange(len(local_descs), dtype=np.int32)
        return self.prepared("", mems[0], local_descs), indices, self.prepared(peer, mems[1], remote_descs), indices

    def prepared(self, agent: str, mem: str, descs: tuple[Desc, ...]) -> nixl_prepped_dlist_handle:
        """A prepared descriptor list, local (agent "") or for a peer, from the cache or made now."""
        cache = self._remote_lists if agent else self._local_lists
        return cache.get((agent, mem, descs), lambda: self._agent.prep_xfer_dlist(agent, list(descs), mem))

    def peer_blocks(self, peer: str) -> BlockLists:
        """``peer``'s block lists, made on the first need (``connect`` or a write): only a side that writes to a
        peer pays for one descriptor per block of its KV (a receiver adds every sender as a peer)."""
        lists = self._remote_blocks.get(peer)
        if lists is None:
            try:
                lists = self._remote_blocks[peer] = BlockLists(self._agent, peer, self._peers[peer])
            except NIXL_ERRORS as exc:
                raise ChannelError(
                    f"nixl: preparing the block lists of peer {peer!r}'s regions failed: {describe_nixl_error(exc)}"
                ) from exc
        return lists

    def local_blocks(self) -> BlockLists:
        """The local block lists, made now if a gridded region came or went since."""
        if self._local_blocks is None:
            try:
                self._local_blocks = BlockLists(self._agent, "", {r: e.meta for r, e in self._local.items()})
            except NIXL_ERRORS as exc:
                raise ChannelError(
                    f"nixl: preparing the block lists of this agent's regions failed: {describe_nixl_error(exc)}"
                ) from exc
        return self._local_blocks

    def drop_local_blocks(self) -> None:
        """Forget the local block lists: the regions they cover changed."""
        self._routes.clear()
        if self._local_blocks is not None:
            self._local_blocks.release()
            self._local_blocks = None

    def drop_local(self) -> None:
        """Release every local list: a prepared list holds the registration it was checked against."""
        self._local_lists.drop()
        self.drop_local_blocks()

    def forget(self, peer: str) -> None:
        """Release the lists prepared against ``peer``'s regions."""
        self._remote_lists.drop(peer)
        self._routes.clear()
        blocks = self._remote_blocks.pop(peer, None)
        if blocks is not None:
            blocks.release()
