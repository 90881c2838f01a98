"""``IncomingBook``: a decode worker's reservations through their life: book, land, renew, fail, revoke, free,
fence, reap.

The rules (README.md, "freed" and the late-write rule): blocks and slots are freed exactly once; a failed
reservation's memory waits until its sender said it writes no more (Done/Cancel) or drain_timeout_s passed;
a sender that went silent is fenced off the data plane before its blocks go to anyone else.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import NamedTuple

import msgspec

from pdkv.channels.grants import Range
from pdkv.channels.handle import Notification
from pdkv.errors import (
    ChecksumError,
    NoticeForged,
    PromptMismatchError,
    ProtocolError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from pdkv.transfer import protocol
from pdkv.transfer.admission import Admission, ReceiverView, whole_blocks
from pdkv.transfer.incoming import IncomingTransfer, ReceivedKV, ReceiveMemory, State
from pdkv.transfer.parts import ReceiverParts
from pdkv.transfer.peers import SenderPeer
from pdkv.transfer.plan import TransferPlan
from pdkv.transfer.pool import ReceiverPools
from pdkv.transfer.protocol import (
    Cancel,
    ChunkNotice,
    ChunkVerdict,
    Done,
    Heartbeat,
    Landed,
    Refused,
    Reserve,
    Reserved,
)

log = logging.getLogger(__name__)


class Landing(NamedTuple):
    """What landing one chunk came to (``IncomingBook.land``)."""

    r: IncomingTransfer | None  # the reservation it landed in, or failed
    verdict: ChunkVerdict
    admitting_ns: int  # a pooled request's admission (counted as the request's host time, not the chunk's)
    refused: tuple[bytes | None, Refused] | None = None  # a pooled request refused: whom to tell, and why


class IncomingBook:
    """Every reservation a receiver holds, its senders' pools, and the transfer ids it already used; all under one
    lock (``parts.lock``)."""

    def __init__(self, parts: ReceiverParts) -> None:
        self.parts = parts
        self.channel, self.memory, self.config, self.counters, self.lock = (
            parts.channel,
            parts.memory,
            parts.config,
            parts.counters,
            parts.lock,
        )
        self.pools = ReceiverPools(parts, self)
        self.res: dict[str, IncomingTransfer] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.free_slots = list(range(parts.config.staging_slots))
        # chunks answered on their data connection (``answer``) where the channel carries answers; else Landed
        self.verdicts = parts.config.data_verdicts and parts.channel.answer_notifications(self.answer)

    def view(self, identity: bytes, peer: SenderPeer, transfer_id: str, held_tokens: int = 0) -> ReceiverView:
        """What admission reads (caller holds the lock); ``held_tokens``: what we hold of the transfer already."""
        memory = self.memory
        return ReceiverView(
            config=self.config,
            layout=memory.layout,
            num_blocks=memory.num_blocks,
            codecs=memory.codecs,
            free_slots=len(self.free_slots),
            reservations=len(self.res),
            id_used=transfer_id in self.res or transfer_id in self.gone,
            peer_layout=peer.layout,
            peer_blocks=tuple(len(r.blocks) for r in self.res.values() if r.identity == identity),
            kv_in_reach=peer.kv_reached and bool(memory.kv_regions),
            held_tokens=held_tokens,
        )

    def open(
        self,
        *,
        identity: bytes,
        peer: SenderPeer,
        req: Reserve,
        admission: Admission,
        blocks: list[int],
        slots: list[int],
    ) -> IncomingTransfer:
        """Book an admitted reservation (caller holds the lock)."""
        now = time.monotonic()
        r = self.res[req.transfer_id] = IncomingTransfer(
            transfer_id=req.transfer_id,
            identity=identity,
            peer_agent=peer.agent,
            num_tokens=req.num_tokens,
            blocks=blocks,
            slots=slots,
            mode=admission.mode,
            num_chunks=admission.chunks,
            created=now,
            lease_deadline=now + self.config.lease_s,
            token=peer.token,
            plan=TransferPlan.build(
                req.transfer_id,
                num_tokens=req.num_tokens,
                chunk_size=self.memory.chunk_size,
                block_size=self.memory.layout.block_size,
                ours=blocks,
                num_blocks=self.memory.num_blocks,
                held=admission.held,
            ),
            prompt_key=req.prompt_key,
            codec=req.codec,
            heads=req.heads,
            whole_blocks=whole_blocks(self.memory.layout, admission.mode, window=req.heads is not None),
        )
        self.counters["reserved"] += 1
        self.lock.notify_all()
        return r

    def reserved(self, r: IncomingTransfer, held: int) -> Reserved:
        """The answer to the Reserve that booked ``r`` (caller holds the lock): where its chunks land, for how long,
        and the prompt's leading tokens we hold already (P pushes only the rest)."""
        return Reserved(
            transfer_id=r.transfer_id,
            mode=r.mode,
            block_ids=list(r.blocks),
            staging_slots=[s * self.memory.slot_bytes for s in r.slots],
            lease_s=self.config.lease_s,
            held_tokens=held,
        )

    def claim(self, r: IncomingTransfer, prompt_key: bytes | None) -> ReceivedKV:
        """Hand a ready reservation's blocks to the caller (caller holds the lock); KV of another prompt is
        freed instead."""
        del self.res[r.transfer_id]
        self.revoke(r)  # from now on its blocks are the caller's: the sender may not touch them
        if prompt_key is not None and r.prompt_key != prompt_key:
            self.free(r)
            self.remember_gone(r.transfer_id, "its KV was computed for another prompt")
            self.counters["prompt_mismatches"] += 1
            raise PromptMismatchError(
                f"KV transfer {r.transfer_id!r} carries the KV of another prompt than the one to decode "
                "(the prompt differs from the one prefilled); computing it instead"
            )
        self.remember_gone(r.transfer_id, "claimed")
        self.counters["claimed"] += 1
        return ReceivedKV(
            transfer_id=r.transfer_id,
            blocks=r.blocks,
            num_tokens=r.num_tokens,
            prompt_key=r.prompt_key,
            held_tokens=r.plan.table_start,
        )

    def cancel(self, transfer_id: str, reason: str) -> None:
        """Abandon a transfer from the decode side (client gone, timeout); frees what it holds."""
        with self.lock:
            r = self.res.get(transfer_id)
            if r is None:
                self.remember_gone(transfer_id, f"cancelled: {reason}")
                return
            if r.state is State.READY:
                del self.res[transfer_id]
                self.free(r)
                self.remember_gone(transfer_id, f"cancelled: {reason}")
            elif r.state is State.RECEIVING:
                self.fail(r, TransferCancelled(f"cancelled: {reason}"), notify_sender=True)
            self.lock.notify_all()

    def beat(self, identity: bytes, msg: Heartbeat) -> None:
        """A heartbeat of an admitted sender: renew the leases it names (and its pool's), and hear the transfers it
        says completed (their ``Done``)."""
        deadline = time.monotonic() + self.config.lease_s
        with self.lock:
            self.pools.renew(identity, deadline)
            for rid in msg.transfer_ids:
                r = self.res.get(rid)
                if r is not None and r.identity == identity:
                    r.lease_deadline = deadline
            for rid in msg.done:
                self.sender_finished(identity, Done(rid, True))

    def sender_finished(self, identity: bytes, msg: Cancel | Done) -> None:
        with self.lock:
            r = self.res.get(msg.transfer_id)
            if r is None and isinstance(msg, Cancel) and msg.writes_may_land and msg.transfer_id not in self.gone:
                # A request we never heard of was written into the sender's pool (its notice never came), and the
                # sender gave up on that write: it may still land there, so the pool's blocks wait out the hold.
                self.pools.lapse(
                    identity, time.monotonic(), f"a write of transfer {msg.transfer_id!r} into it may still land"
                )
            if r is None or r.identity != identity:
                return
            # Its word frees the memory early, unless it gave up on a write that may still land.
            r.sender_done = not (isinstance(msg, Cancel) and msg.writes_may_land)
            if r.state is State.RECEIVING and (isinstance(msg, Cancel) or not msg.ok):
                reason = msg.reason if isinstance(msg, Cancel) else "sender reported failure"
                self.fail(r, TransferCancelled(f"sender cancelled: {reason}"), notify_sender=False)
            self.lock.notify_all()

    def on_notifications(self) -> None:
        """Verify every chunk whose notification arrived (I/O thread); acknowledge each transfer's chunks with one
        Landed, carrying the sender's next pool if a request of its took its last one; then offer the pools of
        pooled requests that sent no Landed on their own (``ReceiverPools.send_refills``).

        The pass decodes every notice first and hashes its direct chunks together (``hash_direct``), then lands
        them one by one in the order they arrived. Over a channel that carries answers (tcp) no chunk comes this
        way: each is landed and answered on the thread that received it (``answer``)."""
        began = time.perf_counter_ns()  # host time per chunk (hosttime.py): to Landed sent
        notifs = self.channel.get_notifications()
        keys = self.notice_keys({n.peer for n in notifs})
        notices = [(n.peer, notice) for n in notifs if (notice := self.decode(n, keys)) is not None]
        hashed = self.hash_direct(notices)
        landed: dict[str, tuple[bytes, list[int]]] = {}
        admitting = 0
        for i, (peer, notice) in enumerate(notices):
            got = self.land(peer, notice, hashed.get(i))
            admitting += got.admitting_ns
            if got.refused is not None and got.refused[0] is not None:
                self.parts.outbox.reply(*got.refused)
            if got.r is not None and got.verdict.outcome == "landed":
                landed.setdefault(got.r.transfer_id, (got.r.identity, []))[1].append(notice.chunk_index)
        for rid, (identity, indices) in landed.items():
            self.parts.outbox.reply(identity, Landed(rid, indices, self.pools.next_pool(identity)))
        if chunks := sum(len(indices) for _, indices in landed.values()):
            # a pass's time shared by its chunks, less the pooled requests' admission (counted per request)
            spent = time.perf_counter_ns() - began - admitting
            for _ in range(chunks):
                self.parts.host.add("chunk", spent // chunks)
        self.pools.send_refills()

    def answer(self, notifs: list[Notification]) -> list[bytes]:
        """``Channel.answer_notifications``: land chunks on the thread that received them and answer each one's
        sender the way it came (a ``ChunkVerdict``, tagged with the session key): no hand-off to the I/O thread,
        no ``Landed`` or ``Refused`` on the control plane. Chunks that arrived together (a nixl watcher's pass) have
        their direct checksums read together, as ``on_notifications`` does (``hash_direct``). A request that took
        its sender's pool gets the next pool in its verdict, granted before the verdict goes, as a ``Landed`` would
        carry it. A notice that is malformed or, with a secret, not tagged under a live session of its sender's is
        counted and dropped, and answered with nothing (b"": a plain acknowledgement, no verdict to act on)."""
        began = time.perf_counter_ns()
        keys = self.notice_keys({n.peer for n in notifs})
        decoded = [self.decode(n, keys) for n in notifs]
        notices = [(n.peer, notice) for n, notice in zip(notifs, decoded, strict=True) if notice is not None]
        hashed = self.hash_direct(notices)
        verdicts: list[tuple[ChunkVerdict, bytes]] = []  # one per notice: (the verdict, the key to tag it with)
        admitting = 0
        with self.lock:
            for i, (peer, notice) in enumerate(notices):
                got = self.land(peer, notice, hashed.get(i), answered=True)
                admitting += got.admitting_ns
                pool = self.pools.next_pool_of(peer)
                session = self.parts.peers.get(got.r.identity) if got.r is not None else None
                key = session.session_key if session is not None else (keys[peer][0] if keys and keys[peer] else b"")
                verdicts.append((got.verdict if pool is None else msgspec.structs.replace(got.verdict, pool=pool), key))
            landed = sum(1 for verdict, _ in verdicts if verdict.outcome == "landed")
            self.counters["verdicts_sent"] += landed  # under the lock: serving threads answer side by side
        sealed = iter([protocol.seal_verdict(*v) for v in verdicts])
        answers = [b"" if notice is None else next(sealed) for notice in decoded]
        if landed:
            spent = time.perf_counter_ns() - began - admitting  # shared by its chunks, as on_notifications' pass
            for _ in range(landed):
                self.parts.host.add("chunk", spent // landed)
        return answers

    def notice_keys(self, agents: set[str]) -> dict[str, list[bytes]] | None:
        """With a secret, the session keys a notice from each of ``agents`` may be tagged with (those of its admitted
        sessions); None without one."""
        if not self.parts.secret:
            return None
        with self.lock:
            peers = list(self.parts.peers.values())
        return {agent: [p.session_key for p in peers if p.agent == agent and p.session_key] for agent in agents}

    def decode(self, notif: Notification, keys: dict[str, list[bytes]] | None) -> ChunkNotice | None:
        """A notification's notice, or None (counted and logged) where it is malformed or, with a secret, not tagged
        under the key of a session its sender proved (``protocol.open_notice``)."""
        try:
            return protocol.open_notice(notif.payload, None if keys is None else keys[notif.peer])
        except NoticeForged as exc:
            self.counters["forged_notices"] += 1
            log.warning("dropping notification from %r: %s", notif.peer, exc)
        except ProtocolError as exc:
            self.counters["malformed_notices"] += 1
            log.warning("dropping notification from %r: %s", notif.peer, exc)
        return None

    def hash_direct(self, notices: list[tuple[str, ChunkNotice]]) -> dict[int, int]:
        """The landed checksums of a pass's direct chunks, read together: one ``blocks_checksums`` call a memory (on
        a GPU, one read-back for the pass, not one a chunk); position in ``notices`` -> value.

        Only chunks ``land`` would hash: of a reservation receiving now from that peer, in range, not landed yet;
        ``land`` checks them again as each lands and hashes the rest itself (staged chunks are hashed by the pass
        that scatters them). Where the channel hashed the blocks as they landed (``landed_checksum``, which a head
        window's copy of the memory keeps), there is no read to share: ``land`` asks it per chunk, as before, and
        this pass takes no lock."""
        if self.memory.landed_checksum is not None:
            return {}
        groups: dict[int, tuple[ReceiveMemory, list[int], list[list[int]]]] = {}
        hashed: dict[int, int] = {}
        with self.lock:
            for i, (peer, notice) in enumerate(notices):
                r = self.receiving(peer, notice.transfer_id) if notice.reserve is None else None
                blocks = r.direct_blocks(notice) if r is not None else None
                if r is None or blocks is None:
                    continue
                memory = self.memory.window(r.heads)
                group = groups.setdefault(id(memory), (memory, [], []))
                group[1].append(i)
                group[2].append(blocks)
            for memory, positions, chunks in groups.values():
                try:
                    hashed.update(zip(positions, memory.blocks_checksums(chunks), strict=True))
                except Exception as exc:  # noqa: BLE001 - each chunk is then hashed, and fails, on its own in land
                    log.warning("hashing %d chunks together failed (%s): each is verified alone", len(chunks), exc)
        return hashed

    def receiving(self, peer: str, transfer_id: str) -> IncomingTransfer | None:
        """The reservation ``transfer_id`` if ``peer`` sends it and it still receives chunks (caller holds the
        lock), else None."""
        r = self.res.get(transfer_id)
        return r if r is not None and r.peer_agent == peer and r.state is State.RECEIVING else None

    def land(self, peer: str, notice: ChunkNotice, got: int | None = None, *, answered: bool = False) -> Landing:
        """Land one chunk from ``peer`` (``got``: its checksum, when ``hash_direct`` read it): the reservation it
        landed in (None where none took it), its verdict, and a pooled request's admission, to tell and count.
        ``answered``: the verdict goes back on the data connection, so a failure sends no ``Cancel`` ahead of it."""
        admitting_ns = 0
        refused: tuple[bytes | None, Refused] | None = None
        with self.lock:
            if notice.reserve is not None:
                admitting = time.perf_counter_ns()
                refused = self.pools.open_pooled(peer, notice)
                if refused is not None:  # the bytes it wrote into the pool are discarded, the pool offered again
                    return Landing(None, self._verdict(notice, "refused", refused[1].reason), 0, refused)
                admitting_ns = time.perf_counter_ns() - admitting
                self.parts.host.add("request", admitting_ns)
            r = self.receiving(peer, notice.transfer_id)
            if r is None:
                self.counters["stray_notices"] += 1
                why = self.gone.get(notice.transfer_id, "no reservation of yours receives it")
                return Landing(None, self._verdict(notice, "gone", why), admitting_ns)
            try:
                nbytes = r.land(self.memory.window(r.heads), notice, got)
            except TransferError as exc:
                mismatch = isinstance(exc, ChecksumError)
                if mismatch:
                    self.counters["checksum_failures"] += 1
                self.fail(r, exc, notify_sender=not answered)
                self.lock.notify_all()
                return Landing(r, self._verdict(notice, "mismatch" if mismatch else "failed", str(exc)), admitting_ns)
            r.lease_deadline = time.monotonic() + self.config.lease_s
            self.counters["chunks_landed"] += 1
            self.counters["bytes_landed"] += nbytes
            self.counters["tokens_landed"] += r.plan.spans[notice.chunk_index][1]
            if r.all_landed:
                r.state, r.ready_at = State.READY, time.monotonic()
                if r.slots and self.channel.revoke(
                    r.token, "write", self.memory.slot_ranges(r.slots), 0
                ):  # nothing left to land
                    self.free_slots.extend(r.slots)
                    r.slots = []
                self.counters["transfers_ready"] += 1
            self.lock.notify_all()
        return Landing(r, self._verdict(notice, "landed"), admitting_ns)

    @staticmethod
    def _verdict(notice: ChunkNotice, outcome: protocol.Outcome, reason: str = "") -> ChunkVerdict:
        return ChunkVerdict(notice.transfer_id, notice.chunk_index, outcome, reason[:1024])

    def fail(self, r: IncomingTransfer, exc: TransferError, notify_sender: bool) -> None:
        """Mark failed (caller holds the lock); memory is freed once the sender can no longer write into it."""
        r.state, r.error = State.FAILED, str(exc)
        # Where fencing cannot stop the sender's writes, only its own word (or a long quarantine) frees the memory.
        r.free_deadline = time.monotonic() + self.config.late_write_hold(self.channel.enforces_grants)
        self.counters["transfers_failed"] += 1
        log.warning("transfer %s: %s", r.transfer_id, exc)
        if notify_sender:
            identity, msg = r.identity, Cancel(r.transfer_id, str(exc))
            self.parts.loop.call_soon(
                lambda: self.parts.outbox.reply(identity, msg)
            )  # _fail also runs on API threads (cancel)

    def granted(self, r: IncomingTransfer) -> list[Range]:
        """The ranges the channel granted ``r``'s sender for it: its slots (staging) or its blocks (direct)."""
        return self.memory.slot_ranges(r.slots) if r.mode == "staging" else self.memory.block_ranges(r.blocks)

    def revoke(self, r: IncomingTransfer) -> None:
        """Take back what ``r`` granted, once (caller holds the lock); a frame still landing there is waited
        out, or its peer fenced."""
        if r.revoked:
            return
        r.revoked = True
        ranges = self.granted(r)
        if ranges and not self.channel.revoke(r.token, "write", ranges, self.config.drain_timeout_s):
            self.counters["fences"] += 1
            log.error(
                "transfer %s: a write was still landing in its memory after drain_timeout_s; cutting its sender's data "
                "connections",
                r.transfer_id,
            )
            self.fence(r.identity)

    def free(self, r: IncomingTransfer) -> None:
        """Give ``r``'s blocks and slots back, exactly once (caller holds the lock)."""
        self.revoke(r)
        self.parts.allocator.free(r.blocks)
        self.free_slots.extend(r.slots)
        r.blocks, r.slots = [], []

    def fence(self, identity: bytes) -> None:
        """Cut a sender that went silent off the data plane before its memory is reused (caller holds the lock).

        The channel drops its data connections, so nothing it queued before can
        land later (a frozen process's writes die with its sockets); its other
        reservations fail (their data path is gone), and it must send Hello
        again: its next Reserve is refused with ``hello-required``.
        """
        peer = self.parts.peers.pop(identity, None)
        if peer is None:
            return
        self.channel.fence(peer.agent, peer.token)
        self.pools.give_back(identity)
        for other in self.res.values():
            if other.identity == identity and other.state is State.RECEIVING:
                self.fail(
                    other,
                    TransferError("the sender was cut off the data plane after it went silent"),
                    notify_sender=True,
                )

    def remember_gone(self, transfer_id: str, why: str) -> None:
        self.gone[transfer_id] = why
        while len(self.gone) > self.config.max_reservations:
            self.gone.popitem(last=False)

    def reap(self) -> None:
        """Scan every reservation (no early exit) for expired leases and timeouts."""
        now = time.monotonic()
        cfg = self.config
        with self.lock:
            self.pools.reap(now)
            for r in list(self.res.values()):
                if r.state is State.RECEIVING and now > r.lease_deadline:
                    self.counters["leases_expired"] += 1
                    # Not presumed dead: a stalled sender may still have writes queued. Its blocks stay quarantined
                    # until it answers the Cancel or drain_timeout_s passes (and the sender itself stops writing once
                    # it sees its heartbeats lapsed), so no late write lands in blocks handed to another request.
                    self.fail(
                        r,
                        TransferTimeout(
                            f"lease expired: no word from the sender for {cfg.lease_s:.3g}s (the prefill side died, "
                            "hung or lost its connection)"
                        ),
                        notify_sender=True,
                    )
                elif r.state is State.RECEIVING and now > r.created + cfg.transfer_timeout_s:
                    self.counters["timeouts"] += 1
                    self.fail(
                        r,
                        TransferTimeout(f"not complete after transfer_timeout_s={cfg.transfer_timeout_s:.3g}s"),
                        notify_sender=True,
                    )
                if r.state is State.FAILED and (r.sender_done or now > r.free_deadline):
                    if not r.sender_done:  # it never said it stopped writing: it may be frozen with writes queued
                        self.counters["fences"] += 1
                        self.fence(r.identity)
                    del self.res[r.transfer_id]
                    self.free(r)
                    self.remember_gone(r.transfer_id, f"failed: {r.error}")
                elif r.state is State.READY and now > r.ready_at + cfg.claim_timeout_s:
                    del self.res[r.transfer_id]
                    self.free(r)
                    self.counters["unclaimed"] += 1
                    self.remember_gone(r.transfer_id, "never claimed by the decode side")
            self.lock.notify_all()
