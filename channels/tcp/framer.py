"""A block write's DATA frames, built natively (csrc/kvsend.cpp) over our registered regions: the initiator's
``post_blocks`` and ``post_blocks_sealed`` frame through one ``BlockFramer``."""

from __future__ import annotations

from pdkv.channels.handle import BlockWrite
from pdkv.channels.landing import address_of
from pdkv.channels.regions import RegionTable
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.wire import MAX_RUNS

FRAMED_KEPT = 64  # sets of regions whose addresses are kept (a sender's chunks name one set per KV buffer)

Framed = tuple[tcp_native.FrameRegions, tuple[memoryview, ...]]


class BlockFramer:
    """Frames block writes over one region table. What ``tcp_native.block_frames`` reads of a write's regions (our
    regions' addresses, the peer's ids) is worked out once per set of regions registered, since a sender's every
    chunk names the same ones; our regions' views come with the frames, to keep the memory alive while a batch
    holds them."""

    def __init__(self, regions: RegionTable[memoryview], max_frame: int) -> None:
        self._regions, self._max_frame = regions, max_frame
        self._framed: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Framed] = {}

    def frames(
        self, blocks: BlockWrite, parts: int, xfer: int, notif: bytes | None, sealed_tail: int = 0
    ) -> tuple[tcp_native.BlockFrames | None, tuple[memoryview, ...]]:
        """``blocks``' frames cut into at most ``parts`` shares (``tcp_native.block_frames``: the frames the Python
        path would send, byte for byte, or a sealed write's), and the views they point into."""
        regions, views = self._regions_of(blocks.local_regions, blocks.remote_regions)
        frames = tcp_native.block_frames(
            regions,
            blocks.local_blocks,
            blocks.remote_blocks,
            blocks.block_bytes,
            parts,
            self._max_frame,
            MAX_RUNS,
            xfer,
            notif,
            sealed_tail,
        )
        return frames, views

    def _regions_of(self, ours: tuple[int, ...], theirs: tuple[int, ...]) -> Framed:
        key = (self._regions.generation, ours, theirs)
        found = self._framed.get(key)
        if found is None:
            if len(self._framed) >= FRAMED_KEPT:
                self._framed.clear()
            views = tuple(self._regions[r] for r in ours)
            found = self._framed[key] = (tcp_native.FrameRegions.of([address_of(v) for v in views], theirs), views)
        return found
