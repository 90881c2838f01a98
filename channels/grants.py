"""Capabilities on the target side: which byte ranges of guarded regions each peer may write or read.

A channel lands a peer's bytes only where that peer's token was granted them
(``Grants``); the receiver grants a reservation's blocks to its sender's
token and revokes them when the reservation ends, waiting out any write
still landing there.

A channel that lands frames natively (tcp, where the kernels load) gives
its ``Grants`` a ``Mirror`` (``tcp/native.py``'s ``GrantMirror``): a native copy of the
write grants that its native frame loop checks frames against without the
GIL. Only this class writes the mirror, under its lock, and ``revoke`` waits
out that loop's frames too.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from pdkv.errors import ChannelError

Access = Literal["write", "read"]
Range = tuple[int, int, int]  # (region, offset, length)
Exposure = Literal["open", "granted", "closed"]


class Mirror(Protocol):
    """A native copy of the write grants (``pdkv.channels.tcp.native.GrantMirror``; named here, so this module needs no
    torch)."""

    def guard(self, region: int, on: bool) -> None: ...

    def add(self, token: bytes, ranges: Sequence[Range]) -> None: ...

    def remove(self, token: bytes, ranges: Sequence[Range]) -> None: ...

    def wait(self, token: bytes, ranges: Sequence[Range], timeout: float) -> bool: ...


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
        self._ranges: dict[
            tuple[bytes, str, int], list[tuple[int, int]]
        ] = {}  # (token, access, region) -> sorted [start, end)
        self._landing: dict[int, tuple[bytes, Sequence[Range]]] = {}  # ticket -> (token, the ranges it lands in)
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

    def guard(self, region: int) -> None:
        with self._cond:
            self._guarded.add(region)
            if self.mirror is not None:
                self.mirror.guard(region, True)

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
            return "closed"

    def grant(self, token: bytes, access: Access, ranges: Sequence[Range]) -> None:
        with self._cond:
            spans = _coalesce(ranges)
            for region, offset, length in spans:
                bisect.insort(self._ranges.setdefault((token, access, region), []), (offset, offset + length))
            if self.mirror is not None and access == "write":
                self.mirror.add(token, spans)

    def revoke(self, token: bytes, access: Access, ranges: Sequence[Range], timeout: float) -> bool:
        """Remove the ranges, then wait up to ``timeout`` s for frames of ``token`` landing in them; False if
        one still is."""
        spans = _coalesce(ranges)
        deadline = time.monotonic() + timeout
        with self._cond:
            for region, offset, length in spans:
                held = self._ranges.get((token, access, region))
                if held is not None:
                    self._ranges[(token, access, region)] = _subtract(held, offset, offset + length)
            if self.mirror is not None and access == "write":
                self.mirror.remove(token, spans)
            while any(
                t == token and r == region and lo < offset + length and offset < lo + n
                for t, landing in self._landing.values()
                for r, lo, n in landing
                for region, offset, length in spans
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        if self.mirror is None or access != "write":
            return True
        return self.mirror.wait(token, spans, max(0.0, deadline - time.monotonic()))

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
                if not _covers(self._ranges.get((token, access, region), []), offset, offset + length):
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
