"""Hashing landed bytes while they are in cache: a channel that receives them itself (tcp) lets verification skip
the read pass over a direct-mode chunk.

The chunk checksum is linear (pdkv/checksum.py): a block's part of it can be
computed piece by piece, as each piece of it lands, and combined at
verification with the weight of the block's position in the chunk. The
receiving thread does that (csrc/kvland.cpp: ``pdkv_recv_runs``) for the
regions ``enable``d here, into one landing table per region (three words a
unit: partial sum, tiling signature, bytes landed). ``checksum`` then gives
``blocks_checksum``'s value: of a block that landed exactly once in hashed
pieces, from the bytes as they landed (nothing else writes there, below); of
any other (partly landed, landed twice, a receive that failed halfway, pieces
not whole words, TLS, which lands through Python), read from memory as before.
The descriptors of every registered region (``snapshot``) also let the target
check a frame's run table in one native call (``pdkv_check_runs``).

A table entry is valid only while the bytes in memory are the ones hashed:
only granted frames write into a guarded region, so ``reset`` clears the
entries of every range when it is granted (a new owner: a fresh reservation
or pool), and nothing landed under an earlier grant is counted.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdkv import native
from pdkv.channels.grants import Grantable, GridSpans
from pdkv.checksum import finish
from pdkv.errors import ChannelError

_DESC = 5  # a region's descriptor words (csrc/kvland.cpp): base, size, unit (0: not hashed), table, units


@dataclass(frozen=True)
class Snapshot:
    """The region descriptors as one frame is checked and received with; holds every table and region it points to,
    so none is freed under a receive still running after a region was deregistered."""

    desc: torch.Tensor  # [regions, 5] int64
    tables: tuple[torch.Tensor, ...]
    views: tuple[memoryview, ...]  # the regions' memory, kept alive as long as a receive may write there
    generation: int = 0  # the count of snapshots published before this one

    @property
    def address(self) -> int:
        return self.desc.data_ptr()

    @property
    def count(self) -> int:
        return self.desc.shape[0]

    def regions(self, counter: int) -> tuple[int, int, int, int]:
        """What the native frame loop lands under: descriptors, their count, the address of the live generation
        counter (``counter``: a frame is handed back once it moved on) and this snapshot's generation."""
        return self.address, self.count, counter, self.generation


def pack(ranges: Grantable) -> tuple[bytes, int]:
    """``ranges`` as the native kernels take them (``native.pack_ranges``), and how many: a grid's spans in each of its
    regions built natively (``native.grid_ranges``), however many regions it has."""
    if isinstance(ranges, GridSpans):
        grid = ranges.grid
        return native.grid_ranges(grid.packed, len(grid.regions), ranges.spans)
    return native.pack_ranges(ranges), len(ranges)


def address_of(view: memoryview) -> int:
    """The host address of a writable byte view (0 when empty)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


class LandingSums:
    """Per region: where it is, and (once ``enable``d) its landing table; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[int, int]] = {}  # region -> (address, size)
        self._views: dict[int, memoryview] = {}
        self._tables: dict[int, tuple[int, torch.Tensor]] = {}  # region -> (unit, [units, 3] int64)
        self._prepared: dict[tuple[tuple[int, ...], int], tuple[native.Int64s, native.Int64s, int]] = {}
        self.snapshot = Snapshot(torch.zeros((0, _DESC), dtype=torch.int64), (), ())
        # the snapshot's generation, where the native frame loop reads it (csrc/kvframes.cpp): a loop serving under
        # an older snapshot hands its next frame back, to be checked against the regions as they now are
        self._generation = ctypes.c_int64(0)
        self.generation_address = ctypes.addressof(self._generation)

    def add_region(self, region: int, view: memoryview) -> None:
        with self._lock:
            self._regions[region] = (address_of(view), view.nbytes)
            self._views[region] = view
            self._publish()

    def remove_region(self, region: int) -> None:
        with self._lock:
            self._regions.pop(region, None)
            self._views.pop(region, None)
            self._tables.pop(region, None)
            self._publish()

    def clear(self) -> None:
        """Forget every region (at close): their memory is no longer held here."""
        with self._lock:
            self._regions.clear()
            self._views.clear()
            self._tables.clear()
            self._publish()

    def enable(self, region: int, unit: int) -> None:
        """Hash what lands in ``region`` from now on, in units of ``unit`` bytes (a KV block)."""
        with self._lock:
            if region not in self._regions:
                raise ChannelError(f"landing sums: region {region} is not registered")
            if unit <= 0:
                raise ChannelError(f"landing sums: a unit of {unit} bytes")
            size = self._regions[region][1]
            self._tables[region] = (unit, torch.zeros((-(-size // unit), 3), dtype=torch.int64))
            self._publish()

    def reset(self, ranges: Grantable) -> None:
        """Forget what landed in ``ranges`` (every unit they touch): they are being granted to a new owner."""
        packed = pack(ranges)
        with self._lock:  # the snapshot's descriptor: every hashed region's table (csrc/kvland.cpp), one call
            desc = self.snapshot.desc
            native.landing_reset(desc.data_ptr(), desc.shape[0], *packed)

    def checksum(self, regions: Sequence[int], ids: Sequence[int], unit: int) -> tuple[int, int]:
        """``blocks_checksum`` of blocks ``ids`` of every region in turn, from what was hashed as it landed; returns
        (the checksum, blocks read from memory). ChannelError if a region is not hashed in units of ``unit``."""
        key = (tuple(regions), unit)
        with self._lock:
            prepared = self._prepared.get(key)
            if prepared is None:
                prepared = self._prepared[key] = self._prepare(regions, unit)
        bases, tables, num_blocks = prepared
        try:
            acc, reread = native.landed_blocks(bases, tables, ids, num_blocks, unit)
        except IndexError as exc:
            raise ChannelError(f"landing sums: {exc}") from None
        return finish(acc, len(regions) * len(ids) * unit), reread

    def _prepare(self, regions: Sequence[int], unit: int) -> tuple[native.Int64s, native.Int64s, int]:
        """What ``checksum`` hands the kernel for these regions (their addresses, their tables' and the fewest
        whole blocks among them), worked out once per snapshot: a receiver verifies every chunk over the same
        ~30 regions (caller holds the lock; ``_publish`` forgets it all)."""
        try:
            entries = [(self._regions[r], self._tables[r]) for r in regions]
        except KeyError as exc:
            raise ChannelError(f"landing sums: region {exc.args[0]} is not hashed as it lands") from None
        if any(u != unit for _, (u, _) in entries):
            raise ChannelError(f"landing sums: regions {list(regions)} are not all hashed in units of {unit} bytes")
        return (
            native.int64s([addr for (addr, _), _ in entries]),
            native.int64s([t.data_ptr() for _, (_, t) in entries]),
            min(size for (_, size), _ in entries) // unit,
        )

    def _publish(self) -> None:
        """A new snapshot for the receives that start from now on (caller holds the lock)."""
        self._prepared.clear()
        n = max(self._regions, default=-1) + 1
        desc = torch.zeros((n, _DESC), dtype=torch.int64)
        tables = []
        for region, (addr, size) in self._regions.items():
            unit, table = self._tables.get(region, (0, None))
            desc[region] = torch.tensor(
                [
                    addr,
                    size,
                    unit,
                    table.data_ptr() if table is not None else 0,
                    table.shape[0] if table is not None else 0,
                ]
            )
            if table is not None:
                tables.append(table)
        generation = self._generation.value + 1
        self.snapshot = Snapshot(desc, tuple(tables), tuple(self._views.values()), generation)
        self._generation.value = generation
