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

The many-small-transfers case posts ``SMALL_COUNT`` writes of ``SMALL_SIZE``
bytes without waiting in between, then waits for all, and reports transfers/s
(``SMALL_REPEATS`` per round whatever ``--repeats`` says: each is 4096 transfers).
Every wait in here has a timeout (``TIMEOUT_S``), so a broken channel fails the
bench instead of hanging it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import socket
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from pdkv.bench import plot
from pdkv.channels import TransferOp, create_channel
from pdkv.errors import ChannelError, ConfigError, TransferTimeout

# channel name -> "module:function" with signature (sizes, repeats) -> {size: GB/s}, sender and receiver in two processes
BASELINES: dict[str, str] = {
    "tcp": "pdkv.bench.channel:raw_socket_baseline",
    "mock": "pdkv.bench.channel:memcpy_baseline",
    "nixl": "pdkv.bench.nixl_raw:raw_nixl_baseline",
    "ucx": "pdkv.bench.ucx_raw:raw_ucx_baseline",
}
# channel name -> "module:function" with signature (count, size, repeats) -> transfers/s; absent: no small baseline
SMALL_BASELINES: dict[str, str] = {
    "tcp": "pdkv.bench.channel:raw_socket_small_baseline",
    "mock": "pdkv.bench.channel:memcpy_small_baseline",
    "nixl": "pdkv.bench.nixl_raw:raw_nixl_small_baseline",
}
IN_PROCESS = {"mock"}  # channels whose peers must share a process

SMALL_COUNT = 4096
SMALL_SIZE = 16 << 10
SMALL_REPEATS = 2
ROUNDS = 5
WARMUP = 2
TIMEOUT_S = 60.0
_POLL_S = 0.005  # the receiver checks notifications this often: coarse, so it does not compete with the transfer for CPU


