"""The tcp channel between processes: exact bytes, notifications after data, hostile frames, dead peers.

The remote agent runs in a spawned process driven through a pipe (``Peer``),
so the bytes really cross a socket between two address spaces. Hostile
frames come from a raw socket, because a well-behaved channel cannot send
them. No assertion depends on timing; waits are bounded so a bug fails a test
instead of hanging it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import signal
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest

from pdkv.auth import NONCE_BYTES, PROOF_BYTES
from pdkv.channels import TransferOp, XferState, create_channel
from pdkv.channels.handle import Notification
from pdkv.channels.reachability import FIRST_RETRY_S
from pdkv.channels.tcp import TcpChannel, TcpOptions, handshake, watching, wire
from pdkv.channels.tcp import options as tcp_options
from pdkv.channels.tcp import workers as tcp_workers
from pdkv.channels.tcp.initiator import _split
from pdkv.channels.tcp.reader import FOLLOW_S, LinkReader
from pdkv.channels.tcp.watching import LinkWatcher
from pdkv.channels.tcp.wire import HEADER, LAST, MAGIC, NOTIF_FOLLOWS, SECRET, VERSION
from pdkv.config import convert_config
from pdkv.errors import ChannelError, ConfigError, PeerUnreachableError
from pdkv.testing.relay import ByteRelay

from tests.conftest import wait_until

CALL_TIMEOUT = 30.0
MiB = 1 << 20


def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


# -- the remote agent, in its own process -----------------------------------------------------------


def _await_notif(
    channel: TcpChannel, bufs: list[bytearray], region: int, offset: int, length: int, timeout: float
) -> tuple[list[Any], int]:
    """Poll for a notification and checksum the range the moment it shows up: is the data already there?"""
    deadline = time.monotonic() + timeout
    while not (notifs := channel.get_notifications()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no notification within {timeout}s")
        time.sleep(0.0001)
    crc = zlib.crc32(memoryview(bufs[region])[offset : offset + length])
    return [(n.peer, n.payload) for n in notifs], crc


def _notifs(channel: TcpChannel, bufs: list[bytearray], wait_s: float) -> list[tuple[str, bytes]]:
    """Notifications that arrive within ``wait_s`` (returns as soon as there is one)."""
    deadline = time.monotonic() + wait_s
    while not (notifs := channel.get_notifications()) and time.monotonic() < deadline:
        time.sleep(0.001)
    return [(n.peer, n.payload) for n in notifs]


def _fill(channel: TcpChannel, bufs: list[bytearray], region: int, seed: int) -> None:
    bufs[region][:] = pattern(seed, len(bufs[region]))


_PEER_COMMANDS: dict[str, Callable[..., Any]] = {
    "add_peer": lambda ch, bufs, meta: ch.add_peer(meta),
    "deregister": lambda ch, bufs, region: ch.deregister(region),
    "fill": _fill,
    "crc": lambda ch, bufs, region, offset, length: zlib.crc32(memoryview(bufs[region])[offset : offset + length]),
    "bytes": lambda ch, bufs, region, offset, length: bytes(bufs[region][offset : offset + length]),
    "await_notif": _await_notif,
    "notifs": _notifs,
}


def _peer_main(conn: Connection, name: str, options: dict[str, Any], sizes: list[int]) -> None:
    """A tcp agent with one region per size, serving commands from the test until told to exit."""
    channel = create_channel("tcp", name, options)
    bufs = [bytearray(n) for n in sizes]
    regions = [channel.register(b) for b in bufs]
    conn.send((channel.metadata(), regions))
    try:
        while (msg := conn.recv())[0] != "exit":
            cmd, args = msg
            try:
                conn.send(("ok", _PEER_COMMANDS[cmd](channel, bufs, *args)))
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except EOFError:
        pass
    finally:
        channel.close()


class Peer:
    """The test's handle on a remote agent process."""

    def __init__(self, name: str, options: dict[str, Any], sizes: list[int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, name, options, sizes), daemon=True)
        self.proc.start()
        self.meta, self.regions = self.recv()

    def recv(self) -> Any:
        if not self.conn.poll(CALL_TIMEOUT):
            pytest.fail(f"peer process did not answer within {CALL_TIMEOUT}s")
        return self.conn.recv()

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def result(self) -> Any:
        status, value = self.recv()
        assert status == "ok", f"peer command failed: {value}"
        return value

    def call(self, cmd: str, *args: Any) -> Any:
        self.send(cmd, *args)
        return self.result()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


# -- two processes: bytes and notifications ----------------------------------------------------------

REMOTE_SIZES = [8 * MiB, 1 * MiB, 4096]  # the last one is deregistered by a test


@dataclass
class Local:
    channel: TcpChannel
    src: bytearray
    dst: bytearray
    src_region: int
    dst_region: int


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer("remote", {"streams": 4, "stream_min_bytes": 256 << 10, "io_timeout": 10}, REMOTE_SIZES)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local(peer: Peer) -> Iterator[Local]:
    channel = TcpChannel("local", TcpOptions(streams=4, stream_min_bytes=256 << 10, one_host_shares=4, io_timeout=10))
    src, dst = bytearray(pattern(1, 8 * MiB)), bytearray(8 * MiB)
    loc = Local(channel, src, dst, channel.register(src), channel.register(dst))
    channel.add_peer(peer.meta)
    peer.call("add_peer", channel.metadata())
    yield loc
    channel.close()


def test_write_of_several_ops_lands_exact_bytes_then_notifies(local: Local, peer: Peer) -> None:
    r0, r1, _ = peer.regions
    peer.call("fill", r0, 10)
    peer.call("fill", r1, 11)
    s = local.src_region
    ops = [
        TransferOp(s, 0, r0, 100, 1000),
        TransferOp(s, 5000, r1, 7, 3000),
        TransferOp(s, 9000, r0, 70000, 4096),
        TransferOp(s, 13096, r0, 74096, 500),  # continues the previous op on both sides: merged
        TransferOp(s, 20000, r1, 1 * MiB - 10, 10),  # up to the very last byte of the region
    ]
    handle = local.channel.write("remote", ops, notif=b"w1")
    local.channel.wait(handle, CALL_TIMEOUT)
    assert local.channel.poll(handle) is XferState.DONE

    expected = [bytearray(pattern(10, REMOTE_SIZES[0])), bytearray(pattern(11, REMOTE_SIZES[1]))]
    for op in ops:
        expected[op.remote_region][op.remote_offset : op.remote_offset + op.length] = local.src[
            op.local_offset : op.local_offset + op.length
        ]
    assert peer.call("crc", r0, 0, REMOTE_SIZES[0]) == zlib.crc32(expected[0])
    assert peer.call("bytes", r1, 0, REMOTE_SIZES[1]) == expected[1]
    assert peer.call("notifs", 10.0) == [("local", b"w1")]


def test_read_of_several_ops_lands_in_local_regions_then_notifies_the_target(local: Local, peer: Peer) -> None:
    r0, _, _ = peer.regions
    peer.call("fill", r0, 20)
    remote = pattern(20, REMOTE_SIZES[0])
    local.dst[:] = bytes(len(local.dst))
    d = local.dst_region
    ops = [TransferOp(d, 0, r0, 123, 4000), TransferOp(d, 10000, r0, 2 * MiB, 6 * MiB)]  # the second spans every stream
    handle = local.channel.read("remote", ops, notif=b"r1")
    local.channel.wait(handle, CALL_TIMEOUT)

    assert local.dst[0:4000] == remote[123:4123]
    assert local.dst[10000 : 10000 + 6 * MiB] == remote[2 * MiB : 8 * MiB]
    assert local.dst[4000:10000] == bytes(6000) and local.dst[10000 + 6 * MiB :] == bytes(
        len(local.dst) - 10000 - 6 * MiB
    )
    assert peer.call("notifs", 10.0) == [("local", b"r1")]


