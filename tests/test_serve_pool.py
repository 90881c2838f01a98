"""The tcp target serves every connection on a few threads (channels/tcp/parking.py): a connection idle between frames
holds none, a peer that trickles a frame cannot hold the others back, and fence and close reach parked connections.

Real sockets and real tcp channels in this process; the trickling peer is a raw socket, since a well-behaved channel
cannot stall inside a frame. Waits are bounded, so a connection that never gets a thread fails a test instead of
hanging it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import socket
import threading
from collections.abc import Iterator

import pytest

from pdkv import native
from pdkv.channels import TransferOp
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.wire import HEADER, LAST, MAGIC, VERSION
from pdkv.errors import ChannelError, ConfigError

from tests.conftest import wait_until

REGION = 256 << 10
WAIT_S = 10.0


def _threads(name: str, kind: str) -> list[threading.Thread]:
    """The live threads of ``name``'s tcp target of one kind: serve, greet (a handshake), watch."""
    return [t for t in threading.enumerate() if t.name == f"tcp-{name}-{kind}"]


def _peer(name: str, d: TcpChannel, streams: int) -> TcpChannel:
    """A prefill worker's side, with one region of REGION bytes (its region 0), that knows ``d``."""
    p = TcpChannel(name, TcpOptions(streams=streams))
    _SOURCES[name] = bytearray(REGION)
    p.register(_SOURCES[name])
    p.add_peer(d.metadata())
    return p


_SOURCES: dict[str, bytearray] = {}


def _write(src: TcpChannel, seed: int, offset: int, length: int) -> bytes:
    """Write ``length`` random bytes from ``src``'s region to d's region at ``offset``, waited for; the bytes."""
    data = random.Random(seed).randbytes(length)
    _SOURCES[src.agent.name][:length] = data
    src.wait(src.write("d", [TransferOp(0, 0, 0, offset, length)]), WAIT_S)
    return data


@pytest.fixture
def target(frame_loop: str) -> Iterator[tuple[TcpChannel, bytearray]]:
    """A decode worker's side: one region, two serve threads, a wait of io_timeout (10 s) before a third is added."""
    channel = TcpChannel("d", TcpOptions(serve_threads=2, serve_wait_s=10.0))
    buf = bytearray(REGION * 16)
    channel.register(buf)
    yield channel, buf
    channel.close()


def test_sixteen_peers_are_served_by_the_serve_threads_not_a_thread_each(target: tuple[TcpChannel, bytearray]) -> None:
    d, buf = target
    peers = [_peer(f"p{i}", d, 2) for i in range(16)]
    try:
        sent: list[bytes] = []
        errors: list[BaseException] = []

        def push(i: int, round_: int) -> None:
            try:
                sent[i] = _write(peers[i], 100 * round_ + i, i * REGION, REGION)
            except BaseException as exc:  # noqa: BLE001 - failed below, on the test's thread
                errors.append(exc)

        for round_ in range(3):
            sent[:] = [b""] * len(peers)
            pushers = [threading.Thread(target=push, args=(i, round_)) for i in range(len(peers))]
            for t in pushers:
                t.start()
            for t in pushers:
                t.join(WAIT_S * 2)
            assert not any(t.is_alive() for t in pushers), "a push hung"
            assert not errors, errors
            assert all(sent), "a push wrote nothing"
            for i, data in enumerate(sent):
                assert bytes(buf[i * REGION : (i + 1) * REGION]) == data, f"peer {i}'s bytes in round {round_}"
        # every connection is idle now: the handshakes' threads are gone, and the serve threads are the two
        wait_until(lambda: not _threads("d", "greet"), WAIT_S, "the handshake threads to end")
        assert len(_threads("d", "serve")) == 2
        assert len(_threads("d", "watch")) == 1
        assert d.stats().get("serve_threads_added", 0) == 0
    finally:
        for p in peers:
            p.close()


