"""``pdkv bench channel``: a channel's throughput as a ratio to a raw baseline measured in the same run.

Absolute GB/s on a shared VM say little; a ratio to the best plain program
doing the same job on the same machine at the same time says how much the
channel costs. The load of a shared machine changes from one second to the
next, so each size alternates baseline and channel ``ROUNDS`` times and
reports the median of each side's per-round medians: a burst of load hits
both sides instead of one.

The job, for a channel and its baseline alike: a sender process puts ``size``
bytes into a preallocated buffer of a receiver process and waits until the
receiver has them (channel: the WRITE handle is DONE, which every channel only
reports once the bytes landed; raw sockets: a 1-byte ack after ``recv_into``
filled the buffer). GB/s = size / median time / 1e9. The channel side only
speaks the ``Channel`` interface (create by name, metadata through a pipe,
WRITE with a notification that the receiver waits for), so nixl and ucx run
unchanged. Channels listed in ``IN_PROCESS`` cannot span processes (mock):
their receiver runs on a thread.

The tcp channel's baseline is plain sockets, measured for each size with one
stream and with as many as the channel uses (``TcpOptions.streams_for``),
each share in one ``sendall`` and in 32 KiB ones (loopback takes those
faster): one thread per stream sends its share, and the receiver's threads
``recv_into(..., MSG_WAITALL)`` theirs, as the channel's own receive path
does. ``ratio`` is against the fastest (``baseline_used``).

Each row has the CPU seconds per GB each side's process spent
(``cpu_s_per_gb``, ``baseline_cpu_s_per_gb``, ``cpu_ratio``; see
``pdkv.bench.cpu``): the number a shared machine does not blur. ``--streams
1,2,4`` (tcp) adds a channel per count whose every transfer is split over
exactly that many streams, in the same rounds (each row's ``streams``).

The many-small-transfers case posts ``SMALL_COUNT`` writes of ``SMALL_SIZE``
bytes without waiting in between, then waits for all, and reports transfers/s
(``SMALL_REPEATS`` per round whatever ``--repeats`` says: each is 4096 transfers).
Every wait in here has a timeout (``TIMEOUT_S``), so a broken channel fails the
bench instead of hanging it.

``--tls`` (tcp only) adds a third side to every round: the tcp channel with
mutual TLS (``channel.options.tls``, certificates of a throwaway CA made for
the run), so each row shows what encryption costs beside the clear channel,
measured in the same rounds: ``tls_gbps`` and ``tls_ratio`` (TLS / clear).

``--link RATE`` (``unshaped``, ``100mbit``, ``1gbit``, ``10gbit``...) runs the
receiver on a second host of ``pdkv.bench.netrig``, across a veth pair shaped
to RATE, the sender on the first: channel, baseline and ``iperf3`` (where
installed) over the same link in the same run, each row with its ratio to
iperf3 too. Repeats then shrink so each side of a round moves about
``LINK_ROUND_S`` seconds of the link's rate, over ``LINK_ROUNDS`` rounds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import queue
import socket
import statistics
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from pdkv.bench import plot
from pdkv.bench.cpu import SIDES, CpuMeter, charge, ratios
from pdkv.bench.netrig import LOOPBACK, Placement, bench_link, call_on, iperf3_gbps, run_in_netns
from pdkv.channels import TransferOp, create_channel
from pdkv.channels.tcp import TcpOptions
from pdkv.channels.tcp.wire import MAX_STREAMS
from pdkv.errors import ChannelError, ConfigError, TransferTimeout
from pdkv.testing.tls import CertificateAuthority

# channel name -> "module:Class" of its raw baseline: ``Class(nbytes, placement)``, a context manager kept open
# for the whole run (a receiver process costs seconds to start) with ``gbps(size, repeats)`` and, where it
# has a baseline for the small-transfers case, ``transfers_per_s(count, size, repeats)``.
BASELINES: dict[str, str] = {
    "tcp": "pdkv.bench.channel:RawSockets",
    "mock": "pdkv.bench.channel:Memcpy",
    "nixl": "pdkv.bench.nixl_raw:RawNixl",
    "ucx": "pdkv.bench.ucx_raw:RawUcx",
}
IN_PROCESS = {"mock"}  # channels whose peers must share a process

SMALL_COUNT = 4096
SMALL_SIZE = 16 << 10
SMALL_REPEATS = 2
ROUNDS = 5
WARMUP = 2
TIMEOUT_S = 60.0
LINK_ROUNDS = 3
LINK_ROUND_S = 1.5
IPERF3_S = 2.0
# the receiver checks notifications this often: coarse, so it does not compete with the transfer for CPU
_POLL_S = 0.005


def repeats_for(size: int, requested: int, rate_bps: float | None = None) -> int:
    """Repeats per round: ``requested`` if set; else enough for a stable median, moving at most ~128 MiB
    (on a shaped link, at most ``LINK_ROUND_S`` of its rate, and never fewer than 2)."""
    if requested > 0:
        return requested
    repeats = max(8, min(100, (128 << 20) // size))
    if rate_bps is not None:
        repeats = min(repeats, max(2, int(rate_bps / 8 * LINK_ROUND_S / size)))
    return repeats


def _load(spec: str) -> Callable[..., Any]:
    module_name, func_name = spec.split(":")
    try:
        return getattr(importlib.import_module(module_name), func_name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"bench baseline {spec!r} is not available: {exc}") from None


def _describe(func: Callable[..., Any], spec: str) -> str:
    doc = (func.__doc__ or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else spec


def _recv(conn: Connection, what: str) -> Any:
    """Next message from the other side, or TransferTimeout instead of a hang; an ("error", msg) reply raises."""
    if not conn.poll(TIMEOUT_S):
        raise TransferTimeout(f"bench: no {what} from the other process within {TIMEOUT_S:.0f}s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise ChannelError(f"bench: the other process failed while {what}: {msg[1]}")
    return msg


class Peer(NamedTuple):
    """Our end of the pipe to a bench peer, and its process id (None: a thread of this process)."""

    conn: Connection
    pid: int | None


@contextmanager
def _peer(
    target: Callable[..., None], args: tuple[Any, ...], in_process: bool, netns: str | None = None
) -> Iterator[Peer]:
    """Run ``target(conn, *args)`` in a spawned process (or a thread), yield our end of its pipe, always reap it.

    The process runs on the rig host whose namespace is ``netns`` (None: this one).
    """
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    runner: threading.Thread | multiprocessing.process.BaseProcess
    if in_process:
        runner = threading.Thread(target=target, args=(theirs, *args), name="bench-receiver", daemon=True)
    else:
        runner = ctx.Process(
            target=run_in_netns, args=(netns, target, theirs, *args), name="bench-receiver", daemon=True
        )
    runner.start()
    try:
        yield Peer(ours, None if isinstance(runner, threading.Thread) else runner.pid)
    finally:
        try:
            ours.send(("close",))
        except OSError:
            pass
        runner.join(TIMEOUT_S / 4)
        if isinstance(runner, multiprocessing.process.BaseProcess) and runner.is_alive():
            runner.kill()
            runner.join(TIMEOUT_S / 4)
        ours.close()


# -- the channel side (generic over Channel) ---------------------------------------------------


def _channel_receiver(conn: Connection, name: str, nbytes: int, options: dict[str, Any]) -> None:
    """Receiver role: register a buffer, publish metadata, count notifications per round, report a CRC."""
    try:
        channel = create_channel(name, "bench-receiver", options)
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"creating channel {name!r}: {exc}"))
        return
    try:
        dst = bytearray(nbytes)
        region = channel.register(dst)
        conn.send((channel.metadata(), region))
        channel.add_peer(_recv(conn, "sender metadata"))
        expected = got = 0
        while (msg := _recv(conn, "a command"))[0] != "close":
            if msg[0] == "round":
                expected, got = msg[1], 0
                while not conn.poll(_POLL_S):  # until the sender, done, asks to verify
                    got += len(channel.get_notifications())
            elif msg[0] == "verify":
                status = _await_notifications(channel, expected, got)
                conn.send(("crc", zlib.crc32(memoryview(dst)[: msg[1]])) if status is None else ("error", status))
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        channel.close()


def _await_notifications(channel: Any, expected: int, got: int) -> str | None:
    """Wait until ``expected`` notifications arrived in all (``got`` so far); an error message instead of a hang."""
    deadline = time.monotonic() + TIMEOUT_S
    while got < expected:
        n = len(channel.get_notifications())
        got += n
        if not n:
            if time.monotonic() > deadline:
                return f"only {got} of {expected} notifications arrived within {TIMEOUT_S:.0f}s"
            time.sleep(_POLL_S)
    got += len(channel.get_notifications())
    return None if got == expected else f"{got} notifications arrived for {expected} transfers"


class _ChannelSender:
    """Sender role, in this process, against a receiver in another.

    ``pids`` and ``bytes_moved`` (every transfer, warm-ups too) let a ``CpuMeter`` charge each side's CPU to
    the bytes, as for the raw baselines.
    """

    def __init__(self, name: str, peer: Peer, nbytes: int, options: dict[str, Any]) -> None:
        self.conn = peer.conn
        self.pids = {"sender": os.getpid(), "receiver": peer.pid}
        self.bytes_moved = 0
        self.channel = create_channel(name, "bench-sender", options)
        try:
            self.src = bytearray(os.urandom(nbytes))
            self.region = self.channel.register(self.src)
            meta, self.remote_region = _recv(self.conn, "receiver metadata")
            self.peer = self.channel.add_peer(meta)
            self.conn.send(self.channel.metadata())
        except BaseException:
            self.channel.close()
            raise

    def _verify(self, nbytes: int) -> None:
        self.conn.send(("verify", nbytes))
        _, crc = _recv(self.conn, "verifying the bytes")
        if crc != zlib.crc32(memoryview(self.src)[:nbytes]):
            raise ChannelError(f"bench: {self.channel.name} delivered wrong bytes ({nbytes} bytes checked)")

    def gbps(self, size: int, repeats: int) -> float:
        ops = [TransferOp(self.region, 0, self.remote_region, 0, size)]
        self.conn.send(("round", WARMUP + repeats))
        times = []
        for i in range(WARMUP + repeats):
            t0 = time.perf_counter()
            handle = self.channel.write(self.peer, ops, notif=b"%d" % i)
            self.channel.wait(handle, TIMEOUT_S)
            times.append(time.perf_counter() - t0)
            self.channel.release(handle)
        self.bytes_moved += (WARMUP + repeats) * size
        self._verify(size)
        return size / statistics.median(times[WARMUP:]) / 1e9

    def transfers_per_s(self, count: int, size: int, repeats: int) -> float:
        ops = [TransferOp(self.region, i * size, self.remote_region, i * size, size) for i in range(count)]
        rates = []
        for _ in range(1 + repeats):
            self.conn.send(("round", 1))
            t0 = time.perf_counter()
            handles = [
                self.channel.write(self.peer, [op], notif=b"last" if i == count - 1 else None)
                for i, op in enumerate(ops)
            ]
            for handle in handles:
                self.channel.wait(handle, TIMEOUT_S)
                self.channel.release(handle)
            rates.append(count / (time.perf_counter() - t0))
            self._verify(count * size)
        return statistics.median(rates[1:])

    def close(self) -> None:
        self.channel.close()


# -- raw baselines -----------------------------------------------------------------------------------

_ROUND = struct.Struct("<QQQQ")  # message size, messages per ack, acks, streams


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``: ``MSG_WAITALL``, as the tcp channel receives, so one call usually does it all
    (the kernel returns early only on a signal or a closed peer)."""
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if not r:
            raise ChannelError("raw socket baseline: the sender closed the connection mid-message")
        got += r


