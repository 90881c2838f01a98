"""The tcp initiator's native sender (csrc/kvsend.cpp): a block write's frames built natively are the frames the
Python path builds for the same write, byte for byte, share by share; the iovecs go out whole through partial sends;
a peer that reads nothing times the send out; a tcp ``write_blocks`` goes this way; a sealed write
(``write_blocks_summed``) is hashed as it is sent and its notification made after its frames went."""

from __future__ import annotations

import ctypes
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv import native
from pdkv.channels import BlockWrite, Channel, TransferHandle, create_channel
from pdkv.channels.regions import RegionTable
from pdkv.channels.tcp import initiator as initiator_module
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.frames import FRAMES_ENV_VAR
from pdkv.channels.tcp.initiator import Initiator, _split
from pdkv.channels.tcp.options import Agent, TcpOptions
from pdkv.channels.tcp.streams import SealedEnd
from pdkv.checksum import blocks_checksum, finish
from pdkv.errors import ChannelError

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels not loaded: {native.reason()}")


Case = tuple[BlockWrite, int, int, int, bytes | None]  # a write, shares, max_frame, runs per frame, notification


def _python_shares(
    write: BlockWrite, regions: RegionTable[memoryview], parts: int, max_frame: int, notif: bytes | None
) -> list[tuple[bytes, int]]:
    """What ``Initiator.post`` sends for ``write`` as ops: each share's bytes and payload size."""
    opts = TcpOptions(host="127.0.0.1", max_frame_bytes=max_frame)
    init = Initiator(Agent("a", opts, b"", 1, lambda _: None), regions)
    ops = write.ops()
    shares = [ops] if parts == 1 and all(op.length <= max_frame for op in ops) else _split(ops, parts, max_frame)
    batches = [init._write_batch(7, share, len(shares), notif if i == 0 else None) for i, share in enumerate(shares)]
    return [(b"".join(bytes(buf) for buf in batch.bufs), batch.nbytes) for batch in batches]


def _native_shares(
    write: BlockWrite, views: list[memoryview], parts: int, max_frame: int, max_runs: int, notif: bytes | None
) -> list[tuple[bytes, int]]:
    regions = tcp_native.FrameRegions.of(
        [ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in views], write.remote_regions
    )
    frames = tcp_native.block_frames(
        regions, write.local_blocks, write.remote_blocks, write.block_bytes, parts, max_frame, max_runs, 7, notif
    )
    return [
        (b"".join(ctypes.string_at(int(a), int(n)) for a, n in frames.iov[first : first + count]), nbytes)
        for first, count, nbytes in frames.shares
    ]


