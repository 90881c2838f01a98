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

import asyncio
import contextlib
import json
import logging
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdkv.channels import TransferOp
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire
from pdkv.errors import ChannelError
from pdkv.http.web import accept_failures
from pdkv.ratelog import REFUSAL_LOG_LINES
from pdkv.testing.http import get_text as get
from pdkv.testing.http import metric
from pdkv.testing.http import post_json as post
from pdkv.testing.procs import start_configured, start_worker

from tests.conftest import wait_until

KEY = "flood-secret"
MiB = 1 << 20
CALL_TIMEOUT = 20.0
ZMTP_FIRST_BYTE = b"\xff"  # a ZeroMQ greeting's first byte, then nothing
HALF_HELLO = wire.pack(wire.HELLO, xfer=7, length=40, flags=wire.SECRET)[:8]  # 8 bytes of a HELLO, then nothing


@pytest.fixture(autouse=True, scope="module")
def enough_fds() -> Iterator[None]:
    """This process opens thousands of sockets: its soft fd limit raised to the hard one for the module, as the
    workers raise theirs, and put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _read(sock: socket.socket) -> bool:
    """Read away what the target sent (a greeting, an ERROR); False once it closed the connection."""
    try:
        return bool(sock.recv(1 << 16))
    except BlockingIOError:
        return True
    except OSError:
        return False


class Flood:
    """``count`` connections from ``source`` to ``port``, each sending ``opening`` once up, then (with
    ``trickle_s``) one more byte every ``trickle_s``: a thread keeps them until ``stop``, reading away what the target
    sends; what it closes is counted (``cut``), never dialled again."""

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
                if events & (select.POLLERR | select.POLLHUP) or (
                    connected and events & select.POLLIN and not _read(sock)
                ):
                    self._poll.unregister(fd)  # closed by the target: this one is done
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
def flooded(port: int, *floods: tuple[str, int, bytes, float], settle_s: float = 3.0) -> Iterator[list[Flood]]:
    """The floods (source, count, opening, trickle_s) against ``port``, once every connection of them is up or
    ``settle_s`` passed (a port that accepts no more leaves the rest dialling)."""
    running = [Flood(port, *flood) for flood in floods]
    try:
        total = sum(flood[1] for flood in floods)
        deadline = time.monotonic() + settle_s
        while sum(f.up + f.cut for f in running) < total and time.monotonic() < deadline:
            time.sleep(0.02)
        yield running
    finally:
        for f in running:
            f.stop()


def test_a_prefill_connects_and_moves_its_kv_through_a_flood_of_unauthenticated_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1,500 idle connections, 300 half HELLOs and 100 HELLOs trickling a byte every 0.5 s hold the data port; a
    prefill that needs a new data connection (its first) still connects and its KV lands, byte for byte; the
    flood's refusals are logged a bounded number of times."""
    caplog.set_level(logging.WARNING, logger="pdkv.channels.tcp")
    decode = TcpChannel("decode", TcpOptions(secret=KEY, connect_timeout=3.0, io_timeout=10.0))
    prefill = TcpChannel("prefill", TcpOptions(secret=KEY, connect_timeout=5.0, io_timeout=10.0, streams=2))
    try:
        src, dst = bytearray(range(256)) * (8 * MiB // 256), bytearray(8 * MiB)
        src_region, dst_region = prefill.register(src), decode.register(dst)
        with flooded(
            decode.port,
            ("127.0.0.2", 1500, b"", 0.0),
            ("127.0.0.3", 300, HALF_HELLO, 0.0),
            ("127.0.0.4", 100, HALF_HELLO, 0.5),
        ):
            prefill.add_peer(decode.metadata())
            handle = prefill.write("decode", [TransferOp(src_region, 0, dst_region, 0, len(src))], notif=b"landed")
            prefill.wait(handle, CALL_TIMEOUT)
            wait_until(lambda: bool(decode.get_notifications()), CALL_TIMEOUT, "the notification")
        assert dst == src
        stats = decode.stats()
        assert stats["handshakes_dropped"] > 0  # the flood was there, and made room
        assert stats.get("connections_refused", 0) == 0
        assert len(caplog.records) <= 3 * REFUSAL_LOG_LINES  # drops, timeouts, truncated HELLOs: each kind bounded
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


def test_a_decode_worker_under_a_control_port_flood_answers_health_and_takes_a_new_prefill(
    model_dir: Path, tmp_path: Path
) -> None:
    """1,500 connections that send a greeting's first byte and wait, on the control port of a decode worker
    started with the common soft fd limit of 1024: it still answers ``/health``, and a prefill that has never
    handshaken it does so and moves its KV. (Idle connections that sent nothing the kernel may leave half open
    under a burst; a byte makes each one real.)"""
    base = {
        "model": str(model_dir),
        "channel": {"name": "tcp"},
        "num_blocks": 128,
        "transfer": {"chunk_size": 32, "transfer_timeout_s": 30, "handshake_timeout_s": 5},
    }
    decode = start_configured(
        "decode",
        {**base, "transfer": {**base["transfer"], "handshake_timeout_s": 2.0}},
        tmp_path / "decode.yaml",
        timeout=120,
        wrap=("sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh"),
    )
    prefill = start_configured("prefill", base, tmp_path / "prefill.yaml", timeout=120)
    router = start_worker("router", "--port", "0", "--prefill", prefill.url, "--decode", decode.url, timeout=60)
    try:
        control_port = int(decode.info["receiver"].rsplit(":", 1)[1])
        with flooded(control_port, ("127.0.0.2", 1500, ZMTP_FIRST_BYTE, 0.0)):
            until = time.monotonic() + 3.0  # the flood takes a second or two to be accepted: answers all along
            while time.monotonic() < until:
                assert json.loads(get(decode.url + "/health", timeout=2.0))
                time.sleep(0.1)
            prompt = [(i * 37) % 300 + 3 for i in range(100)]
            answer = post(
                router.url + "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                timeout=60.0,
            )
            assert len(answer["choices"][0]["text"]) > 0
            d_metrics = get(decode.url + "/metrics", timeout=5.0)
        assert metric(d_metrics, "pdkv_prompt_tokens_total", source="transferred") == len(prompt)
        assert metric(d_metrics, "pdkv_fallbacks_total") == 0
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


def test_a_worker_out_of_file_descriptors_counts_its_failed_accepts_and_says_them_at_a_bounded_rate(
    model_dir: Path, tmp_path: Path
) -> None:
    """A decode worker whose hard fd limit is 1024 (nothing to raise) runs out under 1,500 connections on its
    control port: its failed accepts, HTTP and ZeroMQ alike, are counted and logged a bounded number of times, not a
    traceback each; once the flood is dropped (``handshake_timeout_s``) it answers again."""
    log_path = tmp_path / "decode.log"
    decode = start_configured(
        "decode",
        {
            "model": str(model_dir),
            "channel": {"name": "tcp"},
            "num_blocks": 64,
            "transfer": {"chunk_size": 32, "handshake_timeout_s": 5.0},
        },
        tmp_path / "decode.yaml",
        timeout=120,
        wrap=("sh", "-c", f'ulimit -n 1024 && exec "$@" 2>{log_path}', "sh"),
    )
    try:
        control_port = int(decode.info["receiver"].rsplit(":", 1)[1])
        with flooded(control_port, ("127.0.0.2", 1500, ZMTP_FIRST_BYTE, 0.0), settle_s=0.0):
            # until an HTTP connection finds no descriptor to be accepted with
            wait_until(lambda: not _answers(decode.url + "/health"), 10.0, "the worker to run out of descriptors")
        wait_until(lambda: _answers(decode.url + "/health"), 20.0, "the worker to answer again")
        d_metrics = get(decode.url + "/metrics", timeout=5.0)
        assert metric(d_metrics, "pdkv_transfer_events_total", event="http_accept_failures") > 0
        assert metric(d_metrics, "pdkv_transfer_events_total", event="control_accept_failures") > 0
    finally:
        decode.stop()
    said = log_path.read_text()
    assert "Traceback" not in said
    assert 0 < said.count("cannot accept") <= 2 * REFUSAL_LOG_LINES  # two kinds, each bounded


def _answers(url: str) -> bool:
    try:
        get(url, timeout=1.0)
    except OSError:
        return False
    return True


def test_authenticated_connections_past_max_connections_are_refused_with_the_reason() -> None:
    """``max_connections`` counts authenticated connections alone, and a peer past it hears why."""
    decode = TcpChannel("decode", TcpOptions(secret=KEY, max_connections=1))
    # its write split over both streams (one_host_shares: on loopback a 2-core machine would send it on one)
    prefill = TcpChannel("prefill", TcpOptions(secret=KEY, streams=2, stream_min_bytes=4096, one_host_shares=2))
    try:
        src, dst = bytearray(64 << 10), bytearray(64 << 10)
        src_region, dst_region = prefill.register(src), decode.register(dst)
        prefill.add_peer(decode.metadata())
        with pytest.raises(ChannelError, match="max_connections=1"):
            handle = prefill.write("decode", [TransferOp(src_region, 0, dst_region, 0, len(src))])
            prefill.wait(handle, CALL_TIMEOUT)
        assert decode.stats()["connections_refused"] == 1
    finally:
        prefill.close()
        decode.close()


def test_accept_retries_that_fire_after_the_server_closed_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """After a failed accept asyncio schedules ``_start_serving`` a second later, once per accept of the burst; a
    worker that stops within that second made each retry log a traceback (``ValueError`` on the closed socket),
    which the test above met on a slow machine. Here the retries are scheduled as asyncio's ``_accept_connection``
    does, and the server closed before they fire; any other error a callback raises is still logged."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        accept_failures.install(loop)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        server = await loop.create_server(asyncio.Protocol, sock=sock)
        for _ in range(3):
            loop.call_later(0.05, loop._start_serving, asyncio.Protocol, sock, None, server, 128)  # type: ignore[attr-defined]
        server.close()
        await server.wait_closed()
        assert sock.fileno() == -1
        loop.call_later(0.05, _raise_value_error)
        await asyncio.sleep(0.3)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "_raise_value_error" in errors[0].getMessage(), [r.getMessage() for r in errors]


def _raise_value_error() -> None:
    raise ValueError("a callback's own error: still logged")