def _shares(size: int, streams: int) -> list[tuple[int, int]]:
    """(offset, length) of each stream's share of a ``size``-byte message: near-equal, the last the smallest."""
    share = -(-size // streams)
    return [(offset, min(share, size - offset)) for offset in range(0, size, share)]


class _Crew:
    """One thread per extra stream, kept for the whole run: each message's shares move in parallel.

    ``run`` does the first job on the calling thread and hands the others
    out, then waits for them all; with one job nothing is handed out.
    """

    def __init__(self, streams: int) -> None:
        self._inboxes: list[queue.SimpleQueue[Callable[[], Any] | None]] = [
            queue.SimpleQueue() for _ in range(streams - 1)
        ]
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, args=(box,), name="raw-stream", daemon=True) for box in self._inboxes
        ]
        for t in self._threads:
            t.start()

    def _loop(self, inbox: queue.SimpleQueue[Callable[[], Any] | None]) -> None:
        while (job := inbox.get()) is not None:
            try:
                job()
                self._done.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to ``run``, which raises it
                self._done.put(exc)

    def run(self, jobs: list[Callable[[], Any]]) -> None:
        for box, job in zip(self._inboxes, jobs[1:], strict=False):
            box.put(job)
        errors: list[BaseException] = []
        try:
            jobs[0]()
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others are accounted for
            errors.append(exc)
        for _ in jobs[1:]:
            try:
                outcome = self._done.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise TransferTimeout(
                    f"raw socket baseline: a stream did not finish its share within {TIMEOUT_S:.0f}s"
                ) from None
            if outcome is not None:
                errors.append(outcome)
        if errors:
            raise errors[0]

    def close(self) -> None:
        for box in self._inboxes:
            box.put(None)
        for t in self._threads:
            t.join(TIMEOUT_S / 4)