def test_a_write_of_more_runs_than_a_frame_holds_goes_as_several_frames_and_lands_exactly(
    local: Local, peer: Peer
) -> None:
    r0, _, _ = peer.regions
    peer.call("fill", r0, 12)
    s, n = local.src_region, wire.MAX_RUNS + 100
    ops = [TransferOp(s, 32 * i, r0, 48 * i + 5, 16) for i in range(n)]  # gaps on both sides: nothing merges
    frames = [
        HEADER.unpack_from(buf)
        for buf in local.channel.initiator._write_batch(1, ops, 1, b"n").bufs
        if isinstance(buf, bytearray)
    ]
    assert [(f[2], f[5], f[3] & LAST) for f in frames] == [(wire.DATA, wire.MAX_RUNS, 0), (wire.DATA, 100, LAST)]

    local.channel.wait(local.channel.write("remote", ops, notif=b"runs"), CALL_TIMEOUT)

    expected = bytearray(pattern(12, REMOTE_SIZES[0]))
    for op in ops:
        expected[op.remote_offset : op.remote_offset + 16] = local.src[op.local_offset : op.local_offset + 16]
    assert peer.call("crc", r0, 0, REMOTE_SIZES[0]) == zlib.crc32(expected)
    assert peer.call("notifs", 10.0) == [("local", b"runs")]


@pytest.mark.parametrize("seed", [30, 31, 32])
def test_large_write_is_split_across_streams_and_notified_only_after_every_share_landed(
    local: Local, peer: Peer, seed: int
) -> None:
    r0, _, _ = peer.regions
    local.src[:] = pattern(seed, len(local.src))
    before = local.channel.stream_bytes("remote")
    peer.send(
        "await_notif", r0, 0, 8 * MiB, CALL_TIMEOUT
    )  # the peer checksums the region as soon as the notification shows
    handle = local.channel.write("remote", [TransferOp(local.src_region, 0, r0, 0, 8 * MiB)], notif=b"big%d" % seed)
    local.channel.wait(handle, CALL_TIMEOUT)
    notifs, crc_at_notification = peer.result()

    assert notifs == [("local", b"big%d" % seed)]
    assert crc_at_notification == zlib.crc32(local.src), "the notification arrived before all of the data"
    moved = [a - b for a, b in zip(local.channel.stream_bytes("remote"), before, strict=True)]
    assert sum(moved) == 8 * MiB
    assert sum(1 for m in moved if m) >= 2, f"an 8 MiB write used one stream: {moved}"


def test_write_to_a_region_the_peer_dropped_fails_with_its_reason_and_the_next_write_reconnects(
    local: Local, peer: Peer
) -> None:
    r0, _, r2 = peer.regions
    peer.call("deregister", r2)  # our copy of its metadata still lists it
    handle = local.channel.write("remote", [TransferOp(local.src_region, 0, r2, 0, 4096)])
    with pytest.raises(ChannelError, match="not registered"):
        local.channel.wait(handle, CALL_TIMEOUT)

    handle = local.channel.write("remote", [TransferOp(local.src_region, 0, r0, 0, 4096)], notif=b"after")
    local.channel.wait(handle, CALL_TIMEOUT)
    assert peer.call("crc", r0, 0, 4096) == zlib.crc32(local.src[:4096])
    assert peer.call("notifs", 10.0) == [("local", b"after")]


def test_pipelined_small_writes_all_land_and_complete(local: Local, peer: Peer) -> None:
    r0, _, _ = peer.regions
    local.src[:] = pattern(40, len(local.src))
    size, count = 16 << 10, 256
    handles = [
        local.channel.write("remote", [TransferOp(local.src_region, i * size, r0, i * size, size)])
        for i in range(count)
    ]
    for h in handles:
        local.channel.wait(h, CALL_TIMEOUT)
    assert peer.call("crc", r0, 0, count * size) == zlib.crc32(local.src[: count * size])


# -- a peer that dies, stalls or restarts -----------------------------------------------------------


def test_peer_killed_mid_transfer_fails_the_handle_and_its_restart_is_reachable() -> None:
    channel = TcpChannel("killer", TcpOptions(io_timeout=5))
    src = bytearray(pattern(5, 64 * MiB))
    region = channel.register(src)
    victim = Peer("victim", {}, [64 * MiB])
    try:
        channel.add_peer(victim.meta)
        channel.wait(channel.write("victim", [TransferOp(region, 0, 0, 0, 4096)]), CALL_TIMEOUT)
        pid = victim.proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # 64 MiB cannot fit in socket buffers: the write stays in flight
        handle = channel.write("victim", [TransferOp(region, 0, 0, 0, 64 * MiB)], notif=b"never")
        time.sleep(0.2)
        assert channel.poll(handle) is XferState.PENDING
        os.kill(pid, signal.SIGKILL)
        victim.proc.join(10)
        with pytest.raises(ChannelError, match="victim"):
            channel.wait(handle, CALL_TIMEOUT)
    finally:
        victim.stop()

    restarted = Peer("victim", {}, [64 * MiB])
    try:
        channel.add_peer(restarted.meta)
        channel.wait(channel.write("victim", [TransferOp(region, 0, 0, 0, 64 * MiB)], notif=b"again"), CALL_TIMEOUT)
        assert restarted.call("crc", 0, 0, 64 * MiB) == zlib.crc32(src)
        assert restarted.call("notifs", 10.0) == [("killer", b"again")]
    finally:
        restarted.stop()
        channel.close()


def test_metadata_of_the_previous_wire_version_is_refused() -> None:
    channel = TcpChannel("current")
    try:
        old = msgspec.msgpack.encode(
            {"name": "old", "host": "127.0.0.1", "port": 1, "instance": 1, "regions": {}, "version": VERSION - 1}
        )
        with pytest.raises(ChannelError, match=f"speaks protocol {VERSION - 1}, this agent {VERSION}; upgrade both"):
            channel.add_peer(old)
    finally:
        channel.close()


class FakePeer:
    """Speaks the handshake; then answers the first request with ``reply(its xfer id)``, or nothing: a hung agent."""

    def __init__(self, name: str = "silent", reply: Callable[[int], bytes] | None = None) -> None:
        self.reply = reply
        self.server = socket.create_server(("127.0.0.1", 0))
        self.sessions: set[int] = set()
        self.meta = msgspec.msgpack.encode(
            {
                "name": name,
                "host": "127.0.0.1",
                "port": self.server.getsockname()[1],
                "instance": 77,
                "regions": {0: MiB},
                "version": VERSION,
            }
        )
        self.name = name
        self.conns: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(sock)
            self.threads.append(threading.Thread(target=self._swallow, args=(sock,), daemon=True))
            self.threads[-1].start()

    def _swallow(self, sock: socket.socket) -> None:
        try:
            hdr = sock.recv(HEADER.size, socket.MSG_WAITALL)
            *_, sid, _, length = HEADER.unpack(hdr)
            sock.recv(length, socket.MSG_WAITALL)
            self.sessions.add(sid)
            sock.sendall(wire.pack(wire.HELLO_OK, 77, len(self.name)) + self.name.encode())
            if self.reply is not None and len(hdr := sock.recv(HEADER.size, socket.MSG_WAITALL)) == HEADER.size:
                sock.sendall(self.reply(HEADER.unpack(hdr)[7]))
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass

    def close(self) -> None:
        """Stop accepting and hang up, then wait for every thread (a close alone wakes no blocked accept)."""
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        for s in self.conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self.threads:
            t.join(5)


def test_hung_peer_fails_the_handle_after_io_timeout_and_the_next_write_reconnects() -> None:
    silent = FakePeer()
    channel = TcpChannel("impatient", TcpOptions(io_timeout=1.0, streams=2))
    try:
        region = channel.register(bytearray(MiB))
        channel.add_peer(silent.meta)
        handle = channel.write(silent.name, [TransferOp(region, 0, 0, 0, 4096)])
        with pytest.raises(ChannelError, match="no byte moved"):
            channel.wait(handle, CALL_TIMEOUT)
        assert len(silent.sessions) == 1
        channel.write(silent.name, [TransferOp(region, 0, 0, 0, 4096)])
        assert len(silent.sessions) == 2, "the channel did not reconnect with a new session"
    finally:
        channel.close()
        silent.close()


