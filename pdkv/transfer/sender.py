"""Prefill side of a KV transfer: handshake, reserve, push chunks, settle.

Two parts, the split SGLang's disaggregation makes between its KV manager and
its per-request senders:

* ``KVSender``, one per prefill worker: registers the paged KV buffer and a
  bounded send-staging area with the channel, owns the send credit every
  transfer draws from (bytes in flight, local staging slots), and runs the
  control plane (``pdkv.transfer.control``): one I/O thread, one DEALER per decode
  receiver, the handshake (Hello, and Auth when a secret is set), heartbeats.
* ``OutgoingTransfer``, one per request: its reservation on the receiver, the
  chunks it sent and the receiver verified, its in-flight writes, and the
  state machine from open to settled.

The prefill side calls ``KVSender.open`` for a request and
``OutgoingTransfer.send_chunk`` as each chunk's KV is computed. ``send_chunk``
waits (with a timeout) only for credit: backpressure, never an unbounded
queue. Nothing polls on a timer: a write's completion arrives as the channel
handle's done callback and a receiver's answer as a message, each waking the
I/O thread at once, so several chunks of several requests are in flight
together and a small request costs its round trips, not poll intervals.

Modes (chosen by the receiver): ``direct`` writes whole blocks from our
buffer into the receiver's blocks when both layouts are identical (one
descriptor list per chunk, adjacent blocks merged); ``staging`` gathers a
chunk into canonical form locally and writes it into a staging slot the
receiver scatters from.

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
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from pdkv import native
from pdkv.auth import bound_proof, new_nonce, proof, verify
from pdkv.channels.base import Channel, TransferHandle, TransferOp, XferState
from pdkv.checksum import chunk_checksum, flat_bytes
from pdkv.codec import Codec, make_codec
from pdkv.codec import slot_bytes as codec_slot_bytes
from pdkv.config import TransferConfig
from pdkv.errors import HandshakeError, PdkvError, ReservationError, TransferCancelled, TransferError, TransferTimeout
from pdkv.keys import chunk_spans
from pdkv.layout import KVLayout, block_runs
from pdkv.memory import adopt_kv, memory_kind
from pdkv.native import gather
from pdkv.staging import DeviceStager, pinned_empty
from pdkv.transfer import protocol
from pdkv.transfer.control import ControlLoop, DealerSockets
from pdkv.transfer.protocol import HELLO_REQUIRED, Auth, Cancel, ChunkNotice, Done, Heartbeat, Hello, Landed, Refused, Reserve, Reserved, reserve_fields

log = logging.getLogger(__name__)


@dataclass(eq=False)  # hashable by identity: it keys its DEALER socket
class _Peer:
    address: str
    identity: bytes
    hello: Hello | None = None
    agent: str = ""
    dropped: str = ""  # why it was forgotten; once set, its socket is closed for good and messages to it discarded
    nonce: bytes = field(default_factory=new_nonce)
    token: bytes = field(default_factory=lambda: os.urandom(16))  # our data connections' capability at this receiver
    hello_future: Future[Hello] = field(default_factory=Future)


class _Credit:
    """What every transfer of one sender draws from: bytes in flight and local staging slots.

    Guarded by the sender's condition. One chunk may always go when nothing is
    in flight, so a chunk bigger than the budget still moves, alone.
    """

    def __init__(self, max_bytes: int, slots: int) -> None:
        self.max_bytes = max_bytes
        self.inflight = 0
        self.free_slots = list(range(slots))

    def available(self, nbytes: int, need_slot: bool) -> bool:
        room = self.inflight == 0 or self.inflight + nbytes <= self.max_bytes
        return room and (not need_slot or bool(self.free_slots))

    def take(self, nbytes: int, need_slot: bool) -> int:
        self.inflight += nbytes
        return self.free_slots.pop() if need_slot else -1

    def give(self, nbytes: int, slot: int) -> None:
        self.inflight -= nbytes
        if slot >= 0:
            self.free_slots.append(slot)


@dataclass
class _Source:
    """Our side's memory as every transfer reads it: the KV buffer and the staging area, registered.

    ``kv_regions`` is empty when the channel cannot reach the KV's memory (a
    tcp channel and KV in VRAM): our Hello then says so, receivers grant us
    staging mode only, and ``stager`` moves each chunk through pinned host
    memory.
    """

    layout: KVLayout
    kv: list[torch.Tensor]
    kv_bytes: list[torch.Tensor]  # each KV tensor's bytes, flat, on its own device
    kv_regions: list[int]
    num_blocks: int
    staging: torch.Tensor
    staging_region: int
    slot_bytes: int
    stager: DeviceStager | None


class OutgoingTransfer:
    """One request's push to one receiver. Create with ``KVSender.open``.

    Its state changes under the sender's condition; the I/O thread applies
    what the channel and the receiver report (writes done, chunks landed,
    cancel) and settles it: once it failed or completed and no write of ours
    is in flight, the receiver is told (``Done``/``Cancel``) and the
    ``on_settled`` callbacks run.
    """

    def __init__(self, sender: KVSender, peer: _Peer, transfer_id: str, num_tokens: int, block_table: Sequence[int], reserved: Reserved, codec: Codec) -> None:
        self._sender = sender
        self.codec = codec  # how staged chunks go on the wire (``none``: as they are)
        self.cond = sender.cond
        self.peer = peer
        self.transfer_id = transfer_id
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
        self.writes = 0  # posted writes whose handles have not finished
        self.posting = 0  # chunks between taking credit and their write being tracked
        self.error: TransferError | None = None
        self.settled = False  # Done or Cancel sent: no more writes from us
        self.bytes_sent = 0
        self.wire_bytes = 0  # what the channel carried: less than bytes_sent with a compressing codec
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

    # -- the caller's side -----------------------------------------------------
    def send_chunk(self, index: int, timeout: float | None = None) -> None:
        """Post chunk ``index`` (its KV must already be in our blocks); waits only for credit."""
        if not 0 <= index < self.num_chunks:
            raise TransferError(f"chunk {index} out of range: transfer {self.transfer_id!r} has {self.num_chunks} chunks")
        sender = self._sender
        timeout = sender.config.chunk_timeout_s if timeout is None else timeout
        start, n = self.spans[index]
        nbytes = sender.source.layout.chunk_bytes(n)
        staging = self.mode == "staging"
        local_slot, remote_slot = self._take_credit(index, nbytes, staging, timeout)
        try:
            ops, digest = self._staged_ops(local_slot, remote_slot, start, n) if staging else self._direct_ops(start, n)
            wire = sum(op.length for op in ops)
            notice = protocol.encode(ChunkNotice(self.transfer_id, index, digest, remote_slot, wire if staging else 0))
            handle = sender.channel.write(self.peer.agent, ops, notice, token=self.peer.token)
        except Exception as exc:
            err = exc if isinstance(exc, TransferError) else TransferError(f"posting chunk {index} of {self.transfer_id!r} failed: {exc}")
            with self.cond:
                self.posting -= 1
                sender.credit.give(nbytes, local_slot)
                self.fail(err)
            raise err from exc
        with self.cond:
            self.posting -= 1
            self.writes += 1
            self.bytes_sent += nbytes
            self.wire_bytes += wire
            sender.counters["bytes_raw"] += nbytes
            sender.counters["bytes_wire"] += wire
        handle.add_done_callback(lambda h: sender.loop.call_soon(lambda: self._written(h, nbytes, local_slot)))

    def send_all(self) -> None:
        for i in range(self.num_chunks):
            if i not in self.sent:
                self.send_chunk(i)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the receiver verified every chunk, or raise why it did not."""
        timeout = self._sender.config.transfer_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.error is None and not self.complete:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.fail(TransferTimeout(f"transfer {self.transfer_id!r}: receiver did not confirm all {self.num_chunks} chunks within {timeout:.3g}s"))
                    break
                self.cond.wait(remaining)
            if self.error is not None:
                raise self.error

    def cancel(self, reason: str) -> None:
        """Stop sending; the receiver is told once our in-flight writes settle."""
        with self.cond:
            self.fail(TransferCancelled(f"cancelled by the prefill side: {reason}"))

    def on_settled(self, fn: Callable[[OutgoingTransfer], None]) -> None:
        """Call ``fn(self)`` once no write of ours can touch the source blocks any more.

        The prefill worker frees the request's blocks here, not earlier: a
        block freed while a write still reads from it could ship another
        request's KV. Runs on the sender's I/O thread (or at once if settled).
        """
        with self.cond:
            if not self.settled:
                self._on_settled.append(fn)
                return
        fn(self)

    # -- posting ---------------------------------------------------------------
    def _take_credit(self, index: int, nbytes: int, staging: bool, timeout: float) -> tuple[int, int]:
        credit = self._sender.credit
        deadline = time.monotonic() + timeout
        with self.cond:
            if index in self.sent:
                raise TransferError(f"chunk {index} of {self.transfer_id!r} was already sent")
            while True:
                if self.error is None and time.monotonic() - self.renewed > self.lease_margin:
                    # We were stalled (SIGSTOP, a long GC, a frozen VM) past the point where the receiver may have
                    # reaped the reservation and handed its blocks to another request: writing now could land in them.
                    self.fail(TransferTimeout(
                        f"transfer {self.transfer_id!r}: no heartbeat reached receiver {self.peer.address} for "
                        f"{time.monotonic() - self.renewed:.3g}s (its lease is {self.lease_s:.3g}s); not writing into a reservation that may be gone"))
                if self.error is not None:
                    raise self.error
                if credit.available(nbytes, staging) and (not staging or self.free_remote_slots):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    err = TransferTimeout(f"chunk {index} of {self.transfer_id!r}: no send credit within chunk_timeout_s={timeout:.3g}s (receiver slow or gone)")
                    self.fail(err)
                    raise err
                self.cond.wait(remaining)
            local_slot = credit.take(nbytes, staging)
            remote_slot = self.free_remote_slots.popleft() if staging else -1
            self.sent.add(index)
            self.posting += 1  # keeps the transfer from settling before its write is tracked
            if not self.started:
                self.started = time.monotonic()
            if staging:
                self.slot_of_chunk[index] = remote_slot
        return local_slot, remote_slot

    def _direct_ops(self, start: int, n: int) -> tuple[list[TransferOp], int]:
        """One op per buffer tensor per run of blocks adjacent on both sides; the checksum over the same bytes in wire order."""
        src = self._sender.source
        layout = src.layout
        bs, size = layout.block_size, layout.block_bytes
        first, last = start // bs, -(-(start + n) // bs)
        ours = self.block_table[first:last]
        if min(ours) < 0 or max(ours) >= src.num_blocks:
            raise TransferError(f"transfer {self.transfer_id!r}: block table {ours} outside our {src.num_blocks} blocks")
        runs = block_runs(ours, self.remote_blocks[first:last])
        assert self.peer.hello is not None
        remote_regions = self.peer.hello.kv_regions
        ops = [TransferOp(src.kv_regions[t], a * size, remote_regions[t], b * size, k * size) for t in range(layout.num_tensors) for a, b, k in runs]
        digest = chunk_checksum((src.kv_bytes[t][a * size : (a + k) * size] for t in range(layout.num_tensors) for a, _, k in runs), unit=size)
        return ops, digest

    def _staged_ops(self, local_slot: int, remote_slot: int, start: int, n: int) -> tuple[list[TransferOp], int]:
        """Gather the chunk into our slot (through the codec, when one encodes it); the checksum covers the wire bytes."""
        src = self._sender.source
        layout = src.layout
        base = local_slot * src.slot_bytes
        digest: int | None = None
        if self.codec.passthrough:
            nbytes = layout.chunk_bytes(n)
            if src.stager is not None:  # KV the channel cannot reach: gathered and hashed on its device, copied into the pinned slot
                digest = src.stager.stage_out(self.block_table, start, n, src.staging[base : base + nbytes])
            else:
                out = src.staging[base : base + nbytes].view(layout.torch_dtype).view(layout.chunk_shape(n))
                gather(layout, src.kv, self.block_table, start, n, out=out)
        else:
            raw = self.codec.scratch("raw", layout.chunk_shape(n), layout.torch_dtype)
            if src.stager is not None:
                src.stager.stage_out(self.block_table, start, n, flat_bytes(raw), digest=False)
            else:
                gather(layout, src.kv, self.block_table, start, n, out=raw)
            nbytes = self.codec.encode(raw, src.staging[base : base + src.slot_bytes])
        if digest is None:
            digest = chunk_checksum([src.staging[base : base + nbytes]])
        assert self.peer.hello is not None
        op = TransferOp(src.staging_region, base, self.peer.hello.staging_region, self.remote_slots[remote_slot], nbytes)
        return [op], digest

    # -- what the channel and the receiver report (I/O thread) ----------------
    def _written(self, handle: TransferHandle, nbytes: int, local_slot: int) -> None:
        sender = self._sender
        sender.channel.release(handle)
        with self.cond:
            self.writes -= 1
            sender.credit.give(nbytes, local_slot)
            if handle.state is XferState.ERROR:
                self.fail(TransferError(f"channel write failed: {handle.error}"))
            else:
                sender.counters["chunks_sent"] += 1
                sender.counters["bytes_sent"] += nbytes
            self.cond.notify_all()
        self._settle_if_over()

    def on_landed(self, msg: Landed) -> None:
        with self.cond:
            for index in msg.chunk_indices:
                if index not in self.sent or index in self.landed:
                    continue  # a stray or repeated acknowledgement: nothing of ours to free twice
                self.landed.add(index)
                self._sender.counters["chunks_landed"] += 1
                slot = self.slot_of_chunk.pop(index, None)
                if slot is not None:
                    self.free_remote_slots.append(slot)
            if self.complete and not self.finished_at:
                self.finished_at = time.monotonic()
            self.cond.notify_all()
        self._settle_if_over()

    def check_timeout(self, now: float) -> None:
        """Nobody may be waiting on this transfer (the worker never calls wait): if its receiver died after
        our writes completed, neither Landed nor Cancel ever comes, so bound it here or it stays open forever."""
        with self.cond:
            if self.error is None and not self.complete and now > self.opened + self._sender.config.transfer_timeout_s:
                self.fail(TransferTimeout(
                    f"transfer {self.transfer_id!r}: receiver {self.peer.address} did not confirm all {self.num_chunks} chunks "
                    f"within transfer_timeout_s={self._sender.config.transfer_timeout_s:.3g}s"))
        self._settle_if_over()

    def fail(self, err: TransferError) -> None:
        """First failure wins (caller holds the condition); the I/O thread tells the receiver once writes settle."""
        if self.error is None and not self.complete:
            self.error = err
            self._sender.counters["transfers_failed"] += 1
            log.warning("transfer %s: %s", self.transfer_id, err)
            self._sender.loop.call_soon(self._settle_if_over)
        self.cond.notify_all()

    def _settle_if_over(self) -> None:
        """Once failed or complete with no write of ours in flight: tell the receiver, run the callbacks (I/O thread)."""
        with self.cond:
            over = self.error is not None or self.complete
            if not over or self.writes or self.posting or self.settled:
                return
            self.settled = True
            callbacks, self._on_settled = self._on_settled, []
        self._sender.transfer_settled(self)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("on_settled callback for %s failed", self.transfer_id)


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
        self.fingerprint = fingerprint
        self.config = config or TransferConfig()
        kv = adopt_kv(list(kv_tensors))
        num_blocks = layout.validate_buffer(kv)
        native.available()  # build or load csrc/ now, not inside the first transfer
        # ``none`` and the configured codec: a request uses one of the two (``open(codec=...)``)
        self.codecs: dict[str, Codec] = {name: make_codec(name, layout) for name in dict.fromkeys(("none", self.config.codec))}
        slot_bytes = codec_slot_bytes(layout, self.config.chunk_size, list(self.codecs.values()))
        n_slots = max(1, self.config.max_inflight_bytes // slot_bytes)
        staging = pinned_empty(n_slots * slot_bytes)
        reached = all(channel.reaches(t) for t in kv)
        self.source = _Source(
            layout, kv, [flat_bytes(t) for t in kv], [channel.register(t) for t in kv] if reached else [], num_blocks, staging, channel.register(staging), slot_bytes,
            None if reached else DeviceStager(layout, kv, self.config.chunk_size),
        )
        self.kv_memory = memory_kind(kv[0]) if kv else "host"  # where the KV lives, for benchmarks and logs
        self.credit = _Credit(self.config.max_inflight_bytes, n_slots)
        self.counters: collections.Counter[str] = collections.Counter()
        self.cond = threading.Condition()  # guards the sender's state and every transfer's: one lock, no ordering to get wrong
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._pending_reserve: dict[str, tuple[_Peer, Future[protocol.Message]]] = {}
        self._last_beat = time.monotonic()
        self.loop = ControlLoop("pdkv-sender", min(self.config.heartbeat_s, 0.25), self._tick)
        self._dealers = DealerSockets(self.loop, self._on_message, self._on_lost, self.counters)
        self.loop.start()

    @property
    def layout(self) -> KVLayout:
        return self.source.layout

    # -- public API -------------------------------------------------------------
    def hello(self) -> Hello:
        src = self.source
        return protocol.make_hello(
            self.channel.agent_name, self.channel.name, self.channel.metadata(), self.fingerprint, src.layout, self.config.chunk_size, src.kv_regions, src.staging_region,
            list(self.codecs),
        )

    def open(
        self, transfer_id: str, address: str, num_tokens: int, block_table: Sequence[int], prompt_key: bytes = b"", codec: str | None = None
    ) -> OutgoingTransfer:
        """Handshake (once per receiver) and reserve room for the whole request there.

        ``prompt_key``: the chained key of the prompt whose KV this is (``pdkv.keys.chunk_keys(...)[-1]``);
        it travels in the Reserve, so the decode side adopts this KV only for that prompt.
        ``codec``: ``none`` or the configured ``transfer.codec`` (the default) for this request's chunks;
        any codec but ``none`` makes the receiver grant staging mode (direct writes stay raw).
        """
        codec = self.config.codec if codec is None else codec
        if codec not in self.codecs:
            raise ReservationError(f"transfer {transfer_id!r}: codec {codec!r} is not this sender's; it runs {' or '.join(self.codecs)} (transfer.codec)")
        if num_tokens <= 0:
            raise ReservationError(f"transfer {transfer_id!r}: nothing to transfer (num_tokens={num_tokens})")
        if len(block_table) < self.layout.blocks_for(num_tokens):
            raise ReservationError(f"transfer {transfer_id!r}: block table has {len(block_table)} blocks, {num_tokens} tokens need {self.layout.blocks_for(num_tokens)}")
        deadline = time.monotonic() + self.config.reserve_timeout_s
        rehandshaked = False
        backoff = 0.005
        while True:
            peer = self._connect(address)
            try:
                reply = self._reserve(peer, transfer_id, num_tokens, prompt_key, codec)
            except TransferError as exc:
                if rehandshaked or not peer.dropped or isinstance(exc, TransferTimeout):
                    raise
                rehandshaked = True  # its connection dropped while we asked: a restart looks like this, so ask its new run
                continue
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
            raise ReservationError(f"receiver {address} refused transfer {transfer_id!r}: {reason}")
        self._check_reserved(reply, num_tokens, codec)
        xfer = OutgoingTransfer(self, peer, transfer_id, num_tokens, block_table, reply, self.codecs[codec])
        with self.cond:
            self._transfers[transfer_id] = xfer
        return xfer

    def stats(self) -> dict[str, int]:
        with self.cond:
            out = dict(self.counters)
            out["inflight_bytes"] = self.credit.inflight
            out["open_transfers"] = len(self._transfers)
        return out

    def close(self) -> None:
        if not self.loop.thread.is_alive():
            return
        with self.cond:
            for xfer in list(self._transfers.values()):
                xfer.fail(TransferCancelled("sender closing"))
            deadline = time.monotonic() + self.config.drain_timeout_s
            while self._transfers and time.monotonic() < deadline:  # settling tells each receiver
                self.cond.wait(deadline - time.monotonic())
        self.loop.stop()
        self._dealers.close_all()

    # -- handshake and reservation ------------------------------------------------
    def _connect(self, address: str) -> _Peer:
        with self.cond:
            peer = self._peers.get(address)
            if peer is None:
                ident = f"{self.channel.agent_name}/{next(self._ids)}".encode()
                peer = self._peers[address] = _Peer(address, ident)
                self._send(peer, msgspec.structs.replace(self.hello(), nonce=peer.nonce, data_token=peer.token))
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
            with self.cond:
                if not peer.agent:
                    self._retire_previous_run(peer, hello)
                    peer.agent = self.channel.add_peer(hello.channel_metadata)
        self.channel.connect(peer.agent, self.config.handshake_timeout_s, peer.token)  # the data path too: an unreachable one fails here, loudly
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
            xfer.fail(TransferError(f"receiver {hello.agent!r} at {xfer.peer.address} restarted: transfer {xfer.transfer_id!r} was reserved on its previous run"))
        deadline = time.monotonic() + self.config.handshake_timeout_s
        while any(x.posting for x in stale):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"a write to the previous run of receiver {hello.agent!r} was still being posted after handshake_timeout_s={self.config.handshake_timeout_s:.3g}s")
            self.cond.wait(remaining)

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """Forget a receiver that died, restarted, refused us or stopped answering; fail what is open with it.

        Its open transfers can never complete (no ``Landed`` comes back over a closed socket), so they
        fail now with ``reason`` instead of at transfer_timeout_s, and the prefill side's blocks are
        freed as soon as their writes settle. The next ``open`` to that address handshakes again.
        """
        err = TransferError(reason)
        with self.cond:
            if peer.dropped:
                return
            peer.dropped = reason
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            for xfer in self._transfers.values():
                if xfer.peer is peer:
                    xfer.fail(err)
            waiting: list[Future[Any]] = [peer.hello_future, *(fut for owner, fut in self._pending_reserve.values() if owner is peer)]
            last_of_agent = peer.agent and not any(p.agent == peer.agent for p in self._peers.values())
        if last_of_agent:
            self.channel.remove_peer(peer.agent)  # its link goes too: a write still in flight to it fails now
        for fut in waiting:
            _answer(fut, err)
        self._dealers.close_peer(peer)

    def _reserve(self, peer: _Peer, transfer_id: str, num_tokens: int, prompt_key: bytes, codec: str) -> protocol.Message:
        fut: Future[protocol.Message] = Future()
        with self.cond:
            if transfer_id in self._pending_reserve or transfer_id in self._transfers:
                raise ReservationError(f"transfer {transfer_id!r} already has a transfer open")
            if peer.dropped:  # lost since the handshake: its socket is closed, a Reserve would go nowhere
                raise TransferError(peer.dropped)
            self._pending_reserve[transfer_id] = (peer, fut)
        msg = Reserve(transfer_id, num_tokens, prompt_key, codec=codec)
        if self.secret and peer.hello is not None:
            msg.proof = bound_proof(self.secret, "reserve", peer.hello.nonce + peer.nonce, *reserve_fields(msg))
        self._send(peer, msg)
        timeout = self.config.reserve_timeout_s
        try:
            return fut.result(timeout)
        except FutureTimeout:
            self._send(peer, Cancel(transfer_id, "reservation timed out at the sender"))  # queued before the drop closes the socket
            reason = f"receiver {peer.address} did not answer Reserve for {transfer_id!r} within reserve_timeout_s={timeout:.3g}s"
            self._drop_peer(peer, reason)
            raise TransferTimeout(reason) from None
        finally:
            with self.cond:
                self._pending_reserve.pop(transfer_id, None)

    def _check_reserved(self, reply: Reserved, num_tokens: int, codec: str) -> None:
        """A grant from the wire is checked before any write is built from it."""
        if codec != "none" and reply.mode != "staging":
            raise ReservationError(f"receiver granted {reply.mode} mode for a request encoded with {codec!r}: codecs need staging")
        peer_layout_blocks = -(-num_tokens // self.layout.block_size)
        if reply.mode == "direct" and len(reply.block_ids) < peer_layout_blocks:
            raise ReservationError(f"receiver granted {len(reply.block_ids)} blocks for {num_tokens} tokens")
        if reply.mode == "staging" and not reply.staging_slots:
            raise ReservationError("receiver granted staging mode without staging slots")

    def transfer_settled(self, xfer: OutgoingTransfer) -> None:
        """A transfer settled (I/O thread): tell its receiver and forget it."""
        msg: protocol.Message = Done(xfer.transfer_id, True) if xfer.error is None else Cancel(xfer.transfer_id, str(xfer.error))
        self._send(xfer.peer, msg)
        with self.cond:
            if self._transfers.get(xfer.transfer_id) is xfer:
                del self._transfers[xfer.transfer_id]
            self.counters["transfers_ok" if xfer.error is None else "transfers_settled_failed"] += 1
            self.cond.notify_all()

    # -- control plane (I/O thread) ------------------------------------------------
    def _send(self, peer: _Peer, msg: protocol.Message) -> None:
        self._dealers.send(peer, peer.address, peer.identity, msg)

    def _on_lost(self, peer: _Peer, why: str) -> None:
        """A receiver's control connection dropped (it died or restarted, or the network failed), or never came up.

        Replies in flight on that connection are lost, so nothing open with it can finish: fail it
        now rather than at a timeout. ZeroMQ would reconnect on its own; we drop the peer instead so
        that a receiver that comes back is met with a fresh Hello.
        """
        if not peer.dropped:
            self.counters["peers_lost"] += 1
            log.warning("%s: failing what is open with it; the next request to it handshakes again", why)
            self._drop_peer(peer, why)

    def _on_message(self, peer: _Peer, msg: protocol.Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, protocol.Error):
            err = HandshakeError(f"receiver {peer.address} refused us: {msg.message}")
            if not peer.hello_future.done():
                _answer(peer.hello_future, err)
            else:
                log.warning("receiver %s reported: %s", peer.address, msg.message)
        elif isinstance(msg, (Reserved, Refused)):
            with self.cond:
                owner, fut = self._pending_reserve.get(msg.transfer_id, (None, None))
            if owner is peer and fut is not None and not fut.done():
                _answer(fut, msg)
            elif isinstance(msg, Reserved):  # we gave up waiting: release it at once
                self._send(peer, Cancel(msg.transfer_id, "reservation arrived after the sender gave up"))
        elif isinstance(msg, (Landed, Cancel)):
            with self.cond:
                xfer = self._transfers.get(msg.transfer_id)
            if xfer is None or xfer.peer is not peer:
                return
            if isinstance(msg, Landed):
                xfer.on_landed(msg)
            else:
                with self.cond:
                    xfer.fail(TransferCancelled(f"receiver cancelled: {msg.reason}"))

    def _on_hello(self, peer: _Peer, msg: Hello) -> None:
        try:
            protocol.check_compatible(self.hello(), msg)
            if self.config.codec not in msg.codecs:
                raise HandshakeError(
                    f"receiver {peer.address} cannot decode transfer.codec {self.config.codec!r}: it offers {', '.join(msg.codecs) or 'none'} "
                    "(install the codec's extra there, or set the same transfer.codec on both sides)"
                )
            if self.secret and not verify(self.secret, "receiver", peer.nonce, msg.nonce, msg.auth):
                self.counters["auth_failures"] += 1
                raise HandshakeError(f"receiver {peer.address} did not prove the shared secret (missing or different `secret`)")
        except HandshakeError as exc:
            self.counters["handshake_failures"] += 1
            _answer(peer.hello_future, exc)
            return
        if self.secret:  # queued before anyone can queue a Reserve: the receiver sees it first
            self._send(peer, Auth(proof(self.secret, "sender", msg.nonce, peer.nonce)))
        peer.hello = msg
        _answer(peer.hello_future, msg)

    def _tick(self) -> None:
        """Heartbeats every heartbeat_s, and transfers nobody waits for bounded by transfer_timeout_s."""
        now = time.monotonic()
        with self.cond:
            transfers = list(self._transfers.values())
        for xfer in transfers:
            xfer.check_timeout(now)
        if now - self._last_beat >= self.config.heartbeat_s:
            self._last_beat = now
            self._heartbeat(transfers, now)

    def _heartbeat(self, transfers: list[OutgoingTransfer], now: float) -> None:
        """Renew each live peer's leases over its own socket.

        Grouped by peer, not address: after a receiver restart the address has a new peer (new
        identity) while transfers of the dropped one may not have settled yet, and the receiver
        renews a lease only for the identity that holds it.
        """
        by_peer: dict[bytes, tuple[_Peer, list[str]]] = {}
        with self.cond:
            for xfer in transfers:
                if not xfer.peer.dropped and not xfer.settled:
                    by_peer.setdefault(xfer.peer.identity, (xfer.peer, []))[1].append(xfer.transfer_id)
                    xfer.renewed = now
        for peer, ids in by_peer.values():
            self._send(peer, Heartbeat(ids))


def _answer(fut: Future[Any], outcome: Any) -> None:
    """Resolve ``fut`` with a result, or fail it with an exception; the first thread to answer wins."""
    with contextlib.suppress(InvalidStateError):
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
