"""The peers: their NIXL agents loaded from stage 1 of their metadata (kept loaded, parked, past ``remove_peer``),
their regions from stage 2, and which of them answer notifications."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

from pdkv.channels.nixl.lib import NIXL_ERRORS, describe_nixl_error, nixl_agent
from pdkv.channels.nixl.meta import NixlMeta, RegionMeta
from pdkv.channels.reachability import Reachability
from pdkv.errors import ChannelError

log = logging.getLogger(__name__)


class Peers:
    """What this agent knows of each peer. Called holding the agent's lock."""

    def __init__(self, agent: nixl_agent, reachability: Reachability, parked_peers: int) -> None:
        self._agent = agent
        self._reachability = reachability
        self._parked_peers = parked_peers
        self.regions: dict[str, dict[int, RegionMeta]] = {}
        # NIXL agents loaded, by name: their metadata blob, kept past remove_peer (see load); and those a
        # transfer failed to (their endpoints may be dead: loaded afresh on the next add_peer)
        self.loaded: dict[str, bytes] = {}
        self.broken: set[str] = set()
        self._parked: OrderedDict[str, None] = OrderedDict()  # loaded but forgotten, the longest ago first
        self.answering: set[str] = set()  # peers that answer our notifications (their metadata says so)

    def load(self, meta: NixlMeta) -> None:
        """Stage 1: load the peer's agent metadata; a restarted peer of the same name replaces the old one.

        An agent still loaded from the same metadata is kept, endpoints and all, unless a transfer to it
        failed: NIXL's ``remove_remote_agent`` closes its UCX endpoints without waiting, and UCX keeps their
        TCP connections open on both sides, so unloading and reloading a live peer after each fence or lost
        control connection leaked a socket on each side per round of link faults (issue 31).
        """
        self._parked.pop(meta.name, None)
        if self.loaded.get(meta.name) == meta.agent and meta.name not in self.broken:
            return
        if meta.name in self.loaded:  # the peer restarted (new metadata under its name), or its endpoints failed
            self._unload(meta.name)
        try:
            loaded = self._agent.add_remote_agent(meta.agent)
        except NIXL_ERRORS as exc:
            raise self._reachability.record(
                meta.name,
                f"nixl: cannot reach peer {meta.name!r} from its metadata ({describe_nixl_error(exc)}); is it running, "
                "and do "
                "both sides use a network they share (UCX_NET_DEVICES is "
                f"{os.environ.get('UCX_NET_DEVICES', 'unset')!r} here)?",
            ) from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != meta.name:
            self._agent.remove_remote_agent(name)
            raise ChannelError(f"nixl: peer metadata names {meta.name!r} but its NIXL agent is {name!r}")
        self.loaded[name] = meta.agent

    def add(self, meta: NixlMeta) -> None:
        """Stage 2: the peer's regions, and whether it answers, from its metadata."""
        self.regions[meta.name] = dict(meta.regions)
        if meta.answers:
            self.answering.add(meta.name)
        else:
            self.answering.discard(meta.name)

    def forget(self, peer: str, unload: bool) -> None:
        """Forget the peer's regions. Its NIXL agent goes too with ``unload`` or when a transfer to it failed;
        otherwise it stays loaded for the next ``add_peer`` (``load`` says why), one of at most ``parked_peers``."""
        self.regions.pop(peer, None)
        if unload or peer in self.broken:
            self._unload(peer)
        elif peer in self.loaded:
            self._parked[peer] = None
            self._parked.move_to_end(peer)
            while len(self._parked) > self._parked_peers:
                self._unload(next(iter(self._parked)))

    def _unload(self, peer: str) -> None:
        """Drop the peer's NIXL agent and endpoints."""
        self.loaded.pop(peer, None)
        self.broken.discard(peer)
        self._parked.pop(peer, None)
        try:
            self._agent.remove_remote_agent(peer)
        except NIXL_ERRORS as exc:
            log.debug("nixl: removing peer %r: %s", peer, describe_nixl_error(exc))
