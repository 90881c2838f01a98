"""Prefill side of a KV transfer: handshake, reserve, push chunks, settle.

One ``KVSender`` per prefill worker owns its paged KV buffer's registration
with the channel, a bounded send-staging area, and one I/O thread that owns
every ZeroMQ DEALER socket (one per decode receiver), drives channel
handles to completion and sends heartbeats. The prefill thread calls
``open`` for a request and ``send_chunk`` as each chunk's KV is computed;
``send_chunk`` blocks (with a timeout) only when the in-flight byte budget
or the receiver's staging slots are exhausted: backpressure, never an
unbounded queue.

Modes (chosen by the receiver): ``direct`` writes whole blocks from our
buffer into the receiver's blocks when both layouts are identical; ``staging``
gathers a chunk into canonical form locally and writes it into a staging
slot the receiver scatters from.

A receiver that dies or restarts is noticed when its control connection
drops (a ZeroMQ socket monitor): it is forgotten, everything open with it
fails at once (no ``Landed`` can come back, so waiting for
``transfer_timeout_s`` would only hold the prefill side's blocks), and the
next ``open`` to its address handshakes again. One that hangs with its
connection up is caught by the timeouts.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdkv import protocol
from pdkv.auth import new_nonce, proof, verify
from pdkv.channels.base import Channel, TransferHandle, TransferOp, XferState, merge_ops
from pdkv.checksum import checksum
from pdkv.config import TransferConfig
from pdkv.errors import HandshakeError, PdkvError, ProtocolError, ReservationError, TransferCancelled, TransferError, TransferTimeout
from pdkv.keys import chunk_spans
from pdkv.layout import KVLayout, block_ranges
from pdkv import native
from pdkv.native import gather
from pdkv.memory import byte_view
from pdkv.protocol import Auth, Cancel, ChunkNotice, Done, Heartbeat, Hello, Landed, Refused, Reserve, Reserved
from pdkv.receiver import HELLO_REQUIRED
from pdkv.wakeup import Waker

log = logging.getLogger(__name__)

# How long a closed control socket keeps trying to deliver what was queued on it (the Cancel of a
# reservation we gave up on, the last Done/Cancel at close) before it is discarded: leases cover the rest.
_CLOSE_LINGER_MS = 200
# Queued for the I/O thread: close this peer's sockets (it owns them).
_CLOSE = protocol.Error("close the peer's sockets")


@dataclass
class _Peer:
    address: str
    identity: bytes
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None  # ``sock``'s DISCONNECTED events: the receiver died, restarted or the network dropped
    hello: Hello | None = None
    agent: str = ""
    dropped: str = ""  # why it was forgotten; once set, its sockets are closed for good and messages to it discarded
    nonce: bytes = field(default_factory=new_nonce)
    hello_future: Future[Hello] = field(default_factory=Future)


@dataclass
class _InFlight:
    handle: TransferHandle
    nbytes: int
    local_slot: int  # -1 in direct mode
    remote_slot: int


class OutgoingTransfer:
    """One request's push to one receiver. Create with ``KVSender.open``."""

    def __init__(self, sender: KVSender, peer: _Peer, request_id: str, num_tokens: int, block_table: Sequence[int], reserved: Reserved) -> None:
        self.sender = sender
        self.peer = peer
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.block_table = list(block_table)
        self.mode = reserved.mode
        self.remote_blocks = reserved.block_ids
        self.remote_slots = reserved.staging_slots
        self.spans = list(chunk_spans(num_tokens, sender.config.chunk_size))
        self.free_remote_slots = collections.deque(range(len(reserved.staging_slots)))
        self.slot_of_chunk: dict[int, int] = {}
        self.sent: set[int] = set()
        self.landed: set[int] = set()
        self.inflight: list[_InFlight] = []
        self.posting = 0  # chunks between taking credit and tracking their handle
        self.error: TransferError | None = None
        self.settled = False  # Done or Cancel sent: no more writes from us
        self.bytes_sent = 0
        self.started = 0.0  # first chunk posted: transfer time excludes the wait for compute before it
        self.opened = time.monotonic()  # reservation granted: transfer_timeout_s counts from here, as on the receiver
        self.renewed = self.opened  # last heartbeat posted for it: the receiver's lease runs from about here
        # Past this long without a heartbeat the receiver may have reaped the reservation (two beats of slack
        # for a renewal that was queued but not yet on the wire); its lease_s, not ours, is what counts.
        self.lease_s = reserved.lease_s
        self.lease_margin = max(self.lease_s - 2 * sender.config.heartbeat_s, self.lease_s / 2)
        self.finished_at = 0.0
        self._on_settled: list[Callable[[OutgoingTransfer], None]] = []

    @property
    def num_chunks(self) -> int:
        return len(self.spans)

    @property
    def complete(self) -> bool:
        return len(self.landed) == self.num_chunks

    def send_chunk(self, index: int, timeout: float | None = None) -> None:
        """Post chunk ``index`` (its KV must already be in our blocks); waits only for backpressure."""
        self.sender._send_chunk(self, index, self.sender.config.chunk_timeout_s if timeout is None else timeout)

    def send_all(self) -> None:
        for i in range(self.num_chunks):
            if i not in self.sent:
                self.send_chunk(i)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the receiver verified every chunk, or raise why it did not."""
        self.sender._wait_transfer(self, self.sender.config.transfer_timeout_s if timeout is None else timeout)

    def cancel(self, reason: str) -> None:
        """Stop sending; the receiver is told once our in-flight writes settle."""
        with self.sender._cond:
            self.sender._fail(self, TransferCancelled(f"cancelled by the prefill side: {reason}"))

    def on_settled(self, fn: Callable[[OutgoingTransfer], None]) -> None:
        """Call ``fn(self)`` once no write of ours can touch the source blocks any more.

        The prefill worker frees the request's blocks here, not earlier: a
        block freed while a write still reads from it could ship another
        request's KV. Runs on the sender's I/O thread (or at once if settled).
        """
        with self.sender._cond:
            if not self.settled:
                self._on_settled.append(fn)
                return
        fn(self)


class KVSender:
    """Pushes KV chunks to decode receivers; see the module docstring."""

    _ids = itertools.count()

    def __init__(
        self,
        channel: Channel,
        layout: KVLayout,
        kv_tensors: Sequence[torch.Tensor],
        fingerprint: str,
        config: TransferConfig | None = None,
        secret: str | bytes = b"",
    ) -> None:
        self.channel = channel
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.layout = layout
        self.kv = list(kv_tensors)
        self.num_blocks = layout.validate_buffer(self.kv)
        self.fingerprint = fingerprint
        self.config = config or TransferConfig()
        self._kv_views = [byte_view(t) for t in self.kv]
        self.kv_regions = [channel.register(t) for t in self.kv]
        native.available()  # build or load csrc/ now, not inside the first transfer
        self.slot_bytes = layout.chunk_bytes(self.config.chunk_size)
        n_slots = max(1, self.config.max_inflight_bytes // self.slot_bytes)
        self.staging = torch.zeros(n_slots * self.slot_bytes, dtype=torch.uint8)
        self.staging_region = channel.register(self.staging)
        self._free_local_slots = list(range(n_slots))

        self._cond = threading.Condition()
        self._inflight_bytes = 0
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._pending_reserve: dict[str, tuple[_Peer, Future[protocol.Message]]] = {}
        self._outbox: queue.SimpleQueue[tuple[_Peer, protocol.Message] | None] = queue.SimpleQueue()
        self._sock_peer: dict[zmq.Socket, _Peer] = {}
        self._monitor_peer: dict[zmq.Socket, _Peer] = {}
        self._waker = Waker()
        self.counters: collections.Counter[str] = collections.Counter()
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdkv-sender", daemon=True)
        self._thread.start()

    # -- public API -------------------------------------------------------------
    def hello(self) -> Hello:
        return protocol.make_hello(self.channel, self.fingerprint, self.layout, self.config.chunk_size, self.kv_regions, self.staging_region)

    def open(self, request_id: str, address: str, num_tokens: int, block_table: Sequence[int]) -> OutgoingTransfer:
        """Handshake (once per receiver) and reserve room for the whole request there."""
        if num_tokens <= 0:
            raise ReservationError(f"request {request_id!r}: nothing to transfer (num_tokens={num_tokens})")
        if len(block_table) < self.layout.blocks_for(num_tokens):
            raise ReservationError(f"request {request_id!r}: block table has {len(block_table)} blocks, {num_tokens} tokens need {self.layout.blocks_for(num_tokens)}")
        deadline = time.monotonic() + self.config.reserve_timeout_s
        rehandshaked = False
        backoff = 0.005
        while True:
            peer = self._connect(address)
            reply = self._request(peer, request_id, Reserve(request_id, num_tokens))
            if isinstance(reply, Reserved):
                break
            reason = reply.reason if isinstance(reply, Refused) else getattr(reply, "message", repr(reply))
            if not rehandshaked and reason.startswith(HELLO_REQUIRED):
                rehandshaked = True
                self._drop_peer(peer, f"receiver {address} restarted: it no longer knows the requests reserved on its previous run")
                continue  # handshake with the new run
            if isinstance(reply, Refused) and reply.retryable and time.monotonic() + backoff < deadline:
                self.counters["reservations_retried"] += 1
                time.sleep(backoff)  # room frees up as other requests finish
                backoff = min(backoff * 2, 0.1)
                continue
            self.counters["reservations_refused"] += 1
            raise ReservationError(f"receiver {address} refused request {request_id!r}: {reason}")
        self._check_reserved(reply, num_tokens)
        xfer = OutgoingTransfer(self, peer, request_id, num_tokens, block_table, reply)
        with self._cond:
            self._transfers[request_id] = xfer
        return xfer

    def stats(self) -> dict[str, int]:
        with self._cond:
            out = dict(self.counters)
            out["inflight_bytes"] = self._inflight_bytes
            out["open_transfers"] = len(self._transfers)
        return out

    def close(self) -> None:
        if self._stop.is_set():
            return
        with self._cond:
            for xfer in list(self._transfers.values()):
                self._fail(xfer, TransferCancelled("sender closing"))
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline and self._transfers:  # settling tells each receiver
            time.sleep(0.005)
        self._stop.set()
        self._outbox.put(None)
        self._waker.wake()
        self._thread.join(timeout=5)  # the I/O thread closes every socket on its way out
        self._waker.close()

    # -- handshake and reservation ------------------------------------------------
    def _connect(self, address: str) -> _Peer:
        with self._cond:
            peer = self._peers.get(address)
            if peer is None:
                ident = f"{self.channel.agent_name}/{next(self._ids)}".encode()
                peer = self._peers[address] = _Peer(address, ident)
                self._post(peer, msgspec.structs.replace(self.hello(), nonce=peer.nonce))
        timeout = self.config.handshake_timeout_s
        try:
            hello = peer.hello_future.result(timeout)
        except FutureTimeout:
            reason = f"no Hello reply from receiver {address} within handshake_timeout_s={timeout:.3g}s"
            self._drop_peer(peer, reason)
            raise TransferTimeout(reason) from None
        except PdkvError as exc:  # refused (HandshakeError), or the receiver went away mid-handshake
            self._drop_peer(peer, str(exc))
            raise
        if not peer.agent:
            with self._cond:
                if not peer.agent:
                    self._retire_previous_run(peer, hello)
                    peer.agent = self.channel.add_peer(hello.channel_metadata)
        self.channel.connect(peer.agent, self.config.handshake_timeout_s)  # the data path too: an unreachable one fails here, loudly
        return peer

    def _retire_previous_run(self, peer: _Peer, hello: Hello) -> None:
        """Fail transfers reserved on an earlier run of the receiver ``hello`` comes from (caller holds the lock).

        ``add_peer`` of a restarted receiver that kept its agent name points every later write to that
        name at the new run, where the old reservations' block ids belong to other requests. So the old
        transfers fail first, and a write of theirs being posted right now (to the old run) is waited for.
        """
        stale = [
            x for x in self._transfers.values()
            if x.peer is not peer and x.peer.hello is not None and x.peer.hello.agent == hello.agent
            and x.peer.hello.channel_metadata != hello.channel_metadata
        ]  # fmt: skip
        for xfer in stale:
            self._fail(xfer, TransferError(f"receiver {hello.agent!r} at {xfer.peer.address} restarted: request {xfer.request_id!r} was reserved on its previous run"))
        deadline = time.monotonic() + self.config.handshake_timeout_s
        while any(x.posting for x in stale):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"a write to the previous run of receiver {hello.agent!r} was still being posted after handshake_timeout_s={self.config.handshake_timeout_s:.3g}s")
            self._cond.wait(min(remaining, 0.05))

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """Forget a receiver that died, restarted, refused us or stopped answering; fail what is open with it.

        Its open transfers can never complete (no ``Landed`` comes back over a closed socket), so they
        fail now with ``reason`` instead of at transfer_timeout_s, and the prefill side's blocks are
        freed as soon as their writes settle. The next ``open`` to that address handshakes again.
        """
        err = TransferError(reason)
        with self._cond:
            if peer.dropped:
                return
            peer.dropped = reason
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            for xfer in self._transfers.values():
                if xfer.peer is peer:
                    self._fail(xfer, err)
            waiting: list[Future[Any]] = [peer.hello_future, *(fut for owner, fut in self._pending_reserve.values() if owner is peer)]
            if peer.agent and not any(p.agent == peer.agent for p in self._peers.values()):
                self.channel.remove_peer(peer.agent)  # its link goes too: a write still in flight to it fails now
        for fut in waiting:
            _answer(fut, err)
        self._post(peer, _CLOSE)

    def _request(self, peer: _Peer, request_id: str, msg: Reserve) -> protocol.Message:
        fut: Future[protocol.Message] = Future()
        with self._cond:
            if request_id in self._pending_reserve or request_id in self._transfers:
                raise ReservationError(f"request {request_id!r} already has a transfer open")
            if peer.dropped:  # lost since the handshake: its socket is closed, a Reserve would go nowhere
                raise TransferError(peer.dropped)
            self._pending_reserve[request_id] = (peer, fut)
        self._post(peer, msg)
        timeout = self.config.reserve_timeout_s
        try:
            return fut.result(timeout)
        except FutureTimeout:
            self._post(peer, Cancel(request_id, "reservation timed out at the sender"))  # queued before the drop closes the socket
            reason = f"receiver {peer.address} did not answer Reserve for {request_id!r} within reserve_timeout_s={timeout:.3g}s"
            self._drop_peer(peer, reason)
            raise TransferTimeout(reason) from None
        finally:
            with self._cond:
                self._pending_reserve.pop(request_id, None)

    def _check_reserved(self, reply: Reserved, num_tokens: int) -> None:
        """A grant from the wire is checked before any write is built from it."""
        peer_layout_blocks = -(-num_tokens // self.layout.block_size)
        if reply.mode == "direct" and len(reply.block_ids) < peer_layout_blocks:
            raise ReservationError(f"receiver granted {len(reply.block_ids)} blocks for {num_tokens} tokens")
        if reply.mode == "staging" and not reply.staging_slots:
            raise ReservationError("receiver granted staging mode without staging slots")

    # -- sending ------------------------------------------------------------------
    def _send_chunk(self, xfer: OutgoingTransfer, index: int, timeout: float) -> None:
        if not 0 <= index < xfer.num_chunks:
            raise TransferError(f"chunk {index} out of range: request {xfer.request_id!r} has {xfer.num_chunks} chunks")
        start, n = xfer.spans[index]
        nbytes = self.layout.chunk_bytes(n)
        staging = xfer.mode == "staging"
        deadline = time.monotonic() + timeout
        with self._cond:
            if index in xfer.sent:
                raise TransferError(f"chunk {index} of {xfer.request_id!r} was already sent")
            while True:
                if xfer.error is None and time.monotonic() - xfer.renewed > xfer.lease_margin:
                    # We were stalled (SIGSTOP, a long GC, a frozen VM) past the point where the receiver may have
                    # reaped the reservation and handed its blocks to another request: writing now could land in them.
                    self._fail(xfer, TransferTimeout(
                        f"request {xfer.request_id!r}: no heartbeat reached receiver {xfer.peer.address} for "
                        f"{time.monotonic() - xfer.renewed:.3g}s (its lease is {xfer.lease_s:.3g}s); not writing into a reservation that may be gone"))
                if xfer.error is not None:
                    raise xfer.error
                room = self._inflight_bytes == 0 or self._inflight_bytes + nbytes <= self.config.max_inflight_bytes
                if room and (not staging or (self._free_local_slots and xfer.free_remote_slots)):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    err = TransferTimeout(f"chunk {index} of {xfer.request_id!r}: no send credit within chunk_timeout_s={timeout:.3g}s (receiver slow or gone)")
                    self._fail(xfer, err)
                    raise err
                self._cond.wait(min(remaining, 0.05))
            self._inflight_bytes += nbytes
            local_slot = self._free_local_slots.pop() if staging else -1
            remote_slot = xfer.free_remote_slots.popleft() if staging else -1
            xfer.sent.add(index)
            xfer.posting += 1  # keeps the transfer from settling before the handle is tracked
            if not xfer.started:
                xfer.started = time.monotonic()
            if staging:
                xfer.slot_of_chunk[index] = remote_slot
        try:
            ops, digest = self._direct_ops(xfer, start, n) if not staging else self._staged_ops(xfer, local_slot, remote_slot, start, n)
            notice = protocol.encode(ChunkNotice(xfer.request_id, index, digest, remote_slot))
            handle = self.channel.write(xfer.peer.agent, ops, notice)
        except Exception as exc:
            with self._cond:
                xfer.posting -= 1
                self._release_credit(nbytes, local_slot)
                err = exc if isinstance(exc, TransferError) else TransferError(f"posting chunk {index} of {xfer.request_id!r} failed: {exc}")
                self._fail(xfer, err)
            raise err from exc
        with self._cond:
            xfer.posting -= 1
            xfer.inflight.append(_InFlight(handle, nbytes, local_slot, remote_slot))
            xfer.bytes_sent += nbytes

    def _direct_ops(self, xfer: OutgoingTransfer, start: int, n: int) -> tuple[list[TransferOp], int]:
        bs = self.layout.block_size
        first, last = start // bs, -(-(start + n) // bs)
        ours = block_ranges(self.layout, xfer.block_table[first:last], self.num_blocks)
        theirs = block_ranges(self.layout, xfer.remote_blocks[first:last])
        assert xfer.peer.hello is not None
        remote_regions = xfer.peer.hello.kv_regions
        ops = [
            TransferOp(self.kv_regions[t], off, remote_regions[rt], roff, ln)
            for (t, off, ln), (rt, roff, _) in zip(ours, theirs, strict=True)
        ]
        digest = checksum(self._kv_views[t][off : off + ln] for t, off, ln in ours)
        return merge_ops(ops), digest

    def _staged_ops(self, xfer: OutgoingTransfer, local_slot: int, remote_slot: int, start: int, n: int) -> tuple[list[TransferOp], int]:
        base = local_slot * self.slot_bytes
        nbytes = self.layout.chunk_bytes(n)
        out = self.staging[base : base + nbytes].view(self.layout.torch_dtype).view(self.layout.chunk_shape(n))
        gather(self.layout, self.kv, xfer.block_table, start, n, out=out)
        digest = checksum([byte_view(self.staging)[base : base + nbytes]])
        assert xfer.peer.hello is not None
        op = TransferOp(self.staging_region, base, xfer.peer.hello.staging_region, xfer.remote_slots[remote_slot], nbytes)
        return [op], digest

    def _release_credit(self, nbytes: int, local_slot: int) -> None:
        """Give back local send credit (caller holds the lock); remote slots come back with ``Landed``."""
        self._inflight_bytes -= nbytes
        if local_slot >= 0:
            self._free_local_slots.append(local_slot)
        self._cond.notify_all()

    def _wait_transfer(self, xfer: OutgoingTransfer, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while xfer.error is None and not xfer.complete:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._fail(xfer, TransferTimeout(f"request {xfer.request_id!r}: receiver did not confirm all {xfer.num_chunks} chunks within {timeout:.3g}s"))
                    break
                self._cond.wait(min(remaining, 0.05))
            if xfer.error is not None:
                raise xfer.error

    def _fail(self, xfer: OutgoingTransfer, err: TransferError) -> None:
        """First failure wins (caller holds the lock); the loop tells the receiver once writes settle."""
        if xfer.error is None and not xfer.complete:
            xfer.error = err
            self.counters["transfers_failed"] += 1
            log.warning("request %s: %s", xfer.request_id, err)
        self._cond.notify_all()

    # -- I/O loop -----------------------------------------------------------------
    def _post(self, peer: _Peer, msg: protocol.Message) -> None:
        """Queue a message for the I/O thread, which owns the sockets, and wake it."""
        self._outbox.put((peer, msg))
        self._waker.wake()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker, zmq.POLLIN)
        last_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                self._flush_outbox(poller)
                busy = any(x.inflight for x in list(self._transfers.values()))
                events = dict(poller.poll(1 if busy else 50))
                if events.pop(self._waker.fileno(), None):
                    self._waker.clear()
                for sock in events:
                    if sock in self._monitor_peer:
                        self._on_monitor(sock)
                    else:
                        self._drain(sock)
                self._progress()
                now = time.monotonic()
                if now - last_beat >= self.config.heartbeat_s:
                    last_beat = now
                    self._heartbeat()
            except Exception:
                log.exception("sender loop error")
        self._flush_outbox(poller)  # the last Cancel/Done messages
        for peer in list(self._sock_peer.values()):
            self._close_sockets(poller, peer)

    def _flush_outbox(self, poller: zmq.Poller) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                return
            peer, msg = item
            if msg is _CLOSE:
                self._close_sockets(poller, peer)
                continue
            if peer.sock is None:
                if peer.dropped:
                    continue  # forgotten: a socket opened for it now would never be closed
                peer.sock = self._ctx.socket(zmq.DEALER)
                peer.sock.setsockopt(zmq.LINGER, 0)
                peer.sock.setsockopt(zmq.ROUTING_ID, peer.identity)
                peer.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
                peer.monitor = peer.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                peer.sock.connect(peer.address)
                poller.register(peer.sock, zmq.POLLIN)
                poller.register(peer.monitor, zmq.POLLIN)
                self._sock_peer[peer.sock] = peer
                self._monitor_peer[peer.monitor] = peer
            try:
                peer.sock.send(protocol.encode(msg), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not send %s to %s: %s", type(msg).__name__, peer.address, exc)

    def _close_sockets(self, poller: zmq.Poller, peer: _Peer) -> None:
        """Close a peer's socket and its monitor (on the I/O thread, which owns them)."""
        if peer.sock is None or peer.monitor is None:
            return
        poller.unregister(peer.monitor)
        poller.unregister(peer.sock)
        del self._monitor_peer[peer.monitor], self._sock_peer[peer.sock]
        peer.sock.disable_monitor()
        peer.monitor.close(0)
        peer.sock.close(_CLOSE_LINGER_MS)
        peer.sock = peer.monitor = None

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """A receiver's control connection dropped: it died or restarted, or the network failed.

        Replies in flight on that connection are lost, so nothing open with it can finish: fail it
        now rather than at a timeout. ZeroMQ would reconnect on its own; we drop the peer instead so
        that a receiver that comes back is met with a fresh Hello.
        """
        peer = self._monitor_peer[monitor]
        lost = False
        while True:
            try:
                lost = recv_monitor_message(monitor, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED or lost
            except zmq.Again:
                break
        if lost and not peer.dropped:
            self.counters["peers_lost"] += 1
            log.warning("lost the control connection to receiver %s: failing what is open with it; the next request to it handshakes again", peer.address)
            self._drop_peer(peer, f"lost the control connection to receiver {peer.address} (it died or restarted, or the network dropped)")

    def _drain(self, sock: zmq.Socket) -> None:
        peer = self._sock_peer.get(sock)
        for _ in range(256):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(data)
            except ProtocolError as exc:
                log.warning("dropping message from %s: %s", peer.address if peer else "?", exc)
                continue
            if peer is not None:
                self._on_message(peer, msg)

    def _on_message(self, peer: _Peer, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            try:
                protocol.check_compatible(self.hello(), msg)
                if self.secret and not verify(self.secret, "receiver", peer.nonce, msg.nonce, msg.auth):
                    self.counters["auth_failures"] += 1
                    raise HandshakeError(f"receiver {peer.address} did not prove the shared secret (missing or different `secret`)")
            except HandshakeError as exc:
                self.counters["handshake_failures"] += 1
                if not peer.hello_future.done():
                    peer.hello_future.set_exception(exc)
                return
            if self.secret:  # queued before anyone can queue a Reserve: the receiver sees it first
                self._post(peer, Auth(proof(self.secret, "sender", msg.nonce, peer.nonce)))
            peer.hello = msg
            _answer(peer.hello_future, msg)
        elif isinstance(msg, protocol.Error):
            err = HandshakeError(f"receiver {peer.address} refused us: {msg.message}")
            if not peer.hello_future.done():
                _answer(peer.hello_future, err)
            else:
                log.warning("receiver %s reported: %s", peer.address, msg.message)
        elif isinstance(msg, (Reserved, Refused)):
            with self._cond:
                owner, fut = self._pending_reserve.get(msg.request_id, (None, None))
            if owner is peer and fut is not None and not fut.done():
                _answer(fut, msg)
            elif isinstance(msg, Reserved):  # we gave up waiting: release it at once
                self._post(peer, Cancel(msg.request_id, "reservation arrived after the sender gave up"))
        elif isinstance(msg, Landed):
            with self._cond:
                xfer = self._transfers.get(msg.request_id)
                if xfer is None or xfer.peer is not peer or msg.chunk_index not in xfer.sent:
                    return
                if msg.chunk_index not in xfer.landed:
                    xfer.landed.add(msg.chunk_index)
                    self.counters["chunks_landed"] += 1
                    if xfer.mode == "staging":
                        self._return_remote_slot(xfer, msg.chunk_index)
                    if xfer.complete:
                        xfer.finished_at = time.monotonic()
                self._cond.notify_all()
        elif isinstance(msg, Cancel):
            with self._cond:
                xfer = self._transfers.get(msg.request_id)
                if xfer is not None and xfer.peer is peer:
                    self._fail(xfer, TransferCancelled(f"receiver cancelled: {msg.reason}"))

    def _return_remote_slot(self, xfer: OutgoingTransfer, index: int) -> None:
        slot = xfer.slot_of_chunk.pop(index, None)
        if slot is not None:
            xfer.free_remote_slots.append(slot)

    def _progress(self) -> None:
        """Poll posted handles; release credit; settle transfers that are over."""
        with self._cond:
            transfers = list(self._transfers.values())
        for xfer in transfers:
            for f in list(xfer.inflight):
                state = self.channel.poll(f.handle)
                if state is XferState.PENDING:
                    continue
                self.channel.release(f.handle)
                with self._cond:
                    xfer.inflight.remove(f)
                    if state is XferState.ERROR:
                        self._fail(xfer, TransferError(f"channel write failed: {f.handle.error}"))
                    self._release_credit(f.nbytes, f.local_slot)
                    if state is XferState.DONE:
                        self.counters["chunks_sent"] += 1
                        self.counters["bytes_sent"] += f.nbytes
            with self._cond:
                # Nobody may be waiting on this transfer (the worker never calls wait): if its receiver died after
                # our writes completed, neither Landed nor Cancel ever comes, so bound it here or it stays open forever.
                if xfer.error is None and not xfer.complete and time.monotonic() > xfer.opened + self.config.transfer_timeout_s:
                    self._fail(xfer, TransferTimeout(
                        f"request {xfer.request_id!r}: receiver {xfer.peer.address} did not confirm all {xfer.num_chunks} chunks "
                        f"within transfer_timeout_s={self.config.transfer_timeout_s:.3g}s"))
                over = xfer.error is not None or xfer.complete
                if over and not xfer.inflight and not xfer.posting and not xfer.settled:
                    xfer.settled = True
                    del self._transfers[xfer.request_id]
                    msg: protocol.Message = Done(xfer.request_id, True) if xfer.error is None else Cancel(xfer.request_id, str(xfer.error))
                    self._post(xfer.peer, msg)
                    self.counters["transfers_ok" if xfer.error is None else "transfers_settled_failed"] += 1
                    callbacks, xfer._on_settled = xfer._on_settled, []
                else:
                    callbacks = []
            for fn in callbacks:
                try:
                    fn(xfer)
                except Exception:
                    log.exception("on_settled callback for %s failed", xfer.request_id)

    def _heartbeat(self) -> None:
        """Renew each live peer's leases over its own socket.

        Grouped by peer, not address: after a receiver restart the address has a new peer (new
        identity) while transfers of the dropped one may not have settled yet, and the receiver
        renews a lease only for the identity that holds it.
        """
        with self._cond:
            by_peer: dict[bytes, tuple[_Peer, list[str]]] = {}
            now = time.monotonic()
            for xfer in self._transfers.values():
                if not xfer.peer.dropped:
                    by_peer.setdefault(xfer.peer.identity, (xfer.peer, []))[1].append(xfer.request_id)
                    xfer.renewed = now
        for peer, ids in by_peer.values():
            self._post(peer, Heartbeat(ids))


def _answer(fut: Future[Any], outcome: Any) -> None:
    """Resolve ``fut`` with a result, or fail it with an exception; the first thread to answer wins."""
    with contextlib.suppress(InvalidStateError):
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
