"""``UcxChannel``: the ucx channel's worker, peers and service thread, over the initiator's side (``initiator``), the
target's (``target``) and the messages both exchange (``wire``)."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
import torch

from pdkv.channels.base import Channel, ChannelOptions
from pdkv.channels.handle import TransferHandle, TransferOp, merge_ops
from pdkv.channels.ucx.initiator import Initiator
from pdkv.channels.ucx.lib import OPEN, UCX_ERRORS, ucx_api
from pdkv.channels.ucx.target import Peer, Target
from pdkv.channels.ucx.wire import METADATA_VERSION, Meta
from pdkv.channels.ucx_env import ucx_follow_host
from pdkv.errors import ChannelError
from pdkv.memory import byte_view


class UcxOptions(ChannelOptions):
    """Options of the ucx channel (``channel_options`` in config)."""

    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=16 << 20)] = (
        1 << 16
    )  # bounds ranges per transfer; same on both sides
    # service thread's sleep while transfers are pending
    service_interval_s: Annotated[float, msgspec.Meta(gt=0, le=0.1)] = 0.0001
    idle_interval_s: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 0.002  # its longest sleep when none are
    error_handling: bool = True  # UCX peer-failure handling: a dead peer fails its transfers instead of hanging


class UcxChannel(Channel):
    """Tag-message transfers through a ucxx worker; the protocol: channels/README.md, "ucx"."""

    name: ClassVar[str] = "ucx"
    Options = UcxOptions

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        super().__init__(agent_name, options)
        opts: UcxOptions = self.options  # type: ignore[assignment]
        self._agent_id = secrets.randbits(24)
        ucx_follow_host(opts.host)  # before the UCX context is created, which reads it
        try:
            self._context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
            # Delayed submission: a send or receive posted here is handed to ucxx's progress thread, which also runs
            # UCX's endpoint-error handling; posting straight from this thread raced that handling when a peer
            # died and crashed the process (ucxx's own async API turns it on with a progress thread, too).
            self._worker = ucx_api.UCXWorker(self._context, enable_delayed_submission=True)
            self._worker.start_progress_thread(polling_mode=False)
        except UCX_ERRORS as exc:
            raise ChannelError(f"ucx: could not start a UCX worker ({exc}); check UCX_TLS and UCX_NET_DEVICES") from exc
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._by_id: dict[int, str] = {}
        self._broken: list[str] = []  # peers whose endpoint failed, appended from UCX's thread
        self._gone: dict[str, str] = {}  # failed peers -> why, until added again
        self._initiator = Initiator(agent_name, self._agent_id, self._worker, opts.max_header_bytes)
        self._target = Target(
            agent_name, self._worker, opts.max_header_bytes, self._peers, self.regions, self.grants, self.inbox
        )
        self._closed = False
        self._stop = threading.Event()
        self._service = threading.Thread(target=self._serve, name=f"ucx-{agent_name}", daemon=True)
        self._service.start()
        OPEN.add(self)

    # -- memory ------------------------------------------------------------
    def register(self, buf: Any, block_bytes: int = 0) -> int:
        if isinstance(buf, torch.Tensor) and buf.device.type != "cpu":
            raise ChannelError(
                f"ucx: the ucx channel moves host memory; a tensor on {buf.device} needs the nixl channel"
            )
        view = byte_view(buf)
        if view.readonly or view.nbytes == 0:
            raise ChannelError("ucx: register needs a writable, non-empty buffer (peers may WRITE into it)")
        with self._lock:
            self._check_open()
            return self.regions.add(np.frombuffer(view, dtype=np.uint8), view.nbytes)

    def deregister(self, region: int) -> None:
        with self._lock:
            self.regions.remove(region)

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            meta = Meta(
                METADATA_VERSION, self.agent_name, self._agent_id, self._worker.address.tobytes(), self.regions.sizes()
            )
        return msgspec.msgpack.encode(meta)

    # -- peers -------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = msgspec.msgpack.decode(metadata, type=Meta)
        except msgspec.DecodeError as exc:
            raise ChannelError(f"ucx: malformed peer metadata: {exc}") from None
        if meta.version != METADATA_VERSION:
            raise ChannelError(
                f"ucx: peer metadata version {meta.version}, this pdkv speaks {METADATA_VERSION}; upgrade the older "
                "side"
            )
        if meta.name == self.agent_name:
            raise ChannelError(
                f"ucx: peer has this agent's own name {meta.name!r}; give every worker a unique agent name"
            )
        self.reachability.check(meta.name)  # UCX connects here: a known-unreachable peer fails without waiting again
        with self._lock:
            self._check_open()
            owner = self._by_id.get(meta.agent_id)
            if meta.agent_id == self._agent_id or (owner is not None and owner != meta.name):
                raise ChannelError(f"ucx: peer {meta.name!r} drew an agent id already in use; restart it")
            if meta.name in self._peers:
                self._forget_peer(meta.name, "the peer re-sent its metadata")
            try:
                ep = self._worker.create_endpoint_from_worker_address(
                    ucx_api.UCXAddress.create_from_buffer(meta.address),
                    self.options.error_handling,  # type: ignore[attr-defined]
                )
            except UCX_ERRORS as exc:
                raise self.reachability.record(
                    meta.name,
                    f"ucx: cannot reach peer {meta.name!r} ({exc}); is it running, and do both sides use a network "
                    "they share "
                    f"(UCX_NET_DEVICES is {os.environ.get('UCX_NET_DEVICES', 'unset')!r} here)?",
                ) from exc
            ep.set_close_callback(self._broken.append, cb_args=(meta.name,))
            self._gone.pop(meta.name, None)
            self._peers[meta.name] = Peer(meta.name, meta.agent_id, ep)
            self._by_id[meta.agent_id] = meta.name
            self.regions.add_peer(meta.name, meta.regions)
        return meta.name

    def _remove_peer(self, peer: str) -> None:
        with self._lock:
            self._forget_peer(peer, f"peer {peer!r} removed")

    def _forget_peer(self, peer: str, reason: str) -> None:
        """Fail the peer's transfers and close its endpoint. Holds the lock."""
        self._initiator.forget(peer, reason)
        self._target.forget(peer)
        entry = self._peers.pop(peer, None)
        self.regions.remove_peer(peer)
        if entry is not None:
            self._by_id.pop(entry.agent_id, None)
            if entry.ep.alive:  # UCX already closed a failed endpoint; closing it again crashes
                entry.ep.remove_close_callback()
                entry.ep.close()

    def fence(self, peer: str, token: bytes) -> None:
        """Forget the peer's endpoint: what it sends next is refused until it is added again (after a new Hello)."""
        with self._lock:
            if not self._closed and peer in self._peers:
                self._forget_peer(peer, f"peer {peer!r} fenced: it went silent mid-transfer")

    # -- transfers (initiator) -----------------------------------------------
    def _post(
        self, op: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes
    ) -> TransferHandle:
        with self._lock:
            self._check_open()
            if peer in self._gone:  # fails like a transfer the peer dropped, not like a caller's mistake
                handle = TransferHandle(peer, op, sum(o.length for o in ops))
                handle.fail(self._gone[peer])
                return handle
            total = self.regions.check_ops(peer, ops)
            merged = merge_ops(ops)
            ranges = [(o.remote_region, o.remote_offset, o.length) for o in merged]
            views = [self.regions[o.local_region][o.local_offset : o.local_offset + o.length] for o in merged]
            return self._initiator.post(op, self._peers[peer], ranges, views, notif, token, total)

    # -- service thread (target side and completions) ---------------------------------
    def _serve(self) -> None:
        """Service passes: back to back while things move, every ``service_interval_s`` while transfers are
        pending, backing off to ``idle_interval_s`` when none are (a new header waits at most that long)."""
        opts: UcxOptions = self.options  # type: ignore[assignment]
        pause = opts.service_interval_s
        while not self._stop.is_set():
            with self._lock:
                if self._closed:
                    return
                busy = self._service_once()
                pending = self._target.pending() or self._initiator.pending()
            if busy:
                pause = opts.service_interval_s
                continue
            pause = opts.service_interval_s if pending else min(2 * pause, opts.idle_interval_s)
            self._stop.wait(pause)

    def _service_once(self) -> bool:
        """One pass over everything that may have completed. Holds the lock; True if anything moved."""
        busy = False
        while self._broken:
            peer = self._broken.pop()
            if peer in self._peers:
                self._gone[peer] = f"the connection to {peer!r} failed (its process exited or closed its channel)"
                self._forget_peer(peer, self._gone[peer])
            busy = True
        busy = self._target.serve() or busy
        return self._initiator.serve() or busy

    def release(self, handle: TransferHandle) -> None:
        """Forget a handle; one still pending (its peer hung) is failed. UCX cannot cancel its posted receives
        one by one, so they stay posted under a tag no later transfer uses."""
        with self._lock:
            self._initiator.release(handle)

    # -- shutdown ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ChannelError(f"ucx channel {self.agent_name!r} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._service is not threading.current_thread():
            self._service.join(timeout=5.0)
        with self._lock:
            self._initiator.close("ucx channel closed")
            for peer in list(self._peers):
                self._forget_peer(peer, "ucx channel closed")
            self._target.clear()
            self.regions.clear()
        self._worker.stop_progress_thread()
        OPEN.discard(self)
        super().close()