@st.composite
def writes(draw: st.DrawFn) -> Case:
    """A block write over 1-5 regions (runs, single blocks, reversed), a number of shares, a frame size (down to
    less than a block: pieces cut inside runs), a run limit per frame (down to 1) and a notification."""
    block = draw(st.sampled_from([8, 24, 64]))
    tensors, n = draw(st.integers(1, 5)), draw(st.integers(1, 24))
    ours = draw(st.lists(st.integers(0, 31), min_size=n, max_size=n))
    if draw(st.booleans()):  # long runs, adjacent on both sides
        start = draw(st.integers(0, 31 - n)) if n <= 31 else 0
        ours = list(range(start, start + min(n, 32 - start)))
    theirs = draw(st.permutations(range(32)))[: len(ours)] if draw(st.booleans()) else list(ours)
    remote = tuple(draw(st.lists(st.integers(0, 4), min_size=tensors, max_size=tensors)))
    write = BlockWrite(tuple(range(tensors)), remote, np.array(ours), np.array(theirs), block)
    max_frame = draw(st.sampled_from([block // 2, block, 3 * block, 1 << 20]))
    notif = draw(st.sampled_from([None, b"", b"notice-bytes"]))
    return write, draw(st.integers(1, 4)), max_frame, draw(st.sampled_from([1, 2, 5, 4096])), notif


@settings(max_examples=300, deadline=None)
@given(writes())
def test_native_frames_are_the_python_frames(case: Case) -> None:
    write, parts, max_frame, max_runs, notif = case
    rng = np.random.default_rng(len(write.local_blocks))
    buffers = [rng.integers(0, 256, 32 * write.block_bytes, dtype=np.uint8) for _ in write.local_regions]
    views = [memoryview(b).cast("B") for b in buffers]
    regions: RegionTable[memoryview] = RegionTable("test")
    for v in views:
        regions.add(v, v.nbytes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(initiator_module, "MAX_RUNS", max_runs)
        expected = _python_shares(write, regions, parts, max_frame, notif)
    assert _native_shares(write, views, parts, max_frame, max_runs, notif) == expected


@settings(max_examples=150, deadline=None)
@given(writes(), st.sampled_from([8, 16, 4096]), st.sampled_from([8, 64, 1 << 20]))
def test_sealed_frames_carry_the_stream_in_order_and_their_parts_add_up_to_its_checksum(
    case: Case, tail: int, window: int
) -> None:
    """A sealed write's shares, each's rows then its held-back tail, carry the write's byte stream in order, whole
    words each; no tail is longer than ``tail`` and a word; and the parts of the checksum the shares' summed sends
    give add up to ``blocks_checksum``. Only a frame size off the words refuses the write (None)."""
    write, parts, max_frame, max_runs, _ = case
    block = write.block_bytes
    rng = np.random.default_rng(len(write.local_blocks) + parts)
    buffers = [rng.integers(0, 256, 32 * block, dtype=np.uint8) for _ in write.local_regions]
    regions = tcp_native.FrameRegions.of([b.ctypes.data for b in buffers], write.remote_regions)
    ours, theirs = write.local_blocks, write.remote_blocks
    frames = tcp_native.block_frames(regions, ours, theirs, block, parts, max_frame, max_runs, 7, None, tail)
    if frames is None:
        assert max_frame % 8
        return
    stream = b"".join(bytes(b[i * block : (i + 1) * block]) for b in buffers for i in ours)
    carried, place = [], 0
    for (first, rows, nbytes), (_, _, tail_len) in zip(frames.shares, frames.tails, strict=True):
        payload = [k for k in range(first, first + rows + 1) if frames.offsets[k] >= 0]  # the tail's row last
        assert payload[-1] == first + rows and 0 < tail_len <= tail + 8
        assert sum(int(frames.iov[k][1]) for k in payload) == nbytes
        for k in payload:
            assert frames.offsets[k] == place and place % 8 == 0
            carried.append(ctypes.string_at(int(frames.iov[k][0]), int(frames.iov[k][1])))
            place += int(frames.iov[k][1])
    assert b"".join(carried) == stream
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 10, 0))  # a stuck send fails, never hangs
    b.settimeout(10)
    drained = threading.Thread(target=lambda: [None for _ in iter(lambda: b.recv(1 << 20), b"")])
    drained.start()
    try:
        accs = [tcp_native.send_summed(a.fileno(), frames, i, block, window) for i in range(len(frames.shares))]
    finally:
        a.close()
        drained.join(10)
        b.close()
    assert all(code == native.OK for code, _, _ in accs)
    want = blocks_checksum([torch.from_numpy(b) for b in buffers], list(ours), block)
    assert finish(sum(acc for _, _, acc in accs), len(stream)) == want


def test_iovecs_go_out_whole_through_partial_sends() -> None:
    """4,000 buffers (more than IOV_MAX) of 1-3,000 bytes through a socket whose buffers hold far less: every
    byte arrives, in order."""
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 3_000_000, dtype=np.uint8)
    cuts = np.sort(rng.choice(np.arange(1, len(data)), 3_999, replace=False))
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [len(data)]]))
    iov = np.stack([data.ctypes.data + starts, lengths], axis=1).astype(np.int64)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 30, 0))  # a stuck send fails, never hangs
    b.settimeout(30)
    got = bytearray()

    def read() -> None:
        while len(got) < len(data) and (piece := b.recv(7_000)):
            got.extend(piece)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert tcp_native.send_iov(a.fileno(), iov) == (tcp_native.OK, 0)
        reader.join(30)
        assert not reader.is_alive() and bytes(got) == data.tobytes()
    finally:
        a.close()
        b.close()


def test_a_peer_that_reads_nothing_times_the_send_out() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 200_000))
    data = np.zeros(32 << 20, dtype=np.uint8)
    try:
        code, _ = tcp_native.send_iov(a.fileno(), np.array([[data.ctypes.data, data.nbytes]], dtype=np.int64))
        assert code == tcp_native.LAND_STALLED
        b.close()
        code, os_error = tcp_native.send_iov(a.fileno(), np.array([[data.ctypes.data, 1 << 20]], dtype=np.int64))
        assert (code, os_error) in ((tcp_native.LAND_EOS, 32), (tcp_native.LAND_EOS, 104))  # EPIPE, ECONNRESET
    finally:
        a.close()


