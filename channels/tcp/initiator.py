"""The initiator side of the tcp channel: the peers it may dial, one link per (peer, token), and cutting a
transfer into the batches its streams send.

A transfer is cut into shares, one per stream (``streams_for``: shares of at
least ``stream_min_bytes``; to a peer on this host no more than
``one_host_shares``), each sent as one uninterrupted batch of DATA
frames ending in LAST, or of READ_REQ frames whose answers land where this
side recorded for them (the target never picks an address). Links connect
lazily, at the first transfer (or ``connect``) after the last one failed.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pdkv import native
from pdkv.channels.handle import BlockWrite, TransferHandle, TransferOp, merge_ops
from pdkv.channels.regions import RegionTable
from pdkv.channels.tcp.framer import BlockFramer
from pdkv.channels.tcp.link import Link
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.streams import Batch, Sealed, SealedEnd
from pdkv.channels.tcp.watching import LinkWatcher
from pdkv.channels.tcp.wire import (
    HDR_SIZE,
    HEADER,
    LAST,
    MAGIC,
    MAX_RUNS,
    NOTIF_FOLLOWS,
    READ_REQ,
    VERSION,
    Meta,
    data_frame,
)
from pdkv.errors import ChannelError

SEALED_TAIL = 4096
"""Bytes of each share of a sealed write held back for its LAST frame, sent once the share is hashed (the last to
finish carries the notification, sealed then): the share's last piece's last ``SEALED_TAIL`` (up to a checksum word
more), or all of it if shorter; the receiver waits for no more than them after the frames before it."""
SEALED_NOTIF = b"sealed as sent"
"""What a sealed write's pending entry holds for its notification, which it carries but is made as it is sent
(``Link.misanswered`` asks only whether one went)."""


def _split(ops: Sequence[TransferOp], parts: int, max_frame: int) -> list[list[TransferOp]]:
    """Cut the ops' bytes into ``parts`` near-equal shares of frames no bigger than ``max_frame``.

    The shares go to different streams, so one large op still uses them all.
    """
    total = sum(op.length for op in ops)
    share = -(-total // parts)  # the last share is the smallest, so ``room`` never runs out early
    out: list[list[TransferOp]] = [[] for _ in range(parts)]
    s, room = 0, share
    for op in ops:
        if op.length <= room and op.length <= max_frame:  # the common case: the op whole, not rebuilt
            out[s].append(op)
            room -= op.length
            if room == 0 and s < parts - 1:
                s, room = s + 1, share
            continue
        lo, ro, left = op.local_offset, op.remote_offset, op.length
        while left:
            n = min(left, room, max_frame)
            out[s].append(TransferOp(op.local_region, lo, op.remote_region, ro, n))
            lo, ro, left, room = lo + n, ro + n, left - n, room - n
            if room == 0 and s < parts - 1:
                s, room = s + 1, share
    return [p for p in out if p]


class TcpHandle(TransferHandle):
    """A handle that knows its link, so ``wait`` can read the link's answers on the waiting thread."""

    def __init__(self, peer: str, op: str, nbytes: int, link: Link) -> None:
        super().__init__(peer, op, nbytes)
        self.link = link


