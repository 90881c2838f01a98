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
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdkv.channels.ucx import Array, ucx_api  # imported after the channel set the UCX environment
from pdkv.errors import ChannelError, TransferTimeout

DATA = ucx_api.UCXXTag(1)
ACK = ucx_api.UCXXTag(2)
WARMUP = 3
STARTUP_TIMEOUT_S = 60.0
TRANSFER_TIMEOUT_S = 30.0


def auto_repeats(size: int) -> int:
    """Repeats for ``size`` when the caller passes 0: about 256 MiB per size, 5 to 200 transfers."""
    return max(5, min(200, (256 << 20) // size))


def _worker() -> Any:
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


def _receiver(conn: Connection, nbytes: int) -> None:
    """Receive each payload into one preallocated buffer and ACK it, for the rounds the sender announces."""
    _context, worker = _worker()
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


def raw_ucx_baseline(sizes: list[int], repeats: int) -> dict[int, float]:
    """Raw ucxx: tag_send into a posted tag_recv, 8-byte ACK back; two processes.

    Returns GB/s per size, the median of ``repeats`` transfers (0: chosen per size).
    """
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, max(sizes)), name="raw-ucx-receiver", daemon=True)
    proc.start()
    try:
        if not here.poll(STARTUP_TIMEOUT_S):
            raise TransferTimeout(f"raw ucx receiver did not start within {STARTUP_TIMEOUT_S:.0f}s")
        _context, worker = _worker()
        ep = worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(here.recv()), True)
        here.send(worker.address.tobytes())
        src = np.frombuffer(bytearray(b"\x01") * max(sizes), dtype=np.uint8)
        ack = np.zeros(8, dtype=np.uint8)
        results: dict[int, float] = {}
        for size in sizes:
            count = WARMUP + (repeats or auto_repeats(size))
            here.send(("round", size, count))
            times = []
            for _ in range(count):
                start = time.perf_counter()
                got = worker.tag_recv(Array(ack), ACK)
                _wait([ep.tag_send(Array(src[:size]), DATA), got], f"a {size}-byte transfer")
                times.append(time.perf_counter() - start)
            if ack[0] != 1:
                raise ChannelError("raw ucx: the receiver's ACK did not arrive intact")
            results[size] = size / statistics.median(times[WARMUP:]) / 1e9
        here.send(("stop",))
        ep.close()
        worker.stop_progress_thread()
        return results
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