def test_a_thread_keeps_its_connection_while_there_are_no_more_connections_than_threads(
    target: tuple[TcpChannel, bytearray], frame_loop: str
) -> None:
    """With no more connections than serve threads, a thread that served a connection waits for its next frame in the
    native loop (woken by its bytes, no epoll round, as a thread per connection was); once a third connects it
    lets go, and every idle connection is parked; once that one left, the first is kept again. The Python loop
    (TLS, PDKV_NATIVE_FRAMES=0) cannot wait that way: its idle connections are always parked."""
    d, buf = target
    parked = 0 if frame_loop == "native" else 1  # what stays parked of the first peer's connection
    pool = d.target.pool
    first = _peer("p0", d, 1)
    more: list[TcpChannel] = []
    try:
        for seed in range(3):  # the handshake's thread serves the first turn and parks it; a serve thread keeps it
            data = _write(first, seed, 0, 4096)
            assert bytes(buf[:4096]) == data
        wait_until(lambda: len(pool.parked()) == parked and not pool.crowded, WAIT_S, "the connection to be kept")
        more = [_peer(f"p{i}", d, 1) for i in (1, 2)]
        for i, p in enumerate(more):
            _write(p, 10 + i, REGION * (i + 1), 4096)
        wait_until(lambda: pool.crowded and len(pool.parked()) == 3, WAIT_S, "all three connections to be parked")
        for p in more:
            p.close()
        wait_until(lambda: not pool.crowded, WAIT_S, "the two connections to end")
        data = _write(first, 20, 0, 4096)
        assert bytes(buf[:4096]) == data
        wait_until(lambda: len(pool.parked()) == parked, WAIT_S, "the connection to be kept again")
    finally:
        for p in more:
            p.close()
        first.close()


def _hdr(ftype: int, *, flags: int = 0, shares: int = 0, aux: int = 0, xfer: int = 0, length: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, ftype, flags, shares, aux, 0, xfer, 0, length)


def _raw_peer(port: int) -> socket.socket:
    """A peer without a secret past its handshake (the target has none either): HELLO sent, HELLO_OK read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    name = b"slow"
    sock.sendall(_hdr(wire.HELLO, xfer=7, length=len(name)) + name)
    head = sock.recv(HEADER.size, socket.MSG_WAITALL)
    assert len(head) == HEADER.size, f"the target hung up after {len(head)} bytes of HELLO_OK"
    fields = HEADER.unpack(head)
    assert fields[2] == wire.HELLO_OK, fields
    body = sock.recv(fields[-1], socket.MSG_WAITALL) if fields[-1] else b""
    assert len(body) == fields[-1], "the target hung up inside HELLO_OK"
    return sock


@contextlib.contextmanager
def _good_and_slow(serve_wait_s: float) -> Iterator[tuple[TcpChannel, bytearray, TcpChannel, socket.socket]]:
    """A target with one serve thread, a well-behaved peer that wrote once, and a raw peer whose connection is
    proven: both parked, for a test to make the raw one misbehave."""
    d = TcpChannel("d", TcpOptions(serve_threads=1, serve_wait_s=serve_wait_s, io_timeout=60))
    buf = bytearray(REGION * 2)
    d.register(buf)
    good = _peer("good", d, 1)
    slow: socket.socket | None = None
    try:
        _write(good, 1, REGION, 4096)  # the good peer's connection exists, and is parked after this
        slow = _raw_peer(d.port)
        wait_until(lambda: len(d.target.pool.parked()) == 2, WAIT_S, "both connections to be parked")
        yield d, buf, good, slow
    finally:
        if slow is not None:
            slow.close()
        good.close()
        d.close()


def test_a_peer_trickling_a_frame_does_not_hold_back_another_peers_write(frame_loop: str) -> None:
    """One serve thread, held inside a frame by a peer that sent part of it and stopped: the other peer's write
    completes all the same, on a serve thread added for it, long before the stalled frame's io_timeout."""
    with _good_and_slow(serve_wait_s=0.05) as (d, buf, good, slow):
        pool = d.target.pool
        frame = wire.data_frame(1, [(0, 0, 5000)], 5000, LAST, 1)
        slow.sendall(bytes(frame) + b"z" * 100)  # a serve thread takes it, and waits inside the frame
        wait_until(lambda: len(pool.parked()) == 1, WAIT_S, "the serve thread to take the stalled frame")
        data = _write(good, 2, REGION, 8192)  # within WAIT_S, long before the stalled frame's io_timeout
        assert bytes(buf[REGION : REGION + 8192]) == data
        assert d.stats()["serve_threads_added"] >= 1
        assert len(_threads("d", "serve")) >= 2


def test_a_peer_silent_inside_a_share_holds_no_thread(frame_loop: str) -> None:
    """A peer sends a whole frame of a share (not its last) and then nothing: its connection is parked between the
    two frames like any idle one, so the one serve thread goes on serving the other peer, and none is added."""
    with _good_and_slow(serve_wait_s=30) as (d, buf, good, slow):
        slow.sendall(bytes(wire.data_frame(1, [(0, 0, 100)], 100, 0, 0)) + b"z" * 100)  # not LAST: the share goes on
        wait_until(lambda: bytes(buf[:100]) == b"z" * 100, WAIT_S, "the first frame of the share to land")
        for seed in (2, 3):
            data = _write(good, seed, REGION, 8192)  # within WAIT_S, where serve_wait_s is 30
            assert bytes(buf[REGION : REGION + 8192]) == data
        wait_until(lambda: len(d.target.pool.parked()) == 2, WAIT_S, "both connections to be parked again")


