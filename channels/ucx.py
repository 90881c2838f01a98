"""The UCX channel: UCX through ucxx (the ``ucx`` extra, ``ucxx-cu12``), host memory.

ucxx has no RMA, so one-sided WRITE and READ are tag messages that land directly in the registered regions; how,
and how progress is made: channels/README.md, "ucx".
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import threading
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
import torch

from pdkv.channels.base import Channel, ChannelOptions
from pdkv.channels.handle import TransferHandle, TransferOp, merge_ops
from pdkv.channels.ucx_env import UCX_ENV_DEFAULTS, OpenChannels, apply_env_defaults, ucx_follow_host
from pdkv.errors import ChannelError
from pdkv.memory import byte_view

# UCX_RNDV_THRESH=inf: tag messages go eagerly, never by rendezvous. UCX 1.21 crashes the process when it aborts
# a rendezvous send whose peer died (ucp_proto_rndv_rts_abort -> ucp_memh_invalidate on a context without a
# registration cache: SIGSEGV, seen in CI); an eager send to a dead peer fails its request like any other.
UCX_CHANNEL_ENV_DEFAULTS: dict[str, str] = {
    **UCX_ENV_DEFAULTS,
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_RNDV_THRESH": "inf",
}
apply_env_defaults(UCX_CHANNEL_ENV_DEFAULTS)

# UCX reads the environment set above when it loads, hence these late imports.
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

_OPEN = OpenChannels()  # after the library's import: see OpenChannels

log = logging.getLogger(__name__)

METADATA_VERSION = 1
HEADER, DATA, ACK = 1, 2, 3
KIND_MASK = ucx_api.UCXXTagMask(0xFF << 56)
_LEN = struct.Struct("<I")  # length prefix of a header or ACK in its fixed-size receive buffer
ACK_BYTES = 4096
ACK_ERROR_CHARS = 1000  # an error longer than this is cut so the ACK always fits ACK_BYTES
UCX_ERRORS: tuple[type[Exception], ...] = (ucx_api.UCXError,)


def tag(kind: int, agent_id: int, seq: int) -> ucx_api.UCXXTag:
    """The 64-bit tag of a message of ``kind`` in transfer ``seq`` started by ``agent_id``."""
    return ucx_api.UCXXTag((kind << 56) | (agent_id << 32) | (seq & 0xFFFFFFFF))


class UcxOptions(ChannelOptions):
    """Options of the ucx channel (``channel_options`` in config)."""

    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=16 << 20)] = (
        1 << 16
    )  # bounds ranges per transfer; same on both sides
    # service thread's sleep while transfers are pending
    service_interval_s: Annotated[float, msgspec.Meta(gt=0, le=0.1)] = 0.0001
    idle_interval_s: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 0.002  # its longest sleep when none are
    error_handling: bool = True  # UCX peer-failure handling: a dead peer fails its transfers instead of hanging


class _Meta(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    name: Annotated[str, msgspec.Meta(min_length=1)]
    agent_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]
    address: bytes  # UCX worker address
    regions: dict[int, Annotated[int, msgspec.Meta(gt=0)]]


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    op: Literal["write", "read"]
    seq: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
    src: str
    agent_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]  # the initiator's, for the DATA tag
    ranges: list[tuple[int, int, int]]  # (region, offset, length) on the target
    notif: bytes | None
    token: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # the capability its guarded regions check (``Grants``)


class _Ack(msgspec.Struct, array_like=True):
    seq: int
    error: str | None


def _framed(msg: msgspec.Struct) -> np.ndarray:
    body = msgspec.msgpack.encode(msg)
    return np.frombuffer(_LEN.pack(len(body)) + body, dtype=np.uint8)


def _unframe(buf: np.ndarray) -> bytes:
    (n,) = _LEN.unpack(buf[: _LEN.size].tobytes())
    if n > len(buf) - _LEN.size:
        raise ChannelError(f"ucx: message claims {n} bytes, buffer holds {len(buf) - _LEN.size}")
    return buf[_LEN.size : _LEN.size + n].tobytes()


def _all_done(requests: list[Any]) -> bool:
    return all(r.completed for r in requests)


def _first_error(requests: list[Any]) -> str | None:
    for r in requests:
        try:
            r.check_error()
        except UCX_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


class _Peer(msgspec.Struct):
    name: str
    agent_id: int
    ep: Any  # UCXEndpoint


class _Outgoing(msgspec.Struct):
    """An initiator's transfer: its DATA sends (write) or receives (read), and the ACK it waits for."""

    handle: TransferHandle
    requests: list[Any]
    ack_buf: np.ndarray
    ack: Any
    keep: list[np.ndarray]  # header bytes and views UCX is still reading from