def repeats_for(size: int, requested: int) -> int:
    """Repeats per round: ``requested`` if set; else enough for a stable median, moving at most ~128 MiB."""
    return requested if requested > 0 else max(8, min(100, (128 << 20) // size))


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


@contextmanager
def _peer(target: Callable[..., None], args: tuple[Any, ...], in_process: bool) -> Iterator[Connection]:
    """Run ``target(conn, *args)`` in a spawned process (or a thread), yield our end of its pipe, always reap it."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    runner: threading.Thread | multiprocessing.process.BaseProcess
    if in_process:
        runner = threading.Thread(target=target, args=(theirs, *args), name="bench-receiver", daemon=True)
    else:
        runner = ctx.Process(target=target, args=(theirs, *args), name="bench-receiver", daemon=True)
    runner.start()
    try:
        yield ours
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


def _channel_receiver(conn: Connection, name: str, nbytes: int) -> None:
    """Receiver role: register a buffer, publish metadata, count notifications per round, report a CRC."""
    try:
        channel = create_channel(name, "bench-receiver")
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
    """Sender role, in this process, against a receiver in another."""

    def __init__(self, name: str, conn: Connection, nbytes: int) -> None:
        self.conn = conn
        self.channel = create_channel(name, "bench-sender")
        try:
            self.src = bytearray(os.urandom(nbytes))
            self.region = self.channel.register(self.src)
            meta, self.remote_region = _recv(conn, "receiver metadata")
            self.peer = self.channel.add_peer(meta)
            conn.send(self.channel.metadata())
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
        self._verify(size)
        return size / statistics.median(times[WARMUP:]) / 1e9

    def transfers_per_s(self, count: int, size: int, repeats: int) -> float:
        ops = [TransferOp(self.region, i * size, self.remote_region, i * size, size) for i in range(count)]
        rates = []
        for _ in range(1 + repeats):
            self.conn.send(("round", 1))
            t0 = time.perf_counter()
            handles = [self.channel.write(self.peer, [op], notif=b"last" if i == count - 1 else None) for i, op in enumerate(ops)]
            for handle in handles:
                self.channel.wait(handle, TIMEOUT_S)
                self.channel.release(handle)
            rates.append(count / (time.perf_counter() - t0))
            self._verify(count * size)
        return statistics.median(rates[1:])

    def close(self) -> None:
        self.channel.close()


# -- raw baselines -----------------------------------------------------------------------------------

_ROUND = struct.Struct("<QQQ")  # message size, messages per ack, acks


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:])
        if not r:
            raise ChannelError("raw socket baseline: the sender closed the connection mid-message")
        got += r


def _raw_socket_receiver(conn: Connection, port: int, nbytes: int) -> None:
    """Raw receiver: recv_into a preallocated buffer, one byte back per round; the reference cost."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = memoryview(bytearray(nbytes))
            head = bytearray(_ROUND.size)
            while True:
                try:
                    _recv_exact(sock, memoryview(head))
                except ChannelError:
                    return  # the sender is done
                size, per_ack, acks = _ROUND.unpack(head)
                if size * per_ack > nbytes:
                    raise ChannelError(f"raw socket baseline: {per_ack} x {size} bytes do not fit {nbytes}")
                for _ in range(acks):
                    for j in range(per_ack):
                        _recv_exact(sock, buf[j * size : (j + 1) * size])
                    sock.sendall(b"\x01")
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _raw_socket_rounds(rounds: list[tuple[int, int, int]]) -> list[list[float]]:
    """Seconds per ack for each (size, messages per ack, acks) round, sendall against a receiver process."""
    nbytes = max(size * per_ack for size, per_ack, _ in rounds)
    src = memoryview(bytearray(os.urandom(nbytes)))
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(TIMEOUT_S)
        with _peer(_raw_socket_receiver, (server.getsockname()[1], nbytes), in_process=False) as conn:
            try:
                sock, _ = server.accept()
            except TimeoutError:
                _recv(conn, "connecting")  # raises the receiver's error if it sent one
                raise TransferTimeout(f"raw socket baseline: receiver did not connect within {TIMEOUT_S:.0f}s") from None
            with sock:
                sock.settimeout(TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                out = []
                ack = bytearray(1)
                for size, per_ack, acks in rounds:
                    sock.sendall(_ROUND.pack(size, per_ack, acks))
                    times = []
                    for _ in range(acks):
                        t0 = time.perf_counter()
                        for j in range(per_ack):
                            sock.sendall(src[j * size : (j + 1) * size])
                        if sock.recv_into(ack) != 1:
                            raise ChannelError("raw socket baseline: the receiver hung up")
                        times.append(time.perf_counter() - t0)
                    out.append(times[WARMUP:])
    return out


def raw_socket_baseline(sizes: list[int], repeats: int) -> dict[int, float]:
    """Raw loopback sockets: sendall, recv_into a preallocated buffer, 1-byte ack; two processes."""
    rounds = _raw_socket_rounds([(size, 1, WARMUP + repeats_for(size, repeats)) for size in sizes])
    return {size: size / statistics.median(times) / 1e9 for size, times in zip(sizes, rounds)}


def raw_socket_small_baseline(count: int, size: int, repeats: int) -> float:
    """Raw loopback sockets: ``count`` sendall calls of ``size`` bytes, one ack at the end; two processes."""
    (times,) = _raw_socket_rounds([(size, count, WARMUP + repeats)])
    return count / statistics.median(times)


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


def memcpy_baseline(sizes: list[int], repeats: int) -> dict[int, float]:
    """memcpy between two buffers of one process (what the mock channel does)."""
    return {size: size / statistics.median(_memcpy_times(1, size, repeats_for(size, repeats))) / 1e9 for size in sizes}


def memcpy_small_baseline(count: int, size: int, repeats: int) -> float:
    """memcpy of ``count`` slices of ``size`` bytes in one process."""
    return count / statistics.median(_memcpy_times(count, size, repeats))


# -- entry point -----------------------------------------------------------------------------------------


def _alternate(*sides: Callable[[], float]) -> list[float]:
    """Median of each side over ``ROUNDS`` rounds, each round measuring every side once, in turn."""
    runs: list[list[float]] = [[] for _ in sides]
    for _ in range(ROUNDS):
        for side, out in zip(sides, runs):
            out.append(side())
    return [statistics.median(r) for r in runs]


def _at_size(baseline: Callable[[list[int], int], dict[int, float]], size: int, repeats: int) -> float:
    return baseline([size], repeats)[size]


def measure(name: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    """The result object of ``pdkv bench channel --json``."""
    if name not in BASELINES:
        raise ConfigError(f"bench channel: no baseline for channel {name!r}; expected one of {sorted(BASELINES)}")
    baseline = _load(BASELINES[name])
    small_baseline = _load(SMALL_BASELINES[name]) if name in SMALL_BASELINES else None
    nbytes = max([*sizes, SMALL_COUNT * SMALL_SIZE])
    results = []
    with _peer(_channel_receiver, (name, nbytes), in_process=name in IN_PROCESS) as conn:
        sender = _ChannelSender(name, conn, nbytes)
        try:
            for size in sizes:
                reps = repeats_for(size, repeats)
                base, gbps = _alternate(partial(_at_size, baseline, size, reps), partial(sender.gbps, size, reps))
                results.append({"size_bytes": size, "gbps": gbps, "baseline_gbps": base, "ratio": gbps / base})
            many = partial(sender.transfers_per_s, SMALL_COUNT, SMALL_SIZE, SMALL_REPEATS)
            if small_baseline is None:
                small_base, (rate,) = None, _alternate(many)
            else:
                small_base, rate = _alternate(partial(small_baseline, SMALL_COUNT, SMALL_SIZE, SMALL_REPEATS), many)
        finally:
            sender.close()
    small = {
        "count": SMALL_COUNT,
        "size_bytes": SMALL_SIZE,
        "transfers_per_s": rate,
        "baseline_transfers_per_s": small_base,
        "ratio": rate / small_base if small_base else None,
    }
    return {"channel": name, "baseline": _describe(baseline, BASELINES[name]), "results": results, "small_transfers": small}


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _table(out: dict[str, Any]) -> str:
    lines = [f"channel {out['channel']} vs {out['baseline']}", f"{'size':>10}  {'GB/s':>8}  {'baseline':>8}  {'ratio':>6}"]
    for row in out["results"]:
        lines.append(f"{_human(row['size_bytes']):>10}  {row['gbps']:8.3f}  {row['baseline_gbps']:8.3f}  {row['ratio']:6.2f}")
    s = out["small_transfers"]
    base = "no baseline" if s["baseline_transfers_per_s"] is None else f"baseline {s['baseline_transfers_per_s']:,.0f}/s, ratio {s['ratio']:.2f}"
    lines.append(f"small transfers: {s['count']} x {_human(s['size_bytes'])}: {s['transfers_per_s']:,.0f}/s ({base})")
    return "\n".join(lines)


def draw(out: dict[str, Any], path: str) -> None:
    """``--plot``: GB/s against size, the channel and its same-run baseline."""
    sizes = [r["size_bytes"] for r in out["results"]]
    plot.lines(path, f"pdkv bench channel --channel {out['channel']}", "transfer size (bytes)", "GB/s", {
        out["channel"]: (sizes, [r["gbps"] for r in out["results"]]),
        "baseline: " + out["baseline"][:60]: (sizes, [r["baseline_gbps"] for r in out["results"]]),
    })


def run(args: argparse.Namespace) -> int:
    if args.repeats < 0:
        raise ConfigError(f"bench channel --repeats {args.repeats}: expected >= 0 (0: chosen per size)")
    plot.check(getattr(args, "plot", None))
    out = measure(args.channel, args.sizes, args.repeats)
    print(json.dumps(out) if args.json else _table(out))
    if getattr(args, "plot", None):
        draw(out, args.plot)
    return 0
