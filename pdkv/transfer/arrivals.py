"""Chunks arriving on the decode side (``ChunkArrivals``): their notices opened, their checksums read, each landed
in its reservation and answered.

A chunk counts only after its checksum matched (README.md here, "verified"): ``land`` verifies it and counts it in
the reservation it names, from that peer only, under the book's lock; one that fails fails its reservation
(``IncomingBook.fail``: its memory then waits out the late-write rule). The reservations themselves, through their
life until freed, are the book's (``book.IncomingBook``).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import msgspec

from pdkv.channels.handle import Notification
from pdkv.errors import ChecksumError, NoticeForged, ProtocolError, TransferError
from pdkv.transfer import protocol
from pdkv.transfer.book import IncomingBook
from pdkv.transfer.incoming import IncomingTransfer, ReceiveMemory, State
from pdkv.transfer.parts import ReceiverParts
from pdkv.transfer.protocol import ChunkNotice, ChunkVerdict, Landed, Refused

log = logging.getLogger(__name__)


class Landing(NamedTuple):
    """What landing one chunk came to (``ChunkArrivals.land``)."""

    r: IncomingTransfer | None  # the reservation it landed in, or failed
    verdict: ChunkVerdict
    admitting_ns: int  # a pooled request's admission (counted as the request's host time, not the chunk's)
    refused: tuple[bytes | None, Refused] | None = None  # a pooled request refused: whom to tell, and why


class ChunkArrivals:
    """Lands the chunks whose notifications arrive, in the book's reservations and under its lock (``parts.lock``):
    on the I/O thread (``on_notifications``), or where the channel carries answers, on the thread that received them
    (``answer``)."""

    def __init__(self, parts: ReceiverParts, book: IncomingBook) -> None:
        self.parts, self.book, self.channel, self.memory = parts, book, parts.channel, parts.memory
        self.config, self.counters, self.lock = parts.config, parts.counters, parts.lock
        # chunks answered on their data connection (``answer``) where the channel carries answers; else Landed
        self.verdicts = parts.config.data_verdicts and parts.channel.answer_notifications(
            self.answer, after=self.after_answers
        )
        # where the channel runs ``after_answers`` (tcp): reservations an answer pass landed whole, revoked after it
        self._revokes_after = self.verdicts and parts.channel.runs_after_answers
        self._ready: list[IncomingTransfer] = []  # (under the lock)

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
        opened = [(n.peer, *o) for n in notifs if (o := self.decode(n, keys)) is not None]
        sessions = self.sessions()
        hashed = self.hash_direct([(peer, notice) for peer, notice, _ in opened])
        landed: dict[str, tuple[bytes, list[int]]] = {}
        admitting = 0
        for i, (peer, notice, key) in enumerate(opened):
            got = self.land(peer, notice, hashed.get(i), session=sessions.get(key))
            admitting += got.admitting_ns
            if got.refused is not None and got.refused[0] is not None:
                self.parts.outbox.reply(*got.refused)
            if got.r is not None and got.verdict.outcome == "landed":
                landed.setdefault(got.r.transfer_id, (got.r.identity, []))[1].append(notice.chunk_index)
        for rid, (identity, indices) in landed.items():
            self.parts.outbox.reply(identity, Landed(rid, indices, self.book.pools.next_pool(identity)))
        if chunks := sum(len(indices) for _, indices in landed.values()):
            # a pass's time shared by its chunks, less the pooled requests' admission (counted per request)
            spent = time.perf_counter_ns() - began - admitting
            for _ in range(chunks):
                self.parts.host.add("chunk", spent // chunks)
        self.book.pools.send_refills()

    def answer(self, notifs: list[Notification]) -> list[bytes]:
        """``Channel.answer_notifications``: land chunks on the thread that received them and answer each one's
        sender the way it came (a ``ChunkVerdict``, tagged with the session key): no hand-off to the I/O thread,
        no ``Landed`` or ``Refused`` on the control plane. Chunks that arrived together (a nixl watcher's pass) have
        their direct checksums read together, as ``on_notifications`` does (``hash_direct``). A request that took
        its sender's pool gets the next pool in its verdict, granted before the verdict goes, as a ``Landed`` would
        carry it. A notice that is malformed or, with a secret, not tagged under a live session of its sender's is
        counted and dropped, and answered with nothing (b""): no verdict, so its writer waits for a ``Landed`` that
        will not come either, and its transfer fails at ``transfer_timeout_s``, as it did before verdicts. Each
        verdict is tagged under the key its notice was, so the session that wrote it can check it."""
        began = time.perf_counter_ns()
        keys = self.notice_keys({n.peer for n in notifs})
        decoded = [self.decode(n, keys) for n in notifs]
        sessions = self.sessions()
        opened = [(n.peer, *d) for n, d in zip(notifs, decoded, strict=True) if d is not None]
        hashed = self.hash_direct([(peer, notice) for peer, notice, _ in opened])
        verdicts: list[tuple[ChunkVerdict, bytes]] = []  # one per notice: (the verdict, the key to tag it with)
        admitting = 0
        with self.lock:
            for i, (peer, notice, key) in enumerate(opened):
                got = self.land(peer, notice, hashed.get(i), answered=True, session=sessions.get(key))
                admitting += got.admitting_ns
                # the request's own session, known from its reservation or its refusal: its next pool goes along
                identity = got.r.identity if got.r is not None else got.refused[0] if got.refused else None
                pool = None if identity is None else self.book.pools.next_pool(identity)
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

    def after_answers(self) -> None:
        """What an answer pass leaves until its verdicts went out (``Channel.answer_notifications``' ``after``, on the
        thread that sent them, where the channel runs it): the grants of the reservations it landed whole are taken
        back, so the decode request that claims one later finds nothing left to revoke, and no sender waits for it."""
        if self._ready:
            with self.lock:
                ready, self._ready = self._ready, []
                for r in ready:
                    if self.book.res.get(r.transfer_id) is r and r.state is State.READY:
                        self.book.revoke(r)
                        self.counters["revoked_before_claim"] += 1

    def sessions(self) -> dict[bytes, bytes]:
        """Each session key and its session (the sender's identity): a notice lands only in a reservation or pool of
        the session whose key tagged it (empty without a secret: no keys, nothing to tell apart)."""
        with self.lock:
            return {p.session_key: identity for identity, p in self.parts.peers.items() if p.session_key}

    def notice_keys(self, agents: set[str]) -> dict[str, list[bytes]] | None:
        """With a secret, the session keys a notice from each of ``agents`` may be tagged with (those of its admitted
        sessions); None without one."""
        if not self.parts.secret:
            return None
        with self.lock:
            peers = list(self.parts.peers.values())
        return {agent: [p.session_key for p in peers if p.agent == agent and p.session_key] for agent in agents}

    def decode(self, notif: Notification, keys: dict[str, list[bytes]] | None) -> tuple[ChunkNotice, bytes] | None:
        """A notification's notice and the session key it was tagged under, or None (counted and logged) where it is
        malformed or, with a secret, not tagged under the key of a session its sender proved
        (``protocol.open_notice``)."""
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
                r = self.book.receiving(peer, notice.transfer_id) if notice.reserve is None else None
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

    def land(
        self,
        peer: str,
        notice: ChunkNotice,
        got: int | None = None,
        *,
        answered: bool = False,
        session: bytes | None = None,
    ) -> Landing:
        """Land one chunk from ``peer`` (``got``: its checksum, when ``hash_direct`` read it): the reservation it
        landed in (None where none took it), its verdict, and a pooled request's admission, to tell and count.
        ``answered``: the verdict goes back on the data connection, so a failure sends no ``Cancel`` ahead of it.
        ``session``: the sender session whose key tagged the notice (with a secret), the only one whose reservation
        or pool it may land in: another session of the same agent's is not its to fill."""
        admitting_ns = 0
        refused: tuple[bytes | None, Refused] | None = None
        with self.lock:
            if notice.reserve is not None:
                admitting = time.perf_counter_ns()
                refused = self.book.pools.open_pooled(peer, notice, session)
                if refused is not None:  # the bytes it wrote into the pool are discarded, the pool offered again
                    return Landing(None, self._verdict(notice, "refused", refused[1].reason), 0, refused)
                admitting_ns = time.perf_counter_ns() - admitting
                self.parts.host.add("request", admitting_ns)
            r = self.book.receiving(peer, notice.transfer_id)
            if r is not None and session is not None and r.identity != session:
                r = None  # tagged by another session of this agent: not its reservation
            if r is None:
                self.counters["stray_notices"] += 1
                why = self.book.gone.get(notice.transfer_id, "no reservation of yours receives it")
                return Landing(None, self._verdict(notice, "gone", why), admitting_ns)
            try:
                nbytes = r.land(self.memory.window(r.heads), notice, got)
            except TransferError as exc:
                mismatch = isinstance(exc, ChecksumError)
                if mismatch:
                    self.counters["checksum_failures"] += 1
                self.book.fail(r, exc, notify_sender=not answered)
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
                    self.book.free_slots.extend(r.slots)
                    r.slots = []
                self.counters["transfers_ready"] += 1
                if answered and self._revokes_after:  # its grant taken back once the verdict is out
                    self._ready.append(r)
            self.lock.notify_all()
        return Landing(r, self._verdict(notice, "landed"), admitting_ns)

    @staticmethod
    def _verdict(notice: ChunkNotice, outcome: protocol.Outcome, reason: str = "") -> ChunkVerdict:
        return ChunkVerdict(notice.transfer_id, notice.chunk_index, outcome, reason[:1024])
