"""Decode side of a KV transfer: reserve, land, verify, hand over.

The receiver binds a ZeroMQ ROUTER for the control plane and owns the decode
worker's paged KV buffer (registered with the channel) plus a staging region.
A sender asks it to ``Reserve`` room for a whole request; the receiver takes
every block the request needs or refuses (all or nothing, so two requests can
never deadlock half-allocated). Chunks then arrive over the channel, each
followed by a ``ChunkNotice``; the receiver verifies the checksum, scatters
staged chunks into the blocks, acknowledges with ``Landed`` and, once every
chunk is in, marks the request ready. ``wait`` hands the blocks to the
decode engine.

Blocks and staging slots are freed exactly once, on whichever of success
(by the engine, after ``wait``), failure, cancel or timeout comes first. A
failed request's memory is not reused until the sender has said it will
write no more (``Done``/``Cancel``) or ``drain_timeout_s`` passed: a late
one-sided write must never land in blocks that now belong to someone else.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from pdkv import protocol
from pdkv.auth import new_nonce, proof, verify
from pdkv.blocks import BlockAllocator
from pdkv.channels.base import Channel, Notification
from pdkv.checksum import checksum
from pdkv.config import TransferConfig
from pdkv.errors import ChecksumError, HandshakeError, PdkvError, OutOfBlocksError, ProtocolError, TransferCancelled, TransferError, TransferTimeout
from pdkv.layout import KVLayout, block_ranges
from pdkv import native
from pdkv.native import scatter
from pdkv.memory import byte_view
from pdkv.wakeup import Waker
from pdkv.protocol import Auth, Cancel, ChunkNotice, Done, Heartbeat, Hello, Landed, Refused, Reserve, Reserved

log = logging.getLogger(__name__)

HELLO_REQUIRED = "hello-required"


class State(enum.Enum):
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ReceivedKV:
    """A request's landed KV: ``blocks`` now belong to the caller, who frees them."""

    request_id: str
    blocks: list[int]
    num_tokens: int


@dataclass
class _Peer:
    agent: str
    layout: KVLayout


@dataclass
class _Reservation:
    request_id: str
    identity: bytes
    peer_agent: str
    num_tokens: int
    blocks: list[int]
    slots: list[int]
    mode: str
    num_chunks: int
    created: float
    lease_deadline: float
    state: State = State.RECEIVING
    landed: set[int] = field(default_factory=set)
    error: str = ""
    sender_done: bool = False
    free_deadline: float = 0.0
    ready_at: float = 0.0