def test_a_tcp_block_write_goes_out_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fragmented blocks of three regions land bit-exact, sent from native iovecs (one send per share), not as
    Python buffers."""
    sent: list[int] = []
    real = tcp_native.send_iov

    def counting(fd: int, iov: np.ndarray) -> tuple[int, int]:
        sent.append(len(iov))
        return real(fd, iov)

    monkeypatch.setattr(tcp_native, "send_iov", counting)
    a = create_channel("tcp", "a", {"host": "127.0.0.1"})
    b = create_channel("tcp", "b", {"host": "127.0.0.1"})
    try:
        rng = np.random.default_rng(3)
        srcs = [rng.integers(0, 256, 64 * 128, dtype=np.uint8) for _ in range(3)]
        dsts = [np.zeros(64 * 128, dtype=np.uint8) for _ in range(3)]
        ras = tuple(a.register(s, 128) for s in srcs)
        rbs = tuple(b.register(d, 128) for d in dsts)
        ours, theirs = np.array([5, 6, 7, 20, 2]), np.array([1, 2, 3, 60, 9])
        handle = a.write_blocks(a.add_peer(b.metadata()), BlockWrite(ras, rbs, ours, theirs, 128), b"n")
        a.wait(handle, 10.0)
        assert sent == [1 + 3 * 3 + 1]  # one frame: header and table, three runs of each region, the notification
        for s, d in zip(srcs, dsts, strict=True):
            for i, j in zip(ours, theirs, strict=True):
                assert np.array_equal(d[j * 128 : (j + 1) * 128], s[i * 128 : (i + 1) * 128])
    finally:
        a.close()
        b.close()


# -- a sealed write: hashed as it is sent, its notification made last (issue 46, step 2) ------------------------

SEALED_SHAPES = {  # our blocks, theirs, block bytes (its checksum word), max_frame, regions, shares
    "fragmented": ([5, 6, 7, 20, 2], [1, 2, 3, 60, 9], 128, 1 << 20, 3, 1),
    "tail-only": ([3], [4], 128, 1 << 20, 1, 1),  # one piece shorter than the tail: no frame goes before the LAST one
    "cut-in-blocks": (list(range(40)), list(range(10, 50)), 1024, 3000, 3, 1),  # pieces cut inside blocks
    "words-of-4": ([1, 2], [5, 6], 4100, 1 << 20, 2, 1),  # the tail cut off a longer piece at a narrower word
    "words-of-2": ([0, 1, 9], [3, 4, 8], 4098, 1 << 20, 1, 1),
    "words-of-1": ([6, 7], [0, 1], 4097, 1 << 20, 2, 1),
    "three-shares": (list(range(12)), list(range(20, 32)), 1024, 1 << 20, 3, 3),
    "shares-cut-in-blocks": (list(range(40)), list(range(10, 50)), 1024, 3000, 3, 3),
    "two-shares-of-4-byte-words": ([1, 2, 3, 4], [5, 6, 7, 8], 4100, 1 << 20, 1, 2),
    "tail-only-shares": ([3, 9], [4, 0], 128, 1 << 20, 1, 2),  # every share shorter than its tail
    "three-shares-of-a-third-not-in-words": (list(range(13)), list(range(13)), 1024, 1 << 20, 1, 3),  # cut at words
}


def _sealed_pair(max_frame: int, shares: int, **ours: int) -> tuple[Channel, Channel]:
    """Two tcp channels on loopback; the first splits any write into ``shares`` (one a stream)."""
    split = {"streams": shares, "stream_min_bytes": 1, "one_host_shares": shares}
    a = create_channel("tcp", "a", {"host": "127.0.0.1", "max_frame_bytes": max_frame, **split, **ours})
    b = create_channel("tcp", "b", {"host": "127.0.0.1", "max_frame_bytes": max_frame})
    return a, b


def _notes(channel: Channel, n: int) -> list[bytes]:
    """The notifications ``channel`` received: the first ``n`` (within 10 s), and any more 50 ms after."""
    deadline, got = time.monotonic() + 10, []
    while len(got) < n and time.monotonic() < deadline:
        got += [note.payload for note in channel.get_notifications()]
        time.sleep(0.001)
    time.sleep(0.05)
    return got + [note.payload for note in channel.get_notifications()]


@pytest.mark.parametrize("loop", ["native", "python"])
@pytest.mark.parametrize("window", [8, 4096, 1 << 22])
@pytest.mark.parametrize("shape", sorted(SEALED_SHAPES))
def test_a_sealed_write_is_hashed_as_it_is_sent(
    shape: str, window: int, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum a sealed write hands its ``seal`` is ``blocks_checksum`` of its bytes (what the pass ahead of
    the send computed), whatever windows and shares it was hashed in; the bytes land bit-exact, the notification
    made after every share's frames went arrives with them, once, and every share went through the summed send,
    its tail after it. A write of several shares has its last share held up: the notification then rides that
    share, not the first. The target serves the frames with either frame loop (``PDKV_NATIVE_FRAMES``)."""
    monkeypatch.setenv(FRAMES_ENV_VAR, "0" if loop == "python" else "1")
    ours, theirs, block, max_frame, nregions, nshares = SEALED_SHAPES[shape]
    summed: list[tuple[int, int, int]] = []  # per share sent: (share, its payload bytes, its tail's)
    riders: list[int] = []  # the share that carried the notification
    sending = threading.local()
    real, real_add = tcp_native.send_summed, SealedEnd.add

    def counting(fd: int, frames: tcp_native.BlockFrames, share: int, unit: int, w: int) -> tuple[int, int, int]:
        if share == len(frames.shares) - 1 > 0:
            time.sleep(0.05)  # the others finish first
        summed.append((share, frames.shares[share][2], frames.tails[share][2]))
        sending.share = share
        return real(fd, frames, share, unit, w)

    def adding(end: SealedEnd, acc: int) -> bytes | None:
        notif = real_add(end, acc)
        if notif is not None:
            riders.append(sending.share)
        return notif

    monkeypatch.setattr(tcp_native, "send_summed", counting)
    monkeypatch.setattr(SealedEnd, "add", adding)
    a, b = _sealed_pair(max_frame, nshares, sum_window_bytes=window)
    try:
        rng = np.random.default_rng(len(ours) + window)
        srcs = [rng.integers(0, 256, 64 * block, dtype=np.uint8) for _ in range(nregions)]
        dsts = [np.zeros(64 * block, dtype=np.uint8) for _ in range(nregions)]
        ras = tuple(a.register(s, block) for s in srcs)
        rbs = tuple(b.register(d, block) for d in dsts)
        sealed: list[int] = []

        def seal(digest: int) -> bytes:
            sealed.append(digest)
            return b"notice " + digest.to_bytes(8, "little")

        write = BlockWrite(ras, rbs, np.array(ours), np.array(theirs), block)
        handle = a.write_blocks_summed(a.add_peer(b.metadata()), write, seal)
        assert handle is not None
        a.wait(handle, 10.0)
        expected = blocks_checksum([torch.from_numpy(s) for s in srcs], ours, block)
        assert sealed == [expected]
        total = nregions * len(ours) * block
        assert sorted(share for share, _, _ in summed) == list(range(nshares))
        assert sum(nbytes for _, nbytes, _ in summed) == total
        for _, nbytes, tail in summed:  # each share's tail: at most 4 KiB and a word, all of a share shorter
            assert tail == nbytes if shape.startswith("tail-only") else 0 < tail <= 4096 + 8 and tail < nbytes
        assert _notes(b, 1) == [seal(expected)] and riders == [nshares - 1]
        for s, d in zip(srcs, dsts, strict=True):
            for i, j in zip(ours, theirs, strict=True):
                assert np.array_equal(d[j * block : (j + 1) * block], s[i * block : (i + 1) * block])
    finally:
        a.close()
        b.close()


