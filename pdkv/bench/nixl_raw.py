"""Raw NIXL baseline for ``pdkv bench channel --channel nixl``.

The same sizes moved by ``nixl_agent`` calls directly between two processes,
with nothing of pdkv in the data path: each transfer is what a careful NIXL
user writes (descriptor lists prepared once per size, then per transfer
``make_prepped_xfer`` with a notification, ``transfer``, ``check_xfer_state``
in a busy loop until DONE, ``release``). The agents are built as the nixl
channel builds its own (``create_nixl_agent``: the same UCX environment).

Each way is run twice, by two pairs of agents (``progress_threads``): with
NIXL's progress thread on, as vLLM's NixlConnector runs its agent, and with
it off, as the nixl channel runs its own by default. Neither program is the
faster everywhere (2-vCPU VM, issue 46's history file): single writes of 256
KiB moved at 4.4-5.7 GB/s with the thread and 0.9-1.0 without (a write that
small waits for the target's progress, which without the thread comes only
with its polls), while a 2048-token request's blocks took 17.0-17.5 ms without
it against 18.3-19.8 with it. A bench row's baseline is the fastest of them
(``baseline_used``), so no row is measured against the weaker program.

The target polls for notifications only while the initiator moves bytes
(``_RawPair.polling``) and otherwise sleeps on its pipe: a target polling
every ``POLL_S`` for the whole run took CPU from the rigs measured in between.

``gbps`` has two ways (``variants``): contiguous (labelled ``raw``), the bytes
as one transfer; and, given a KV layout's grid (``block_bytes``, ``tensors``,
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

import contextlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Iterator
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
IDLE_TIMEOUT_S = 3600.0  # a target told nothing for this long takes its initiator for dead and leaves
PROGRESS_THREADS = (True, False)  # both programs, each a pair of agents (module docstring)
# what a variant's label says of its program: NIXL's progress thread on (vLLM's NixlConnector), or off
SETTING_LABELS = {True: "", False: ", no progress thread"}


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


def _name(agent: str, progress_thread: bool) -> str:
    """An agent's name in the program ``progress_thread`` names (each program's pair is its own)."""
    return f"{agent}-thread" if progress_thread else agent


def _target(conn: Connection, nbytes: int, host: str, memory: MemType, progress_thread: bool) -> None:
    """The receiving side: register a buffer, publish metadata, then follow the initiator's word until it says how
    many notifications it asked for, and answer how many came.

    Told ``poll``, it drains notifications the way the bench's channel receiver does (every ``POLL_S`` when none
    came), so both sides of the ratio do the same job; told ``idle``, it sleeps on its pipe; told the count, it
    drains until it has them all or ``TRANSFER_TIMEOUT_S`` passes.
    """
    agent = create_nixl_agent(
        _name(TARGET_NAME, progress_thread), NixlOptions(host=host, progress_thread=progress_thread)
    )
    buf, addr = _buffer(nbytes, memory, 0)  # the peer writes here until the end of this function
    reg = agent.register_memory([(addr, nbytes, 0, "")], memory)
    conn.send((agent.get_agent_metadata(), addr))
    notified, expected, deadline, polling = 0, None, float("inf"), False
    while expected is None or (notified < expected and time.monotonic() < deadline):
        word = _word(conn, 0.0 if polling or expected is not None else IDLE_TIMEOUT_S)
        if word is not None:
            polling = word == "poll"
            if isinstance(word, tuple):
                expected, deadline = word[1], time.monotonic() + TRANSFER_TIMEOUT_S
        fresh = sum(len(v) for v in agent.get_new_notifs().values())
        notified += fresh
        if not fresh and (polling or expected is not None):
            time.sleep(POLL_S)
    with contextlib.suppress(OSError):  # an initiator gone hears nothing
        conn.send(notified)
    agent.deregister_memory(reg)


def _word(conn: Connection, wait: float) -> Any:
    """The initiator's next word, waiting up to ``wait`` s: None if none came; a count of none once it is gone (its
    end of the pipe closed, or silent for ``IDLE_TIMEOUT_S``), so the target leaves."""
    try:
        if conn.poll(wait):
            return conn.recv()
    except (EOFError, OSError):
        return ("count", 0)
    return ("count", 0) if wait >= IDLE_TIMEOUT_S else None


class _RawPair:
    """This process's NIXL agent and the target process's buffer, for the raw baselines.

    Counts the notifications it asks for and, on leaving, checks the target
    received exactly that many, so a baseline that lost one cannot pass.
    """

    def __init__(
        self, nbytes: int, placement: Placement, memory: MemType = "DRAM", progress_thread: bool = True
    ) -> None:
        self.nbytes = nbytes
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.memory = memory
        args = (placement.receiver_netns, _target, there, nbytes, placement.receiver_addr, memory, progress_thread)
        self.proc = ctx.Process(target=run_in_netns, args=args, name="raw-nixl-target", daemon=True)
        self.proc.start()
        there.close()  # the child's end: the parent holds only its own
        self.notified = 0
        try:
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise TransferTimeout(f"raw nixl target did not start within {STARTUP_TIMEOUT_S:.0f}s")
            agent_md, self.remote_addr = self.conn.recv()
            self.agent = create_nixl_agent(
                _name(INITIATOR_NAME, progress_thread),
                NixlOptions(host=placement.sender_addr, progress_thread=progress_thread),
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
                self.conn.send(("count", self.notified))
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

    @contextlib.contextmanager
    def polling(self) -> Iterator[None]:
        """The target polls for notifications while this lasts (the initiator is moving bytes), and sleeps after."""
        self.conn.send("poll")
        try:
            yield
        finally:
            self.conn.send("idle")

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
    """Raw NIXL: nixl_agent prepped WRITE with notification, check_xfer_state until DONE; two processes per program.

    One target process and one pair of agents per progress-thread setting (``progress_threads``), for the whole run
    (a context manager); on leaving, each target must have received every notification its pair asked for.
    """

    moves_blocks = True  # ``variants`` can also move a KV layout's whole blocks (``pdkv bench transfer``'s ``blocks``)

    def __init__(
        self,
        nbytes: int,
        placement: Placement = LOOPBACK,
        memory: MemType = "DRAM",
        progress_threads: tuple[bool, ...] = PROGRESS_THREADS,
    ) -> None:
        if not progress_threads or len(set(progress_threads)) != len(progress_threads):
            raise ChannelError(f"raw nixl: progress_threads {progress_threads} must name each setting once")
        self.pairs: dict[bool, _RawPair] = {}
        with contextlib.ExitStack() as stack:  # a pair that fails to start leaves those made before it
            for on in progress_threads:
                self.pairs[on] = stack.enter_context(_RawPair(nbytes, placement, memory, progress_thread=on))
            self._stack = stack.pop_all()
        self.bytes_moved = 0  # by every call, warm-ups too: what a ``CpuMeter`` charges the processes' CPU to

    def __enter__(self) -> RawNixl:
        return self

    def __exit__(self, *exc: Any) -> None:
        """Leave every pair, each checking that its target received every notification it asked for."""
        self._stack.__exit__(*exc)

    def variants(self, size: int, grid: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
        """``gbps`` keyword arguments per way this baseline moves ``size`` bytes, each by every program: ``raw`` (one
        WRITE), and given a KV layout's ``grid`` (``block_bytes``, ``tensors``, ``requests``), ``blocks`` (as vLLM's
        NixlConnector posts a request); the program without NIXL's progress thread labelled so
        (``SETTING_LABELS``)."""
        ways = {"raw": {}, **({"blocks": grid} if grid else {})}
        return {
            f"{way}{SETTING_LABELS[on]}": {**kw, "progress_thread": on} for way, kw in ways.items() for on in self.pairs
        }

    def pids_for(self, progress_thread: bool = True, **_: int) -> dict[str, int | None]:
        """The processes doing each side of a variant (``gbps``'s keyword arguments): what its ``CpuMeter`` reads."""
        return {"sender": os.getpid(), "receiver": self._pair(progress_thread).proc.pid}

    def _pair(self, progress_thread: bool) -> _RawPair:
        if progress_thread not in self.pairs:
            raise ChannelError(f"raw nixl: no pair of agents with progress_thread={progress_thread} was made")
        return self.pairs[progress_thread]

    def gbps(
        self,
        size: int,
        repeats: int,
        block_bytes: int = 0,
        tensors: int = 1,
        requests: int = 1,
        progress_thread: bool = True,
    ) -> float:
        """GB/s of ``size`` bytes, the median of ``repeats`` transfers (0: chosen per size): one WRITE; or, with
        ``block_bytes``, ``requests`` WRITEs of whole blocks of ``tensors`` tensors (module docstring); by the pair
        of agents whose progress thread is on or off as ``progress_thread`` says."""
        pair = self._pair(progress_thread)
        with pair.polling():
            if block_bytes:
                return self._blocks_gbps(pair, size, repeats, block_bytes, tensors, requests)
            return self._contiguous_gbps(pair, size, repeats)

    def _contiguous_gbps(self, pair: _RawPair, size: int, repeats: int) -> float:
        local, remote = pair.lists([(0, size)])
        times = []
        count = WARMUP + (repeats or auto_repeats(size))
        self.bytes_moved += count * size
        for i in range(count):
            start = time.perf_counter()
            pair.finish(pair.post(local, remote, 0, b"%d" % i))
            times.append(time.perf_counter() - start)
        local.release()
        remote.release()
        return size / statistics.median(times[WARMUP:]) / 1e9

    def _blocks_gbps(
        self, pair: _RawPair, size: int, repeats: int, block_bytes: int, tensors: int, requests: int
    ) -> float:
        """``size`` bytes as ``requests`` requests' whole blocks, each block a descriptor of lists prepared once."""
        per_tensor = pair.nbytes // (tensors * block_bytes)
        blocks = -(-size // (requests * tensors * block_bytes))  # per request and tensor: its tokens, rounded up
        if requests * blocks > per_tensor:
            raise ChannelError(
                f"raw nixl: {requests} requests of {blocks} blocks of {block_bytes} bytes in {tensors} tensors do not "
                f"fit its {pair.nbytes}-byte buffer"
            )
        local, remote = pair.lists([(i * block_bytes, block_bytes) for i in range(tensors * per_tensor)])
        tensor_starts = per_tensor * np.arange(tensors, dtype=np.int64)[:, None]
        times = []
        count = WARMUP + (repeats or auto_repeats(size))
        self.bytes_moved += count * size
        for i in range(count):
            start = time.perf_counter()
            xfers = [
                pair.post(local, remote, (tensor_starts + r * blocks + np.arange(blocks)).ravel(), b"%d-%d" % (i, r))
                for r in range(requests)
            ]
            for xfer in xfers:
                pair.finish(xfer)
            times.append(time.perf_counter() - start)
        local.release()
        remote.release()
        return size / statistics.median(times[WARMUP:]) / 1e9

    def transfers_per_s(self, count: int, size: int, repeats: int) -> float:
        """``count`` prepped WRITEs of ``size`` bytes posted back to back, the last notifying; the median over
        ``repeats`` rounds, of the faster program (this rate is one number, not a row per variant).

        What the bench's small-transfers case asks of a channel.
        """
        return max(self._transfers_per_s(pair, count, size, repeats) for pair in self.pairs.values())

    def _transfers_per_s(self, pair: _RawPair, count: int, size: int, repeats: int) -> float:
        rates = []
        local, remote = pair.lists([(i * size, size) for i in range(count)])
        with pair.polling():
            for _ in range(WARMUP + repeats):
                start = time.perf_counter()
                handles = [pair.post(local, remote, i, b"last" if i == count - 1 else b"") for i in range(count)]
                for xfer in handles:
                    pair.finish(xfer)
                rates.append(count / (time.perf_counter() - start))
        local.release()
        remote.release()
        return statistics.median(rates[WARMUP:])

    def post_cost(
        self, counts: list[int], total: int, repeats: int, progress_thread: bool = True
    ) -> dict[int, dict[str, float]]:
        """What NIXL's post costs by descriptor count: ``total`` bytes as ``count`` equal descriptors, each a gap apart
        on both sides (so NIXL cannot merge them, as a request's blocks of many layers are apart), one prepped WRITE
        with its notification, for each of ``counts``, the counts taking turns within every repeat (so each meets the
        same load). Medians, in microseconds, of ``make_prepped_xfer`` (build), ``transfer`` (post: over cma on one
        host UCX moves the bytes inside this call) and from its return to DONE (wire), after the warm-ups; by the pair
        of agents ``progress_thread`` names."""
        pair = self._pair(progress_thread)
        lists = {}
        for count in counts:
            size = total // count
            if 2 * size * count > pair.nbytes or size == 0 or size * count != total:
                raise ChannelError(f"raw nixl: {total} bytes as {count} descriptors a gap apart do not fit or divide")
            lists[count] = pair.lists([(2 * i * size, size) for i in range(count)])
        timed: dict[int, dict[str, list[float]]] = {c: {"build_us": [], "post_us": [], "wire_us": []} for c in counts}
        with pair.polling():
            for i in range(WARMUP + repeats):
                for count in counts[i % len(counts) :] + counts[: i % len(counts)]:  # each count first in turn
                    local, remote = lists[count]
                    every = np.arange(count, dtype=np.int64)
                    t0 = time.perf_counter_ns()
                    xfer = pair.agent.make_prepped_xfer("WRITE", local, every, remote, every, b"p%d-%d" % (i, count))
                    t1 = time.perf_counter_ns()
                    if pair.agent.transfer(xfer) == "ERR":
                        raise ChannelError("raw nixl WRITE failed when posted")
                    t2 = time.perf_counter_ns()
                    pair.notified += 1
                    pair.finish(xfer)
                    t3 = time.perf_counter_ns()
                    if i >= WARMUP:
                        for name, ns in (("build_us", t1 - t0), ("post_us", t2 - t1), ("wire_us", t3 - t2)):
                            timed[count][name].append(ns / 1e3)
        self.bytes_moved += (WARMUP + repeats) * total * len(counts)
        for local, remote in lists.values():
            local.release()
            remote.release()
        return {count: {name: statistics.median(xs) for name, xs in t.items()} for count, t in timed.items()}
