"""The nixl channel's options (``channel_options`` in config)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdkv.channels.base import ChannelOptions


class NixlOptions(ChannelOptions):
    """Options of the nixl channel (``channel_options`` in config)."""

    backends: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["UCX"])
    # NIXL's progress thread, event-driven (channels/README.md, "nixl"). Off: the watcher's polls progress the agent,
    # which they must anyway to see a transfer finish; the thread's wake-ups only competed with them for the cores
    progress_thread: bool = False
    progress_delay_us: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 1000  # its longest sleep between wake-ups
    spin_s: Annotated[float, msgspec.Meta(ge=0)] = 0.005  # wait() busy-polls this long before backing off
    # longest pause between polls in wait(), and the watcher's while a region is open to every peer
    max_poll_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.001
    # the watcher's pause right after activity (channels/README.md, "nixl")
    watch_min_s: Annotated[float, msgspec.Meta(gt=0)] = 0.00005
    # the watcher's longest pause while a peer holds a write grant here (a reservation or a pool open: its
    # notification may come any moment); with no grant and every region guarded it sleeps until an event
    granted_poll_s: Annotated[float, msgspec.Meta(gt=0)] = 0.0002
    # after this long with nothing moving, a held grant is watched at max_poll_interval_s instead: a pool a sender
    # holds between requests costs ~1.6% of a core rather than ~11%, and the first write after the quiet spell
    # is seen up to max_poll_interval_s later (a grant, a post or a landed write makes the watch fast again)
    granted_idle_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    prep_cache_size: Annotated[int, msgspec.Meta(ge=1)] = 4096  # prepared lists of unaligned writes kept per side
    # the most blocks a region registered with a block size may have, here or at a peer: one descriptor each
    max_region_blocks: Annotated[int, msgspec.Meta(ge=1)] = 1 << 22
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0  # UCX backend worker threads (0: NIXL's default)
    # forgotten peers whose NIXL agent stays loaded for their next add_peer (see Peers.load); past this many the
    # one forgotten longest ago is unloaded (a peer that died for good: a decode worker restarted under a new name)
    parked_peers: Annotated[int, msgspec.Meta(ge=0)] = 16
