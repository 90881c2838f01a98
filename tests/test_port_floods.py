"""Floods of connections that never authenticate, against a real data port and a real worker's control port.

An attacker on the workers' network holds no secret but can open thousands
of connections: idle, sending the first bytes of a HELLO and stopping, or a
byte every so often. None of them may keep a prefill that needs a new data
connection from connecting and moving its KV, nor keep a decode worker from
handshaking a new prefill and answering ``/health``; a trickle is cut at the
handshake's deadline however its bytes come. Attackers dial from other
loopback addresses (127.0.0.2, 127.0.0.3) than the peers (127.0.0.1), as
another host would.
"""

from __future__ import annotations

import contextlib
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pdkv.channels import TransferOp
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire

from tests.conftest import wait_until

KEY = "flood-secret"
MiB = 1 << 20
CALL_TIMEOUT = 20.0
HALF_HELLO = wire.pack(wire.HELLO, xfer=7, length=40, flags=wire.SECRET)[:8]  # 8 bytes of a HELLO, then nothing


@pytest.fixture(autouse=True, scope="module")
def enough_fds() -> None:
    """This process opens thousands of sockets: its soft fd limit raised to the hard one, as the workers do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Flood:
    """``count`` connections from ``source`` to ``port``, each sending ``opening`` once up, then (with
    ``trickle_s``) one more byte every ``trickle_s``: a thread keeps them until ``stop``; what the target closes
    is counted (``cut``), never dialled again."""

    def __init__(self, port: int, source: str, count: int, opening: bytes = b"", trickle_s: float = 0.0) -> None:
        self._opening = opening
        self._trickle_s = trickle_s
        self._poll = select.poll()
        self._socks: dict[int, tuple[socket.socket, bool]] = {}  # fd -> (socket, connected)
        self.up = self.cut = 0
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.bind((source, 0))
            sock.connect_ex(("127.0.0.1", port))
            self._socks[sock.fileno()] = (sock, False)
            self._poll.register(sock, select.POLLOUT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_byte = time.monotonic() + self._trickle_s
        while not self._stop.is_set():
            for fd, events in self._poll.poll(50):
                sock, connected = self._socks[fd]
                if events & (select.POLLERR | select.POLLHUP) or (connected and events & select.POLLIN):
                    self._poll.unregister(fd)  # closed by the target (or told why first): this one is done
                    self.cut += 1
                elif not connected and events & select.POLLOUT:
                    with contextlib.suppress(OSError):
                        sock.send(self._opening)
                    self._socks[fd] = (sock, True)
                    self._poll.modify(fd, select.POLLIN)
                    self.up += 1
            if self._trickle_s and time.monotonic() >= next_byte:
                next_byte += self._trickle_s
                for sock, connected in self._socks.values():
                    if connected:
                        with contextlib.suppress(OSError):
                            sock.send(b"\0")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock, _ in self._socks.values():
            sock.close()


@contextlib.contextmanager
def flooded(port: int, *floods: tuple[str, int, bytes]) -> Iterator[list[Flood]]:
    """The floods (source, count, opening) against ``port``, once every connection of them is up or 3 s passed
    (a port that accepts no more leaves the rest dialling)."""
    running = [Flood(port, source, count, opening) for source, count, opening in floods]
    try:
        total = sum(count for _, count, _ in floods)
        deadline = time.monotonic() + 3.0
        while sum(f.up + f.cut for f in running) < total and time.monotonic() < deadline:
            time.sleep(0.02)
        yield running
    finally:
        for f in running:
            f.stop()


def test_a_prefill_connects_and_moves_its_kv_through_a_flood_of_unauthenticated_connections() -> None:
    """1,500 idle connections and 300 half HELLOs hold the data port; a prefill that needs a new data connection
    (its first) still connects and its KV lands, byte for byte."""
    decode = TcpChannel("decode", TcpOptions(secret=KEY, connect_timeout=3.0, io_timeout=10.0))
    prefill = TcpChannel("prefill", TcpOptions(secret=KEY, connect_timeout=5.0, io_timeout=10.0, streams=2))
    try:
        src, dst = bytearray(range(256)) * (8 * MiB // 256), bytearray(8 * MiB)
        src_region, dst_region = prefill.register(src), decode.register(dst)
        with flooded(decode.port, ("127.0.0.2", 1500, b""), ("127.0.0.3", 300, HALF_HELLO)):
            prefill.add_peer(decode.metadata())
            handle = prefill.write("decode", [TransferOp(src_region, 0, dst_region, 0, len(src))], notif=b"landed")
            prefill.wait(handle, CALL_TIMEOUT)
            wait_until(lambda: bool(decode.get_notifications()), CALL_TIMEOUT, "the notification")
        assert dst == src
        stats = decode.stats()
        assert stats["handshakes_dropped"] > 0  # the flood was there, and made room
        assert stats.get("connections_refused", 0) == 0
    finally:
        prefill.close()
        decode.close()


def test_a_connection_that_trickles_its_handshake_is_cut_at_the_deadline() -> None:
    """One byte every 0.2 s (well inside ``io_timeout``) keeps no data connection past ``connect_timeout``."""
    decode = TcpChannel("decode", TcpOptions(secret=KEY, connect_timeout=1.0, io_timeout=10.0))
    try:
        with socket.create_connection(("127.0.0.1", decode.port), timeout=CALL_TIMEOUT) as sock:
            start = time.monotonic()
            sock.settimeout(0.2)
            closed = None
            for byte in (HALF_HELLO + bytes(100))[: int(3.0 / 0.2)]:  # 3 s of trickle at most
                try:
                    sock.send(bytes([byte]))
                    if sock.recv(1 << 16) == b"":
                        closed = time.monotonic() - start
                        break
                except TimeoutError:
                    continue
                except OSError:  # reset: cut too
                    closed = time.monotonic() - start
                    break
        assert closed is not None, "the trickling connection was still open after 3 s (connect_timeout=1 s)"
        assert closed < 2.0
        wait_until(lambda: decode.stats().get("handshake_timeouts", 0) == 1, 5.0, "the timeout to be counted")
    finally:
        decode.close()
