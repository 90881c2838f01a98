"""The tcp channel itself: the ``Channel`` contract over an ``Initiator`` (the transfers this agent starts) and a
``Target`` (the transfers peers start into it), which share its regions, grants, inbox and counters.

The protocol lives in those two and the modules under them; this class
checks what callers pass, keeps the registered memory and the peers'
metadata, and opens and closes both sides. The protocol and its guarantees:
channels/README.md, "tcp" (the frames: "Wire format" there, and wire.py).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import msgspec

from pdkv import native
from pdkv.channels.base import Channel, ChannelOptions, SummedWrites
from pdkv.channels.grants import Access, Grantable
from pdkv.channels.handle import BlockWrite, TransferHandle, TransferOp, XferState
from pdkv.channels.landing import LandingSums
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.conn import SHUTDOWN_JOIN_S
from pdkv.channels.tcp.frames import FrameServer
from pdkv.channels.tcp.initiator import Initiator, TcpHandle
from pdkv.channels.tcp.options import Agent, TcpOptions
from pdkv.channels.tcp.target import Target
from pdkv.channels.tcp.tls import tls_contexts
from pdkv.channels.tcp.wire import MAX_NAME_BYTES, Meta, decode_meta
from pdkv.errors import ChannelError, ConfigError, TransferTimeout
from pdkv.memory import byte_view


class TcpChannel(Channel, SummedWrites):
    """The tcp channel; the protocol and its guarantees: channels/README.md, "tcp"."""

    name: ClassVar[str] = "tcp"
    Options = TcpOptions
    authenticates_data: ClassVar[bool] = True
    carries_answers: ClassVar[bool] = True  # an ANSWER frame: the ACK with the target's answer
    runs_after_answers: ClassVar[bool] = True  # on the connection's thread, once the ANSWER is sent
    wakes_waiter: ClassVar[bool] = True  # ``wait`` reads the link on the waiting thread (``LinkReader.drive``)

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        # Everything that can refuse the options first: the base opens the notification pipe, which a refused
        # channel would leak.
        opts = options if options is not None else self.Options()
        if not isinstance(opts, TcpOptions):
            raise ConfigError(f"tcp channel needs TcpOptions, got {type(opts).__name__}")
        if len(agent_name.encode()) > MAX_NAME_BYTES:
            raise ConfigError(f"tcp channel agent name {agent_name!r}: expected at most {MAX_NAME_BYTES} UTF-8 bytes")
        tls = tls_contexts(opts.tls) if opts.tls is not None else None
        super().__init__(agent_name, opts)
        self._lock = threading.Lock()
        self.closed = False
        self.agent = Agent(agent_name, opts, opts.secret.encode(), secrets.randbits(63), self.count, tls)
        self.initiator = Initiator(self.agent, self.regions)
        # DATA lands through the native receive, hashed as it lands, where the kernels load (csrc/kvland.cpp)
        self.landing = LandingSums() if native.available() else None
        if self.landing is not None:  # and frames are checked there against a native copy of the grants
            self.grants.mirror_to(tcp_native.GrantMirror())
        self.target = Target(self.agent, FrameServer(self.agent, self.regions, self.grants, self.inbox, self.landing))
        self.port: int = self.target.port

    # -- memory ----------------------------------------------------------------
    def register(self, buf: Any, block_bytes: int = 0) -> int:
        view = byte_view(buf)
        if view.readonly:
            raise ChannelError("tcp: cannot register read-only memory; transfers land bytes in registered regions")
        region = self.regions.add(view, view.nbytes)
        if self.landing is not None:
            self.landing.add_region(region, view)
        return region

    def deregister(self, region: int) -> None:
        self.regions.remove(region)
        if self.landing is not None:
            self.landing.remove_region(region)

    def grant(self, token: bytes, access: Access, ranges: Grantable) -> None:
        if self.landing is not None and access == "write":
            self.landing.reset(ranges)  # a new owner: nothing landed under an earlier grant counts
        super().grant(token, access, ranges)

    def hash_landing(self, region: int, unit: int) -> bool:
        """Yes on clear connections with the native kernels loaded, for a guarded region (only granted frames
        write there, and each grant resets what was hashed); through TLS frames land in Python, unhashed."""
        if self.landing is None or self.agent.tls is not None or not self.grants.guarded(region):
            return False
        self.landing.enable(region, unit)
        return True

    def landed_checksum(self, regions: Sequence[int], ids: Sequence[int], unit: int) -> int:
        if self.landing is None:
            return super().landed_checksum(regions, ids, unit)
        value, reread = self.landing.checksum(regions, ids, unit)
        if reread:  # blocks that did not land exactly once in hashed pieces: read from memory
            with self._lock:
                self.counters["landed_blocks_reread"] += reread
        return value

    def metadata(self) -> bytes:
        host = self.agent.opts.advertise_host or self.agent.opts.host
        port = self.agent.opts.advertise_port or self.port
        return msgspec.msgpack.encode(Meta(self.agent_name, host, port, self.agent.instance, self.regions.sizes()))

    # -- peers -------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        meta = decode_meta(metadata)
        self.regions.add_peer(meta.name, meta.regions)
        if self.initiator.add_peer(meta):
            self.reachability.forget(meta.name)  # new address: worth trying at once
        return meta.name

    def _remove_peer(self, peer: str) -> None:
        self.regions.remove_peer(peer)
        self.initiator.remove_peer(peer)

    def _probe(self, peer: str, timeout: float, token: bytes) -> None:
        """Open the link that transfers presenting ``token`` will use, if it is not up: every stream connected and,
        with a secret, both sides proven.

        Bounded by ``connect_timeout`` per stream (``timeout`` is not used).
        """
        try:
            self.initiator.link(peer, token)
        except ChannelError as exc:
            raise ChannelError(
                f"{exc}. The peer advertises {self.initiator.address_of(peer)}: on another host it must advertise an "
                "address this host can reach "
                "(its host / --host, or advertise_host and advertise_port behind a NAT or proxy)"
            ) from None

    # -- transfers ---------------------------------------------------------------
    def _post(
        self, kind: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes
    ) -> TransferHandle:
        self._check_open()
        return self._send(kind, peer, ops, self.regions.check_ops(peer, ops), notif, token)

    def write_blocks(
        self, peer: str, blocks: BlockWrite, notif: bytes | None = None, token: bytes = b"", *, inline: bool = False
    ) -> TransferHandle:
        """The blocks checked on their arrays (``check_blocks``), then framed and sent natively where that runs
        (``Initiator.post_blocks``), else as their runs' ops (merged already); ``inline``: the first share on this
        thread whatever its size (``inline_max_bytes`` otherwise)."""
        self._check_open()
        total = self.regions.check_blocks(peer, blocks)
        self._check_notif(notif)
        return self.initiator.post_blocks(peer, blocks, total, notif, token, inline)

    def write_blocks_summed(
        self, peer: str, blocks: BlockWrite, seal: Callable[[int], bytes], token: bytes = b"", *, inline: bool = False
    ) -> TransferHandle | None:
        """``SummedWrites``: each share hashed as its frames go (``Initiator.post_blocks_sealed``)."""
        self._check_open()
        total = self.regions.check_blocks(peer, blocks)
        return self.initiator.post_blocks_sealed(peer, blocks, total, seal, token, inline)

    def _send(
        self,
        kind: Literal["write", "read"],
        peer: str,
        ops: Sequence[TransferOp],
        total: int,
        notif: bytes | None,
        token: bytes,
        merged: bool = False,
    ) -> TransferHandle:
        """Hand checked ``ops`` (``total`` bytes, ``merged`` or not: ``Initiator.post``) to the initiator, once
        ``notif`` is known to fit."""
        self._check_notif(notif)
        return self.initiator.post(kind, peer, ops, total, notif, token, merged)

    def _check_notif(self, notif: bytes | None) -> None:
        if notif is not None and len(notif) > self.agent.opts.max_notif_bytes:
            raise ChannelError(
                f"tcp: notification of {len(notif)} bytes exceeds max_notif_bytes={self.agent.opts.max_notif_bytes}"
            )

    def _check_open(self) -> None:
        if self.closed:
            raise ChannelError("tcp channel is closed")

    def poll(self, handle: TransferHandle) -> XferState:
        """The handle's state, after landing whatever answers are already there (never blocks)."""
        if isinstance(handle, TcpHandle) and handle.state is XferState.PENDING:
            handle.link.reader.drain()
        return handle.state

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """Block until the handle finishes, reading its link's answers on this thread (see ``LinkReader``)."""
        if isinstance(handle, TcpHandle) and handle.state is XferState.PENDING:
            handle.link.reader.drive(handle, time.monotonic() + timeout)
            if handle.state is XferState.PENDING:
                raise TransferTimeout(
                    f"tcp {handle.op} of {handle.nbytes} bytes to {handle.peer!r} still pending after {timeout:.3g}s "
                    "while its link is up (peer slow or overloaded?)"
                )
        super().wait(handle, timeout)  # finished: returns, or raises the handle's error

    def stream_bytes(self, peer: str, token: bytes = b"") -> list[int]:
        """Bytes written to ``peer`` per stream of the current link (for metrics, and to see the split)."""
        return self.initiator.stream_bytes(peer, token)

    def count(self, event: str) -> None:
        """Count ``event`` in ``stats()``, from any of the channel's threads."""
        with self._lock:
            self.counters[event] += 1

    def fence(self, peer: str, token: bytes) -> None:
        """Hang up every session that presented ``token`` and wait until each of its connections is closed: nothing
        queued behind them lands."""
        self.target.fence(peer, token)

    # -- shutdown ------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        threads = [*self.target.close(), *self.initiator.close()]
        me = threading.current_thread()
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        for t in threads:
            if t is not me and t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        self.regions.clear()
        if self.landing is not None:
            self.landing.clear()
        self.regions.clear_peers()
        super().close()