def test_sealed_writes_of_several_shares_from_several_threads_each_land_with_their_own_notification() -> None:
    """Shares of concurrent sealed writes wait for no other (the last hashed seals): threads whose writes start on
    different streams, and so queue their shares in opposite orders, all land, each notification over its own
    write's bytes."""
    block, writes = 4096, 8
    a, b = _sealed_pair(1 << 20, 2, inline_max_bytes=0)
    try:
        src = np.random.default_rng(3).integers(0, 256, 2 * writes * 4 * block, dtype=np.uint8)
        dst = np.zeros_like(src)
        ra, rb = a.register(src, block), b.register(dst, block)
        peer = a.add_peer(b.metadata())
        handles: list[TransferHandle] = []
        lock = threading.Lock()

        def post(first: int) -> None:
            for k in range(first, 2 * writes, 2):
                ids = np.arange(4 * k, 4 * k + 4)
                write = BlockWrite((ra,), (rb,), ids, ids, block)
                handle = a.write_blocks_summed(peer, write, lambda d, k=k: b"%d:%d" % (k, d))
                assert handle is not None
                with lock:
                    handles.append(handle)

        threads = [threading.Thread(target=post, args=(first,)) for first in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for handle in handles:
            a.wait(handle, 10.0)
        want = {
            b"%d:%d" % (k, blocks_checksum([torch.from_numpy(src)], list(range(4 * k, 4 * k + 4)), block))
            for k in range(2 * writes)
        }
        assert len(handles) == 2 * writes and sorted(_notes(b, 2 * writes)) == sorted(want)
        assert np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


def test_a_write_the_send_cannot_hash_is_left_to_the_caller() -> None:
    """Pieces that are not whole checksum words (frames cut at 12 bytes of 8-byte words, in one share or two):
    ``write_blocks_summed`` sends nothing and says so (None), and the caller hashes first."""
    for opts, nbytes in (
        ({"max_frame_bytes": 12}, 24),
        ({"max_frame_bytes": 12, "streams": 2, "stream_min_bytes": 8}, 24),
    ):
        a = create_channel("tcp", "a", {"host": "127.0.0.1", **opts})
        b = create_channel("tcp", "b", {"host": "127.0.0.1", **opts})
        try:
            src, dst = np.ones(8 * nbytes, dtype=np.uint8), np.zeros(8 * nbytes, dtype=np.uint8)
            ids = np.array([1, 2, 3])
            write = BlockWrite((a.register(src, nbytes),), (b.register(dst, nbytes),), ids, ids + 2, nbytes)
            assert a.write_blocks_summed(a.add_peer(b.metadata()), write, lambda d: b"n") is None
            assert not dst.any()
        finally:
            a.close()
            b.close()


def test_a_summed_send_refuses_rows_off_the_words_and_times_out_on_a_peer_that_reads_nothing() -> None:
    """A payload row at a place in the stream that is not a whole word is refused before a byte is sent; a peer
    that reads nothing stalls the send (``LAND_STALLED``), never hangs it."""
    data = np.zeros(32 << 20, dtype=np.uint8)
    regions = tcp_native.FrameRegions.of([data.ctypes.data], [0])
    frames = tcp_native.block_frames(regions, np.arange(4), np.arange(4), 8 << 20, 1, 1 << 30, 16, 1, None, 4096)
    assert frames is not None and frames.tails == [(0, (32 << 20) - 4096, 4096)]
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 200_000))
    try:
        bad = frames._replace(offsets=frames.offsets.copy())
        bad.offsets[1] += 4
        assert tcp_native.send_summed(a.fileno(), bad, 0, 8 << 20, 1 << 20)[0] == tcp_native.LAND_EARG
        assert select.select([b], [], [], 0.05)[0] == []  # not a byte went
        code, _, _ = tcp_native.send_summed(a.fileno(), frames, 0, 8 << 20, 1 << 20)
        assert code == tcp_native.LAND_STALLED
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("shares", [1, 2])
@pytest.mark.parametrize("seal_fails", ["too long", "raises"])
def test_a_notification_that_cannot_be_sealed_ends_its_link(seal_fails: str, shares: int) -> None:
    """Sealed after its frames went, a notification over max_notif_bytes (or a seal that raises) cannot end the
    write: the write fails saying why, its link ends (the target delivers nothing for it; any other write in
    flight on that link fails with it), and the next write opens a new link and lands with its notification. In
    two shares, the seal runs on a stream's sender thread or the caller's, whichever share is hashed last."""
    a, b = _sealed_pair(1 << 20, shares, max_notif_bytes=64)
    try:
        src, dst = np.arange(4 * 4096, dtype=np.int64).view(np.uint8), np.zeros(32 * 4096, dtype=np.uint8)
        write = BlockWrite((a.register(src, 8192),), (b.register(dst, 8192),), np.array([0, 1]), np.array([2, 3]), 8192)
        peer = a.add_peer(b.metadata())

        def bad(digest: int) -> bytes:
            if seal_fails == "raises":
                raise RuntimeError("no key")
            return b"x" * 65

        handle = a.write_blocks_summed(peer, write, bad)
        assert handle is not None
        with pytest.raises(ChannelError, match="max_notif_bytes" if seal_fails == "too long" else "no key"):
            a.wait(handle, 10.0)
        handle = a.write_blocks_summed(peer, write, lambda digest: b"good")
        assert handle is not None
        a.wait(handle, 10.0)
        deadline = time.monotonic() + 10
        while not (notes := b.get_notifications()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [n.payload for n in notes] == [b"good"]
        assert np.array_equal(dst[2 * 8192 : 4 * 8192], src[: 2 * 8192])
    finally:
        a.close()
        b.close()
