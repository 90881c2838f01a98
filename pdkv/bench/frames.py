"""`pdkv bench frames`: the tcp target's DATA frame loop alone, native (csrc/kvframes.cpp), against a plain receiver.

The receiving side of a tcp transfer spends, per DATA frame, the header, the
run table, the run and grant checks and the ACK on top of the bytes' copy.
`pdkv bench transfer` sees that only inside a whole request's cost; here a raw
socket streams frames (each one share: LAST, a run table of ``runs`` runs into
a guarded region granted to its token) into a tcp channel's target, and the
row is the target's serve threads' CPU time per frame (their CPU-time clocks,
``pthread_getcpuclockid``; the connection is parked before the stream starts, so
they do all of its serving) and the wall time until every ACK came back, for the native
loop and for the Python loop (its reference, ``FrameServer.native`` False)
on fresh connections, alternating round by round with the baseline; medians.

The baseline is the floor of the same job: a plain thread reading the same
stream with ``recv_into`` straight into a buffer of the region's size, in
large reads, parsing, checking and hashing nothing, and answering once at the
end. ``ratio``: its CPU per frame over the native loop's (1.0: a frame costs
no more than its bytes' copy); ``python_over_native``: how much cheaper the
native loop made a frame.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import secrets
import socket
import statistics
import threading
import time
from typing import Any

from pdkv import native
from pdkv.bench import plot
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire
from pdkv.errors import ConfigError

FRAMES = 20000  # frames of the smallest size; larger ones stream at most STREAM_BYTES
STREAM_BYTES = 256 << 20
ROUNDS = 3
RUN_BYTES = 4096  # a run per 4 KiB of frame, at most MAX_RUNS_PER_FRAME: a direct chunk's blocks
MAX_RUNS_PER_FRAME = 64
TOKEN = b"bench-frames-tok"
LOOPS = ("python", "native")
PLAIN_READ_BYTES = 1 << 20  # the plain receiver's reads
TIMEOUT_S = 60.0  # the longest wait for the target's next answer

Report = dict[str, Any]


def run(args: argparse.Namespace) -> int:
    frames, rounds = getattr(args, "frames", FRAMES), getattr(args, "rounds", ROUNDS)
    sizes: list[int] = getattr(args, "sizes", None) or [4 << 10, 64 << 10, 256 << 10]
    if frames < 1 or rounds < 1 or min(sizes) < 1:
        raise ConfigError(f"bench frames: --frames {frames}, --rounds {rounds} and every size must be >= 1")
    if not native.available():
        raise ConfigError(f"bench frames: the native kernels are not loaded ({native.reason()}): nothing to compare")
    plot.check(getattr(args, "plot", None))
    report = measure(sizes, frames, rounds)
    print(json.dumps(report) if args.json else format_table(report))
    if getattr(args, "plot", None):
        draw(report, args.plot)
    return 0


def measure(sizes: list[int], frames: int = FRAMES, rounds: int = ROUNDS) -> Report:
    """One row per frame size: each loop's serve-thread CPU and wall time per frame, medians over ``rounds``."""
    region = 4 * max(sizes)
    channel = TcpChannel("bench-frames", TcpOptions(io_timeout=30, max_frame_bytes=max(sizes)))
    try:
        rid = channel.register(bytearray(region))
        channel.guard(rid)
        channel.grant(TOKEN, "write", [(rid, 0, region)])
        rows = []
        for size in sizes:
            count = min(frames, max(100, STREAM_BYTES // size))
            stream = _stream(rid, region, size, count)
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in (*LOOPS, "plain")}
            for _ in range(rounds):
                for loop in LOOPS:
                    channel.target.frames.native = loop == "native"
                    samples[loop].append(_serve(channel, stream, count))
                samples["plain"].append(_serve_plain(stream, count, region))
            row: dict[str, Any] = {"frame_bytes": size, "runs": _runs(size), "frames": count}
            for name, got in samples.items():
                row[name] = {
                    "cpu_us_per_frame": statistics.median(cpu for cpu, _ in got),
                    "wall_us_per_frame": statistics.median(wall for _, wall in got),
                }
            native_cpu = max(row["native"]["cpu_us_per_frame"], 1e-9)
            row["ratio"] = row["plain"]["cpu_us_per_frame"] / native_cpu
            row["wall_ratio"] = row["plain"]["wall_us_per_frame"] / max(row["native"]["wall_us_per_frame"], 1e-9)
            row["python_over_native"] = row["python"]["cpu_us_per_frame"] / native_cpu
            rows.append(row)
    finally:
        channel.close()
    return {
        "bench": "frames",
        "baseline": "a plain thread reading the same stream with recv_into into a region-sized buffer, 1 MiB reads, "
        "nothing parsed, checked or hashed, one answer at the end; the Python frame loop (PDKV_NATIVE_FRAMES=0) "
        "beside it; alternating rounds",
        "cpu": "the target's serve threads' CPU time per frame (their CPU-time clocks), medians over rounds",
        "results": rows,
    }


def _runs(size: int) -> int:
    return max(1, min(MAX_RUNS_PER_FRAME, size // RUN_BYTES))


def _stream(rid: int, region: int, size: int, frames: int) -> bytes:
    """``frames`` DATA frames (each LAST of a one-share transfer) of ``size`` bytes in ``_runs(size)`` runs."""
    runs, out = _runs(size), []
    run_bytes = size // runs
    for i in range(frames):
        base = (i * size) % (region - size + 1)
        table = [(rid, base + k * run_bytes, run_bytes) for k in range(runs)]
        out.append(bytes(wire.data_frame(i, table, run_bytes * runs, wire.LAST, 1)) + bytes(run_bytes * runs))
    return b"".join(out)


def _serve(channel: TcpChannel, stream: bytes, frames: int) -> tuple[float, float]:
    """Stream the frames over a fresh connection; (the serve threads' CPU us per frame, wall us per frame to every
    ACK). The connection is parked before the stream starts (its handshake's thread gone), so the target's serve
    threads (channels/tcp/parking.py), which outlive it, do all of its serving: their clocks are read around it."""
    prefix = f"tcp-{channel.agent.name}-"
    with socket.create_connection(("127.0.0.1", channel.port), timeout=TIMEOUT_S) as sock:
        name = b"bench"
        sid = secrets.randbits(63)  # a session of its own: the last round's connection hangs up only its own
        sock.sendall(
            wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.HELLO, 0, len(TOKEN), 0, 0, sid, 0, len(TOKEN + name))
            + TOKEN
            + name
        )
        _read_frame(sock)  # HELLO_OK: the connection is served from here on
        deadline = time.monotonic() + TIMEOUT_S
        while any(t.name == prefix + "greet" for t in threading.enumerate()):  # its first turn found nothing: parked
            if time.monotonic() > deadline:
                raise ConfigError("bench frames: the connection's handshake thread did not end")
            time.sleep(0.001)
        clocks = [_cpu_clock(t) for t in threading.enumerate() if t.name == prefix + "serve"]
        cpu0, start = sum(time.clock_gettime(c) for c in clocks), time.perf_counter()
        sender = threading.Thread(target=sock.sendall, args=(stream,), daemon=True)
        sender.start()
        acked = 0
        while acked < frames:
            ftype, aux = _read_frame(sock)
            if ftype != wire.ACK:
                raise ConfigError(f"bench frames: the target answered frame type {ftype}, not ACK")
            acked += aux
        wall, cpu = time.perf_counter() - start, sum(time.clock_gettime(c) for c in clocks) - cpu0
        sender.join(TIMEOUT_S)
    return cpu / frames * 1e6, wall / frames * 1e6


def _serve_plain(stream: bytes, frames: int, region: int) -> tuple[float, float]:
    """The baseline: the same stream read by a plain thread into a region-sized buffer; (its CPU us per frame, wall
    us per frame to its answer)."""
    buf = memoryview(bytearray(region))
    spent: list[float] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(TIMEOUT_S)

        def read() -> None:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                cpu0, left, at = time.thread_time(), len(stream), 0
                while left:
                    n = conn.recv_into(buf[at:], min(left, PLAIN_READ_BYTES, region - at))
                    if not n:
                        raise ConfigError("bench frames: the plain baseline's sender hung up early")
                    left, at = left - n, (at + n) % region
                spent.append(time.thread_time() - cpu0)
                conn.sendall(b"k")

        reader = threading.Thread(target=read, name="bench-frames-plain", daemon=True)
        reader.start()
        with socket.create_connection(server.getsockname()[:2], timeout=TIMEOUT_S) as sock:
            start = time.perf_counter()
            sender = threading.Thread(target=sock.sendall, args=(stream,), daemon=True)
            sender.start()
            _recv_exact(sock, 1)
            wall = time.perf_counter() - start
            sender.join(TIMEOUT_S)
        reader.join(TIMEOUT_S)
    if not spent:
        raise ConfigError("bench frames: the plain baseline read nothing")
    return spent[0] / frames * 1e6, wall / frames * 1e6


def _read_frame(sock: socket.socket) -> tuple[int, int]:
    """One frame from the target: (its type, its aux field: an ACK's count); its payload read away."""
    _, _, ftype, _, _, aux, _, _, _, length = wire.HEADER.unpack(_recv_exact(sock, wire.HDR_SIZE))
    _recv_exact(sock, length)
    return ftype, aux


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes (the socket's timeout bounds each wait); ConfigError if the target hangs up first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConfigError(f"bench frames: the target hung up after {len(buf)} of {n} bytes of an answer")
        buf += chunk
    return bytes(buf)


def _cpu_clock(thread: threading.Thread) -> int:
    """The CPU-time clock of ``thread`` (``time.clock_gettime`` reads it in ns steps; /proc's ticks are 10 ms)."""
    clock = ctypes.c_int(0)
    if thread.ident is None or ctypes.CDLL(None).pthread_getcpuclockid(
        ctypes.c_ulong(thread.ident), ctypes.byref(clock)
    ):
        raise ConfigError(f"bench frames: no CPU clock for thread {thread.name}")
    return clock.value


def draw(report: Report, path: str) -> None:
    """``--plot``: each loop's serve-thread CPU per frame and the plain receiver's, per frame size."""
    rows = report["results"]
    plot.bars(
        path,
        "pdkv bench frames: the tcp target's CPU per DATA frame",
        "us of CPU per frame",
        [f"{plot.size_label(r['frame_bytes'])}, {r['runs']} runs" for r in rows],
        {
            **{f"{loop} loop": [r[loop]["cpu_us_per_frame"] for r in rows] for loop in LOOPS},
            "plain receiver": [r["plain"]["cpu_us_per_frame"] for r in rows],
        },
    )


def format_table(report: Report) -> str:
    lines = [
        "the tcp target's DATA frame loop, CPU us per frame: native, the Python loop, a plain receiver (baseline)",
        f"{'frame':>9} {'runs':>5} {'native':>8} {'python':>8} {'plain':>8} {'ratio':>6} {'wall ratio':>10}",
    ]
    for r in report["results"]:
        cpu = [r[name]["cpu_us_per_frame"] for name in ("native", "python", "plain")]
        lines.append(
            f"{plot.size_label(r['frame_bytes']):>9} {r['runs']:>5} {cpu[0]:>8.1f} {cpu[1]:>8.1f} {cpu[2]:>8.1f} "
            f"{r['ratio']:>6.2f} {r['wall_ratio']:>10.2f}"
        )
    return "\n".join(lines)