@pytest.mark.parametrize("held", ["parked", "kept"])
def test_fence_cuts_the_connection_and_returns_once_it_is_closed(
    target: tuple[TcpChannel, bytearray], frame_loop: str, held: str
) -> None:
    """With two more peers than serve threads every idle connection is parked; alone, with the native loop, a serve
    thread keeps its connection, waiting in the native loop for the next frame. Either way the fence's hang-up
    reaches it, the fence returns once it is closed, and the peer lands anew afterwards."""
    d, _ = target
    pool = d.target.pool
    others = [_peer(f"o{i}", d, 1) for i in range(2 if held == "parked" else 0)]
    p = _peer("p", d, 1)
    try:
        for i, peer in enumerate(others):
            _write(peer, i, 0, 4096)
        for seed in range(3):  # from the second on, a serve thread serves it (the first may be the handshake's)
            _write(p, 10 + seed, 0, 4096)
        parked = len(others) + 1 if held == "parked" or frame_loop == "python" else 0
        wait_until(lambda: not _threads("d", "greet") and len(pool.parked()) == parked, WAIT_S, "the connection idle")
        session = next(s for s in d.target._sessions.values() if s.peer == "p")
        (conn,) = session.conns
        d.fence("p", b"")  # the token its writes presented: the default
        assert conn.sock.fileno() == -1, f"fence returned before the {held} connection was closed"
        assert all(s.peer != "p" for s in d.target._sessions.values())
        # the peer hears why (its link may learn it only from its next write), and then lands on a new connection
        try:
            _write(p, 4, 0, 4096)
        except ChannelError as exc:
            assert "fenced by 'd'" in str(exc)
            _write(p, 5, 0, 4096)
        assert any(s.peer == "p" for s in d.target._sessions.values())
    finally:
        for peer in [*others, p]:
            peer.close()


def test_close_finishes_parked_connections_and_ends_every_thread(frame_loop: str) -> None:
    d = TcpChannel("d", TcpOptions(serve_threads=2))
    d.register(bytearray(REGION))
    peers = [_peer(f"p{i}", d, 2) for i in range(4)]
    try:
        for i, p in enumerate(peers):
            _write(p, i, 0, 4096)
        wait_until(lambda: not _threads("d", "greet"), WAIT_S, "the connections to be parked")
        conns = list(d.target._accepted)
        assert len(conns) == 8
    finally:
        d.close()
        for p in peers:
            p.close()
    assert all(c.sock.fileno() == -1 for c in conns)
    for kind in ("serve", "watch", "greet", "accept"):
        assert not _threads("d", kind), kind


@pytest.mark.parametrize(
    "raw", [{"serve_threads": 0}, {"serve_threads": -1}, {"serve_wait_s": 0}, {"serve_wait_s": 11, "io_timeout": 10}]
)
def test_bad_serve_options_are_refused_with_the_field_named(raw: dict[str, float]) -> None:
    field = next(iter(raw))
    with pytest.raises(ConfigError, match=f"tcp channel option {field}="):
        TcpOptions(**raw)  # type: ignore[arg-type]


@pytest.mark.skipif(not native.available(), reason="the native kernels did not load")
def test_the_native_loop_waits_between_frames_until_bytes_or_the_crowd_fd() -> None:
    """``FrameLoop.serve`` with a wake fd: bytes first, whatever the fd says (a header waiting is read), and with
    nothing to read it returns FRAME_IDLE as soon as the fd is readable, instead of waiting for the next frame."""
    ours, theirs = socket.socketpair()
    crowd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    generation = ctypes.c_int64(0)
    loop = tcp_native.FrameLoop(1024, 4)
    mirror = tcp_native.GrantMirror()

    def serve() -> int:
        regions = (0, 0, ctypes.addressof(generation), 0)
        return loop.serve(
            ours.fileno(), mirror, b"token", regions, (1 << 16, 4, 1 << 20, 1024, 1 << 16), 4, False, crowd
        )

    done: list[int] = []
    waiter = threading.Thread(target=lambda: done.append(serve()))
    try:
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), f"the loop returned {done} with nothing to read and the fd not readable"
        os.eventfd_write(crowd, 1)
        waiter.join(WAIT_S)
        assert done == [tcp_native.FRAME_IDLE]
        theirs.sendall(_hdr(wire.NOTIF, length=3) + b"abc")  # a frame the native loop hands back after its header
        assert serve() == tcp_native.FRAME_HEADER
        assert HEADER.unpack(loop.header.raw)[2] == wire.NOTIF
    finally:
        theirs.close()  # EOF ends a wait the test left running, before its fd closes
        waiter.join(WAIT_S)
        os.close(crowd)
        ours.close()