def test_close_fails_pending_handles_and_is_idempotent() -> None:
    silent = FakePeer()
    channel = TcpChannel("closer", TcpOptions(io_timeout=30))
    region = channel.register(bytearray(MiB))
    channel.add_peer(silent.meta)
    handle = channel.write(silent.name, [TransferOp(region, 0, 0, 0, 4096)])
    channel.close()
    channel.close()
    silent.close()
    assert handle.state is XferState.ERROR and "closed" in (handle.error or "")
    with pytest.raises(ChannelError, match="closed"):
        channel.write(silent.name, [TransferOp(region, 0, 0, 0, 4096)])


LYING_ANSWERS: dict[str, tuple[str, Callable[[int], bytes], str]] = {
    "ack of a transfer never posted": ("write", lambda x: wire.pack(wire.ACK, x + 1000, aux=1), "not pending"),
    "ack count that lies": ("write", lambda x: wire.pack(wire.ACK, x, 8 * 999, aux=1000), "ACK of 1000 ids"),
    "read data longer than asked": (
        "read",
        lambda x: wire.pack(wire.READ_DATA, x, 1 << 30) + b"\xee" * 8192,
        "answered READ",
    ),
    "read data of another transfer": (
        "read",
        lambda x: wire.pack(wire.READ_DATA, x + 1, 4096) + b"\xee" * 4096,
        "answered READ",
    ),
    "read data for a write": ("write", lambda x: wire.pack(wire.READ_DATA, x, 4096) + b"\xee" * 4096, "nobody asked"),
    "data sent to the initiator": (
        "write",
        lambda x: HEADER.pack(MAGIC, VERSION, wire.DATA, LAST, 1, 0, 0, x, 0, 16) + b"\xee" * 16,
        "DATA frame",
    ),
    "answer of a transfer never posted": (
        "write",
        lambda x: wire.pack(wire.ANSWER, x + 1000, 4) + b"okay",
        "answered a transfer that is not pending",
    ),
    "ack of a read": ("read", lambda x: wire.pack(wire.ACK, x, aux=1), "acknowledged READ"),
    "answer of a read": ("read", lambda x: wire.pack(wire.ANSWER, x, 4) + b"okay", "acknowledged READ"),
    "answer of a write that asked nothing": (
        "write",
        lambda x: wire.pack(wire.ANSWER, x, 4) + b"okay",
        "carried no notification to answer",
    ),
    "answer longer than a notification may be": (
        "write",
        lambda x: wire.pack(wire.ANSWER, x, 1 << 30) + b"\xee" * 64,
        "answer of 1073741824 bytes exceeds",
    ),
    "garbage": ("read", lambda x: b"\xee" * 64, "bad magic"),
    "an error frame": ("write", lambda x: wire.pack(wire.ERROR, 0, 7) + b"go away", "go away"),
}


@pytest.mark.parametrize("case", list(LYING_ANSWERS))
def test_lying_answer_fails_the_transfer_and_lands_nothing(case: str) -> None:
    kind, reply, reason = LYING_ANSWERS[case]
    liar = FakePeer("liar", reply)
    channel = TcpChannel("trusting", TcpOptions(io_timeout=5, streams=1))
    local = bytearray(pattern(3, MiB))
    try:
        region = channel.register(local)
        channel.add_peer(liar.meta)
        op = [TransferOp(region, 4096, 0, 0, 4096)]
        handle = channel.write(liar.name, op) if kind == "write" else channel.read(liar.name, op)
        with pytest.raises(ChannelError, match=reason):
            channel.wait(handle, CALL_TIMEOUT)
        assert local == pattern(3, MiB), "a lying answer changed local memory"
    finally:
        channel.close()
        liar.close()


# -- hostile frames from a raw socket -----------------------------------------------------------------

REGION = 64 << 10


def _hdr(
    ftype: int,
    *,
    flags: int = 0,
    shares: int = 0,
    aux: int = 0,
    notif: int = 0,
    xfer: int = 0,
    offset: int = 0,
    length: int = 0,
    version: int = VERSION,
) -> bytes:
    return HEADER.pack(MAGIC, version, ftype, flags, shares, aux, notif, xfer, offset, length)


def _hello(name: bytes = b"evil") -> bytes:
    return _hdr(wire.HELLO, xfer=99, length=len(name)) + name


def _data(
    region: int, offset: int, length: int, *, flags: int = LAST, shares: int = 1, notif: int = 0, xfer: int = 1
) -> bytes:
    """A DATA frame's header and its table of one run."""
    return bytes(wire.data_frame(xfer, [(region, offset, length)], length, flags, shares, notif))


def _runs(runs: list[tuple[int, int, int]], length: int | None = None, nruns: int | None = None) -> bytes:
    """A LAST DATA frame's header and run table that may lie: ``length`` and ``nruns`` override the true ones."""
    frame = wire.data_frame(1, runs, sum(n for _, _, n in runs) if length is None else length, LAST, 1)
    if nruns is not None:
        frame[: HEADER.size] = _hdr(wire.DATA, flags=LAST, shares=1, aux=nruns, xfer=1, length=length or 0)
    return bytes(frame)


# name -> (bytes the attacker sends, range of region 0 its valid prefix may legitimately write)
HOSTILE: dict[str, tuple[bytes, tuple[int, int]]] = {
    "garbage": (b"GET / HTTP/1.1\r\nHost: pdkv\r\n\r\n" + b"\xff" * 64, (0, 0)),
    "bad version": (_hdr(wire.HELLO, version=99, length=4) + b"evil", (0, 0)),
    # the previous version's DATA frame named one range in its header: this one must not read it as a run table
    "previous version": (
        _hello() + _hdr(wire.DATA, version=VERSION - 1, flags=LAST, shares=1, xfer=1, length=16) + b"x" * 16,
        (0, 0),
    ),
    "data before hello": (_data(0, 0, 16) + b"x" * 16, (0, 0)),
    "huge name": (_hdr(wire.HELLO, xfer=1, length=1 << 40), (0, 0)),
    "second hello": (_hello() + _hello(), (0, 0)),
    "unknown type": (_hello() + _hdr(200), (0, 0)),
    "unknown region": (_hello() + _data(7, 0, 16) + b"x" * 16, (0, 0)),
    "offset past end": (_hello() + _data(0, REGION - 8, 16) + b"x" * 16, (0, 0)),
    "offset overflows": (_hello() + _data(0, (1 << 64) - 8, 16) + b"x" * 16, (0, 0)),
    "huge length": (_hello() + _data(0, 0, 1 << 62), (0, 0)),
    "huge notification": (
        _hello() + _data(0, 0, 16, flags=LAST | NOTIF_FOLLOWS, notif=(1 << 32) - 1) + b"x" * 16,
        (0, 0),
    ),
    "unknown flag": (_hello() + _data(0, 0, 16, flags=0x80) + b"x" * 16, (0, 0)),
    "notification without last": (_hello() + _data(0, 0, 16, flags=NOTIF_FOLLOWS, notif=2) + b"x" * 18, (0, 0)),
    "zero shares": (_hello() + _data(0, 0, 16, shares=0) + b"x" * 16, (0, 0)),
    "too many shares": (_hello() + _data(0, 0, 16, shares=1000) + b"x" * 16, (0, 0)),
    "interleaved transfers": (
        _hello() + _data(0, 0, 16, flags=0, shares=0, xfer=1) + b"x" * 16 + _data(0, 100, 16, xfer=2) + b"y" * 16,
        (0, 16),
    ),
    "ack from initiator": (_hello() + _hdr(wire.ACK, aux=1, xfer=1), (0, 0)),
    "truncated header": (_hello() + _data(0, 0, 16)[:20], (0, 0)),
    "truncated payload": (_hello() + _data(0, 1000, 5000) + b"z" * 100, (1000, 1100)),
    # a DATA frame's runs are all checked before any of them lands: one bad run, and nothing of the frame lands
    "no runs": (_hello() + _runs([], 16) + b"x" * 16, (0, 0)),
    "more runs than allowed": (
        _hello() + _runs([(0, 16 * i, 16) for i in range(wire.MAX_RUNS + 1)]) + b"x" * 16 * (wire.MAX_RUNS + 1),
        (0, 0),
    ),
    "a run count that lies": (_hello() + _runs([(0, 0, 16)], 16, nruns=wire.MAX_RUNS) + b"x" * 16, (0, 0)),
    "a zero-length run": (_hello() + _runs([(0, 0, 16), (0, 100, 0)]) + b"x" * 16, (0, 0)),
    "overlapping runs": (_hello() + _runs([(0, 0, 16), (0, 200, 16), (0, 8, 16)]) + b"x" * 48, (0, 0)),
    "a run past the region": (_hello() + _runs([(0, 0, 16), (0, REGION - 8, 16)]) + b"x" * 32, (0, 0)),
    "a run in an unknown region": (_hello() + _runs([(0, 0, 16), (7, 0, 16)]) + b"x" * 32, (0, 0)),
    "runs that miss the length": (_hello() + _runs([(0, 0, 16), (0, 100, 16)], 48) + b"x" * 48, (0, 0)),
    "the offset field set": (_hello() + _hdr(wire.DATA, flags=LAST, shares=1, aux=1, offset=1, length=16), (0, 0)),
    "truncated run table": (_hello() + _runs([(0, 0, 16), (0, 100, 16)])[: HEADER.size + 30], (0, 0)),
    # bytes of a cut-off frame may land only inside its runs, and it never counts: no notification, no ACK
    "truncated body": (_hello() + _runs([(0, 0, 16), (0, 100, 5000)]) + b"z" * 100, (0, 5100)),
}


