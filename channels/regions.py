"""The region table every channel keeps: its own registered regions, and the sizes of its peers'.

Every channel numbers the buffers it registers, keeps something for each (a
byte view, a NumPy view, NIXL's registration), publishes their sizes in its
metadata, learns its peers' sizes from theirs, and checks each range of a
transfer against both before a byte moves. One table does that bookkeeping
for all of them, so a range is checked the same way, with the same message,
over every channel.
"""

from __future__ import annotations

import itertools
from collections.abc import ItemsView, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from pdkv.errors import ChannelError

if TYPE_CHECKING:
    from pdkv.channels.handle import BlockWrite, TransferOp

E = TypeVar("E")
FEWEST_KEPT = 64  # region sets whose fewest blocks a table keeps (a sender names one set per peer)


class RegionTable(Generic[E]):
    """Regions registered here (id -> size and the channel's entry for it) and each peer's region sizes.

    ``owner`` (the channel's name) leads the errors the table raises.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._entries: dict[int, E] = {}
        self._sizes: dict[int, int] = {}
        self._peers: dict[str, dict[int, int]] = {}
        self._ids = itertools.count()
        # (generation, peer or None for ours, regions, block size) -> the fewest whole blocks of those regions: a
        # sender's every chunk names the same regions. ``_changed`` moves the generation after each change of sizes.
        self._fewest: dict[tuple[int, str | None, tuple[int, ...], int], int] = {}
        self._generation = 0

    # -- this agent's regions ----------------------------------------------------
    def add(self, entry: E, size: int) -> int:
        """Register ``entry`` of ``size`` bytes under the next region id; returns the id."""
        region = next(self._ids)
        self._entries[region] = entry
        self._sizes[region] = size
        self._changed()
        return region

    def remove(self, region: int) -> E | None:
        """Forget a region; returns its entry, or None if it was not registered."""
        self._sizes.pop(region, None)
        self._changed()
        return self._entries.pop(region, None)

    def __getitem__(self, region: int) -> E:
        return self._entries[region]

    def get(self, region: int) -> E | None:
        return self._entries.get(region)

    def items(self) -> ItemsView[int, E]:
        return self._entries.items()

    def sizes(self) -> dict[int, int]:
        """A copy of region id -> size, for the channel's metadata."""
        return dict(self._sizes)

    def clear(self) -> None:
        """Forget every region of this agent (at close); the peers' tables stay until they are removed."""
        self._entries.clear()
        self._sizes.clear()
        self._changed()

    def check(self, region: int, offset: int, length: int, whose: str = "local") -> None:
        """Raise ``ChannelError`` unless ``[offset, offset+length)`` lies inside this agent's ``region``."""
        _check_range(self._sizes, region, offset, length, whose)

    # -- the peers' regions --------------------------------------------------------
    def add_peer(self, peer: str, sizes: Mapping[int, int]) -> None:
        """Record ``peer``'s region sizes from its metadata, replacing what was known of it."""
        self._peers[peer] = dict(sizes)
        self._changed()

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._changed()

    def clear_peers(self) -> None:
        self._peers.clear()
        self._changed()

    @property
    def generation(self) -> int:
        """Moves on with every change of the regions (ours or a peer's): what was worked out for them is stale."""
        return self._generation

    def _changed(self) -> None:
        """Sizes changed (called after the change): what ``_fewest_blocks`` worked out before no longer holds. A
        check racing with the change stores its answer under the generation it began in, never read again."""
        self._generation += 1
        self._fewest.clear()

    def check_ops(self, peer: str, ops: Sequence[TransferOp]) -> int:
        """Validate every op against local and the peer's region sizes; return total bytes.

        Done before anything is posted, so a bad descriptor never moves a byte.
        """
        remote = self._peers.get(peer)
        if remote is None:
            raise ChannelError(f"{self.owner}: unknown peer {peer!r}; call add_peer with its metadata first")
        if not ops:
            raise ChannelError(f"{self.owner}: empty transfer to {peer!r}")
        total = 0
        for op in ops:
            _check_range(self._sizes, op.local_region, op.local_offset, op.length, "local")
            _check_range(remote, op.remote_region, op.remote_offset, op.length, f"peer {peer!r}")
            total += op.length
        return total

    def check_blocks(self, peer: str, write: BlockWrite) -> int:
        """``check_ops`` for a write of whole blocks, on its arrays' bounds (``BlockWrite.bounds``), not a Python
        pass per op. Refuses exactly what ``check_ops(peer, write.ops())`` refuses, with its message (a refused
        write is handed to it to name the first range refused); returns total bytes.

        A block id ``b`` fits a region of ``size`` bytes exactly when ``0 <= b < size // block_bytes``: the op
        of the run holding it then fits too, and an op fits when every block of its run does.
        """
        if peer not in self._peers:
            raise ChannelError(f"{self.owner}: unknown peer {peer!r}; call add_peer with its metadata first")
        if not len(write.local_blocks) or not write.local_regions:
            raise ChannelError(f"{self.owner}: empty transfer to {peer!r}")
        fits = all(
            lo >= 0 and hi < self._fewest_blocks(whose, regions, write.block_bytes)
            for whose, regions, (lo, hi) in (
                (None, write.local_regions, write.bounds[0]),
                (peer, write.remote_regions, write.bounds[1]),
            )
        )
        return write.nbytes if fits else self.check_ops(peer, write.ops())

    def _fewest_blocks(self, peer: str | None, regions: tuple[int, ...], block_bytes: int) -> int:
        """The fewest whole blocks of ``block_bytes`` in any of ``regions`` (ours, or ``peer``'s); 0 if one of them
        is not registered."""
        key = (self._generation, peer, regions, block_bytes)
        fewest = self._fewest.get(key)
        if fewest is None:
            if len(self._fewest) >= FEWEST_KEPT:
                self._fewest.clear()
            sizes = self._sizes if peer is None else self._peers.get(peer, {})
            fewest = self._fewest[key] = min(sizes.get(region, 0) // block_bytes for region in regions)
        return fewest


def _check_range(sizes: Mapping[int, int], region: int, offset: int, length: int, whose: str) -> None:
    """Raise ``ChannelError`` unless ``[offset, offset+length)`` lies inside ``region``."""
    size = sizes.get(region)
    if size is None:
        raise ChannelError(f"{whose} region {region} is not registered")
    if offset < 0 or length <= 0 or offset + length > size:
        raise ChannelError(
            f"{whose} range offset={offset} length={length} does not fit region {region} of {size} bytes"
        )