class KVReceiver:
    """Lands pushed KV chunks in a paged buffer; see the module docstring."""

    def __init__(
        self,
        channel: Channel,
        layout: KVLayout,
        kv_tensors: Sequence[torch.Tensor],
        allocator: BlockAllocator,
        fingerprint: str,
        config: TransferConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes = b"",
        advertise_host: str = "",
    ) -> None:
        self.channel = channel
        self.layout = layout
        self.kv = list(kv_tensors)
        self.num_blocks = layout.validate_buffer(self.kv)
        if allocator.num_blocks != self.num_blocks:
            raise TransferError(f"allocator manages {allocator.num_blocks} blocks but the KV buffer has {self.num_blocks}")
        self.allocator = allocator
        self.fingerprint = fingerprint
        self.config = config or TransferConfig()
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self._unproven: dict[bytes, tuple[Hello, bytes]] = {}  # identity -> (its Hello, our nonce)
        self.slot_bytes = layout.chunk_bytes(self.config.chunk_size)
        self.staging = torch.zeros(self.config.staging_slots * self.slot_bytes, dtype=torch.uint8)
        self._staging_view = byte_view(self.staging)
        self._kv_views = [byte_view(t) for t in self.kv]
        self.kv_regions = [channel.register(t) for t in self.kv]
        native.available()  # build or load csrc/ now, not inside the first transfer
        self.staging_region = channel.register(self.staging)
        self._free_slots = list(range(self.config.staging_slots))

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertise_host or host}:{port}"  # what senders dial: not a wildcard bind address

        self._peers: dict[bytes, _Peer] = {}
        self._res: dict[str, _Reservation] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Condition()
        self._outbox: queue.SimpleQueue[tuple[bytes, protocol.Message]] = queue.SimpleQueue()
        self.counters: collections.Counter[str] = collections.Counter()
        self._waker = Waker()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdkv-receiver", daemon=True)
        self._thread.start()

    # -- public API -----------------------------------------------------------
    def hello(self) -> Hello:
        return protocol.make_hello(self.channel, self.fingerprint, self.layout, self.config.chunk_size, self.kv_regions, self.staging_region)

    def wait(self, request_id: str, timeout: float | None = None) -> ReceivedKV:
        """Block until the request's KV has landed and verified, then hand it over.

        Raises ``TransferError`` if it failed (its memory is already on its way
        back to the pool) and ``TransferTimeout`` after ``timeout`` seconds
        (default ``transfer_timeout_s``), cancelling the reservation so nothing
        leaks: the caller falls back to computing the prefix itself.
        """
        timeout = self.config.transfer_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                r = self._res.get(request_id)
                if r is not None and r.state is State.READY:
                    del self._res[request_id]
                    self._remember_gone(request_id, "claimed")
                    self.counters["claimed"] += 1
                    return ReceivedKV(request_id, r.blocks, r.num_tokens)
                if r is not None and r.state is State.FAILED:
                    raise TransferError(f"KV transfer for request {request_id!r} failed: {r.error}")
                if r is None and request_id in self._gone:
                    raise TransferError(f"KV transfer for request {request_id!r} is over: {self._gone[request_id]}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)
        self.cancel(request_id, f"decode side stopped waiting after {timeout:.3g}s")
        raise TransferTimeout(f"KV for request {request_id!r} did not arrive within {timeout:.3g}s")

    def cancel(self, request_id: str, reason: str) -> None:
        """Abandon a request from the decode side (client gone, timeout); frees what it holds."""
        with self._lock:
            r = self._res.get(request_id)
            if r is None:
                self._remember_gone(request_id, f"cancelled: {reason}")
                return
            if r.state is State.READY:
                del self._res[request_id]
                self._free(r)
                self._remember_gone(request_id, f"cancelled: {reason}")
            elif r.state is State.RECEIVING:
                self._fail(r, TransferCancelled(f"cancelled: {reason}"), notify_sender=True)
            self._lock.notify_all()

    def stats(self) -> dict[str, int]:
        """Counters plus the gauges the leak checks read (free blocks, reservations)."""
        with self._lock:
            out = dict(self.counters)
            out["free_blocks"] = self.allocator.num_free
            out["free_staging_slots"] = len(self._free_slots)
            out["reservations"] = len(self._res)
            out["reserved_blocks"] = sum(len(r.blocks) for r in self._res.values())
        return out

    def close(self) -> None:
        """Stop the loop and free every reservation still held."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=5)
        self._waker.close()
        with self._lock:
            for r in list(self._res.values()):
                self._free(r)
            self._res.clear()
            self._lock.notify_all()
        self._sock.close(0)

    # -- loop ------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        while not self._stop.is_set():
            busy = any(r.state is State.RECEIVING for r in list(self._res.values()))
            events = dict(poller.poll(1 if busy else 20))
            if events.pop(self._waker.fileno(), None):
                self._waker.clear()
            try:
                if events.get(self._sock):
                    self._drain_socket()
                for notif in self.channel.get_notifications():
                    self._on_notice(notif)
                self._flush_outbox()
                self._reap()
            except Exception:  # the loop must survive anything a peer sends
                log.exception("receiver loop error")

    def _drain_socket(self) -> None:
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.counters["malformed_messages"] += 1
                continue
            identity, data = frames
            try:
                msg = protocol.decode(data)
            except ProtocolError as exc:
                self.counters["malformed_messages"] += 1
                log.warning("dropping message from %r: %s", identity, exc)
                self._send(identity, protocol.Error(str(exc)))
                continue
            self._on_message(identity, msg)

    def _send(self, identity: bytes, msg: protocol.Message) -> None:
        try:
            self._sock.send_multipart([identity, protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to %r: %s", type(msg).__name__, identity, exc)

    def _flush_outbox(self) -> None:
        while True:
            try:
                identity, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(identity, msg)

    # -- control messages -------------------------------------------------------
    def _on_message(self, identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, Auth):
            self._on_auth(identity, msg)
        elif isinstance(msg, Reserve):
            self._send(identity, self._on_reserve(identity, msg))
        elif isinstance(msg, Heartbeat):
            self._renew(identity, msg.request_ids)
        elif isinstance(msg, (Cancel, Done)):
            self._on_sender_finished(identity, msg)
        else:
            self._send(identity, protocol.Error(f"unexpected {type(msg).__name__} at the receiver"))

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        ours = self.hello()
        try:
            protocol.check_compatible(ours, hello)
        except HandshakeError as exc:
            self.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            self._send(identity, protocol.Error(str(exc)))
            return
        if not self.secret:
            if self._admit(identity, hello):
                self._send(identity, ours)
            return
        # with a secret: prove ours now, admit the peer once it proves its own (Auth)
        nonce = new_nonce()
        if len(self._unproven) >= self.config.max_reservations:
            self._unproven.pop(next(iter(self._unproven)))
        self._unproven[identity] = (hello, nonce)
        self._send(identity, msgspec.structs.replace(ours, nonce=nonce, auth=proof(self.secret, "receiver", hello.nonce, nonce)))

    def _on_auth(self, identity: bytes, msg: Auth) -> None:
        pending = self._unproven.pop(identity, None)
        if pending is None or not self.secret:
            self._send(identity, protocol.Error("unexpected Auth: send Hello first"))
            return
        hello, nonce = pending
        if not verify(self.secret, "sender", nonce, hello.nonce, msg.proof):
            self.counters["auth_failures"] += 1
            log.warning("peer %r failed authentication (wrong or missing shared secret)", hello.agent)
            self._unproven[identity] = pending  # its Reserves are refused as unauthenticated
            self._send(identity, protocol.Error("authentication failed: the shared secret does not match"))
            return
        self._admit(identity, hello)

    def _admit(self, identity: bytes, hello: Hello) -> bool:
        """Make a compatible (and, with a secret, authenticated) peer reachable over the channel."""
        try:
            agent = self.channel.add_peer(hello.channel_metadata)
        except PdkvError as exc:
            self.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            self._send(identity, protocol.Error(str(exc)))
            return False
        with self._lock:
            self._peers[identity] = _Peer(agent, hello.layout)
        return True

    def _on_reserve(self, identity: bytes, req: Reserve) -> protocol.Message:
        peer = self._peers.get(identity)
        if peer is None and identity in self._unproven:
            self.counters["auth_failures"] += 1
            return Refused(req.request_id, "not authenticated: this receiver requires the shared secret (set the same `secret` on both sides)")
        if peer is None:
            return Refused(req.request_id, f"{HELLO_REQUIRED}: this receiver has no Hello from you (did it restart?)")
        cfg = self.config
        with self._lock:
            if req.request_id in self._res or req.request_id in self._gone:
                self.counters["refused"] += 1
                return Refused(req.request_id, f"request id {req.request_id!r} was already used on this receiver")
            if len(self._res) >= cfg.max_reservations:
                self.counters["refused"] += 1
                return Refused(req.request_id, f"receiver holds its maximum of {cfg.max_reservations} reservations", retryable=True)
            num_chunks = -(-req.num_tokens // cfg.chunk_size)
            direct = peer.layout == self.layout and cfg.chunk_size % self.layout.block_size == 0
            want_slots = 0 if direct else min(cfg.slots_per_request, num_chunks)
            if want_slots > len(self._free_slots):
                self.counters["refused"] += 1
                return Refused(req.request_id, f"no staging slots free ({len(self._free_slots)} of {cfg.staging_slots})", retryable=True)
            needed = self.layout.blocks_for(req.num_tokens)
            try:
                blocks = self.allocator.allocate(needed)
            except OutOfBlocksError as exc:
                self.counters["refused"] += 1
                return Refused(req.request_id, f"cannot hold {req.num_tokens} tokens: {exc}", retryable=needed <= self.num_blocks)
            slots = [self._free_slots.pop() for _ in range(want_slots)]
            now = time.monotonic()
            self._res[req.request_id] = _Reservation(
                req.request_id, identity, peer.agent, req.num_tokens, blocks, slots,
                "direct" if direct else "staging", num_chunks, now, now + cfg.lease_s,
            )
            self.counters["reserved"] += 1
            self._lock.notify_all()
        return Reserved(req.request_id, "direct" if direct else "staging", blocks, [s * self.slot_bytes for s in slots], cfg.lease_s)

    def _renew(self, identity: bytes, request_ids: list[str]) -> None:
        deadline = time.monotonic() + self.config.lease_s
        with self._lock:
            for rid in request_ids:
                r = self._res.get(rid)
                if r is not None and r.identity == identity:
                    r.lease_deadline = deadline

    def _on_sender_finished(self, identity: bytes, msg: Cancel | Done) -> None:
        with self._lock:
            r = self._res.get(msg.request_id)
            if r is None or r.identity != identity:
                return
            r.sender_done = True
            if r.state is State.RECEIVING and (isinstance(msg, Cancel) or not msg.ok):
                reason = msg.reason if isinstance(msg, Cancel) else "sender reported failure"
                self._fail(r, TransferCancelled(f"sender cancelled: {reason}"), notify_sender=False)
            self._lock.notify_all()

    # -- chunks -----------------------------------------------------------------
    def _on_notice(self, notif: Notification) -> None:
        try:
            notice = protocol.decode_notice(notif.payload)
        except ProtocolError as exc:
            self.counters["malformed_notices"] += 1
            log.warning("dropping notification from %r: %s", notif.peer, exc)
            return
        with self._lock:
            r = self._res.get(notice.request_id)
            if r is None or r.peer_agent != notif.peer or r.state is not State.RECEIVING:
                self.counters["stray_notices"] += 1
                return
            try:
                self._land(r, notice)
            except TransferError as exc:
                self._fail(r, exc, notify_sender=True)
            self._lock.notify_all()

    def _land(self, r: _Reservation, notice: ChunkNotice) -> None:
        idx = notice.chunk_index
        if idx >= r.num_chunks or idx in r.landed:
            raise TransferError(f"chunk {idx} is out of range or duplicated (request has {r.num_chunks} chunks)")
        cs = self.config.chunk_size
        start, n = idx * cs, min(cs, r.num_tokens - idx * cs)
        if r.mode == "direct":
            bs = self.layout.block_size
            ranges = block_ranges(self.layout, r.blocks[start // bs : -(-(start + n) // bs)], self.num_blocks)
            got = checksum(self._kv_views[t][off : off + ln] for t, off, ln in ranges)
        else:
            if not 0 <= notice.slot < len(r.slots):
                raise TransferError(f"chunk {idx} names staging slot {notice.slot}, request has {len(r.slots)}")
            base = r.slots[notice.slot] * self.slot_bytes
            nbytes = self.layout.chunk_bytes(n)
            got = checksum([self._staging_view[base : base + nbytes]])
        if got != notice.checksum:
            self.counters["checksum_failures"] += 1
            raise ChecksumError(f"chunk {idx} of request {r.request_id!r} failed its checksum (sent {notice.checksum:#x}, landed {got:#x})")
        if r.mode == "staging":
            chunk = self.staging[base : base + nbytes].view(self.layout.torch_dtype).view(self.layout.chunk_shape(n))
            scatter(self.layout, self.kv, r.blocks, start, chunk)
        r.landed.add(idx)
        r.lease_deadline = time.monotonic() + self.config.lease_s
        self.counters["chunks_landed"] += 1
        self.counters["bytes_landed"] += self.layout.chunk_bytes(n)
        self._outbox.put((r.identity, Landed(r.request_id, idx)))
        if len(r.landed) == r.num_chunks:
            r.state, r.ready_at = State.READY, time.monotonic()
            self._free_slots.extend(r.slots)
            r.slots = []
            self.counters["transfers_ready"] += 1

    # -- failure and release ----------------------------------------------------
    def _fail(self, r: _Reservation, exc: TransferError, notify_sender: bool) -> None:
        """Mark failed; memory is freed once the sender can no longer write into it."""
        r.state, r.error = State.FAILED, str(exc)
        r.free_deadline = time.monotonic() + self.config.drain_timeout_s
        self.counters["transfers_failed"] += 1
        log.warning("request %s: %s", r.request_id, exc)
        if notify_sender:
            self._outbox.put((r.identity, Cancel(r.request_id, str(exc))))
            self._waker.wake()  # _fail also runs on API threads (cancel)

    def _free(self, r: _Reservation) -> None:
        self.allocator.free(r.blocks)
        self._free_slots.extend(r.slots)
        r.blocks, r.slots = [], []

    def _remember_gone(self, request_id: str, why: str) -> None:
        self._gone[request_id] = why
        while len(self._gone) > self.config.max_reservations:
            self._gone.popitem(last=False)

    def _reap(self) -> None:
        """Scan every reservation (no early exit) for expired leases and timeouts."""
        now = time.monotonic()
        cfg = self.config
        with self._lock:
            for r in list(self._res.values()):
                if r.state is State.RECEIVING and now > r.lease_deadline:
                    self.counters["leases_expired"] += 1
                    # Not presumed dead: a stalled sender may still have writes queued. Its blocks stay quarantined
                    # until it answers the Cancel or drain_timeout_s passes (and the sender itself stops writing once
                    # it sees its heartbeats lapsed), so no late write lands in blocks handed to another request.
                    self._fail(r, TransferTimeout(f"lease expired: no word from the sender for {cfg.lease_s:.3g}s (the prefill side died, hung or lost its connection)"), notify_sender=True)
                elif r.state is State.RECEIVING and now > r.created + cfg.transfer_timeout_s:
                    self.counters["timeouts"] += 1
                    self._fail(r, TransferTimeout(f"not complete after transfer_timeout_s={cfg.transfer_timeout_s:.3g}s"), notify_sender=True)
                if r.state is State.FAILED and (r.sender_done or now > r.free_deadline):
                    del self._res[r.request_id]
                    self._free(r)
                    self._remember_gone(r.request_id, f"failed: {r.error}")
                elif r.state is State.READY and now > r.ready_at + cfg.claim_timeout_s:
                    del self._res[r.request_id]
                    self._free(r)
                    self.counters["unclaimed"] += 1
                    self._remember_gone(r.request_id, "never claimed by the decode side")
            self._lock.notify_all()
