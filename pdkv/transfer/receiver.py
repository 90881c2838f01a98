"""Decode side of a KV transfer: reserve, land, verify, hand over.

Two parts, like the sender's:

* ``KVReceiver``, one per decode worker: owns the paged KV buffer (registered
  with the channel), the block allocator's view of it, a staging region, and
  the control plane (``pdkv.transfer.control``): one I/O thread that sleeps in ``poll``
  on the bound ROUTER and on the channel's notification fd, so a Reserve is
  answered and a landed chunk verified the moment it arrives.
* ``IncomingTransfer``, one per reservation: its blocks and staging slots,
  which chunks landed, its lease, and its state (receiving, ready, failed).

A sender asks the receiver to ``Reserve`` room for a whole request; the
receiver takes every block the request needs or refuses (all or nothing, so
two requests can never deadlock half-allocated). Chunks then arrive over the
channel, each followed by a ``ChunkNotice``; the receiver verifies the
checksum, scatters staged chunks into the blocks and acknowledges every chunk
it verified in one pass with one ``Landed``; once every chunk is in, the
request is ready and ``wait`` hands the blocks to the decode engine.

Blocks and staging slots are freed exactly once, on whichever of success
(by the engine, after ``wait``), failure, cancel or timeout comes first. A
failed request's memory is not reused until the sender has said it will
write no more (``Done``/``Cancel``) or ``drain_timeout_s`` passed: a late
one-sided write must never land in blocks that now belong to someone else.

The data plane is capability-based whatever the secret: the KV buffer and
the staging area are *guarded* regions of the channel, and a reservation
grants its blocks (or slots) to the sender's capability token (sent in its
Hello, presented on its data connections) for exactly as long as it lasts. A
frame outside a sender's grants lands nothing. Taking a grant back waits out
any frame still landing in it; when a sender went silent instead of saying it
stopped, the receiver also *fences* it: the channel cuts its data connections
(bytes it queued before cannot arrive later) and the peer must handshake
again, before its blocks go to anyone else.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from pdkv import native
from pdkv.auth import new_nonce, proof, verify, verify_bound
from pdkv.blocks import BlockAllocator
from pdkv.channels.base import Channel, Notification
from pdkv.channels.grants import Range
from pdkv.checksum import chunk_checksum, flat_bytes
from pdkv.codec import Codec, available_codecs, make_codec
from pdkv.codec import slot_bytes as codec_slot_bytes
from pdkv.config import TransferConfig
from pdkv.errors import ChecksumError, HandshakeError, NotAnnouncedError, OutOfBlocksError, PdkvError, PromptMismatchError, ProtocolError, TransferCancelled, TransferError, TransferTimeout
from pdkv.layout import KVLayout, block_runs
from pdkv.memory import adopt_kv
from pdkv.native import scatter
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.control import ControlLoop, RouterSocket
from pdkv.transfer.protocol import HELLO_REQUIRED, Auth, Cancel, ChunkNotice, Done, Heartbeat, Hello, Landed, Refused, Reserve, Reserved, reserve_fields

log = logging.getLogger(__name__)

_REAP_TICK_S = 0.05  # how often leases, timeouts and quarantines are checked
MIN_TOKEN_BYTES = 16  # a sender's data_token: unguessable


class State(enum.Enum):
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ReceivedKV:
    """A request's landed KV: ``blocks`` now belong to the caller, who frees them.

    ``prompt_key`` is the key of the prompt the sender computed this KV from (its Reserve).
    """

    transfer_id: str
    blocks: list[int]
    num_tokens: int
    prompt_key: bytes = b""


@dataclass
class _Peer:
    agent: str
    layout: KVLayout
    token: bytes  # its data connections' capability: its reservations are granted to it
    session: bytes = b""
    kv_reached: bool = True  # its channel registered its KV (an empty kv_regions in its Hello: not, so staging only)  # both handshake nonces (with a secret): what its Reserves' proofs are bound to


@dataclass
class _Target:
    """Our side's memory as every transfer lands in it, and its regions in the channel.

    ``kv_regions`` is empty when the channel cannot reach the KV's memory:
    every reservation is then staged, and ``stager`` copies each landed chunk
    from its pinned slot to the KV's device.
    """

    layout: KVLayout
    kv: list[torch.Tensor]
    kv_bytes: list[torch.Tensor]  # each KV tensor's bytes, flat, on its own device
    num_blocks: int
    staging: torch.Tensor
    slot_bytes: int
    chunk_size: int
    kv_regions: list[int]
    staging_region: int
    codecs: dict[str, Codec]  # what this side decodes (offered in its Hello)
    stager: DeviceStager | None

    def block_ranges(self, blocks: list[int]) -> list[Range]:
        """Byte ranges of ``blocks`` in every buffer tensor, in wire order, adjacent blocks as one range."""
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise TransferError(f"block ids {blocks} outside the buffer's {self.num_blocks} blocks")
        size = self.layout.block_bytes
        return [(self.kv_regions[t], a * size, k * size) for t in range(self.layout.num_tensors) for a, _, k in block_runs(blocks)]

    def slot_ranges(self, slots: list[int]) -> list[Range]:
        return [(self.staging_region, s * self.slot_bytes, self.slot_bytes) for s in slots]


@dataclass
class IncomingTransfer:
    """One reservation: the memory it holds and how far its chunks got. Changed under the receiver's lock."""

    transfer_id: str
    identity: bytes
    peer_agent: str
    num_tokens: int
    blocks: list[int]
    slots: list[int]
    mode: str
    num_chunks: int
    created: float
    lease_deadline: float
    token: bytes  # the sender's capability: what its blocks and slots are granted to
    prompt_key: bytes = b""
    codec: str = "none"  # how its staged chunks arrive
    revoked: bool = False  # its grants were taken back: the sender can no longer write into it
    state: State = State.RECEIVING
    landed: set[int] = field(default_factory=set)
    error: str = ""
    sender_done: bool = False
    free_deadline: float = 0.0
    ready_at: float = 0.0

    def land(self, target: _Target, notice: ChunkNotice) -> int:
        """Verify one chunk that arrived (and scatter it, when staged); returns its bytes. Raises ``TransferError``."""
        idx = notice.chunk_index
        if idx >= self.num_chunks or idx in self.landed:
            raise TransferError(f"chunk {idx} is out of range or duplicated (request has {self.num_chunks} chunks)")
        cs = target.chunk_size
        start, n = idx * cs, min(cs, self.num_tokens - idx * cs)
        nbytes = target.layout.chunk_bytes(n)
        if self.mode == "direct":
            bs = target.layout.block_size
            ranges = target.block_ranges(self.blocks[start // bs : -(-(start + n) // bs)])
            views = dict(zip(target.kv_regions, target.kv_bytes, strict=True))
            got = chunk_checksum((views[region][off : off + ln] for region, off, ln in ranges), unit=target.layout.block_bytes)
        else:
            if not 0 <= notice.slot < len(self.slots):
                raise TransferError(f"chunk {idx} names staging slot {notice.slot}, request has {len(self.slots)}")
            codec = target.codecs[self.codec]
            wire = notice.nbytes
            if not (wire == nbytes if codec.passthrough else 0 < wire <= target.slot_bytes):  # checked before the slot is read
                raise TransferError(f"chunk {idx} claims {wire} bytes in its slot ({self.codec!r} chunk of {n} tokens, slots of {target.slot_bytes})")
            base = self.slots[notice.slot] * target.slot_bytes
            got = chunk_checksum([target.staging[base : base + wire]])
        if got != notice.checksum:
            raise ChecksumError(f"chunk {idx} of transfer {self.transfer_id!r} failed its checksum (sent {notice.checksum:#x}, landed {got:#x})")
        if self.mode == "staging":
            if codec.passthrough:
                chunk = target.staging[base : base + nbytes].view(target.layout.torch_dtype).view(target.layout.chunk_shape(n))
            else:  # a frame that does not decode to exactly this chunk raises CodecError (a TransferError)
                chunk = codec.decode(target.staging[base : base + wire], codec.scratch("raw", target.layout.chunk_shape(n), target.layout.torch_dtype))
            if target.stager is not None:  # to the KV's device on pdkv's stream; back once the chunk is there
                target.stager.stage_in(self.blocks, start, chunk)
            else:
                scatter(target.layout, target.kv, self.blocks, start, chunk)
        self.landed.add(idx)
        return nbytes

    @property
    def all_landed(self) -> bool:
        return len(self.landed) == self.num_chunks


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
        kv = adopt_kv(list(kv_tensors))
        num_blocks = layout.validate_buffer(kv)
        if allocator.num_blocks != num_blocks:
            raise TransferError(f"allocator manages {allocator.num_blocks} blocks but the KV buffer has {num_blocks}")
        self.allocator = allocator
        self.fingerprint = fingerprint
        self.config = config or TransferConfig()
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self._unproven: dict[bytes, tuple[Hello, bytes]] = {}  # identity -> (its Hello, our nonce)
        codecs = {name: make_codec(name, layout) for name in available_codecs(layout)}
        slot_bytes = codec_slot_bytes(layout, self.config.chunk_size, list(codecs.values()))  # any offered codec's frame fits
        staging = pinned_empty(self.config.staging_slots * slot_bytes)
        reached = all(channel.reaches(t) for t in kv)
        self.kv_regions = [channel.register(t) for t in kv] if reached else []
        self.staging_region = channel.register(staging)
        for region in (*self.kv_regions, self.staging_region):
            channel.guard(region)  # peers write only into what a reservation of theirs granted them
        if not channel.enforces_grants:
            log.warning(
                "%s channel: one-sided writes never pass through this receiver, so it cannot check them against "
                "its reservations; with peers you do not trust, use the tcp channel or a shared secret", channel.name
            )
        self.target = _Target(
            layout, kv, [flat_bytes(t) for t in kv], num_blocks, staging, slot_bytes, self.config.chunk_size, self.kv_regions, self.staging_region, codecs,
            None if reached else DeviceStager(layout, kv, self.config.chunk_size),
        )
        native.available()  # build or load csrc/ now, not inside the first transfer
        self._free_slots = list(range(self.config.staging_slots))

        self._peers: dict[bytes, _Peer] = {}
        self._res: dict[str, IncomingTransfer] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Condition()
        self.counters: collections.Counter[str] = collections.Counter()
        self.loop = ControlLoop("pdkv-receiver", min(_REAP_TICK_S, self.config.lease_s / 4), self._reap)
        self._router = RouterSocket(self.loop, host, port, self._on_message, self.counters)
        self.address = self._router.address
        if advertise_host:  # what senders dial: not a wildcard bind address
            self.address = f"tcp://{advertise_host}:{self.address.rsplit(':', 1)[1]}"
        self.loop.watch(channel.notification_fd(), self._on_notifications)
        self.loop.start()

    # -- public API -----------------------------------------------------------
    def hello(self) -> Hello:
        return protocol.make_hello(
            self.channel.agent_name, self.channel.name, self.channel.metadata(), self.fingerprint, self.layout, self.config.chunk_size, self.kv_regions, self.staging_region,
            list(self.target.codecs),
        )

    def wait(self, transfer_id: str, timeout: float | None = None, prompt_key: bytes | None = None) -> ReceivedKV:
        """Block until the request's KV has landed and verified, then hand it over.

        ``prompt_key``: the key of the prompt the caller will decode. When given,
        the KV is handed over only if the sender computed it for that prompt (the
        key in its Reserve); otherwise its blocks are freed and
        ``PromptMismatchError`` raised: a mismatch is a recompute, never a decode.

        Raises ``TransferError`` if it failed (its memory is already on its way
        back to the pool) and ``TransferTimeout`` after ``timeout`` seconds
        (default ``transfer_timeout_s``), or after ``announce_timeout_s`` if no
        sender ever reserved it, cancelling the reservation so nothing leaks:
        the caller falls back to computing the prefix itself.
        """
        timeout = self.config.transfer_timeout_s if timeout is None else timeout
        now = time.monotonic()
        deadline, unannounced = now + timeout, now + self.config.announce_timeout_s
        why, error = f"KV of transfer {transfer_id!r} did not arrive within {timeout:.3g}s", TransferTimeout
        with self._lock:
            while True:
                r = self._res.get(transfer_id)
                if r is not None and r.state is State.READY:
                    del self._res[transfer_id]
                    self._revoke(r)  # from now on its blocks are the caller's: the sender may not touch them
                    if prompt_key is not None and r.prompt_key != prompt_key:
                        self._free(r)
                        self._remember_gone(transfer_id, "its KV was computed for another prompt")
                        self.counters["prompt_mismatches"] += 1
                        raise PromptMismatchError(
                            f"KV transfer {transfer_id!r} carries the KV of another prompt than the one to decode "
                            "(the prompt differs from the one prefilled); computing it instead"
                        )
                    self._remember_gone(transfer_id, "claimed")
                    self.counters["claimed"] += 1
                    return ReceivedKV(transfer_id, r.blocks, r.num_tokens, r.prompt_key)
                if r is not None and r.state is State.FAILED:
                    raise TransferError(f"KV transfer {transfer_id!r} failed: {r.error}")
                if r is None and transfer_id in self._gone:
                    raise TransferError(f"KV transfer {transfer_id!r} is over: {self._gone[transfer_id]}")
                now = time.monotonic()
                if r is None and now >= unannounced:
                    self.counters["unannounced"] += 1
                    why = f"no sender announced a transfer for transfer {transfer_id!r} within announce_timeout_s={self.config.announce_timeout_s:.3g}s"
                    error = NotAnnouncedError
                    break
                if now >= deadline:
                    break
                self._lock.wait(min(deadline, unannounced if r is None else deadline) - now)
        self.cancel(transfer_id, f"decode side stopped waiting: {why}")
        raise error(why)

    def cancel(self, transfer_id: str, reason: str) -> None:
        """Abandon a request from the decode side (client gone, timeout); frees what it holds."""
        with self._lock:
            r = self._res.get(transfer_id)
            if r is None:
                self._remember_gone(transfer_id, f"cancelled: {reason}")
                return
            if r.state is State.READY:
                del self._res[transfer_id]
                self._free(r)
                self._remember_gone(transfer_id, f"cancelled: {reason}")
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
        if not self.loop.thread.is_alive():
            return
        self.loop.stop()
        with self._lock:
            for r in list(self._res.values()):
                self._free(r)
            self._res.clear()
            self._lock.notify_all()
        self._router.close()

    # -- control messages (I/O thread) ------------------------------------------
    def _reply(self, identity: bytes, msg: protocol.Message) -> None:
        """Send from the I/O thread; other threads go through ``loop.call_soon``."""
        self._router.send(identity, msg)

    def _on_message(self, identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, Auth):
            self._on_auth(identity, msg)
        elif isinstance(msg, Reserve):
            self._reply(identity, self._on_reserve(identity, msg))
        elif isinstance(msg, Heartbeat):
            self._renew(identity, msg.transfer_ids)
        elif isinstance(msg, (Cancel, Done)):
            self._on_sender_finished(identity, msg)
        else:
            self._reply(identity, protocol.Error(f"unexpected {type(msg).__name__} at the receiver"))

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        ours = self.hello()
        try:
            protocol.check_compatible(ours, hello)
        except HandshakeError as exc:
            self.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            self._reply(identity, protocol.Error(str(exc)))
            return
        if not self.secret:
            if self._admit(identity, hello, b""):
                self._reply(identity, ours)
            return
        # with a secret: prove ours now, admit the peer once it proves its own (Auth)
        nonce = new_nonce()
        if len(self._unproven) >= self.config.max_reservations:
            self._unproven.pop(next(iter(self._unproven)))
        self._unproven[identity] = (hello, nonce)
        self._reply(identity, msgspec.structs.replace(ours, nonce=nonce, auth=proof(self.secret, "receiver", hello.nonce, nonce)))

    def _on_auth(self, identity: bytes, msg: Auth) -> None:
        pending = self._unproven.pop(identity, None)
        if pending is None or not self.secret:
            self._reply(identity, protocol.Error("unexpected Auth: send Hello first"))
            return
        hello, nonce = pending
        if not verify(self.secret, "sender", nonce, hello.nonce, msg.proof):
            self.counters["auth_failures"] += 1
            log.warning("peer %r failed authentication (wrong or missing shared secret)", hello.agent)
            self._unproven[identity] = pending  # its Reserves are refused as unauthenticated
            self._reply(identity, protocol.Error("authentication failed: the shared secret does not match"))
            return
        self._admit(identity, hello, nonce + hello.nonce)

    def _admit(self, identity: bytes, hello: Hello, session: bytes) -> bool:
        """Make a compatible (and, with a secret, authenticated) peer reachable over the channel."""
        try:
            if len(hello.data_token) < MIN_TOKEN_BYTES:
                raise HandshakeError(f"peer {hello.agent!r} sent no data_token of at least {MIN_TOKEN_BYTES} bytes: it cannot be granted any blocks (an older pdkv?)")
            agent = self.channel.add_peer(hello.channel_metadata)
        except PdkvError as exc:
            self.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            self._reply(identity, protocol.Error(str(exc)))
            return False
        with self._lock:
            self._peers[identity] = _Peer(agent, hello.layout, hello.data_token, session, kv_reached=bool(hello.kv_regions))
        return True

    def _on_reserve(self, identity: bytes, req: Reserve) -> protocol.Message:
        peer = self._peers.get(identity)
        if peer is None and identity in self._unproven:
            self.counters["auth_failures"] += 1
            return Refused(req.transfer_id, "not authenticated: this receiver requires the shared secret (set the same `secret` on both sides)")
        if peer is None:
            return Refused(req.transfer_id, f"{HELLO_REQUIRED}: this receiver has no Hello from you (did it restart?)")
        if self.secret and not verify_bound(self.secret, "reserve", peer.session, req.proof, *reserve_fields(req)):
            self.counters["auth_failures"] += 1
            return Refused(req.transfer_id, "the Reserve's proof does not check out: it was not made by the peer that proved the shared secret")
        cfg = self.config
        if req.codec not in self.target.codecs:
            self.counters["refused"] += 1
            return Refused(req.transfer_id, f"codec {req.codec!r} is not one this receiver decodes ({', '.join(self.target.codecs)})")
        with self._lock:
            if req.transfer_id in self._res or req.transfer_id in self._gone:
                self.counters["refused"] += 1
                return Refused(req.transfer_id, f"transfer id {req.transfer_id!r} was already used on this receiver")
            if len(self._res) >= cfg.max_reservations:
                self.counters["refused"] += 1
                return Refused(req.transfer_id, f"receiver holds its maximum of {cfg.max_reservations} reservations", retryable=True)
            held = [r for r in self._res.values() if r.identity == identity]
            if len(held) >= cfg.max_reservations_per_peer:
                self.counters["refused"] += 1
                return Refused(req.transfer_id, f"you hold this receiver's per-peer maximum of {cfg.max_reservations_per_peer} reservations (max_reservations_per_peer)", retryable=True)
            peer_cap = int(cfg.max_peer_blocks_share * self.target.num_blocks)
            if cfg.max_peer_blocks_share < 1 and self.layout.blocks_for(req.num_tokens) + sum(len(r.blocks) for r in held) > peer_cap:
                self.counters["refused"] += 1
                return Refused(
                    req.transfer_id,
                    f"{req.num_tokens} tokens would take you past your share of this receiver's blocks "
                    f"({peer_cap} of {self.target.num_blocks}: max_peer_blocks_share={cfg.max_peer_blocks_share:g})",
                    retryable=self.layout.blocks_for(req.num_tokens) <= peer_cap,
                )
            num_chunks = -(-req.num_tokens // cfg.chunk_size)
            direct = (
                peer.layout == self.layout and cfg.chunk_size % self.layout.block_size == 0 and req.codec == "none" and peer.kv_reached and bool(self.kv_regions)
            )
            want_slots = 0 if direct else min(cfg.slots_per_request, num_chunks)
            if want_slots > len(self._free_slots):
                self.counters["refused"] += 1
                return Refused(req.transfer_id, f"no staging slots free ({len(self._free_slots)} of {cfg.staging_slots})", retryable=True)
            needed = self.layout.blocks_for(req.num_tokens)
            try:
                blocks = self.allocator.allocate(needed)
            except OutOfBlocksError as exc:
                self.counters["refused"] += 1
                return Refused(req.transfer_id, f"cannot hold {req.num_tokens} tokens: {exc}", retryable=needed <= self.target.num_blocks)
            slots = [self._free_slots.pop() for _ in range(want_slots)]
            now = time.monotonic()
            r = self._res[req.transfer_id] = IncomingTransfer(
                req.transfer_id, identity, peer.agent, req.num_tokens, blocks, slots,
                "direct" if direct else "staging", num_chunks, now, now + cfg.lease_s, peer.token, req.prompt_key, req.codec,
            )  # fmt: skip
            self.channel.grant(peer.token, "write", self._granted(r))
            self.counters["reserved"] += 1
            self._lock.notify_all()
        return Reserved(req.transfer_id, "direct" if direct else "staging", blocks, [s * self.target.slot_bytes for s in slots], cfg.lease_s)

    def _renew(self, identity: bytes, transfer_ids: list[str]) -> None:
        deadline = time.monotonic() + self.config.lease_s
        with self._lock:
            for rid in transfer_ids:
                r = self._res.get(rid)
                if r is not None and r.identity == identity:
                    r.lease_deadline = deadline

    def _on_sender_finished(self, identity: bytes, msg: Cancel | Done) -> None:
        with self._lock:
            r = self._res.get(msg.transfer_id)
            if r is None or r.identity != identity:
                return
            r.sender_done = True
            if r.state is State.RECEIVING and (isinstance(msg, Cancel) or not msg.ok):
                reason = msg.reason if isinstance(msg, Cancel) else "sender reported failure"
                self._fail(r, TransferCancelled(f"sender cancelled: {reason}"), notify_sender=False)
            self._lock.notify_all()

    # -- chunks (I/O thread) -------------------------------------------------------
    def _on_notifications(self) -> None:
        """Verify every chunk whose notification arrived; acknowledge each request's chunks with one Landed."""
        landed: dict[str, tuple[bytes, list[int]]] = {}
        for notif in self.channel.get_notifications():
            r, index = self._on_notice(notif)
            if r is not None:
                landed.setdefault(r.transfer_id, (r.identity, []))[1].append(index)
        for rid, (identity, indices) in landed.items():
            self._reply(identity, Landed(rid, indices))

    def _on_notice(self, notif: Notification) -> tuple[IncomingTransfer | None, int]:
        """Land one chunk; the reservation and chunk index to acknowledge, or (None, -1)."""
        try:
            notice = protocol.decode_notice(notif.payload)
        except ProtocolError as exc:
            self.counters["malformed_notices"] += 1
            log.warning("dropping notification from %r: %s", notif.peer, exc)
            return None, -1
        with self._lock:
            r = self._res.get(notice.transfer_id)
            if r is None or r.peer_agent != notif.peer or r.state is not State.RECEIVING:
                self.counters["stray_notices"] += 1
                return None, -1
            try:
                nbytes = r.land(self.target, notice)
            except TransferError as exc:
                if isinstance(exc, ChecksumError):
                    self.counters["checksum_failures"] += 1
                self._fail(r, exc, notify_sender=True)
                self._lock.notify_all()
                return None, -1
            r.lease_deadline = time.monotonic() + self.config.lease_s
            self.counters["chunks_landed"] += 1
            self.counters["bytes_landed"] += nbytes
            if r.all_landed:
                r.state, r.ready_at = State.READY, time.monotonic()
                if r.slots and self.channel.revoke(r.token, "write", self.target.slot_ranges(r.slots), 0):  # nothing left to land
                    self._free_slots.extend(r.slots)
                    r.slots = []
                self.counters["transfers_ready"] += 1
            self._lock.notify_all()
        return r, notice.chunk_index

    # -- failure and release --------------------------------------------------------
    def _fail(self, r: IncomingTransfer, exc: TransferError, notify_sender: bool) -> None:
        """Mark failed (caller holds the lock); memory is freed once the sender can no longer write into it."""
        r.state, r.error = State.FAILED, str(exc)
        r.free_deadline = time.monotonic() + self.config.drain_timeout_s
        self.counters["transfers_failed"] += 1
        log.warning("transfer %s: %s", r.transfer_id, exc)
        if notify_sender:
            identity, msg = r.identity, Cancel(r.transfer_id, str(exc))
            self.loop.call_soon(lambda: self._reply(identity, msg))  # _fail also runs on API threads (cancel)

    def _granted(self, r: IncomingTransfer) -> list[Range]:
        return self.target.slot_ranges(r.slots) if r.mode == "staging" else self.target.block_ranges(r.blocks)

    def _revoke(self, r: IncomingTransfer) -> None:
        """Take back what ``r`` granted, once (caller holds the lock); a frame still landing there is waited out, or its peer fenced."""
        if r.revoked:
            return
        r.revoked = True
        ranges = self._granted(r)
        if ranges and not self.channel.revoke(r.token, "write", ranges, self.config.drain_timeout_s):
            self.counters["fences"] += 1
            log.error("transfer %s: a write was still landing in its memory after drain_timeout_s; cutting its sender's data connections", r.transfer_id)
            self._fence(r.identity)

    def _free(self, r: IncomingTransfer) -> None:
        """Give ``r``'s blocks and slots back, exactly once (caller holds the lock)."""
        self._revoke(r)
        self.allocator.free(r.blocks)
        self._free_slots.extend(r.slots)
        r.blocks, r.slots = [], []

    def _fence(self, identity: bytes) -> None:
        """Cut a sender that went silent off the data plane before its memory is reused (caller holds the lock).

        The channel drops its data connections, so nothing it queued before can
        land later (a frozen process's writes die with its sockets); its other
        reservations fail (their data path is gone), and it must send Hello
        again: its next Reserve is refused with ``hello-required``.
        """
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        self.channel.fence(peer.agent, peer.token)
        for other in self._res.values():
            if other.identity == identity and other.state is State.RECEIVING:
                self._fail(other, TransferError("the sender was cut off the data plane after it went silent"), notify_sender=True)

    def _remember_gone(self, transfer_id: str, why: str) -> None:
        self._gone[transfer_id] = why
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
                    if not r.sender_done:  # it never said it stopped writing: it may be frozen with writes queued
                        self.counters["fences"] += 1
                        self._fence(r.identity)
                    del self._res[r.transfer_id]
                    self._free(r)
                    self._remember_gone(r.transfer_id, f"failed: {r.error}")
                elif r.state is State.READY and now > r.ready_at + cfg.claim_timeout_s:
                    del self._res[r.transfer_id]
                    self._free(r)
                    self.counters["unclaimed"] += 1
                    self._remember_gone(r.transfer_id, "never claimed by the decode side")
            self._lock.notify_all()