def _raw_socket_receiver(conn: Connection, host: str, port: int, nbytes: int, streams: int) -> None:
    """Raw receiver: ``streams`` connections, each ``recv_into(..., MSG_WAITALL)`` its share of a preallocated
    buffer, one byte back per round."""
    socks: list[socket.socket] = []
    crew = _Crew(streams)
    try:
        for index in range(streams):
            sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
            socks.append(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(bytes([index]))
        buf = memoryview(bytearray(nbytes))
        head = bytearray(_ROUND.size)
        while True:
            try:
                _recv_exact(socks[0], memoryview(head))
            except ChannelError:
                return  # the sender is done
            size, per_ack, acks, used = _ROUND.unpack(head)
            if size * per_ack > nbytes or not 1 <= used <= streams:
                raise ChannelError(
                    f"raw socket baseline: {per_ack} x {size} bytes over {used} streams do not fit {nbytes} bytes, "
                    f"{streams} streams"
                )
            shares = _shares(size, used)
            for _ in range(acks):
                for j in range(per_ack):
                    base = j * size
                    crew.run(
                        [
                            partial(_recv_exact, socks[i], buf[base + off : base + off + n])
                            for i, (off, n) in enumerate(shares)
                        ]
                    )
                socks[0].sendall(b"\x01")
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        crew.close()
        for sock in socks:
            sock.close()


def _accept_streams(server: socket.socket, streams: int, conn: Connection) -> list[socket.socket]:
    """The receiver's connections, in the order of the index each sends first."""
    socks: list[socket.socket | None] = [None] * streams
    try:
        for _ in range(streams):
            try:
                sock, _ = server.accept()
            except TimeoutError:
                _recv(conn, "connecting")  # raises the receiver's error if it sent one
                raise TransferTimeout(
                    f"raw socket baseline: receiver did not connect within {TIMEOUT_S:.0f}s"
                ) from None
            sock.settimeout(TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            index = bytearray(1)
            _recv_exact(sock, memoryview(index))
            if index[0] >= streams or socks[index[0]] is not None:
                sock.close()
                raise ChannelError(f"raw socket baseline: a stream announced index {index[0]} of {streams}")
            socks[index[0]] = sock
    except BaseException:
        for s in socks:
            if s is not None:
                s.close()
        raise
    return [s for s in socks if s is not None]


RAW_SEND_PIECE = 32 << 10
"""The piece a raw sender's other variant hands the kernel per ``sendall``: on loopback, 32-48 KiB sends move a
request's bytes in about half the time of one send of all of them (benchmarks/send_window.py), so the best plain
program sends that way there."""


def _send_in_pieces(sock: socket.socket, view: memoryview, piece: int) -> None:
    for at in range(0, len(view), piece):
        sock.sendall(view[at : at + piece])


class RawSockets:
    """Raw sockets, 1 stream and the tcp channel's count: sendall a share each (whole, or in ``RAW_SEND_PIECE``
    pieces), recv_into MSG_WAITALL, 1-byte ack.

    Two processes: sendall a share per stream, recv_into(..., MSG_WAITALL)
    a preallocated buffer, one byte back.

    One receiver process and ``TcpOptions().streams`` connections for the
    whole run. Each message is cut into one share per stream used, sent in
    parallel (a thread per stream), then one byte comes back once every
    share landed. ``variants`` says how a size is measured: over one stream, and the
    channel's count (``TcpOptions.streams_for``) where that is more, each
    share sent whole and in pieces; a bench compares the channel with the
    fastest, so splitting a size the channel should not split, or sending it
    in a way the kernel takes slower, shows as a loss.
    """

    def __init__(self, nbytes: int, placement: Placement = LOOPBACK) -> None:
        self.streams = TcpOptions().streams
        self.rate_bps = placement.rate_bps
        self.bytes_moved = 0
        self.src = memoryview(bytearray(os.urandom(nbytes)))
        self._stack = ExitStack()
        try:
            server = self._stack.enter_context(socket.create_server((placement.sender_addr, 0), backlog=self.streams))
            server.settimeout(TIMEOUT_S)
            args = (placement.sender_addr, server.getsockname()[1], nbytes, self.streams)
            peer = self._stack.enter_context(
                _peer(_raw_socket_receiver, args, in_process=False, netns=placement.receiver_netns)
            )
            self.pids = {"sender": os.getpid(), "receiver": peer.pid}
            self.socks = _accept_streams(server, self.streams, peer.conn)
            for sock in self.socks:
                self._stack.callback(sock.close)
            self.crew = _Crew(self.streams)
            self._stack.callback(self.crew.close)
        except BaseException:
            self._stack.close()
            raise

    def _round(self, size: int, per_ack: int, acks: int, used: int, piece: int = 0) -> list[float]:
        """Seconds per ack, warm-up excluded; ``piece``: each share sent in sends of that many bytes (0: one)."""
        self.socks[0].sendall(_ROUND.pack(size, per_ack, acks, used))
        shares = _shares(size, used)
        times = []
        ack = bytearray(1)
        for _ in range(acks):
            t0 = time.perf_counter()
            for j in range(per_ack):
                base = j * size
                self.crew.run(
                    [
                        partial(_send_in_pieces, self.socks[i], self.src[base + off : base + off + n], piece or n)
                        for i, (off, n) in enumerate(shares)
                    ]
                )
            if self.socks[0].recv_into(ack) != 1:
                raise ChannelError("raw socket baseline: the receiver hung up")
            times.append(time.perf_counter() - t0)
        self.bytes_moved += acks * per_ack * size
        return times[WARMUP:]

    def variants(self, size: int) -> dict[str, dict[str, int]]:
        """``gbps`` keyword arguments per variant measured for ``size``: one stream, and the channel's count; each
        share in one send, and in ``RAW_SEND_PIECE`` sends."""
        counts = sorted({1, TcpOptions().streams_for(size)})
        out: dict[str, dict[str, int]] = {}
        for n in counts:
            label = f"{n} stream{'s' if n > 1 else ''}"
            out[label] = {"streams": n}
            out[f"{label}, {RAW_SEND_PIECE >> 10} KiB sends"] = {"streams": n, "piece": RAW_SEND_PIECE}
        return out

    def gbps(self, size: int, repeats: int, streams: int | None = None, piece: int = 0) -> float:
        """GB/s of a ``size``-byte message over ``streams`` (default: as many as the channel uses for it), each
        share sent in sends of ``piece`` bytes (0: one send)."""
        used = TcpOptions().streams_for(size) if streams is None else streams
        if not 1 <= used <= self.streams:
            raise ConfigError(f"raw socket baseline: {used} streams asked, 1..{self.streams} open")
        times = self._round(size, 1, WARMUP + repeats_for(size, repeats, self.rate_bps), used, piece)
        return size / statistics.median(times) / 1e9

    def transfers_per_s(self, count: int, size: int, repeats: int) -> float:
        """``count`` sendall calls of ``size`` bytes on one stream, one ack at the end."""
        return count / statistics.median(self._round(size, count, WARMUP + repeats, 1))

    def __enter__(self) -> RawSockets:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _memcpy_times(count: int, size: int, rounds: int) -> list[float]:
    src = memoryview(bytearray(os.urandom(count * size)))
    dst = memoryview(bytearray(count * size))
    times = []
    for _ in range(WARMUP + rounds):
        t0 = time.perf_counter()
        for j in range(count):
            dst[j * size : (j + 1) * size] = src[j * size : (j + 1) * size]
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


class Memcpy:
    """memcpy between two buffers of one process (what the mock channel does)."""

    def __init__(self, nbytes: int, placement: Placement = LOOPBACK) -> None:
        self.pids: dict[str, int | None] = {"sender": os.getpid(), "receiver": None}
        self.bytes_moved = 0

    def gbps(self, size: int, repeats: int) -> float:
        count = repeats_for(size, repeats)
        self.bytes_moved += (WARMUP + count) * size
        return size / statistics.median(_memcpy_times(1, size, count)) / 1e9

    def transfers_per_s(self, count: int, size: int, repeats: int) -> float:
        """memcpy of ``count`` slices of ``size`` bytes."""
        return count / statistics.median(_memcpy_times(count, size, repeats))

    def __enter__(self) -> Memcpy:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


# -- entry point -----------------------------------------------------------------------------------------


def _alternate(*sides: Callable[[], float], rounds: int = ROUNDS) -> list[float]:
    """Median of each side over ``rounds`` rounds, each round measuring every side once, in turn."""
    runs: list[list[float]] = [[] for _ in sides]
    for _ in range(rounds):
        for side, out in zip(sides, runs, strict=True):
            out.append(side())
    return [statistics.median(r) for r in runs]


def channel_options(name: str, host: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bench's options for a channel on ``host``: its defaults, listening (UCX: on the interface) there, plus
    ``extra``."""
    return {} if name in IN_PROCESS else {"host": host, **(extra or {})}


def tls_options(stack: ExitStack, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--tls``: the sender's and the receiver's extra tcp options, certificates of a CA made for this run (removed
    with ``stack``)."""
    if name != "tcp":
        raise ConfigError(f"bench --tls: only the tcp channel has TLS, not {name!r}")
    ca = CertificateAuthority(
        Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdkv-bench-tls-"))), "bench-ca"
    )
    return {"tls": ca.issue("sender").options()}, {"tls": ca.issue("receiver").options()}


def _open_sender(
    stack: ExitStack,
    name: str,
    nbytes: int,
    placement: Placement,
    extra: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
) -> _ChannelSender:
    """A receiver process (or thread) and the sender here, both closed with ``stack``; ``extra``: (sender's,
    receiver's) options."""
    receiver = (name, nbytes, channel_options(name, placement.receiver_addr, extra[1]))
    peer = stack.enter_context(
        _peer(_channel_receiver, receiver, in_process=name in IN_PROCESS, netns=placement.receiver_netns)
    )
    sender = _ChannelSender(name, peer, nbytes, channel_options(name, placement.sender_addr, extra[0]))
    stack.callback(sender.close)
    return sender


def baseline_variants(baseline: Any, size: int, grid: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """``gbps`` keyword arguments per way the baseline moves ``size`` bytes (``RawSockets``: stream counts;
    ``RawNixl``: with NIXL's progress thread and without). ``grid``: a KV layout's (``block_bytes``, ``tensors``,
    ``requests``), which a baseline that moves whole blocks (``RawNixl``: as vLLM's NixlConnector) also moves
    them as."""
    if not hasattr(baseline, "variants"):
        return {"raw": {}}
    return (
        baseline.variants(size, grid) if grid and getattr(baseline, "moves_blocks", False) else baseline.variants(size)
    )


def variant_pids(baseline: Any, kw: dict[str, int]) -> dict[str, int | None]:
    """The processes doing each side of one of the baseline's variants: a baseline running each of its programs in
    processes of their own (``RawNixl``) says which (``pids_for``)."""
    return baseline.pids_for(**kw) if hasattr(baseline, "pids_for") else baseline.pids


def warm_up(baseline: Any, size: int) -> None:
    """One untimed transfer per variant: a fresh receiver's first message pays one-off costs (threads starting,
    first touches of its buffer: 1.5 s/GB of receiver CPU at 256 KiB measured that way) that are no transfer's."""
    for kw in baseline_variants(baseline, size).values():
        baseline.gbps(size, 1, **kw)


def baseline_fields(measured: dict[str, tuple[float, dict[str, float | None]]]) -> dict[str, Any]:
    """A row's baseline: the fastest variant's GB/s and CPU per GB and which it was (``baseline_used``), beside
    every variant's (``baselines``)."""
    used = max(measured, key=lambda label: measured[label][0])
    return {
        "baseline_gbps": measured[used][0],
        "baseline_used": used,
        "baseline_cpu_s_per_gb": measured[used][1],
        "baselines": {label: {"gbps": g, "cpu_s_per_gb": cpu} for label, (g, cpu) in measured.items()},
    }


def stream_options(streams: int) -> dict[str, int]:
    """tcp options that split every transfer over exactly ``streams`` connections (``--streams``)."""
    return {"streams": streams, "stream_min_bytes": 1, "one_host_shares": streams}


def measure(
    name: str,
    sizes: list[int],
    repeats: int,
    placement: Placement = LOOPBACK,
    tls: bool = False,
    streams: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The result object of ``pdkv bench channel --json``.

    ``streams`` (tcp): one more channel per count, every transfer split over exactly that many streams, in the
    same rounds (each row's ``streams``: GB/s, CPU per GB and ratio per count).
    """
    if streams and name != "tcp":
        raise ConfigError(f"bench channel --streams: only the tcp channel has streams, not {name!r}")
    if not all(1 <= n <= MAX_STREAMS for n in streams):
        raise ConfigError(f"bench channel --streams {streams}: each must be 1..{MAX_STREAMS}")
    if name not in BASELINES:
        raise ConfigError(f"bench channel: no baseline for channel {name!r}; expected one of {sorted(BASELINES)}")
    if name in IN_PROCESS and placement.link is not None:
        raise ConfigError(f"bench channel: the {name} channel cannot span hosts; --link needs tcp, nixl or ucx")
    baseline_class = _load(BASELINES[name])
    rate = placement.rate_bps
    rounds = ROUNDS if placement.link is None else LINK_ROUNDS
    small_count = (
        SMALL_COUNT if rate is None else max(64, min(SMALL_COUNT, int(rate / 8 * LINK_ROUND_S / 4 / SMALL_SIZE)))
    )
    nbytes = max([*sizes, small_count * SMALL_SIZE])
    iperf3_streams = TcpOptions().streams_for(max(sizes))
    iperf3_runs = []
    if placement.link is not None and (first := iperf3_gbps(placement.link, iperf3_streams, IPERF3_S)) is not None:
        iperf3_runs.append(first)
    results = []
    with ExitStack() as stack:
        tls_extra = (
            tls_options(stack, name) if tls else None
        )  # first: a channel without TLS fails before any process starts
        sender = _open_sender(stack, name, nbytes, placement)
        tls_sender = _open_sender(stack, name, nbytes, placement, tls_extra) if tls_extra is not None else None
        split = {
            n: _open_sender(stack, name, nbytes, placement, (stream_options(n), stream_options(n))) for n in streams
        }
        baseline = stack.enter_context(baseline_class(nbytes, placement))
        warm_up(baseline, sizes[0])
        for side in (sender, tls_sender, *split.values()):
            if side is not None:
                side.gbps(sizes[0], 1)
        for size in sizes:
            reps = repeats_for(size, repeats, rate)
            variants = baseline_variants(baseline, size)
            sides: dict[str, tuple[Any, Callable[[], float]]] = {
                label: (baseline, partial(baseline.gbps, size, reps, **kw)) for label, kw in variants.items()
            }
            pids = {label: variant_pids(baseline, kw) for label, kw in variants.items()}
            sides["channel"] = (sender, partial(sender.gbps, size, reps))
            if tls_sender is not None:
                sides["tls"] = (tls_sender, partial(tls_sender.gbps, size, reps))
            for n, side in split.items():
                sides[f"streams {n}"] = (side, partial(side.gbps, size, reps))
            meters = {key: CpuMeter(pids.get(key) or side.pids) for key, (side, _) in sides.items()}
            got = dict(
                zip(
                    sides,
                    _alternate(
                        *(partial(charge, meters[key], side, call) for key, (side, call) in sides.items()),
                        rounds=rounds,
                    ),
                    strict=True,
                )
            )
            cpu = {key: meter.per_gb() for key, meter in meters.items()}
            row = {"size_bytes": size, "gbps": got["channel"], "cpu_s_per_gb": cpu["channel"]}
            row.update(baseline_fields({label: (got[label], cpu[label]) for label in variants}))
            row.update(
                ratio=row["gbps"] / row["baseline_gbps"],
                cpu_ratio=ratios(cpu["channel"], row["baseline_cpu_s_per_gb"]),
            )
            if tls_sender is not None:
                row.update(tls_gbps=got["tls"], tls_ratio=got["tls"] / row["gbps"], tls_cpu_s_per_gb=cpu["tls"])
            if split:
                row["streams"] = {
                    str(n): {
                        "gbps": got[f"streams {n}"],
                        "ratio": got[f"streams {n}"] / row["baseline_gbps"],
                        "cpu_s_per_gb": cpu[f"streams {n}"],
                    }
                    for n in split
                }
            results.append(row)
        many = [partial(sender.transfers_per_s, small_count, SMALL_SIZE, SMALL_REPEATS)]
        if tls_sender is not None:
            many.append(partial(tls_sender.transfers_per_s, small_count, SMALL_SIZE, SMALL_REPEATS))
        if not hasattr(baseline, "transfers_per_s"):
            small_base, (small_rate, *tls_rate) = None, _alternate(*many, rounds=rounds)
        else:
            small_base, small_rate, *tls_rate = _alternate(
                partial(baseline.transfers_per_s, small_count, SMALL_SIZE, SMALL_REPEATS), *many, rounds=rounds
            )
    if iperf3_runs and (last := iperf3_gbps(placement.link, iperf3_streams, IPERF3_S)) is not None:  # type: ignore[arg-type]
        iperf3_runs.append(last)
    iperf3 = None
    if iperf3_runs:
        iperf3 = {
            "gbps": statistics.median(iperf3_runs),
            "runs_gbps": iperf3_runs,
            "streams": iperf3_streams,
            "seconds": IPERF3_S,
        }
        for row in results:
            row["iperf3_ratio"] = row["gbps"] / iperf3["gbps"]
    small = {
        "count": small_count,
        "size_bytes": SMALL_SIZE,
        "transfers_per_s": small_rate,
        "baseline_transfers_per_s": small_base,
        "ratio": small_rate / small_base if small_base else None,
    }
    if tls_rate:
        small.update(tls_transfers_per_s=tls_rate[0], tls_ratio=tls_rate[0] / small_rate)
    return {
        "channel": name,
        "baseline": _describe(baseline_class, BASELINES[name]),
        "link": placement.label,
        "iperf3": iperf3,
        "results": results,
        "small_transfers": small,
        "tls": tls,
        "cpu": "CPU seconds per GB moved, per side: the process's user+sys time (all threads) over the timed "
        "calls, warm-ups included, divided by the bytes they moved",
    }


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def cpu_pair(cpu: dict[str, float | None]) -> str:
    """``sender/receiver`` CPU seconds per GB for a table cell; ``-`` for a side not measured."""
    return "/".join("-" if (v := cpu.get(side)) is None else f"{v:.2f}" for side in SIDES)


def _table(out: dict[str, Any]) -> str:
    """The human table: per size, GB/s and CPU s/GB (sender/receiver) beside the baseline's faster variant."""
    iperf3 = out["iperf3"]
    lines = [f"channel {out['channel']} over {out['link']} vs {out['baseline']}"]
    if iperf3 is not None:
        lines.append(f"iperf3 -P {iperf3['streams']} over the same link: {iperf3['gbps']:.3f} GB/s")
    tls = out["tls"]
    split = list(out["results"][0].get("streams", {})) if out["results"] else []
    lines.append(
        f"{'size':>10}  {'GB/s':>8}  {'baseline':>8}  {'via':>9}  {'ratio':>6}  {'CPU s/GB':>11}  {'base CPU':>11}"
        + ("  vs iperf3" if iperf3 else "")
        + (f"  {'TLS GB/s':>8}  TLS/clear" if tls else "")
        + "".join(f"  {f'{n} str GB/s':>11}  {'CPU s/GB':>11}" for n in split)
    )
    for row in out["results"]:
        tail = f"  {row['iperf3_ratio']:9.2f}" if iperf3 else ""
        tail += f"  {row['tls_gbps']:8.3f}  {row['tls_ratio']:9.2f}" if tls else ""
        tail += "".join(
            f"  {v['gbps']:11.3f}  {cpu_pair(v['cpu_s_per_gb']):>11}" for v in row.get("streams", {}).values()
        )
        lines.append(
            f"{_human(row['size_bytes']):>10}  {row['gbps']:8.3f}  {row['baseline_gbps']:8.3f}  "
            f"{row['baseline_used'][:9]:>9}  {row['ratio']:6.2f}  {cpu_pair(row['cpu_s_per_gb']):>11}  "
            f"{cpu_pair(row['baseline_cpu_s_per_gb']):>11}{tail}"
        )
    s = out["small_transfers"]
    base = (
        "no baseline"
        if s["baseline_transfers_per_s"] is None
        else f"baseline {s['baseline_transfers_per_s']:,.0f}/s, ratio {s['ratio']:.2f}"
    )
    if tls:
        base += f"; TLS {s['tls_transfers_per_s']:,.0f}/s, TLS/clear {s['tls_ratio']:.2f}"
    lines.append(f"small transfers: {s['count']} x {_human(s['size_bytes'])}: {s['transfers_per_s']:,.0f}/s ({base})")
    return "\n".join(lines)


def draw(out: dict[str, Any], path: str) -> None:
    """``--plot``: GB/s against size, the channel and its same-run baseline."""
    sizes = [r["size_bytes"] for r in out["results"]]
    plot.lines(
        path,
        f"pdkv bench channel --channel {out['channel']}",
        "transfer size (bytes)",
        "GB/s",
        {
            out["channel"]: (sizes, [r["gbps"] for r in out["results"]]),
            "baseline: " + out["baseline"][:60]: (sizes, [r["baseline_gbps"] for r in out["results"]]),
        },
    )


def run(args: argparse.Namespace) -> int:
    if args.repeats < 0:
        raise ConfigError(f"bench channel --repeats {args.repeats}: expected >= 0 (0: chosen per size)")
    plot.check(getattr(args, "plot", None))
    with bench_link(args.link) as placement:
        out = call_on(
            placement.sender_netns,
            measure,
            args.channel,
            args.sizes,
            args.repeats,
            placement,
            args.tls,
            tuple(args.streams),
        )
    print(json.dumps(out) if args.json else _table(out))
    if getattr(args, "plot", None):
        draw(out, args.plot)
    return 0
