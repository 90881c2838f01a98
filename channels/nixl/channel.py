"""``NixlChannel``: the ``Channel`` interface over the nixl channel's rooms (the package docstring names them)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec

from pdkv.channels.answers import Asks
from pdkv.channels.base import Channel, ChannelOptions
from pdkv.channels.grants import Access, Grantable
from pdkv.channels.handle import BlockWrite, Notification, TransferHandle, TransferOp, XferState, merge_ops
from pdkv.channels.nixl.agent import Agent
from pdkv.channels.nixl.lib import NIXL_ERRORS, OPEN, describe_nixl_error
from pdkv.channels.nixl.lists import Lists, mems_of
from pdkv.channels.nixl.meta import METADATA_VERSION, NixlMeta, check_grid, decode_metadata, describe_buffer
from pdkv.channels.nixl.notices import Notices
from pdkv.channels.nixl.options import NixlOptions
from pdkv.channels.nixl.peers import Peers
from pdkv.channels.nixl.transfers import NixlTransferHandle, Transfers
from pdkv.channels.nixl.watcher import Watcher
from pdkv.errors import ChannelError

log = logging.getLogger(__name__)


class NixlChannel(Channel):
    """Transfers through a NIXL agent; the design: channels/README.md, "nixl"."""

    name: ClassVar[str] = "nixl"
    Options = NixlOptions
    enforces_grants: ClassVar[bool] = False  # RDMA/cma writes never pass through the target's code
    # VRAM by address; emulated device memory (PDKV_EMULATE_DEVICE) by address too, as DRAM: the direct
    # device path on CPU, with no host view taken.
    memory: ClassVar[frozenset[str]] = frozenset({"host", "cuda", "emulated"})
    carries_answers: ClassVar[bool] = True  # as notifications of their own (channels/answers.py)

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        super().__init__(agent_name, options)
        opts: NixlOptions = self.options  # type: ignore[assignment]
        self._opts = opts
        self._agent = Agent(agent_name, opts)
        self._peers = Peers(self._agent.nixl, self.reachability, opts.parked_peers)
        self._lists = Lists(self._agent.nixl, opts.prep_cache_size, self.regions, self._peers.regions)
        asks = Asks()  # our writes waiting for their answer
        self._notices = Notices(self._agent, asks, self.inbox)
        self._transfers = Transfers(self._agent, self._peers, asks, self._notices)
        self._watcher = Watcher(self._agent, opts, self._transfers, self.regions, self.grants)
        OPEN.add(self)

    @property
    def watch_polls(self) -> int:
        """The watcher's passes: none while nothing can arrive."""
        return self._watcher.polls

    # -- memory ------------------------------------------------------------
    def register(self, buf: Any, block_bytes: int = 0) -> int:
        meta = describe_buffer(buf)
        if block_bytes:
            meta.block = block_bytes
            check_grid(meta, "a buffer registered here", self._opts.max_region_blocks)
        with self._agent.lock:
            self._agent.check_open()
            region = self.regions.add(self._agent.register(meta, buf), meta.size)
            if meta.block:
                self._lists.drop_local_blocks()
        self._watcher.wake()  # open to every peer until guarded: the watcher looks for notifications
        return region

    def grant(self, token: bytes, access: Access, ranges: Grantable) -> None:
        """A peer may write here from now on: its notification is what the watcher waits for."""
        super().grant(token, access, ranges)
        self._watcher.moved()

    def deregister(self, region: int) -> None:
        with self._agent.lock:
            entry = self.regions.remove(region)
            if entry is None or self._agent.closed:
                return
            self._lists.drop_local()  # a prepared list holds the registration it was checked against
            self._agent.deregister(entry)

    def registered_with_nixl(self, buf: Any) -> bool:
        """NIXL's own word, not pdkv's table: whether ``buf``'s bytes are registered with this agent (NIXL prepares a
        descriptor list over them). A leak check reads it: a released region must be gone from NIXL too."""
        meta = describe_buffer(buf)
        with self._agent.lock:
            self._agent.check_open()
            return self._agent.registered(meta)

    def metadata(self) -> bytes:
        with self._agent.lock:
            self._agent.check_open()
            sealed = self.grants.sealed()
            regions = self.regions.items()
            shown = {r: e.meta for r, e in regions if r not in sealed}
            hidden = len(shown) < len(regions)  # sealed regions: their keys stay here (``guard``)
            agent_md = self._agent.metadata(list(shown.values()) if hidden else None)
            meta = NixlMeta(METADATA_VERSION, self.agent_name, agent_md, shown, self.inbox.answerer is not None)
        return msgspec.msgpack.encode(meta)

    # -- peers -------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        meta = decode_metadata(metadata, self.agent_name, self._opts.max_region_blocks)
        self.reachability.check(meta.name)  # UCX connects here: a known-unreachable peer fails without waiting again
        with self._agent.lock:
            self._agent.check_open()
            self._peers.load(meta)  # stage 1
            self._lists.forget(meta.name)
            self._peers.add(meta)
            self.regions.add_peer(meta.name, {r: m.size for r, m in meta.regions.items()})
            try:
                self._lists.check_peer(meta.name, meta.regions)  # stage 2
            except ChannelError:
                self._forget_peer(meta.name, unload=True)
                raise
        return meta.name

    def fence(self, peer: str, token: bytes) -> None:
        """NIXL writes are one-sided: the target cannot stop a peer holding its registration keys. The sender's
        own lease check (it stops writing once its heartbeats may have lapsed) is the defence here; forget the
        peer (``remove_peer``) so that it must hand over its metadata again."""
        log.warning("nixl: cannot fence peer %r: its one-sided writes never pass through this agent", peer)
        self.remove_peer(peer)

    def _remove_peer(self, peer: str) -> None:
        with self._agent.lock:
            if not self._agent.closed:
                self._forget_peer(peer, f"peer {peer!r} removed")

    def _probe(self, peer: str, timeout: float, token: bytes) -> None:
        """Have NIXL open its connections to ``peer`` now (UCX created the endpoint, and connected, in ``add_peer``)."""
        with self._agent.lock:
            self._agent.check_open()
            if peer not in self._peers.regions:
                raise ChannelError(f"nixl: unknown peer {peer!r}; call add_peer with its metadata first")
            try:
                self._agent.nixl.make_connection(peer)
            except NIXL_ERRORS as exc:
                raise ChannelError(f"nixl: cannot connect to peer {peer!r}: {describe_nixl_error(exc)}") from exc
            # the side that writes connects (a sender, at its handshake): its first write finds the lists made
            self._lists.local_blocks()
            self._lists.peer_blocks(peer)

    def _forget_peer(self, peer: str, reason: str = "peer removed", unload: bool = False) -> None:
        """Fail the peer's pending transfers, release its prepared lists and regions: nothing reaches it until
        ``add_peer`` again. Its NIXL agent stays loaded unless ``unload`` (``Peers.forget``). Holds the lock."""
        self._transfers.forget(peer, reason)
        self._lists.forget(peer)
        self.regions.remove_peer(peer)
        self._peers.forget(peer, unload)

    # -- transfers ---------------------------------------------------------
    def _post(
        self, op: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes
    ) -> NixlTransferHandle:
        with self._agent.lock:
            self._agent.check_open()
            total = self.regions.check_ops(peer, ops)
            merged = merge_ops(ops)
            remote = self._peers.regions[peer]
            # each region looked up once: a chunk is an op per tensor and run of blocks, hundreds of them
            local = {r: self.regions[r].meta for r in {o.local_region for o in merged}}
            theirs = {r: remote[r] for r in {o.remote_region for o in merged}}
            mems = mems_of(peer, local.values(), theirs.values())
            handle = self._transfers.submit(
                NixlTransferHandle(peer, op, total, len(merged)),
                lambda: self._lists.for_ops(peer, merged, local, theirs, mems),
                notif,
            )
        self._watcher.moved()
        return handle

    def write_blocks(
        self, peer: str, blocks: BlockWrite, notif: bytes | None = None, token: bytes = b"", *, inline: bool = False
    ) -> TransferHandle:
        """The blocks checked on their arrays (``check_blocks``) and posted as index arrays into the block lists, as
        NixlConnector posts them: no op made, none merged in Python (NIXL merges adjacent descriptors). Regions
        not gridded in ``blocks.block_bytes`` on both sides go as ops (``Channel.write_blocks``)."""
        with self._agent.lock:
            self._agent.check_open()
            total = self.regions.check_blocks(peer, blocks)
            route = self._lists.route(peer, blocks)
            if route is not None:
                handle = self._transfers.submit(
                    NixlTransferHandle(peer, "write", total, len(blocks.local_regions) * len(blocks.local_blocks)),
                    lambda: self._lists.for_blocks(peer, blocks, route),
                    notif,
                )
        if route is None:
            return super().write_blocks(peer, blocks, notif, token)
        self._watcher.moved()
        return handle

    def poll(self, handle: TransferHandle) -> XferState:
        return self._transfers.poll(handle)

    def poll_interval(self, waited: float) -> float:
        """Spin for ``spin_s`` (polling is what moves the data), then pause 10% of the time waited past it."""
        opts = self._opts
        return 0.0 if waited < opts.spin_s else min(opts.max_poll_interval_s, (waited - opts.spin_s) * 0.1)

    def release(self, handle: TransferHandle) -> None:
        """Free the NIXL request; a still-pending transfer is aborted and its handle failed."""
        self._transfers.release(handle)

    # -- notifications -------------------------------------------------------
    def get_notifications(self) -> list[Notification]:
        self._notices.fetch()
        return super().get_notifications()

    # -- shutdown ------------------------------------------------------------
    def close(self) -> None:
        with self._agent.lock:
            if self._agent.closed:
                return
            self._agent.closed = True
            self._transfers.close("nixl channel closed")
            self._lists.drop_local()
            for peer in list(self._peers.loaded):
                self._forget_peer(peer, "nixl channel closed", unload=True)
            for _, entry in self.regions.items():
                self._agent.deregister(entry)
            self.regions.clear()
        self._watcher.stop()
        OPEN.discard(self)
        super().close()