def _attack(port: int, payload: bytes) -> list[tuple[int, bytes]]:
    """Send ``payload`` and half-close; return the frames the channel answered with before hanging up."""
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT) as sock:
        data = b""
        try:  # the channel may hang up (even reset) before the attacker is done: that counts as hanging up
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):  # a timeout here means the channel never hung up: the test fails
                data += chunk
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise
    frames = []
    while len(data) >= HEADER.size:
        *_, length = HEADER.unpack_from(data)
        ftype = HEADER.unpack_from(data)[2]
        frames.append((ftype, data[HEADER.size : HEADER.size + length]))
        data = data[HEADER.size + length :]
    return frames


@dataclass
class Victim:
    channel: TcpChannel
    regions: list[bytearray]
    good: TcpChannel
    good_src: int


@pytest.fixture(scope="module")
def victim() -> Iterator[Victim]:
    channel = TcpChannel("victim", TcpOptions(io_timeout=5))
    regions = [bytearray(pattern(i, REGION)) for i in range(3)]  # 0: attacked, 1: bystander, 2: good peer's inbox
    for buf in regions:
        channel.register(buf)
    good = TcpChannel("good", TcpOptions(io_timeout=5))
    src = good.register(bytearray(pattern(9, REGION)))
    good.add_peer(channel.metadata())
    yield Victim(channel, regions, good, src)
    good.close()
    channel.close()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_frame_is_rejected_without_touching_other_memory(
    victim: Victim, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    payload, (lo, hi) = HOSTILE[case]
    pristine = [bytes(b) for b in victim.regions]
    caplog.set_level(logging.ERROR, logger="pdkv.channels.tcp")

    frames = _attack(victim.channel.port, payload)

    assert any(r.levelno == logging.ERROR and "rejecting" in r.getMessage() for r in caplog.records), (
        "no error was logged"
    )
    assert all(ftype in (wire.HELLO_OK, wire.ERROR) for ftype, _ in frames), frames
    attacked = victim.regions[0]
    assert attacked[:lo] == pristine[0][:lo] and attacked[hi:] == pristine[0][hi:], (
        "bytes landed outside the frame's range"
    )
    assert victim.regions[1] == pristine[1] and victim.regions[2] == pristine[2]
    attacked[:] = pristine[0]
    assert victim.channel.get_notifications() == []

    # and the channel still serves a well-behaved peer
    handle = victim.good.write("victim", [TransferOp(victim.good_src, 0, 2, 0, 4096)], notif=case.encode())
    victim.good.wait(handle, CALL_TIMEOUT)
    assert victim.regions[2][:4096] == pattern(9, REGION)[:4096]
    victim.regions[2][:] = pristine[2]
    deadline = time.monotonic() + CALL_TIMEOUT
    while not (notifs := victim.channel.get_notifications()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [(n.peer, n.payload) for n in notifs] == [("good", case.encode())]


# -- the shared secret on the data plane ------------------------------------------------------------------

KEY = "s3cret"


@dataclass
class Guarded:
    channel: TcpChannel
    regions: list[bytearray]


@pytest.fixture(scope="module")
def guarded() -> Iterator[Guarded]:
    """An agent whose data connections must prove ``KEY`` before anything of theirs lands."""
    channel = TcpChannel("guarded", TcpOptions(io_timeout=5, connect_timeout=5, secret=KEY))
    regions = [bytearray(pattern(50 + i, REGION)) for i in range(2)]
    for buf in regions:
        channel.register(buf)
    yield Guarded(channel, regions)
    channel.close()


def _secret_hello(nonce: bytes = b"n" * NONCE_BYTES, name: bytes = b"evil") -> bytes:
    return _hdr(wire.HELLO, flags=SECRET, xfer=99, length=NONCE_BYTES + len(name)) + nonce + name


def _proof_frame(given: bytes) -> bytes:
    return _hdr(wire.AUTH, length=len(given)) + given


# name -> bytes an attacker without the secret sends: well-formed frames, every one in bounds, no valid proof
UNPROVEN: dict[str, bytes] = {
    "hello without the secret flag": _hello() + _data(0, 0, 16) + b"x" * 16,
    "data where the proof is due": _secret_hello() + _data(0, 0, 16) + b"x" * 16,
    "a wrong proof": _secret_hello() + _proof_frame(b"p" * 32) + _data(0, 0, 16) + b"x" * 16,
    "a short proof": _secret_hello() + _proof_frame(b"p" * 8) + _data(0, 0, 16) + b"x" * 16,
    "a notification where the proof is due": _secret_hello() + _hdr(wire.NOTIF, length=2) + b"hi",
    "a hello too short for its nonce": _hdr(wire.HELLO, flags=SECRET, xfer=99, length=4) + b"evil",
}


@pytest.mark.parametrize("case", list(UNPROVEN))
def test_frames_without_the_proof_land_nothing_and_are_disconnected(
    guarded: Guarded, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    pristine = [bytes(b) for b in guarded.regions]
    before = guarded.channel.stats().get("auth_failures", 0)
    caplog.set_level(logging.ERROR, logger="pdkv.channels.tcp")

    frames = _attack(
        guarded.channel.port, UNPROVEN[case]
    )  # returns once the agent hung up (an ERROR may be lost to a reset)

    assert [bytes(b) for b in guarded.regions] == pristine, "an unauthenticated connection changed memory"
    assert guarded.channel.get_notifications() == []
    assert all(ftype in (wire.HELLO_OK, wire.ERROR) for ftype, _ in frames), frames
    expected = 0 if case == "a hello too short for its nonce" else 1  # malformed, not a failed proof
    assert guarded.channel.stats().get("auth_failures", 0) == before + expected
    assert any(r.levelno == logging.ERROR and "rejecting" in r.getMessage() for r in caplog.records), (
        "no error was logged"
    )


def test_a_replayed_proof_is_refused(guarded: Guarded) -> None:
    """A proof is bound to the agent's fresh nonce of that connection: one seen on the wire is worth nothing later."""
    pristine = bytes(guarded.regions[0])
    nonce = b"r" * NONCE_BYTES
    with socket.create_connection(("127.0.0.1", guarded.channel.port), timeout=CALL_TIMEOUT) as sock:
        sock.sendall(_secret_hello(nonce))
        *_, instance, _, length = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        ok = sock.recv(length, socket.MSG_WAITALL)
        said = handshake.HandshakeTranscript(
            session=99,
            stream=0,
            token=b"",
            initiator=b"evil",
            initiator_nonce=nonce,
            target=ok[NONCE_BYTES + PROOF_BYTES :],
            instance=instance,
            target_nonce=ok[:NONCE_BYTES],
        )
        # all of it
        assert said.verify(KEY.encode(), handshake.TARGET_ROLE, ok[NONCE_BYTES : NONCE_BYTES + PROOF_BYTES])
        seen = said.proof(KEY.encode(), handshake.INITIATOR_ROLE)  # what a legitimate peer sent on that connection
    before = guarded.channel.stats().get("auth_failures", 0)

    frames = _attack(
        guarded.channel.port, _secret_hello(nonce) + _proof_frame(seen)
    )  # nothing after it: the ERROR is not lost to a reset

    assert frames[-1][0] == wire.ERROR and b"failed to prove" in frames[-1][1], frames
    assert bytes(guarded.regions[0]) == pristine and guarded.channel.get_notifications() == []
    wait_until(
        lambda: guarded.channel.stats().get("auth_failures", 0) >= before + 1, CALL_TIMEOUT, "the replay to be counted"
    )


def test_peers_with_the_same_secret_transfer_both_ways(guarded: Guarded) -> None:
    peer = TcpChannel("friend", TcpOptions(io_timeout=5, secret=KEY))
    try:
        src = bytearray(pattern(60, REGION))
        region = peer.register(src)
        peer.add_peer(guarded.channel.metadata())
        before = guarded.channel.stats().get("auth_failures", 0)
        handle = peer.write("guarded", [TransferOp(region, 0, 1, 0, REGION)], notif=b"hi")
        peer.wait(handle, CALL_TIMEOUT)
        assert guarded.regions[1] == src
        read_back = bytearray(REGION)
        peer.wait(peer.read("guarded", [TransferOp(peer.register(read_back), 0, 0, 0, REGION)]), CALL_TIMEOUT)
        assert read_back == guarded.regions[0]
        deadline = time.monotonic() + CALL_TIMEOUT
        while not (notifs := guarded.channel.get_notifications()) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [(n.peer, n.payload) for n in notifs] == [("friend", b"hi")]
        assert guarded.channel.stats().get("auth_failures", 0) == before and not peer.stats()
    finally:
        peer.close()
        guarded.regions[1][:] = pattern(51, REGION)


@pytest.mark.parametrize(
    ("ours", "theirs", "error"),
    [
        ("other", KEY, "did not prove the shared secret"),
        ("", KEY, "requires the shared secret and the peer has none"),
        (KEY, "", "the peer holds a shared secret and this agent none"),
    ],
    ids=["wrong secret", "no secret", "target without one"],
)
def test_a_peer_without_the_right_secret_fails_with_a_clear_error_and_lands_nothing(
    ours: str, theirs: str, error: str
) -> None:
    target = TcpChannel("target", TcpOptions(io_timeout=5, secret=theirs))
    initiator = TcpChannel("stranger", TcpOptions(io_timeout=5, secret=ours))
    dst = bytearray(REGION)
    try:
        target.register(dst)
        region = initiator.register(bytearray(pattern(70, REGION)))
        initiator.add_peer(target.metadata())
        with pytest.raises(ChannelError, match=error):
            initiator.write("target", [TransferOp(region, 0, 0, 0, REGION)], notif=b"no")
        assert dst == bytearray(REGION) and target.get_notifications() == []
        wait_until(lambda: target.stats().get("auth_failures", 0) == 1, CALL_TIMEOUT, "the target to count the failure")
        assert initiator.stats().get("auth_failures", 0) == (
            1 if ours and theirs else 0
        )  # it checked the target's proof
    finally:
        initiator.close()
        target.close()


# where in the first bytes of a data connection (its HELLO) a relay on the path would change what it says
HELLO_FIELDS = {"session": 16, "stream": 8, "token": HEADER.size + NONCE_BYTES}


@pytest.mark.parametrize("field", list(HELLO_FIELDS))
def test_a_hello_rewritten_on_the_path_gets_no_connection(field: str) -> None:
    """Both data-plane proofs cover the whole handshake (session, stream, token, both names, instance, nonces): a relay
    that changes what the initiator said, and passes the rest on, gets a proof the initiator refuses, and nothing
    lands."""

    def flip(first: bytes) -> bytes:
        at = HELLO_FIELDS[field]
        return first[:at] + bytes([first[at] ^ 1]) + first[at + 1 :]

    target = TcpChannel("target", TcpOptions(io_timeout=5, secret=KEY))
    initiator = TcpChannel("friend", TcpOptions(io_timeout=5, secret=KEY))
    dst = bytearray(REGION)
    target.register(dst)
    meta = wire.decode_meta(target.metadata())
    relay = ByteRelay((meta.host, meta.port), rewrite=flip)
    try:
        region = initiator.register(bytearray(pattern(70, REGION)))
        initiator.add_peer(msgspec.msgpack.encode(msgspec.structs.replace(meta, port=relay.port)))
        with pytest.raises(ChannelError, match="did not prove the shared secret over this handshake"):
            initiator.write("target", [TransferOp(region, 0, 0, 0, REGION)], notif=b"no")
        assert relay.connections >= 1 and initiator.stats()["auth_failures"] >= 1
        assert dst == bytearray(REGION) and target.get_notifications() == []
    finally:
        relay.close()
        initiator.close()
        target.close()


def test_a_listener_that_trickles_its_answer_is_cut_at_the_handshake_deadline() -> None:
    """The initiator bounds the whole handshake answer by connect_timeout, as the listener bounds its HELLO: a
    listener that sends one byte of HELLO_OK every 0.2 s (each within io_timeout) holds the connect no longer."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            answer = _hdr(wire.HELLO_OK, length=4) + b"evil"
            for byte in answer:
                if stop.wait(0.2):
                    return
                conn.sendall(bytes([byte]))
            stop.wait(10)

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    target = TcpChannel("evil", TcpOptions(io_timeout=5))
    meta = msgspec.structs.replace(wire.decode_meta(target.metadata()), port=listener.getsockname()[1])
    target.close()
    initiator = TcpChannel("friend", TcpOptions(io_timeout=5, connect_timeout=1))
    try:
        region = initiator.register(bytearray(REGION))
        initiator.add_peer(msgspec.msgpack.encode(msgspec.structs.replace(meta, regions={0: REGION})))
        # only the deadline says this (its 44 bytes would trickle in whole after 9 s, a HELLO_OK of another instance)
        with pytest.raises(ChannelError, match="handshake answer .* not complete within 1s, however its bytes"):
            initiator.write("evil", [TransferOp(region, 0, 0, 0, REGION)], notif=b"no")
    finally:
        stop.set()
        initiator.close()
        listener.close()
        server.join(5)


def test_the_top_level_secret_guards_the_channel_and_is_no_channel_option() -> None:
    config = convert_config({"secret": KEY, "channel": {"name": "tcp", "options": {"streams": 2}}})
    options = TcpChannel.parse_options(config.channel_options())
    assert options.secret == KEY and options.streams == 2 and KEY not in repr(options)
    with pytest.raises(ConfigError, match="channel.options.secret") as exc:
        convert_config({"channel": {"name": "tcp", "options": {"secret": "hunter2"}}})
    assert "hunter2" not in str(exc.value)
    with pytest.raises(ConfigError, match="streams") as exc:
        TcpChannel.parse_options({"streams": 0, "secret": "hunter2"})
    assert "hunter2" not in str(exc.value)


# -- configuration, metadata, splitting ----------------------------------------------------------------


def test_default_streams_are_four_but_never_more_than_the_cores_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A share per core at most (benchmarks/history/, issue 28); a ``streams`` the user sets is kept as set."""
    assert tcp_options.usable_cores() == len(os.sched_getaffinity(0))
    for cores, want in ((1, 1), (2, 2), (3, 3), (16, 4)):
        monkeypatch.setattr(tcp_options, "usable_cores", lambda cores=cores: cores)
        assert TcpOptions().streams == want
        assert TcpOptions(streams=4).streams == 4
        assert TcpChannel.parse_options({}).streams == want


def test_a_transfer_to_this_host_is_cut_into_at_most_half_the_cores_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """On one host a share keeps two cores busy (benchmarks/history/2026-11-29-request-round-trip-issue-46.md): a
    loopback peer gets at most half the cores' shares, or ``one_host_shares`` where set; another host, ``streams``."""
    for cores, want in ((1, 1), (2, 1), (3, 1), (4, 2), (16, 4)):
        monkeypatch.setattr(tcp_options, "usable_cores", lambda cores=cores: cores)
        for host in ("127.0.0.1", "127.3.0.9", "::1", "localhost"):
            assert TcpOptions(streams=4).shares_to(host) == want
        assert TcpOptions(streams=4, one_host_shares=3).shares_to("127.0.0.1") == 3
        assert TcpOptions(streams=2, one_host_shares=3).shares_to("127.0.0.1") == 2
        assert TcpOptions(streams=4).shares_to("10.0.0.2") == 4


def test_to_this_host_a_large_write_goes_whole_and_the_next_one_on_the_next_stream() -> None:
    """With one share to a peer on this host, a write past ``inline_max_bytes`` goes whole on the thread's stream
    and moves it on, so a request's chunks spread over the streams as a split write's shares did; a small one
    leaves it where it is (an idle stream's reader would have to be woken on both sides)."""
    writer = TcpChannel("whole-w", TcpOptions(streams=2, one_host_shares=1, stream_min_bytes=1 << 20, io_timeout=10))
    target = TcpChannel("whole-t", TcpOptions(io_timeout=10))
    try:
        src = bytearray(pattern(5, 12 * MiB))
        dst = bytearray(12 * MiB)
        s, d = writer.register(src), target.register(dst)
        writer.add_peer(target.metadata())

        def moved(*writes: tuple[int, int]) -> list[int]:
            before = writer.stream_bytes("whole-t") or [0, 0]  # none before the first write opens the link
            for offset, length in writes:
                writer.wait(writer.write("whole-t", [TransferOp(s, offset, d, offset, length)]), CALL_TIMEOUT)
            return [a - b for a, b in zip(writer.stream_bytes("whole-t"), before, strict=True)]

        first = moved((0, 8 * MiB))
        assert sorted(first) == [0, 8 * MiB], first  # whole, on one stream (two shares of 4 MiB before)
        second = moved((8 * MiB, 2 * MiB))
        assert sorted(second) == [0, 2 * MiB] and second.index(2 * MiB) != first.index(8 * MiB), (first, second)
        small = moved((10 * MiB, 64 << 10), (11 * MiB, 64 << 10))
        assert sorted(small) == [0, 128 << 10], small  # both on the one stream
        assert dst[: 10 * MiB + (64 << 10)] == src[: 10 * MiB + (64 << 10)]
        assert dst[11 * MiB : 11 * MiB + (64 << 10)] == src[11 * MiB : 11 * MiB + (64 << 10)]
    finally:
        writer.close()
        target.close()


@pytest.mark.parametrize(
    "raw",
    [
        {"streams": 0},
        {"streams": 65},
        {"one_host_shares": -1},
        {"io_timeout": 0},
        {"port": 70000},
        {"advertise_port": -1},
        {"max_frame_bytes": 0},
        {"no_such_option": 1},
    ],
)
def test_bad_options_are_refused_with_the_field_named(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(raw))):
        TcpChannel.parse_options(raw)


def test_bad_metadata_and_unknown_peer_are_refused() -> None:
    with TcpChannel("lonely") as channel:
        region = channel.register(bytearray(4096))
        with pytest.raises(ChannelError, match="metadata"):
            channel.add_peer(b"\x93garbage")
        with pytest.raises(ChannelError, match="unknown peer"):
            channel.write("nobody", [TransferOp(region, 0, 0, 0, 16)])


@pytest.mark.parametrize(
    ("lengths", "parts", "max_frame"),
    [([10], 1, 100), ([10], 4, 3), ([100, 7, 1, 50], 3, 40), ([9], 4, 100), ([1 << 20], 4, 1 << 18)],
)
def test_split_covers_every_byte_once_in_order_within_frame_limits(
    lengths: list[int], parts: int, max_frame: int
) -> None:
    ops, at = [], 0
    for i, n in enumerate(lengths):
        ops.append(TransferOp(0, at, 1, 1000 * i + at, n))
        at += n
    shares = _split(ops, parts, max_frame)
    pieces = [p for share in shares for p in share]

    assert 1 <= len(shares) <= parts
    assert all(0 < p.length <= max_frame for p in pieces)
    flat = [(p.local_offset + k, p.remote_offset + k) for p in pieces for k in range(p.length)]
    assert flat == [(op.local_offset + k, op.remote_offset + k) for op in ops for k in range(op.length)]
    sizes = [sum(p.length for p in share) for share in shares]
    assert max(sizes) - min(sizes) <= max(sizes) // 2 + 1


def test_a_share_over_max_frame_bytes_goes_as_frames_within_it_each_run_whole() -> None:
    channel = TcpChannel("frames", TcpOptions(max_frame_bytes=10_000))
    try:
        region = channel.register(bytearray(pattern(3, 1 << 16)))
        ops = [TransferOp(region, 5000 * i, 1, 8000 * i, 4096) for i in range(7)]
        bufs = channel.initiator._write_batch(9, ops, 1, b"note").bufs

        frames, at = [], 0
        while at < len(bufs) - 1:  # each frame: its header and run table, then one view per run; the note last
            ftype, flags, _, nruns, nlen, xfer, offset, length = wire.unpack_header(bufs[at], "test")
            runs = list(wire.RUN.iter_unpack(bufs[at][HEADER.size :]))
            views = bufs[at + 1 : at + 1 + nruns]
            assert (ftype, xfer, offset, len(runs)) == (wire.DATA, 9, 0, nruns)
            assert length == sum(n for *_, n in runs) == sum(v.nbytes for v in views) <= 10_000
            frames.append((flags, nlen, runs, b"".join(views)))
            at += 1 + nruns
        assert bufs[-1] == b"note"
        assert [(f[0], f[1]) for f in frames] == [(0, 0), (0, 0), (0, 0), (LAST | NOTIF_FOLLOWS, 4)]
        assert [r for f in frames for r in f[2]] == [(1, op.remote_offset, op.length) for op in ops]
        assert b"".join(f[3] for f in frames) == b"".join(
            pattern(3, 1 << 16)[op.local_offset : op.local_offset + op.length] for op in ops
        )
    finally:
        channel.close()


def test_an_answerer_answers_each_write_on_its_data_connection(frame_loop: str) -> None:
    """``answer_notifications``: the target's answer to a write's notification comes back with its completion
    (``TransferHandle.answer``) and the notification never reaches the inbox; a write without one is a plain ACK;
    an answerer that fails fails only its write (NACK), and so does an answer too big for the wire."""
    target = TcpChannel("answering", TcpOptions(max_notif_bytes=64))
    initiator = TcpChannel("asking", TcpOptions(streams=2))
    landed = bytearray(MiB)
    failures = {b"boom": RuntimeError("no room for it"), b"big": None}

    def answer(notifs: list[Notification]) -> list[bytes]:
        (n,) = notifs  # tcp answers each transfer as it lands
        if n.payload == b"boom":
            raise failures[n.payload]  # type: ignore[misc]
        return [b"x" * 65 if n.payload == b"big" else f"{n.peer} wrote {n.payload.decode()}".encode()]

    try:
        assert target.answer_notifications(answer)
        region = target.register(landed)
        source = initiator.register(bytearray(pattern(5, MiB)))
        initiator.add_peer(target.metadata())
        ops = [TransferOp(source, 0, region, 0, 600 << 10), TransferOp(source, 700 << 10, region, 700 << 10, 4096)]
        handle = initiator.write("answering", ops, b"chunk 1")
        initiator.wait(handle, CALL_TIMEOUT)
        assert handle.answer == b"asking wrote chunk 1"
        assert landed[: 600 << 10] == pattern(5, MiB)[: 600 << 10]  # the bytes landed before the answer came
        silent = initiator.write("answering", ops)
        initiator.wait(silent, CALL_TIMEOUT)
        assert silent.answer == b""
        for payload, reason in ((b"boom", "could not take its notification: no room for it"), (b"big", "exceeds")):
            failed = initiator.write("answering", ops, payload)
            with pytest.raises(ChannelError, match=reason):
                initiator.wait(failed, CALL_TIMEOUT)
        again = initiator.write("answering", ops, b"chunk 2")  # the link went on
        initiator.wait(again, CALL_TIMEOUT)
        assert again.answer == b"asking wrote chunk 2" and target.get_notifications() == []
    finally:
        initiator.close()
        target.close()


def test_a_channel_that_cannot_carry_answers_keeps_notifications_in_its_inbox() -> None:
    channel = create_channel("mock", "inbox-only")
    try:
        assert not channel.answer_notifications(lambda notifs: [b"never"] * len(notifs))
        assert channel.inbox.answerer is None
    finally:
        channel.close()


# -- the initiator's threads: one send pool and one link watcher for all its peers ---------------------------------


def _initiator_threads(channel: TcpChannel) -> dict[str, int]:
    """The live threads of ``channel``'s initiator: its workers (``io``) and its link watcher (``links``)."""
    kinds = {f"tcp-{channel.agent_name}-io": "io", f"tcp-{channel.agent_name}-links": "links"}
    counts: dict[str, int] = {}
    for t in threading.enumerate():
        if t.name in kinds:
            counts[kinds[t.name]] = counts.get(kinds[t.name], 0) + 1
    return counts


def test_an_initiators_threads_do_not_grow_with_its_peers() -> None:
    """Writes split over two streams to one peer, then to six at once: the writer holds two workers and one link
    watcher either way (a thread per stream and a watcher per link held 18 for six), every byte lands, and closing
    the channel ends them. (``send_wait_s`` at ``io_timeout``: no worker is added however slow this machine is.)"""
    writer = TcpChannel(
        "fan", TcpOptions(streams=2, stream_min_bytes=64 << 10, one_host_shares=2, io_timeout=10, send_wait_s=10)
    )
    targets = [TcpChannel(f"fan-target-{i}", TcpOptions(streams=2, io_timeout=10)) for i in range(6)]
    try:
        assert _initiator_threads(writer) == {}  # nothing started before the first link
        src = bytearray(pattern(3, 2 * MiB))
        s = writer.register(src)
        dsts = [bytearray(2 * MiB) for _ in targets]
        regions = [t.register(d) for t, d in zip(targets, dsts, strict=True)]
        for t in targets:
            writer.add_peer(t.metadata())
        seen = []
        for n in (1, len(targets)):
            handles = [
                writer.write(t.agent_name, [TransferOp(s, 0, r, 0, 2 * MiB)])
                for t, r in zip(targets[:n], regions[:n], strict=True)
            ]
            for h in handles:
                writer.wait(h, CALL_TIMEOUT)
                assert writer.poll(h) is XferState.DONE
            split = [writer.stream_bytes(t.agent_name) for t in targets[:n]]
            assert all(len(b) == 2 and min(b) > 0 for b in split), split  # both streams carried a share
            seen.append(_initiator_threads(writer))
        assert all(d == src for d in dsts)
        assert seen == [{"io": 2, "links": 1}, {"io": 2, "links": 1}]
    finally:
        writer.close()
        for t in targets:
            t.close()
    assert _initiator_threads(writer) == {}


def test_a_peer_that_stops_reading_does_not_hold_back_another_peers_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker (one stream), blocked sending 64 MiB to a frozen peer (SIGSTOP: its sockets fill up and stay
    open): a write to another peer still goes, on a worker the watcher adds after ``send_wait_s``; the frozen peer's
    write completes once it thaws, and the added worker ends once it has had nothing to do for ``SPARE_IDLE_S``."""
    monkeypatch.setattr(tcp_workers, "SPARE_IDLE_S", 0.5)
    stuck = Peer("stuck", {"streams": 1, "io_timeout": 60}, [64 * MiB])
    other = TcpChannel("unstuck", TcpOptions(streams=1, io_timeout=60))
    writer = TcpChannel("writer", TcpOptions(streams=1, io_timeout=60, send_wait_s=0.05, inline_max_bytes=0))
    try:
        src = bytearray(pattern(5, 64 * MiB))
        s = writer.register(src)
        dst = bytearray(8 * MiB)
        r = other.register(dst)
        writer.add_peer(stuck.meta)
        writer.add_peer(other.metadata())
        (sr,) = stuck.regions
        writer.wait(writer.write("stuck", [TransferOp(s, 0, sr, 0, 4096)]), CALL_TIMEOUT)  # linked and proven
        os.kill(stuck.proc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            big = writer.write("stuck", [TransferOp(s, 0, sr, 0, 64 * MiB)])  # more than its sockets hold
            small = writer.write("unstuck", [TransferOp(s, 0, r, 0, 8 * MiB)])
            writer.wait(small, CALL_TIMEOUT)
            assert writer.poll(small) is XferState.DONE and dst == src[: 8 * MiB]
            assert writer.poll(big) is XferState.PENDING
            assert _initiator_threads(writer)["io"] == 2
        finally:
            os.kill(stuck.proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
        writer.wait(big, CALL_TIMEOUT)
        assert writer.poll(big) is XferState.DONE
        assert stuck.call("crc", sr, 0, 64 * MiB) == zlib.crc32(src)
        wait_until(lambda: _initiator_threads(writer).get("io") == 1, CALL_TIMEOUT, "the added worker ended once idle")
    finally:
        writer.close()
        other.close()
        stuck.stop()


class _StallingRelay(ByteRelay):
    """Forwards tcp connections to ``target`` byte for byte until ``stall`` is set; from then on an answer coming
    back is cut after its first byte, and the rest waits until ``release`` (a peer trickling an answer)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.stall, self.release = threading.Event(), threading.Event()
        super().__init__(target, timeout=CALL_TIMEOUT, back=self._trickle)

    def _trickle(self, data: bytes, dst: socket.socket) -> bytes:
        if not self.stall.is_set():
            return data
        dst.sendall(data[:1])
        self.release.wait(CALL_TIMEOUT)
        return data[1:]

    def close(self) -> None:
        self.release.set()
        super().close()


def test_a_peer_trickling_an_answer_does_not_hold_back_another_peers_answers() -> None:
    """A peer whose ACK stops after one byte holds the worker reading it until ``io_timeout``; another peer's ACK,
    which nobody waits for but a done callback, is read at once by another worker: the watcher reads no frame
    itself."""
    io_timeout = 20.0
    writer = TcpChannel("reader-w", TcpOptions(streams=1, io_timeout=io_timeout, send_wait_s=0.05))
    slow = TcpChannel("reader-slow", TcpOptions(streams=1, io_timeout=io_timeout))
    fast = TcpChannel("reader-fast", TcpOptions(streams=1, io_timeout=io_timeout))
    s = writer.register(bytearray(pattern(7, 4096)))
    rs, rf = slow.register(bytearray(4096)), fast.register(bytearray(4096))
    meta = wire.decode_meta(slow.metadata())
    relay = _StallingRelay((meta.host, meta.port))
    try:
        writer.add_peer(msgspec.msgpack.encode(msgspec.structs.replace(meta, port=relay.port)))
        writer.add_peer(fast.metadata())
        for peer, region in (("reader-slow", rs), ("reader-fast", rf)):  # linked and proven
            writer.wait(writer.write(peer, [TransferOp(s, 0, region, 0, 4096)]), CALL_TIMEOUT)
        relay.stall.set()
        stuck = writer.write("reader-slow", [TransferOp(s, 0, rs, 0, 4096)])  # its ACK: one byte, then nothing
        time.sleep(0.3)  # the one worker is inside its ACK by now
        assert stuck.state is XferState.PENDING
        done = threading.Event()
        quick = writer.write("reader-fast", [TransferOp(s, 0, rf, 0, 4096)])
        quick.add_done_callback(lambda h: done.set())  # nobody waits: a worker reads its ACK
        assert done.wait(io_timeout / 2), "the fast peer's ACK waited for the trickling one"
        assert quick.state is XferState.DONE and stuck.state is XferState.PENDING
        assert _initiator_threads(writer)["io"] == 2
        relay.release.set()
        writer.wait(stuck, CALL_TIMEOUT)
        assert writer.poll(stuck) is XferState.DONE
    finally:
        relay.close()
        writer.close()
        slow.close()
        fast.close()


def test_the_watcher_waits_while_another_thread_reads_a_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ACK waiting while another thread holds the link's reader (a ``poll`` reading a big READ_DATA frame, say):
    the watcher's worker finds it busy and the stream is armed again ``FOLLOW_S`` later, not at once (which spun a
    core at 200,000 tries a second); once the reader lets go, the ACK is read."""
    tries = []
    drain = LinkReader.drain

    def counting(self: LinkReader) -> bool:
        tries.append(time.monotonic())
        return drain(self)

    monkeypatch.setattr(LinkReader, "drain", counting)
    writer = TcpChannel("spin-w", TcpOptions(streams=1, io_timeout=10))
    target = TcpChannel("spin-t", TcpOptions(streams=1, io_timeout=10))
    try:
        s, r = writer.register(bytearray(4096)), target.register(bytearray(4096))
        writer.add_peer(target.metadata())
        first = writer.write("spin-t", [TransferOp(s, 0, r, 0, 4096)])
        writer.wait(first, CALL_TIMEOUT)
        reader = first.link.reader
        with reader.rx_lock:  # another thread reading the link
            handle = writer.write("spin-t", [TransferOp(s, 0, r, 0, 4096)])
            time.sleep(0.5)
            assert handle.state is XferState.PENDING
            held = len(tries)
        assert 1 <= held <= 0.5 / FOLLOW_S + 20, held  # one try every FOLLOW_S at most
        wait_until(lambda: handle.state is XferState.DONE, 2.0, "the ACK read once the reader let go")
    finally:
        writer.close()
        target.close()


def test_a_bug_in_a_pass_of_the_watcher_does_not_stop_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of the link watcher that raises (a bug of ours) is logged and the watcher goes on: the ACK of a write
    nobody waits for, which only the watcher hands to a worker, is still read and its done callback fires."""
    tick = LinkWatcher._tick
    raised: list[float] = []

    def failing_once(self: LinkWatcher, now: float) -> None:
        if not raised:
            raised.append(now)
            raise RuntimeError("a bug in the watcher's pass")
        tick(self, now)

    monkeypatch.setattr(LinkWatcher, "_tick", failing_once)
    writer = TcpChannel("bug-w", TcpOptions(streams=1, io_timeout=10))
    target = TcpChannel("bug-t", TcpOptions(streams=1, io_timeout=10))
    try:
        s, r = writer.register(bytearray(pattern(9, 4096))), target.register(bytearray(4096))
        writer.add_peer(target.metadata())
        writer.wait(writer.write("bug-t", [TransferOp(s, 0, r, 0, 4096)]), CALL_TIMEOUT)
        wait_until(lambda: bool(raised), CALL_TIMEOUT, "the watcher's first pass")
        done = threading.Event()
        handle = writer.write("bug-t", [TransferOp(s, 0, r, 0, 4096)])
        handle.add_done_callback(lambda h: done.set())  # nobody waits: only the watcher's worker reads its ACK
        assert done.wait(CALL_TIMEOUT), "the watcher stopped after a failed pass"
        assert handle.state is XferState.DONE
    finally:
        writer.close()
        target.close()


def test_a_peer_reached_before_and_lost_is_tried_again_soon_not_after_unreachable_retry_s() -> None:
    """A decode worker whose route flapped (here: the relay in front of it closed, then listening again at the same
    address): the link fails, the next connect is refused and marks it unreachable, but it was reached before, so it
    is tried again after ``FIRST_RETRY_S`` (backing off from there), not after ``unreachable_retry_s``, during which
    every request to it would be recomputed."""
    writer = TcpChannel("flap-w", TcpOptions(streams=1, io_timeout=10, unreachable_retry_s=30))
    target = TcpChannel("flap-t", TcpOptions(streams=1, io_timeout=10))
    meta = msgspec.msgpack.decode(target.metadata())
    front = ByteRelay((meta["host"], meta["port"]))
    port = front.port

    def refused() -> bool:
        try:
            writer.connect("flap-t", CALL_TIMEOUT)
        except PeerUnreachableError:
            return True
        return False

    try:
        writer.register(bytearray(64))
        target.register(bytearray(64))
        writer.add_peer(msgspec.msgpack.encode({**meta, "port": port}))
        writer.connect("flap-t", CALL_TIMEOUT)
        front.close()
        wait_until(refused, CALL_TIMEOUT, "the connect refused once the relay closed")
        with pytest.raises(PeerUnreachableError, match="tried again in"):
            writer.connect("flap-t", CALL_TIMEOUT)  # at once: the verdict holds
        front = ByteRelay((meta["host"], meta["port"]), port=port)
        # within a few seconds, not the 30 s verdict of a peer never reached
        wait_until(lambda: not refused(), 10 * FIRST_RETRY_S, "the peer tried again")
        assert writer.stats()["peer_unreachable"] <= 3
    finally:
        front.close()
        writer.close()
        target.close()


class _HeldLock:
    """A link reader's ``rx_lock`` that a stuck reader holds: says when someone waits to take it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.waited = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and timeout != 0:
            self.waited.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()


def test_a_failed_link_that_a_reader_still_holds_does_not_stop_the_other_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a failed link's sockets waits for its reader to let go (a reused fd number must never be read). That
    wait runs on a worker, not on the link watcher: meanwhile the ACK of a write to another peer, which nobody waits
    for, is still read and its done callback fires; once the reader lets go, the failed link's socket is closed."""
    monkeypatch.setattr(watching, "SHUTDOWN_JOIN_S", 2 * CALL_TIMEOUT)  # the release waits longer than we do below
    writer = TcpChannel("held-w", TcpOptions(streams=1, io_timeout=10))
    stuck = TcpChannel("held-a", TcpOptions(streams=1, io_timeout=10))
    other = TcpChannel("held-b", TcpOptions(streams=1, io_timeout=10))
    held = _HeldLock()
    try:
        s = writer.register(bytearray(pattern(10, 4096)))
        for target in (stuck, other):
            r = target.register(bytearray(4096))
            writer.add_peer(target.metadata())
            writer.wait(writer.write(target.agent_name, [TransferOp(s, 0, r, 0, 4096)]), CALL_TIMEOUT)
        link = writer.initiator.link("held-a", b"")
        link.reader.rx_lock = held  # type: ignore[assignment]  # a reader that does not stop
        link.fail("the test fails it")
        assert held.waited.wait(CALL_TIMEOUT), "nobody went to close the failed link's sockets"
        done = threading.Event()
        handle = writer.write("held-b", [TransferOp(s, 0, 0, 0, 4096)])
        handle.add_done_callback(lambda h: done.set())  # nobody waits: only the watcher hands its ACK to a worker
        assert done.wait(CALL_TIMEOUT), "the link watcher waited for the failed link's reader"
        assert handle.state is XferState.DONE
        assert link.streams[0].conn.sock.fileno() != -1  # not closed while its reader holds it
        held.release()
        wait_until(lambda: link.streams[0].conn.sock.fileno() == -1, CALL_TIMEOUT, "the failed link's socket closed")
    finally:
        with contextlib.suppress(RuntimeError):
            held.release()
        writer.close()
        stuck.close()
        other.close()