class _Incoming(msgspec.Struct):
    """A target's side of a transfer: its DATA receives (write) or sends (read), then notify and ACK."""

    peer: str
    header: _Header
    requests: list[Any]
    error: str | None
    tickets: list[int | None] = []  # its ranges, marked landing (``Grants``) until it is over


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
        self._peers: dict[str, _Peer] = {}
        self._by_id: dict[int, str] = {}
        self._seq = 0
        self._outgoing: dict[int, _Outgoing] = {}  # by handle id
        self._incoming: list[_Incoming] = []
        self._acks: list[tuple[Any, np.ndarray]] = []  # ACK sends in flight, with the bytes UCX reads from
        self._drains: list[
            Any
        ] = []  # receives discarding a stranger's DATA; kept so they get posted (delayed submission)
        self._broken: list[str] = []  # peers whose endpoint failed, appended from UCX's thread
        self._gone: dict[str, str] = {}  # failed peers -> why, until added again
        self._header_buf = np.zeros(opts.max_header_bytes, dtype=np.uint8)
        self._header_req = self._worker.tag_recv(Array(self._header_buf), ucx_api.UCXXTag(HEADER << 56), KIND_MASK)
        self._drain_buf = np.zeros(1, dtype=np.uint8)
        self._closed = False
        self._stop = threading.Event()
        self._service = threading.Thread(target=self._serve, name=f"ucx-{agent_name}", daemon=True)
        self._service.start()
        _OPEN.add(self)

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
            meta = _Meta(
                METADATA_VERSION, self.agent_name, self._agent_id, self._worker.address.tobytes(), self.regions.sizes()
            )
        return msgspec.msgpack.encode(meta)

    # -- peers -------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = msgspec.msgpack.decode(metadata, type=_Meta)
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
            self._peers[meta.name] = _Peer(meta.name, meta.agent_id, ep)
            self._by_id[meta.agent_id] = meta.name
            self.regions.add_peer(meta.name, meta.regions)
        return meta.name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._forget_peer(peer, f"peer {peer!r} removed")

    def _forget_peer(self, peer: str, reason: str) -> None:
        """Fail the peer's transfers and close its endpoint. Holds the lock."""
        for out in [o for o in self._outgoing.values() if o.handle.peer == peer]:
            out.handle.fail(reason)
            del self._outgoing[out.handle.id]
        self._incoming = [i for i in self._incoming if i.peer != peer]
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
            entry = self._peers[peer]
            seq, self._seq = self._seq, (self._seq + 1) & 0xFFFFFFFF
            ranges = [(o.remote_region, o.remote_offset, o.length) for o in merged]
            header = _framed(_Header(op, seq, self.agent_name, self._agent_id, ranges, notif, token))
            if header.nbytes > self.options.max_header_bytes:  # type: ignore[attr-defined]
                raise ChannelError(
                    f"ucx: {len(merged)} ranges do not fit one header of {self.options.max_header_bytes} bytes; split "
                    "the transfer or raise max_header_bytes"
                )  # type: ignore[attr-defined]
            handle = TransferHandle(peer, op, total)
            views = [self.regions[o.local_region][o.local_offset : o.local_offset + o.length] for o in merged]
            data_tag = tag(DATA, self._agent_id, seq)
            ack_buf = np.zeros(ACK_BYTES, dtype=np.uint8)
            try:
                ack = self._worker.tag_recv(Array(ack_buf), tag(ACK, self._agent_id, seq))
                if op == "read":  # receives first, so the target's DATA always finds them
                    requests = [self._worker.tag_recv(Array(v), data_tag) for v in views]
                    requests.append(
                        entry.ep.tag_send(Array(header), tag(HEADER, self._agent_id, seq))
                    )  # held: ucxx posts it later
                else:
                    requests = [entry.ep.tag_send(Array(header), tag(HEADER, self._agent_id, seq))]
                    requests += [entry.ep.tag_send(Array(v), data_tag) for v in views]
            except UCX_ERRORS as exc:
                handle.fail(f"posting to {peer!r} failed: {exc}")
                return handle
            self._outgoing[handle.id] = _Outgoing(handle, requests, ack_buf, ack, [header, *views])
        return handle

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
                pending = bool(self._incoming or self._outgoing or self._acks)
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
        if self._header_req.completed:
            error = _first_error([self._header_req])
            raw = None if error else _unframe(self._header_buf)
            self._header_req = self._worker.tag_recv(Array(self._header_buf), ucx_api.UCXXTag(HEADER << 56), KIND_MASK)
            if raw is not None:
                self._accept(raw)
            else:
                log.warning("ucx: dropped a header: %s", error)
            busy = True
        self._acks = [(r, b) for r, b in self._acks if not r.completed]
        self._drains = [r for r in self._drains if not r.completed]
        for inc in [i for i in self._incoming if _all_done(i.requests)]:
            self._incoming.remove(inc)
            self._finish_incoming(inc)
            busy = True
        for out in list(self._outgoing.values()):
            if not _all_done(out.requests):
                continue
            error = _first_error(out.requests)  # a failed send needs no ACK to be final
            if error is None and not out.ack.completed:
                continue
            del self._outgoing[out.handle.id]
            self._finish_outgoing(out, error)
            busy = True
        return busy

    def _accept(self, raw: bytes) -> None:
        """Check a header and start the target's side of its transfer. Holds the lock."""
        try:
            header = msgspec.msgpack.decode(raw, type=_Header)
        except msgspec.DecodeError as exc:
            log.warning("ucx: dropped a malformed header: %s", exc)
            return
        peer = self._peers.get(header.src)
        data_tag = tag(DATA, header.agent_id, header.seq)
        if peer is None or peer.agent_id != header.agent_id:
            # Nothing can be sent back to a stranger; drain what it wrote so UCX does not keep it.
            log.warning("ucx: refused a %s from %r, which is not a peer of %r", header.op, header.src, self.agent_name)
            if header.op == "write":
                self._drains += [self._worker.tag_recv(Array(self._drain_buf), data_tag) for _ in header.ranges]
            return
        error = None
        tickets: list[int | None] = []
        try:
            for region, offset, length in header.ranges:
                self.regions.check(region, offset, length)
            for region, offset, length in header.ranges:
                tickets.append(self.grants.begin(header.token, header.op, region, offset, length))
        except ChannelError as exc:
            error = str(exc)
            for ticket in tickets:
                self.grants.end(ticket)
            tickets = []
        if header.op == "write":
            if error is None:
                requests = [
                    self._worker.tag_recv(Array(self.regions[r][o : o + n]), data_tag) for r, o, n in header.ranges
                ]
            else:  # drain: a one-byte buffer truncates and discards each DATA message
                requests = [self._worker.tag_recv(Array(self._drain_buf), data_tag) for _ in header.ranges]
        else:
            empty = self._drain_buf[:0]
            views = (
                [self.regions[r][o : o + n] for r, o, n in header.ranges]
                if error is None
                else [empty] * len(header.ranges)
            )
            requests = [peer.ep.tag_send(Array(v), data_tag) for v in views]
        self._incoming.append(_Incoming(header.src, header, requests, error, tickets))

    def _finish_incoming(self, inc: _Incoming) -> None:
        """The target's side is over: notify (on success) and ACK the initiator. Holds the lock."""
        for ticket in inc.tickets:
            self.grants.end(ticket)
        error = inc.error or _first_error(inc.requests)  # drained receives fail with truncation: not the error
        if error is None and inc.header.notif is not None:
            self.inbox.deliver(inc.peer, inc.header.notif)
        peer = self._peers.get(inc.peer)
        if peer is not None:
            ack = _framed(_Ack(inc.header.seq, error[:ACK_ERROR_CHARS] if error else None))
            self._acks.append((peer.ep.tag_send(Array(ack), tag(ACK, peer.agent_id, inc.header.seq)), ack))

    def _finish_outgoing(self, out: _Outgoing, error: str | None) -> None:
        """The initiator's transfer is over: DONE if every request and the ACK say so. Holds the lock."""
        error = error or _first_error([out.ack])
        if error is None:
            try:
                ack = msgspec.msgpack.decode(_unframe(out.ack_buf), type=_Ack)
                error = ack.error
            except (msgspec.DecodeError, ChannelError) as exc:
                error = f"malformed ACK: {exc}"
        if error is None:
            out.handle.complete()
        else:
            out.handle.fail(f"{out.handle.op} refused or failed at {out.handle.peer!r}: {error}")

    def release(self, handle: TransferHandle) -> None:
        """Forget a handle; one still pending (its peer hung) is failed. UCX cannot cancel its posted receives
        one by one, so they stay posted under a tag no later transfer uses."""
        with self._lock:
            if self._outgoing.pop(handle.id, None) is not None:
                handle.fail("released before it completed")

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
            for out in self._outgoing.values():
                out.handle.fail("ucx channel closed")
            self._outgoing.clear()
            for peer in list(self._peers):
                self._forget_peer(peer, "ucx channel closed")
            self._incoming.clear()
            self.regions.clear()
        self._worker.stop_progress_thread()
        _OPEN.discard(self)
        super().close()
