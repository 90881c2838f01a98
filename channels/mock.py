"""In-process channel: memcpy between regions of agents in the same process.

For unit tests of the layers above the channel (sender, receiver, tier),
never as a stand-in for a channel we claim to have. Copies run on a worker
thread so handles complete asynchronously like a real channel's, and tests
can inject faults (delay, stall, corruption, peer death) through ``faults``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgspec

from pdkv.channels.base import Channel, ChannelOptions
from pdkv.channels.handle import TransferHandle, TransferOp, XferState
from pdkv.errors import ChannelError
from pdkv.memory import byte_view

_FABRIC: dict[str, MockChannel] = {}
_FABRIC_LOCK = threading.Lock()


class MockOptions(ChannelOptions):
    delay_s: float = 0.0


@dataclass
class MockFaults:
    """Switches a test flips to make the next transfers misbehave."""

    stall: bool = False  # transfers never complete (a hung peer)
    corrupt_next: int = 0  # flip a byte in the next N transfers after copying
    fail_next: int = 0  # fail the next N transfers with an error


class _Meta(msgspec.Struct):
    name: str
    regions: dict[int, int]


class MockChannel(Channel):
    name: ClassVar[str] = "mock"
    Options = MockOptions

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        super().__init__(agent_name, options)
        self.faults = MockFaults()
        self._queue: queue.SimpleQueue[tuple[TransferHandle, Any] | None] = queue.SimpleQueue()
        self._pending: set[TransferHandle] = set()
        self.closed = False
        with _FABRIC_LOCK:
            if agent_name in _FABRIC:
                raise ChannelError(f"mock agent name {agent_name!r} already in use in this process")
            _FABRIC[agent_name] = self
        self._worker = threading.Thread(target=self._run, name=f"mock-{agent_name}", daemon=True)
        self._worker.start()

    def register(self, buf: Any, block_bytes: int = 0) -> int:
        view = byte_view(buf)
        return self.regions.add(view, view.nbytes)

    def deregister(self, region: int) -> None:
        self.regions.remove(region)

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode(_Meta(self.agent_name, self.regions.sizes()))

    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = msgspec.msgpack.decode(metadata, type=_Meta)
        except msgspec.DecodeError as exc:
            raise ChannelError(f"mock: malformed peer metadata: {exc}") from None
        self.regions.add_peer(meta.name, meta.regions)
        return meta.name

    def _remove_peer(self, peer: str) -> None:
        self.regions.remove_peer(peer)
        for h in list(self._pending):
            if h.peer == peer:
                h.fail(f"peer {peer!r} removed")

    def _post(
        self, op: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes
    ) -> TransferHandle:
        if self.closed:
            raise ChannelError("mock channel is closed")
        total = self.regions.check_ops(peer, ops)
        handle = TransferHandle(peer, op, total)
        self._pending.add(handle)
        self._queue.put((handle, (list(ops), notif, token)))
        return handle

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            handle, (ops, notif, token) = item
            try:
                self._execute(handle, ops, notif, token)
            except ChannelError as exc:
                handle.fail(str(exc))
            finally:
                if handle.state is not XferState.PENDING or not self.faults.stall:
                    self._pending.discard(handle)

    def _execute(self, handle: TransferHandle, ops: list[TransferOp], notif: bytes | None, token: bytes) -> None:
        opts: MockOptions = self.options  # type: ignore[assignment]
        if opts.delay_s:
            time.sleep(opts.delay_s)
        if self.faults.stall:
            return
        if self.faults.fail_next:
            self.faults.fail_next -= 1
            raise ChannelError("injected transfer failure")
        with _FABRIC_LOCK:
            peer = _FABRIC.get(handle.peer)
        if peer is None or peer.closed:
            raise ChannelError(f"peer {handle.peer!r} is gone")
        access = "write" if handle.op == "write" else "read"
        tickets: list[int | None] = []
        try:
            for op in ops:  # every range is admitted by the target's grants before a byte moves
                peer.regions.check(op.remote_region, op.remote_offset, op.length, f"peer {handle.peer!r}")
                tickets.append(peer.grants.begin(token, access, op.remote_region, op.remote_offset, op.length))
            for op in ops:
                remote = peer.regions[op.remote_region]
                local = self.regions[op.local_region]
                src, dst = (local, remote) if handle.op == "write" else (remote, local)
                s_off, d_off = (
                    (op.local_offset, op.remote_offset) if handle.op == "write" else (op.remote_offset, op.local_offset)
                )
                dst[d_off : d_off + op.length] = src[s_off : s_off + op.length]
        finally:
            for ticket in tickets:
                peer.grants.end(ticket)
        if self.faults.corrupt_next:
            self.faults.corrupt_next -= 1
            op = ops[0]
            target = peer.regions[op.remote_region] if handle.op == "write" else self.regions[op.local_region]
            at = op.remote_offset if handle.op == "write" else op.local_offset
            target[at] ^= 0xFF
        if notif is not None and handle.state is XferState.PENDING:  # the target hears of it before the initiator does
            peer.inbox.deliver(self.agent_name, notif)
        handle.complete()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        for h in list(self._pending):
            h.fail("mock channel closed")
        self._pending.clear()
        with _FABRIC_LOCK:
            if _FABRIC.get(self.agent_name) is self:
                del _FABRIC[self.agent_name]
        self.regions.clear()
        super().close()
