"""Raw ucxx baseline for ``pdkv bench channel --channel ucx``.

The same sizes moved by ucxx calls directly between two processes, nothing
of pdkv in the data path: the sender posts the receive of an 8-byte ACK and
tag-sends the payload; the receiver tag-receives it straight into a
preallocated buffer and sends the ACK. That is the least a two-sided
transfer needs to tell the sender the bytes landed, which is what the ucx
channel's WRITE reports. Both processes use the ucx channel's UCX
environment (``UCX_CHANNEL_ENV_DEFAULTS``) and its progress mode (ucxx's
event-driven progress thread). Buffers are bytearrays, as on the bench's
channel side (see pdkv/bench/nixl_raw.py on why allocation matters).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdkv.bench.netrig import LOOPBACK, Placement, run_in_netns
from pdkv.channels.ucx import Array, ucx_api  # imported after the channel set the UCX environment
from pdkv.channels.ucx_env import ucx_follow_host
from pdkv.errors import ChannelError, TransferTimeout

DATA = ucx_api.UCXXTag(1)
ACK = ucx_api.UCXXTag(2)
WARMUP = 3
STARTUP_TIMEOUT_S = 60.0
TRANSFER_TIMEOUT_S = 30.0


def auto_repeats(size: int) -> int:
    """Repeats for ``size`` when the caller passes 0: about 256 MiB per size, 5 to 200 transfers."""
    return max(5, min(200, (256 << 20) // size))


def _worker(host: str) -> Any:
    ucx_follow_host(host)  # as the ucx channel does: UCX on the interface of ``host``
    context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(context)
    worker.start_progress_thread(polling_mode=False)
    return context, worker


def _wait(requests: list[Any], what: str) -> None:
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S
    while not all(r.completed for r in requests):
        if time.monotonic() > deadline:
            raise TransferTimeout(f"raw ucx: {what} not done after {TRANSFER_TIMEOUT_S:.0f}s")
        time.sleep(0)  # spin, yielding: ucxx's progress thread needs one of the 2 cores
    for r in requests:
        r.check_error()


def _receiver(conn: Connection, nbytes: int, host: str) -> None:
    """Receive each payload into one preallocated buffer and ACK it, for the rounds the sender announces."""
    _context, worker = _worker(host)
    buf = np.frombuffer(bytearray(nbytes), dtype=np.uint8)
    ack = np.ones(8, dtype=np.uint8)
    conn.send(worker.address.tobytes())
    ep = worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(conn.recv()), True)
    while (msg := conn.recv())[0] == "round":
        _, size, count = msg
        for _ in range(count):
            _wait([worker.tag_recv(Array(buf[:size]), DATA)], "receiving a payload")
            _wait([ep.tag_send(Array(ack), ACK)], "sending an ACK")
    ep.close()
    worker.stop_progress_thread()


class RawUcx:
    """Raw ucxx: tag_send into a posted tag_recv, 8-byte ACK back; two processes.

    One receiver process and one pair of workers for the whole run (a
    context manager). No small-transfers baseline.
    """

    def __init__(self, nbytes: int, placement: Placement = LOOPBACK) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        args = (placement.receiver_netns, _receiver, there, nbytes, placement.receiver_addr)
        self.proc = ctx.Process(target=run_in_netns, args=args, name="raw-ucx-receiver", daemon=True)
        self.proc.start()
        self.pids = {"sender": os.getpid(), "receiver": self.proc.pid}
        self.bytes_moved = 0  # by ``gbps``, warm-ups too: what a ``CpuMeter`` charges the processes' CPU to
        try:
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise TransferTimeout(f"raw ucx receiver did not start within {STARTUP_TIMEOUT_S:.0f}s")
            self._context, self.worker = _worker(placement.sender_addr)
            self.ep = self.worker.create_endpoint_from_worker_address(
                ucx_api.UCXAddress.create_from_buffer(self.conn.recv()), True
            )
            self.conn.send(self.worker.address.tobytes())
            self.src = np.frombuffer(bytearray(b"\x01") * nbytes, dtype=np.uint8)
        except BaseException:
            self._reap()
            raise

    def __enter__(self) -> RawUcx:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.conn.send(("stop",))
            self.ep.close()
            self.worker.stop_progress_thread()
        finally:
            self._reap()

    def _reap(self) -> None:
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)

    def gbps(self, size: int, repeats: int) -> float:
        """GB/s of one ``size``-byte transfer, the median of ``repeats`` (0: chosen per size)."""
        count = WARMUP + (repeats or auto_repeats(size))
        self.bytes_moved += count * size
        self.conn.send(("round", size, count))
        ack = np.zeros(8, dtype=np.uint8)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            got = self.worker.tag_recv(Array(ack), ACK)
            _wait([self.ep.tag_send(Array(self.src[:size]), DATA), got], f"a {size}-byte transfer")
            times.append(time.perf_counter() - start)
        if ack[0] != 1:
            raise ChannelError("raw ucx: the receiver's ACK did not arrive intact")
        return size / statistics.median(times[WARMUP:]) / 1e9
