"""Raw NIXL baseline for ``pdkv bench channel --channel nixl``.

The same sizes moved by ``nixl_agent`` calls directly between two processes,
with nothing of pdkv in the data path: each transfer is what a careful NIXL
user writes (descriptor lists prepared once per size, then per transfer
``make_prepped_xfer`` with a notification, ``transfer``, ``check_xfer_state``
in a busy loop until DONE, ``release``). The agents are built as the nixl
channel builds its own (``create_nixl_agent``: the same UCX environment) but
with NIXL's progress thread on (``RAW_PROGRESS_THREAD``), as vLLM's NixlConnector runs
its agent: the channel turns it off by default, and this program is the
faster one where it matters most. Measured on the 2-vCPU VM (issue 46's
history file): single writes of 256 KiB moved at 4.4-5.7 GB/s with the thread
and 0.9-1.0 without (a write that small waits for the target's progress,
which without the thread comes only with its polls); a request's blocks took
0.32-0.33 ms with it at 40 tokens against 0.31 without, and 18.3-19.8 ms at
2048 tokens against 17.0-17.5: there the baseline is up to a tenth slower
than it could be, which the rows' ratios flatter by.

``gbps`` has two ways (``variants``): ``contiguous``, the bytes as one
transfer; and, given a KV layout's grid (``block_bytes``, ``tensors``,
``requests``), ``blocks``, the way vLLM's NixlConnector moves a request's KV:
each side's buffer prepared once as one descriptor per tensor x block, then
per request one ``make_prepped_xfer`` of numpy index arrays naming its blocks
(NIXL merges runs of adjacent ones) with the notification on it, the target
counting the notifications. Request ``r`` owns blocks ``r*n .. r*n+n-1`` of
every tensor on both sides, where fresh block allocators put them.

Buffers are bytearrays, as on the bench's channel side, because allocation
matters here: numpy arrays (and torch tensors with THP_MEM_ALLOC_ENABLE=1)
get transparent huge pages through madvise and moved about 2x faster over
cma on this machine than bytearrays or default torch tensors. With
``memory="VRAM"`` both buffers are CUDA tensors on device 0 instead: the bar
for a request's KV moved VRAM to VRAM (tests/gpu/check.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np

from pdkv.bench.netrig import LOOPBACK, Placement, run_in_netns
from pdkv.channels.nixl import NixlOptions, create_nixl_agent
from pdkv.errors import ChannelError, TransferTimeout

TARGET_NAME = "raw-nixl-target"
INITIATOR_NAME = "raw-nixl-initiator"
WARMUP = 3
STARTUP_TIMEOUT_S = 60.0  # spawning a process that imports NIXL takes seconds on a busy machine
TRANSFER_TIMEOUT_S = 30.0
POLL_S = 0.0002  # the bench receiver's pause between notification polls
RAW_PROGRESS_THREAD = True  # NIXL's progress thread on, as vLLM's NixlConnector runs its agent (module docstring)


def auto_repeats(size: int) -> int:
    """Repeats for ``size`` when the caller passes 0: about 256 MiB per size, 5 to 200 transfers."""
    return max(5, min(200, (256 << 20) // size))


MemType = Literal["DRAM", "VRAM"]


def _buffer(nbytes: int, memory: MemType, fill: int) -> tuple[Any, int]:
    """A buffer of ``nbytes`` in ``memory`` filled with ``fill``, and its address."""
    if memory == "VRAM":
        import torch  # only the VRAM baseline needs it, and a GPU

        tensor = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda:0")
        return tensor, tensor.data_ptr()
    buf = bytearray([fill]) * nbytes
    return buf, int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _target(conn: Connection, nbytes: int, host: str, memory: MemType) -> None:
    """The receiving side: register a buffer, publish metadata, drain notifications until it has them all.

    It drains them the way the bench's channel receiver does (every
    ``POLL_S`` when none came), so both sides of the ratio do the same job.
    """
    agent = create_nixl_agent(TARGET_NAME, NixlOptions(host=host, progress_thread=RAW_PROGRESS_THREAD))
    buf, addr = _buffer(nbytes, memory, 0)  # the peer writes here until the end of this function
    reg = agent.register_memory([(addr, nbytes, 0, "")], memory)
    conn.send((agent.get_agent_metadata(), addr))
    notified, expected, deadline = 0, None, float("inf")
    while expected is None or (notified < expected and time.monotonic() < deadline):
        if expected is None and conn.poll():
            expected, deadline = conn.recv(), time.monotonic() + TRANSFER_TIMEOUT_S  # the sender's count
        fresh = sum(len(v) for v in agent.get_new_notifs().values())
        notified += fresh
        if not fresh:
            time.sleep(POLL_S)
    conn.send(notified)
    agent.deregister_memory(reg)


class _RawPair:
    """This process's NIXL agent and the target process's buffer, for the raw baselines.

    Counts the notifications it asks for and, on leaving, checks the target
    received exactly that many, so a baseline that lost one cannot pass.
    """

    def __init__(self, nbytes: int, placement: Placement, memory: MemType = "DRAM") -> None:
        self.nbytes = nbytes
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.memory = memory
        args = (placement.receiver_netns, _target, there, nbytes, placement.receiver_addr, memory)
        self.proc = ctx.Process(target=run_in_netns, args=args, name="raw-nixl-target", daemon=True)
        self.proc.start()
        there.close()  # the child's end: the parent holds only its own
        self.notified = 0
        try:
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise TransferTimeout(f"raw nixl target did not start within {STARTUP_TIMEOUT_S:.0f}s")
            agent_md, self.remote_addr = self.conn.recv()
            self.agent = create_nixl_agent(
                INITIATOR_NAME, NixlOptions(host=placement.sender_addr, progress_thread=RAW_PROGRESS_THREAD)
            )
            self.buf, self.addr = _buffer(nbytes, memory, 1)
            self.reg = self.agent.register_memory([(self.addr, nbytes, 0, "")], memory)
            self.peer = self.agent.add_remote_agent(agent_md)
        except BaseException:
            self._reap()
            raise

    def __enter__(self) -> _RawPair:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            if exc_type is None:
                self.conn.send(self.notified)
                got = self.conn.recv() if self.conn.poll(2 * TRANSFER_TIMEOUT_S) else None
                if got != self.notified:
                    raise ChannelError(f"raw nixl target received {got} notifications for {self.notified} transfers")
            self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
        finally:
            del self.agent  # its UCX worker's pipes and sockets go with it, not at some later collection
            self._reap()

    def _reap(self) -> None:
        self.proc.join(timeout=0 if self.proc.exitcode is not None else 10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self.conn.close()

    def lists(self, ranges: list[tuple[int, int]]) -> tuple[Any, Any]:
        """Prepared local and remote descriptor lists of (offset, length) ranges, same offsets both sides."""
        local = self.agent.prep_xfer_dlist("", [(self.addr + o, n, 0) for o, n in ranges], self.memory)
        remote = self.agent.prep_xfer_dlist(self.peer, [(self.remote_addr + o, n, 0) for o, n in ranges], self.memory)
        return local, remote

    def post(self, local: Any, remote: Any, index: int | np.ndarray, notif: bytes) -> Any:
        """Post one WRITE of descriptor ``index`` (or of every descriptor an index array names); returns its
        handle."""
        indices = index if isinstance(index, np.ndarray) else [index]
        xfer = self.agent.make_prepped_xfer("WRITE", local, indices, remote, indices, notif)
        if self.agent.transfer(xfer) == "ERR":
            raise ChannelError("raw nixl WRITE failed when posted")
        self.notified += bool(notif)
        return xfer

    def finish(self, xfer: Any) -> None:
        """Spin on ``check_xfer_state`` until DONE, then release the handle."""
        deadline = time.perf_counter() + TRANSFER_TIMEOUT_S
        state = "PROC"
        while (state := self.agent.check_xfer_state(xfer)) == "PROC" and time.perf_counter() < deadline:
            pass
        if state != "DONE":
            raise ChannelError(f"raw nixl WRITE ended {state}")
        xfer.release()


class RawNixl:
    """Raw NIXL: nixl_agent prepped WRITE with notification, check_xfer_state until DONE; two processes.

    One target process and one pair of agents for the whole run (a context
    manager); on leaving, the target must have received every notification.
    """

    moves_blocks = True  # ``gbps`` also moves a KV layout's whole blocks (``pdkv bench transfer``'s ``blocks``)

    def __init__(self, nbytes: int, placement: Placement = LOOPBACK, memory: MemType = "DRAM") -> None:
        self.pair = _RawPair(nbytes, placement, memory)
        self.pids = {"sender": os.getpid(), "receiver": self.pair.proc.pid}
        self.bytes_moved = 0  # by ``gbps``, warm-ups too: what a ``CpuMeter`` charges the processes' CPU to

    def __enter__(self) -> RawNixl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pair.__exit__(*exc)

    def gbps(self, size: int, repeats: int, block_bytes: int = 0, tensors: int = 1, requests: int = 1) -> float:
        """GB/s of ``size`` bytes, the median of ``repeats`` transfers (0: chosen per size): one WRITE; or, with
        ``block_bytes``, ``requests`` WRITEs of whole blocks of ``tensors`` tensors (module docstring)."""
        if block_bytes:
            return self._blocks_gbps(size, repeats, block_bytes, tensors, requests)
        local, remote = self.pair.lists([(0, size)])
        times = []
        count = WARMUP + (repeats or auto_repeats(size))
        self.bytes_moved += count * size
        for i in range(count):
            start = time.perf_counter()
            self.pair.finish(self.pair.post(local, remote, 0, b"%d" % i))
            times.append(time.perf_counter() - start)
        local.release()
        remote.release()
        return size / statistics.median(times[WARMUP:]) / 1e9

    def _blocks_gbps(self, size: int, repeats: int, block_bytes: int, tensors: int, requests: int) -> float:
        """``size`` bytes as ``requests`` requests' whole blocks, each block a descriptor of lists prepared once."""
        per_tensor = self.pair.nbytes // (tensors * block_bytes)
        blocks = -(-size // (requests * tensors * block_bytes))  # per request and tensor: its tokens, rounded up
        if requests * blocks > per_tensor:
            raise ChannelError(
                f"raw nixl: {requests} requests of {blocks} blocks of {block_bytes} bytes in {tensors} tensors do not "
                f"fit its {self.pair.nbytes}-byte buffer"
            )
        local, remote = self.pair.lists([(i * block_bytes, block_bytes) for i in range(tensors * per_tensor)])
        tensor_starts = per_tensor * np.arange(tensors, dtype=np.int64)[:, None]
        times = []
        count = WARMUP + (repeats or auto_repeats(size))
        self.bytes_moved += count * size
        for i in range(count):
            start = time.perf_counter()
            xfers = [
                self.pair.post(
                    local, remote, (tensor_starts + r * blocks + np.arange(blocks)).ravel(), b"%d-%d" % (i, r)
                )
                for r in range(requests)
            ]
            for xfer in xfers:
                self.pair.finish(xfer)
            times.append(time.perf_counter() - start)
        local.release()
        remote.release()
        return size / statistics.median(times[WARMUP:]) / 1e9

    def transfers_per_s(self, count: int, size: int, repeats: int) -> float:
        """``count`` prepped WRITEs of ``size`` bytes posted back to back, the last notifying; the median over
        ``repeats`` rounds.

        What the bench's small-transfers case asks of a channel.
        """
        rates = []
        local, remote = self.pair.lists([(i * size, size) for i in range(count)])
        for _ in range(WARMUP + repeats):
            start = time.perf_counter()
            handles = [self.pair.post(local, remote, i, b"last" if i == count - 1 else b"") for i in range(count)]
            for xfer in handles:
                self.pair.finish(xfer)
            rates.append(count / (time.perf_counter() - start))
        local.release()
        remote.release()
        return statistics.median(rates[WARMUP:])

    def post_cost(self, counts: list[int], total: int, repeats: int) -> dict[int, dict[str, float]]:
        """What NIXL's post costs by descriptor count: ``total`` bytes as ``count`` equal descriptors, each a gap apart
        on both sides (so NIXL cannot merge them, as a request's blocks of many layers are apart), one prepped WRITE
        with its notification, for each of ``counts``, the counts taking turns within every repeat (so each meets the
        same load). Medians, in microseconds, of ``make_prepped_xfer`` (build), ``transfer`` (post: over cma on one
        host UCX moves the bytes inside this call) and from its return to DONE (wire), after the warm-ups."""
        lists = {}
        for count in counts:
            size = total // count
            if 2 * size * count > self.pair.nbytes or size == 0 or size * count != total:
                raise ChannelError(f"raw nixl: {total} bytes as {count} descriptors a gap apart do not fit or divide")
            lists[count] = self.pair.lists([(2 * i * size, size) for i in range(count)])
        timed: dict[int, dict[str, list[float]]] = {c: {"build_us": [], "post_us": [], "wire_us": []} for c in counts}
        for i in range(WARMUP + repeats):
            for count in counts[i % len(counts) :] + counts[: i % len(counts)]:  # each count first in turn
                local, remote = lists[count]
                every = np.arange(count, dtype=np.int64)
                t0 = time.perf_counter_ns()
                xfer = self.pair.agent.make_prepped_xfer("WRITE", local, every, remote, every, b"p%d-%d" % (i, count))
                t1 = time.perf_counter_ns()
                if self.pair.agent.transfer(xfer) == "ERR":
                    raise ChannelError("raw nixl WRITE failed when posted")
                t2 = time.perf_counter_ns()
                self.pair.notified += 1
                self.pair.finish(xfer)
                t3 = time.perf_counter_ns()
                if i >= WARMUP:
                    for name, ns in (("build_us", t1 - t0), ("post_us", t2 - t1), ("wire_us", t3 - t2)):
                        timed[count][name].append(ns / 1e3)
        self.bytes_moved += (WARMUP + repeats) * total * len(counts)
        for local, remote in lists.values():
            local.release()
            remote.release()
        return {count: {name: statistics.median(xs) for name, xs in t.items()} for count, t in timed.items()}