class Initiator:
    """What the channel needs to start transfers: its peers' addresses and the live links to them.

    ``closed`` is set once the channel closes (no link is kept after that).
    """

    def __init__(self, agent: Agent, regions: RegionTable[memoryview]) -> None:
        self.agent = agent
        self.closed = False
        self._regions = regions
        self._xfer_ids = itertools.count(1)
        self._rr = itertools.count()
        self._caller = threading.local()
        self._peers: dict[str, Meta] = {}
        self._links: dict[tuple[str, bytes], Link] = {}  # (peer, token) -> its live link
        self._link_locks: dict[tuple[str, bytes], threading.Lock] = collections.defaultdict(threading.Lock)
        self._lock = threading.Lock()
        self._framer = BlockFramer(regions, agent.opts.max_frame_bytes)
        self._watcher: LinkWatcher | None = None  # and its workers: started with the first link

    def watcher(self) -> LinkWatcher:
        """The link watcher (and workers) every link shares, started by the first link: ChannelError once closed."""
        with self._lock:
            if self.closed:
                raise ChannelError("tcp: the channel is closed")
            self._watcher = self._watcher or LinkWatcher(self.agent.name, self.agent.opts)
            return self._watcher

    # -- peers -------------------------------------------------------------------
    def add_peer(self, meta: Meta) -> bool:
        """Know ``meta.name`` by this metadata; True if it is new or changed (its old links are failed)."""
        with self._lock:
            old = self._peers.get(meta.name)
            self._peers[meta.name] = meta
            links = self._pop_links(meta.name) if old != meta else []
        for link in links:
            link.fail(f"peer {meta.name!r} re-added with new metadata")
        return old != meta

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)
            links = self._pop_links(peer)
        for link in links:
            link.fail(f"peer {peer!r} removed")

    def address_of(self, peer: str) -> str:
        """Where ``peer`` says it can be reached, for messages."""
        meta = self._peers.get(peer)
        return f"{meta.host}:{meta.port}" if meta is not None else "the address in its metadata"

    def _pop_links(self, peer: str) -> list[Link]:
        """Forget every link to ``peer``, whatever its token (caller holds the lock)."""
        return [self._links.pop(key) for key in [k for k in self._links if k[0] == peer]]

    def link(self, peer: str, token: bytes) -> Link:
        """The live link to ``peer`` presenting ``token``, connecting (again) if there is none: reconnection is lazy.

        One link per (peer, token): a transfer always travels with the capability it was posted with.
        """
        key = (peer, token)
        link = self._links.get(key)
        if link is not None and link.dead is None:
            return link
        with self._link_locks[key]:
            link = self._links.get(key)
            if link is not None and link.dead is None:
                return link
            meta = self._peers.get(peer)
            if meta is None:
                raise ChannelError(f"tcp: unknown peer {peer!r}; call add_peer with its metadata first")
            link = Link(self, peer, meta, token)
            with self._lock:
                current = not self.closed and self._peers.get(peer) is meta
                if current:
                    self._links[key] = link
            if not current:
                link.fail("the channel closed or the peer was re-added while connecting")
                raise ChannelError(
                    f"tcp: peer {peer!r} was removed or re-added, or the channel closed, while connecting"
                )
            return link

    def post(
        self,
        kind: Literal["write", "read"],
        peer: str,
        ops: Sequence[TransferOp],
        total: int,
        notif: bytes | None,
        token: bytes,
        merged: bool = False,
        inline: bool = False,
    ) -> TcpHandle:
        """Post checked ``ops`` (``total`` bytes) over the link presenting ``token``: split, batched, sent or queued.
        ``merged``: no op continues the previous one on both sides (a ``BlockWrite``'s runs), so none is merged;
        ``inline``: the first share on this thread, whatever its size."""
        link = self.link(peer, token)
        parts = link.shares_for(total)
        max_frame = self.agent.opts.max_frame_bytes
        runs = ops if merged else merge_ops(ops)
        if parts == 1 and all(op.length <= max_frame for op in runs):
            shares = [runs]  # one share whose runs need no cutting: no op rebuilt
        else:
            shares = _split(runs, parts, max_frame)
        xfer = next(self._xfer_ids)
        if kind == "write":
            built = [
                self._write_batch(xfer, share, len(shares), notif if i == 0 else None) for i, share in enumerate(shares)
            ]
        else:
            built = [self._read_batch(xfer, share) for share in shares]
        return self._dispatch(link, TcpHandle(peer, kind, total, link), xfer, built, notif, inline)

    def post_blocks(
        self, peer: str, blocks: BlockWrite, total: int, notif: bytes | None, token: bytes, inline: bool = False
    ) -> TcpHandle:
        """Post a checked block write (``total`` bytes): framed natively (``BlockFramer``: the frames
        ``post`` would send, byte for byte) and sent from the iovecs natively, where the kernels load and the link
        is clear; else as its runs' ops through ``post``."""
        if self.agent.tls is not None or not native.available():
            return self.post("write", peer, blocks.ops(), total, notif, token, merged=True, inline=inline)
        link = self.link(peer, token)
        xfer = next(self._xfer_ids)
        frames, views = self._framer.frames(blocks, link.shares_for(total), xfer, notif)
        assert frames is not None  # only a sealed write's can be refused
        keep = (frames.out, views, notif)  # the frames' tables, the regions' memory and the notification, until sent
        built = [Batch([], nbytes, iov=frames.iov[first : first + n], keep=keep) for first, n, nbytes in frames.shares]
        return self._dispatch(link, TcpHandle(peer, "write", total, link), xfer, built, notif, inline)

    def post_blocks_sealed(
        self, peer: str, blocks: BlockWrite, total: int, seal: Callable[[int], bytes], token: bytes, inline: bool
    ) -> TcpHandle | None:
        """Post a checked block write whose notification ``seal(checksum)`` makes from the checksum of its bytes,
        each share hashed as it is sent (``Sealed``; ``inline`` as ``post_blocks``); None where that is not done
        (TLS, no kernels, pieces that are not whole checksum words): the caller hashes first."""
        opts = self.agent.opts
        if self.agent.tls is not None or not native.available():
            return None
        link = self.link(peer, token)
        xfer = next(self._xfer_ids)
        frames, views = self._framer.frames(blocks, link.shares_for(total), xfer, None, SEALED_TAIL)
        if frames is None:
            return None
        end = SealedEnd(len(frames.shares), total, xfer, seal, opts.max_notif_bytes)
        built = [
            Batch([], nbytes, keep=views, sealed=Sealed(frames, i, blocks.block_bytes, opts.sum_window_bytes, end))
            for i, (_, _, nbytes) in enumerate(frames.shares)
        ]
        return self._dispatch(link, TcpHandle(peer, "write", total, link), xfer, built, SEALED_NOTIF, inline)

    def _dispatch(
        self, link: Link, handle: TcpHandle, xfer: int, built: list[Batch], notif: bytes | None, inline: bool
    ) -> TcpHandle:
        """Hand a transfer's batches to the link, share i on the calling thread's stream + i; the first share goes
        out on this thread when small enough (a READ's are requests, no payload) or ``inline`` says so. Where the
        link cuts transfers into fewer shares than it has streams (a peer on this host), a large transfer moves the
        thread's stream on past its shares: a request's chunks then spread over the streams as a split one's
        shares would."""
        home, nstreams = self._home_stream(), len(link.streams)
        batches = [((home + i) % nstreams, batch) for i, batch in enumerate(built)]
        if link.max_shares < nstreams and built[0].nbytes > self.agent.opts.inline_max_bytes:
            self._caller.stream = home + len(built)
        link.post(handle, xfer, batches, notif, inline or built[0].nbytes <= self.agent.opts.inline_max_bytes)
        return handle

    def _home_stream(self) -> int:
        """The calling thread's stream: where its unsplit transfers go and its split ones start.

        One busy stream beats several idle ones for small transfers: an idle
        stream's reader sleeps, and waking it on both sides costs more than
        sending 16 KiB. Different threads still spread over the streams.
        """
        home: int | None = getattr(self._caller, "stream", None)
        if home is None:
            home = self._caller.stream = next(self._rr)
        return home

    def _write_batch(self, xfer: int, share: list[TransferOp], nshares: int, notif: bytes | None) -> Batch:
        """The share as vectored DATA frames (usually one): a header and run table, then the runs' bytes as views.

        A frame holds at most ``MAX_RUNS`` runs and ``max_frame_bytes``; the
        last is flagged LAST (and NOTIF, with the notification after it).
        """
        max_frame = self.agent.opts.max_frame_bytes
        regions = dict(self._regions.items())  # a plain dict: one lookup per run, not a method call
        frames: list[tuple[list[tuple[int, int, int]], list[memoryview], int]] = []
        runs: list[tuple[int, int, int]] = []
        views: list[memoryview] = []
        size = nbytes = 0
        for local, at, remote, offset, length in share:  # _split cut every op to at most max_frame bytes
            if runs and (len(runs) == MAX_RUNS or size + length > max_frame):
                frames.append((runs, views, size))
                runs, views, size = [], [], 0
            runs.append((remote, offset, length))
            views.append(regions[local][at : at + length])
            size += length
        frames.append((runs, views, size))
        bufs: list[Any] = []
        last = len(frames) - 1
        for i, (runs, views, size) in enumerate(frames):
            if i < last:
                bufs.append(data_frame(xfer, runs, size))
            else:
                flags = LAST if notif is None else LAST | NOTIF_FOLLOWS
                bufs.append(data_frame(xfer, runs, size, flags, nshares, len(notif) if notif else 0))
            bufs += views
            nbytes += size
        if notif:
            bufs.append(notif)
        return Batch(bufs, nbytes)

    def _read_batch(self, xfer: int, share: list[TransferOp]) -> Batch:
        """READ_REQ frames; where each answer lands is decided here, never by the target."""
        hdrs = bytearray(HDR_SIZE * len(share))
        expect = []
        for i, op in enumerate(share):
            HEADER.pack_into(
                hdrs,
                i * HDR_SIZE,
                MAGIC,
                VERSION,
                READ_REQ,
                0,
                0,
                op.remote_region,
                0,
                xfer,
                op.remote_offset,
                op.length,
            )
            expect.append((xfer, self._regions[op.local_region][op.local_offset : op.local_offset + op.length]))
        return Batch([hdrs], 0, expect)

    def stream_bytes(self, peer: str, token: bytes = b"") -> list[int]:
        """Bytes written to ``peer`` per stream of the current link (for metrics, and to see the split)."""
        return link.bytes_per_stream() if (link := self._links.get((peer, token))) is not None else []

    def close(self) -> list[threading.Thread]:
        """Fail every link (their transfers fail) and keep none after; returns their threads, to join."""
        with self._lock:
            self.closed = True
            links = list(self._links.values())
            self._links.clear()
            self._peers.clear()
        for link in links:
            link.fail("tcp channel closed")
        return [] if self._watcher is None else [self._watcher.close(), *self._watcher.workers.close()]
