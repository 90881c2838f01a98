"""Capabilities on the target side: which byte ranges of guarded regions each peer may write or read.

A channel lands a peer's bytes only where that peer's token was granted them
(``Grants``); the receiver grants a reservation's blocks to its sender's
token and revokes them when the reservation ends, waiting out any write
still landing there.

A KV buffer's tensors are granted and revoked in whole blocks over all of
them at once (``GridSpans`` over a ``BlockGrid``): a reservation's blocks are
the same block ids in every tensor, and kept once per grid, not once per
tensor, so a grant costs the same for a model of 30 layers as of 80. A
region of a grid is written only through its grid's grants.

A channel that lands frames natively (tcp, where the kernels load) gives
its ``Grants`` a ``Mirror`` (``tcp/native.py``'s ``GrantMirror``): a native copy of the
write grants that its native frame loop checks frames against without the
GIL. Only this class writes the mirror, under its lock, and ``revoke`` waits
out that loop's frames too.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from pdkv.errors import ChannelError

Access = Literal["write", "read"]
Range = tuple[int, int, int]  # (region, offset, length)
Exposure = Literal["open", "granted", "closed"]


Span = tuple[int, int]  # (offset, length) in each region of a grid


@dataclass(frozen=True, eq=False)
class BlockGrid:
    """Guarded regions laid out alike in blocks of ``block_bytes``: block ``i`` at byte ``i * block_bytes`` of each
    (a KV buffer's tensors). Granted in whole blocks over all of its regions at once (``GridSpans``). One
    object per buffer: a grid is itself (compared and hashed by identity, in O(1) however many regions it has)."""

    regions: tuple[int, ...]
    block_bytes: int
    packed: bytes = field(init=False, repr=False, compare=False)  # the regions as native int64s (for the mirror)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions))
        if self.block_bytes <= 0 or len(set(self.regions)) != len(self.regions):
            raise ChannelError(
                f"a block grid needs distinct regions and blocks of at least one byte (regions {self.regions}, "
                f"block_bytes {self.block_bytes})"
            )
        object.__setattr__(self, "packed", struct.pack(f"={len(self.regions)}q", *self.regions))

    def spans(self, blocks: Iterable[int]) -> list[Span]:
        """``blocks``' bytes in each region, (offset, length) with adjacent blocks as one, in ascending order."""
        runs: list[list[int]] = []
        for b in sorted(blocks):
            if b < 0:
                raise ChannelError(f"block id {b} of a block grid is negative")
            if runs and runs[-1][1] >= b:
                runs[-1][1] = max(runs[-1][1], b + 1)
            else:
                runs.append([b, b + 1])
        size = self.block_bytes
        return [(lo * size, (hi - lo) * size) for lo, hi in runs]

    def ranges(self, spans: Sequence[Span]) -> list[Range]:
        """``spans`` in every region, region by region: the (region, offset, length) ranges they stand for."""
        return [(region, offset, n) for region in self.regions for offset, n in spans]


class GridSpans(NamedTuple):
    """``spans`` (``BlockGrid.spans`` of some blocks) in every region of ``grid``: granted or revoked as one, the way
    a receiver grants a reservation's blocks of its whole KV buffer (``Channel.grant``, ``Channel.revoke``)."""

    grid: BlockGrid
    spans: Sequence[Span]


Grantable = Sequence[Range] | GridSpans  # what ``grant`` and ``revoke`` take


class Mirror(Protocol):
    """A native copy of the write grants (``pdkv.channels.tcp.native.GrantMirror``; named here, so this module needs no
    torch)."""

    def guard(self, region: int, on: bool) -> None: ...

    def add(self, token: bytes, ranges: Grantable) -> None: ...

    def remove(self, token: bytes, ranges: Grantable) -> None: ...

    def wait(self, token: bytes, ranges: Grantable, timeout: float) -> bool: ...


class Grants:
    """The target side's capability table: which byte ranges of *guarded* regions each peer may write or read.

    A region registered plainly is open to every peer that reaches the
    channel (tests, benchmarks, the raw channel). A ``guard``ed one is open only
    through grants: a ``KVReceiver`` guards its KV buffer and staging area and
    grants a sender exactly the blocks (or staging slots) of a reservation it
    opened, for as long as that reservation lasts. Peers are named by the
    capability *token* each transfer presents (``Channel.write(..., token=)``),
    which the decode side learned from that sender's authenticated Hello; a
    claimed agent name proves nothing.

    ``use`` checks one frame's range before a byte of it lands and marks it as
    landing until done; ``revoke`` removes ranges and then waits out any frame
    still landing in them (the fence), so once it returns true, nothing of that
    peer touches them again and they may go to another request.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._guarded: set[int] = set()
        self._sealed: set[int] = set()
        self._ranges: dict[
            tuple[bytes, str, int], list[tuple[int, int]]
        ] = {}  # (token, access, region) -> sorted [start, end)
        self._landing: dict[int, tuple[bytes, Sequence[Range]]] = {}  # ticket -> (token, the ranges it lands in)
        self._grids: dict[int, BlockGrid] = {}  # region -> the grid it is written through (``GridSpans``)
        self._adopted: set[BlockGrid] = set()
        # (token, grid) -> sorted [start, end) spans it may write in every region of the grid
        self._blocks: dict[tuple[bytes, BlockGrid], list[tuple[int, int]]] = {}
        self._tickets = itertools.count()
        self.mirror: Mirror | None = None  # the write grants, natively, where a channel lands frames natively

    def mirror_to(self, mirror: Mirror) -> None:
        """Keep ``mirror`` a copy of the write grants from now on, starting with those held now."""
        with self._cond:
            self.mirror = mirror
            for region in self._guarded:
                mirror.guard(region, True)
            for (token, access, region), held in self._ranges.items():
                if access == "write":
                    mirror.add(token, [(region, lo, hi - lo) for lo, hi in held])
            for (token, grid), spans in self._blocks.items():
                mirror.add(token, GridSpans(grid, [(lo, hi - lo) for lo, hi in spans]))

    def guard(self, region: int, sealed: bool = False) -> None:
        """``region`` only through grants from now on; ``sealed``: through none, ever (``grant`` refuses it)."""
        with self._cond:
            self._guarded.add(region)
            if sealed:
                self._sealed.add(region)
            if self.mirror is not None:
                self.mirror.guard(region, True)

    def sealed(self) -> frozenset[int]:
        """The regions no grant may ever open (``guard(..., sealed=True)``)."""
        with self._cond:
            return frozenset(self._sealed)

    def guarded(self, region: int) -> bool:
        with self._cond:
            return region in self._guarded

    def exposure(self, regions: Iterable[int], access: Access = "write") -> Exposure:
        """Whether a peer may touch ``regions`` now: ``open`` (one is not guarded: any peer, any time),
        ``granted`` (a grant in one is held), or ``closed``: nothing can arrive until a grant is made."""
        with self._cond:
            if any(region not in self._guarded for region in regions):
                return "open"
            if any(spans for (_, a, _), spans in self._ranges.items() if a == access):
                return "granted"
            if access == "write" and any(self._blocks.values()):
                return "granted"
            return "closed"

    def grant(self, token: bytes, access: Access, ranges: Grantable) -> None:
        """Raises ``ChannelError`` for a range in a sealed region: no peer may touch one, whatever it was given."""
        if isinstance(ranges, GridSpans):
            self._grant_blocks(token, access, ranges)
            return
        with self._cond:
            self._not_sealed(region for region, _, _ in ranges)
            self._not_in_grids(access, ranges)
            spans = _coalesce(ranges)
            for region, offset, length in spans:
                bisect.insort(self._ranges.setdefault((token, access, region), []), (offset, offset + length))
            if self.mirror is not None and access == "write":
                self.mirror.add(token, spans)

    def revoke(self, token: bytes, access: Access, ranges: Grantable, timeout: float) -> bool:
        """Remove the ranges, then wait up to ``timeout`` s for frames of ``token`` landing in them; False if
        one still is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if isinstance(ranges, GridSpans):
                removed: Grantable = ranges
                _grid_access(access)  # a grid never granted holds nothing to take back: it is not adopted here
                held = self._blocks.get((token, ranges.grid))
                if held is not None:
                    for offset, length in ranges.spans:
                        held = _subtract(held, offset, offset + length)
                    self._blocks[(token, ranges.grid)] = held
            else:
                removed = _coalesce(ranges)
                self._not_in_grids(access, removed)
                for region, offset, length in removed:
                    held = self._ranges.get((token, access, region))
                    if held is not None:
                        self._ranges[(token, access, region)] = _subtract(held, offset, offset + length)
            if self.mirror is not None and access == "write":
                self.mirror.remove(token, removed)
            while self._landing_in(token, removed):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        if self.mirror is None or access != "write":
            return True
        return self.mirror.wait(token, removed, max(0.0, deadline - time.monotonic()))

    def _grant_blocks(self, token: bytes, access: Access, granted: GridSpans) -> None:
        """``grant`` of ``granted.spans`` in every region of its grid, kept once for all of them: the grid's regions
        are written only this way from its first grant on."""
        grid, spans = granted
        with self._cond:
            self._not_sealed(grid.regions)
            self._adopt(grid, access)
            held = self._blocks.setdefault((token, grid), [])
            for offset, length in spans:
                bisect.insort(held, (offset, offset + length))
            if self.mirror is not None:
                self.mirror.add(token, granted)

    def _not_sealed(self, regions: Iterable[int]) -> None:
        """Raise ``ChannelError`` if one of ``regions`` is sealed; the caller holds the lock."""
        if shut := sorted(self._sealed.intersection(regions)):
            raise ChannelError(f"region(s) {shut} are sealed: no peer may read or write them, so none is granted")

    def _landing_in(self, token: bytes, ranges: Grantable) -> bool:
        """Whether a frame of ``token`` that the Python loop admitted still lands in ``ranges`` (caller holds the
        lock)."""
        if not self._landing:
            return False
        where = ranges.grid.ranges(ranges.spans) if isinstance(ranges, GridSpans) else ranges
        return any(
            t == token and r == region and lo < offset + length and offset < lo + n
            for t, landing in self._landing.values()
            for r, lo, n in landing
            for region, offset, length in where
        )

    def _adopt(self, grid: BlockGrid, access: Access) -> None:
        """Make ``grid``'s regions written through it alone (caller holds the lock): ChannelError where one is
        another grid's, or holds write grants by range (or the grant is not a write's: a grid is written)."""
        _grid_access(access)
        if grid in self._adopted:
            return
        for region in grid.regions:
            other = self._grids.get(region)
            if other is not None and other is not grid:
                raise ChannelError(f"region {region} is granted in blocks of another grid ({other.regions})")
            if any(spans for (_, a, r), spans in self._ranges.items() if a == "write" and r == region):
                raise ChannelError(f"region {region} holds grants by range: it cannot be granted in whole blocks too")
        for region in grid.regions:
            self._grids[region] = grid
        self._adopted.add(grid)

    def _not_in_grids(self, access: Access, ranges: Iterable[Range]) -> None:
        """ChannelError for a write grant by range into a region written through a grid (caller holds the lock)."""
        if access == "write" and self._grids:
            for region, _, _ in ranges:
                if region in self._grids:
                    raise ChannelError(
                        f"region {region} is granted in whole blocks of its grid: grant and revoke it by GridSpans"
                    )

    def _held(self, token: bytes, access: Access, region: int) -> list[tuple[int, int]]:
        """What ``token`` may touch of ``region`` (caller holds the lock): its grid's spans, or its ranges."""
        grid = self._grids.get(region) if access == "write" else None
        if grid is not None:
            return self._blocks.get((token, grid), [])
        return self._ranges.get((token, access, region), [])

    def begin(self, token: bytes, access: Access, region: int, offset: int, length: int) -> int | None:
        """Admit one frame: a ticket while it lands (end it with ``end``), None for an open region; ChannelError
        if refused."""
        return self.begin_many(token, access, ((region, offset, length),))

    def begin_many(self, token: bytes, access: Access, ranges: Sequence[Range]) -> int | None:
        """Admit a frame of several runs, all or nothing: a ticket while they land, None if every region is open;
        ChannelError naming the first run refused, and then none of them is admitted."""
        with self._cond:
            guarded = [rng for rng in ranges if rng[0] in self._guarded]
            if not guarded:
                return None
            for region, offset, length in guarded:
                if not _covers(self._held(token, access, region), offset, offset + length):
                    raise ChannelError(
                        f"no {access} grant for region {region} bytes [{offset}, {offset + length}): not reserved for "
                        "this peer"
                    )
            ticket = next(self._tickets)
            self._landing[ticket] = (token, guarded)
            return ticket

    def end(self, ticket: int | None) -> None:
        if ticket is None:
            return
        with self._cond:
            del self._landing[ticket]
            self._cond.notify_all()


def _grid_access(access: Access) -> None:
    """ChannelError unless ``access`` is a write's: a grid is granted and revoked for writing, reads by range."""
    if access != "write":
        raise ChannelError("a block grid is granted for writing; grant reads by range")


def _coalesce(ranges: Sequence[Range]) -> list[Range]:
    """Merge ranges of one region that touch, so a reservation of adjacent blocks is one interval."""
    out: list[Range] = []
    for region, offset, length in sorted(ranges):
        if out and out[-1][0] == region and out[-1][1] + out[-1][2] >= offset:
            r, o, n = out[-1]
            out[-1] = (r, o, max(n, offset + length - o))
        else:
            out.append((region, offset, length))
    return out


def _covers(intervals: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether sorted, disjoint ``intervals`` cover ``[start, end)`` (through touching neighbours)."""
    i = bisect.bisect_right(intervals, (start, float("inf"))) - 1
    while i >= 0 and i < len(intervals) and intervals[i][0] <= start < intervals[i][1]:
        if intervals[i][1] >= end:
            return True
        start = intervals[i][1]
        i += 1
    return False


def _subtract(intervals: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    out = []
    for lo, hi in intervals:
        if hi <= start or end <= lo:
            out.append((lo, hi))
            continue
        if lo < start:
            out.append((lo, start))
        if end < hi:
            out.append((end, hi))
    return out
